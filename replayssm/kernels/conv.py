"""Triton kernels for the causal depthwise conv (Mamba-2 / GDN short conv) of the
decode and speculative steps; fp32 arithmetic, one launch each instead of gather + concat +
conv + gather + scatter.  The window is ``[P, C, W-1]`` (oldest first).

* :func:`conv_decode` (contract of :func:`replayssm.ops.conv.naive.conv_decode`): one
  always-accepted token ``x [Bt, C]``: ``out = act(bias + Σ_{k<W-1} w[:, k] window[:, k]
  + w[:, W-1] x)``, and the window shifts left by one with ``x`` appended.
* :func:`conv_verify` (:func:`replayssm.ops.conv.naive.conv_verify`): ``T`` tentative tokens
  ``x [Bt, T, C]``: ``out_t = act(bias + Σ_k w[:, k] s[t + k])`` over ``s = [window; x]``;
  the window is left untouched.
* :func:`conv_commit` (:func:`replayssm.ops.conv.naive.conv_commit`): the window becomes the
  last ``W-1`` entries of ``[window; x[:a]]`` for each row's accepted count ``a``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.conv.naive import check_varlen_args
from ..ops.varlen import check_slots
from ._triton import HAVE_TRITON, count_args, flat_grid, next_pow2, search_steps, triton, tl

__all__ = ["conv_decode", "conv_verify", "conv_commit"]

if HAVE_TRITON:

    @triton.jit
    def _conv_decode_kernel(
        win_ptr, slot_ptr, x_ptr, w_ptr, b_ptr, y_ptr,
        C, x_stride,
        WM1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        pid = tl.program_id(0)  # flat grid, channel blocks fastest: no limit on rows
        cb = pid % tl.cdiv(C, BC)
        r = pid // tl.cdiv(C, BC)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        offs_c = cb * BC + tl.arange(0, BC)
        mc = offs_c < C
        kk = tl.arange(0, WP)
        mwin = mc[:, None] & (kk[None, :] < WM1)
        wbase = (slot * C + offs_c[:, None]) * WM1 + kk[None, :]
        win = tl.load(win_ptr + wbase, mask=mwin, other=0.0).to(tl.float32)             # [BC, WP]
        nxt = tl.load(win_ptr + wbase + 1, mask=mc[:, None] & (kk[None, :] < WM1 - 1), other=0.0)
        xraw = tl.load(x_ptr + r.to(tl.int64) * x_stride + offs_c, mask=mc, other=0.0)
        wt = tl.load(w_ptr + offs_c[:, None] * (WM1 + 1) + kk[None, :],
                     mask=mc[:, None] & (kk[None, :] <= WM1), other=0.0).to(tl.float32)  # taps
        w_last = tl.sum(tl.where(kk[None, :] == WM1, wt, 0.0), 1)
        acc = tl.sum(tl.where(kk[None, :] < WM1, win * wt, 0.0), 1) + xraw.to(tl.float32) * w_last
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + r.to(tl.int64) * C + offs_c, acc.to(y_ptr.dtype.element_ty), mask=mc)
        tl.debug_barrier()  # every lane has read the old window before any lane overwrites it
        new = tl.where(kk[None, :] == WM1 - 1, xraw[:, None].to(nxt.dtype), nxt)
        tl.store(win_ptr + wbase, new.to(win_ptr.dtype.element_ty), mask=mwin)


    @triton.jit
    def _conv_verify_kernel(
        win_ptr, slot_ptr, x_ptr, w_ptr, b_ptr, y_ptr,
        C, T, xs_b, xs_t,
        WM1: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        pid = tl.program_id(0)  # flat grid, channel blocks fastest: no limit on rows
        cb = pid % tl.cdiv(C, BC)
        r = pid // tl.cdiv(C, BC)
        r64 = r.to(tl.int64)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        offs_c = cb * BC + tl.arange(0, BC)
        mc = offs_c < C
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
        for t in range(T):
            acc = tl.zeros([BC], dtype=tl.float32)
            for k in tl.static_range(WM1 + 1):
                i = tl.zeros([BC], dtype=tl.int32) + (t + k - WM1)  # < 0: window entry WM1 + i, else token i
                xv = tl.load(x_ptr + r64 * xs_b + i * xs_t + offs_c, mask=mc & (i >= 0), other=0.0)
                wv = tl.load(win_ptr + (slot * C + offs_c) * WM1 + WM1 + i, mask=mc & (i < 0), other=0.0)
                tap = tl.load(w_ptr + offs_c * (WM1 + 1) + k, mask=mc, other=0.0).to(tl.float32)
                acc += tap * (xv.to(tl.float32) + wv.to(tl.float32))
            if HAS_BIAS:
                acc += bias
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(y_ptr + (r64 * T + t) * C + offs_c, acc.to(y_ptr.dtype.element_ty), mask=mc)

    @triton.jit
    def _conv_commit_kernel(
        win_ptr, slot_ptr, x_ptr, acc_ptr, C, xs_b, xs_t,
        WM1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
    ):
        pid = tl.program_id(0)  # flat grid, channel blocks fastest: no limit on rows
        cb = pid % tl.cdiv(C, BC)
        r = pid // tl.cdiv(C, BC)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        a = tl.load(acc_ptr + r).to(tl.int32)
        offs_c = cb * BC + tl.arange(0, BC)
        mc = offs_c < C
        kk = tl.arange(0, WP)
        src = a + kk  # new entry kk is entry a + kk of [window; x]
        mk = mc[:, None] & (kk[None, :] < WM1)
        old = tl.load(win_ptr + (slot * C + offs_c[:, None]) * WM1 + src[None, :],
                      mask=mk & (src[None, :] < WM1), other=0.0)
        xv = tl.load(x_ptr + r.to(tl.int64) * xs_b + (src[None, :] - WM1) * xs_t + offs_c[:, None],
                     mask=mk & (src[None, :] >= WM1), other=0.0)
        new = tl.where(src[None, :] < WM1, old, xv.to(old.dtype))
        tl.debug_barrier()  # every lane has read the old window before any lane overwrites it
        tl.store(win_ptr + (slot * C + offs_c[:, None]) * WM1 + kk[None, :], new, mask=mk)


def _check_conv(win, x: Tensor, weight: Tensor | None, activation, T: bool):
    """Validate ``x`` (``[Bt, T, C]`` if ``T`` else ``[Bt, C]``), the activation and the
    taps against the window; returns ``(x with a contiguous last axis, weight [C, W]
    contiguous | None, C, W)``."""
    if x.dim() != (3 if T else 2):
        raise ValueError(f"x must be [Bt, {'T, ' if T else ''}C], got {tuple(x.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unknown activation {activation!r}")
    C = x.shape[-1]
    W = win.window.shape[2] + 1
    if win.window.shape[1] != C:
        raise ValueError(f"x has {C} channels, the window {win.window.shape[1]}")
    if weight is not None:
        weight = weight.reshape(C, -1)
        if weight.shape[1] != W:
            raise ValueError(f"weight has {weight.shape[1]} taps, the window needs {W}")
        weight = weight.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, weight, C, W


def _no_window(x: Tensor, weight: Tensor, bias: Tensor | None, activation) -> Tensor:
    """``W == 1`` (no window): ``act(bias + w x)`` elementwise, in x's dtype."""
    out = x.float() * weight[:, 0].float() + (bias.float() if bias is not None else 0.0)
    out = out * torch.sigmoid(out) if activation in ("silu", "swish") else out
    return out.to(x.dtype)


def conv_verify(win, slot: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None,
                activation: str | None = None, check: bool | None = None) -> Tensor:
    """``x [Bt, T, C]`` (last axis contiguous; rows and tokens may be strided) ->
    ``out [Bt, T, C]`` (x dtype), each token convolved after the committed window and the
    earlier tokens of its row; the window is not changed."""
    x, weight, C, W = _check_conv(win, x, weight, activation, True)
    Bt, T, _ = x.shape
    y = torch.empty(Bt, T, C, dtype=x.dtype, device=x.device)
    if Bt == 0 or T == 0:
        return y
    if W == 1:
        return _no_window(x, weight, bias, activation)
    BC = min(256, next_pow2(C))
    _conv_verify_kernel[flat_grid(triton.cdiv(C, BC), Bt)](
        win.window, slot, x, weight, bias if bias is not None else weight, y,
        C, T, x.stride(0), x.stride(1), WM1=W - 1, BC=BC, HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"), num_warps=4)
    return y


def conv_commit(win, slot: Tensor, x: Tensor, accepted: Tensor, check: bool | None = None) -> None:
    """Window of each row's slot := the last ``W-1`` entries of ``[window; x[:accepted]]``
    (``x [Bt, T, C]``, ``accepted [Bt]`` in ``[0, T]``), in place."""
    x, _, C, W = _check_conv(win, x, None, None, True)
    Bt = x.shape[0]
    if Bt == 0 or W == 1:
        return
    BC = min(128, next_pow2(C))
    _conv_commit_kernel[flat_grid(triton.cdiv(C, BC), Bt)](
        win.window, slot, x, accepted, C, x.stride(0), x.stride(1),
        WM1=W - 1, WP=max(2, next_pow2(W - 1)), BC=BC, num_warps=4)


def conv_decode(win, slot: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None,
                activation: str | None = None, check: bool | None = None) -> Tensor:
    """``x [Bt, C]`` (last axis contiguous; rows may be strided) -> ``out [Bt, C]`` (x dtype);
    the window of each row's slot advances by one in place."""
    x, weight, C, W = _check_conv(win, x, weight, activation, False)
    Bt = x.shape[0]
    y = torch.empty(Bt, C, dtype=x.dtype, device=x.device)
    if Bt == 0:
        return y
    if W == 1:
        return _no_window(x, weight, bias, activation)
    BC = min(256, next_pow2(C))
    _conv_decode_kernel[flat_grid(triton.cdiv(C, BC), Bt)](
        win.window, slot, x, weight, bias if bias is not None else weight, y,
        C, x.stride(0), WM1=W - 1, WP=next_pow2(W), BC=BC, HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"), num_warps=4)
    return y


# ---------------------------------------------------------------------------- packed prefill
if HAVE_TRITON:

    @triton.jit(**count_args("Nt", "N"))
    def _conv_varlen_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, cu_ptr, win_ptr, slot_ptr, fresh_ptr,
        Nt, C, N, sx,
        LOGN: tl.constexpr, WM1: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_FRESH: tl.constexpr,
    ):
        """Tokens ``[BT]`` × channels ``[BC]`` of a packed batch: each token's sequence by a
        binary search of ``cu_seqlens``; taps before the sequence start read its window."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
        mt = t < Nt
        mc = offs_c < C
        lo = tl.zeros([BT], dtype=tl.int32)
        hi = lo + N
        for _ in tl.static_range(LOGN):  # largest i with cu[i] <= t
            mid = (lo + hi) // 2
            go = tl.load(cu_ptr + mid).to(tl.int64) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        s0 = tl.load(cu_ptr + lo).to(tl.int64)
        slot = tl.load(slot_ptr + lo).to(tl.int64)
        rd = mt
        if HAS_FRESH:
            rd = rd & (tl.load(fresh_ptr + lo).to(tl.int32) == 0)
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for k in tl.static_range(WM1 + 1):
            p = t - WM1 + k
            inx = p >= s0
            xv = tl.load(x_ptr + p[:, None] * sx + offs_c[None, :], mask=(mt & inx)[:, None] & mc[None, :],
                         other=0.0)
            wv = tl.load(win_ptr + (slot[:, None] * C + offs_c[None, :]) * WM1 + (WM1 + p - s0)[:, None],
                         mask=(rd & ~inx)[:, None] & mc[None, :], other=0.0)
            tap = tl.load(w_ptr + offs_c * (WM1 + 1) + k, mask=mc, other=0.0).to(tl.float32)
            acc += tap[None, :] * (xv.to(tl.float32) + wv.to(tl.float32))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + t[:, None].to(tl.int64) * C + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mt[:, None] & mc[None, :])

    @triton.jit
    def _conv_varlen_window_kernel(
        x_ptr, cu_ptr, win_ptr, slot_ptr, fresh_ptr, C, sx,
        WM1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, HAS_FRESH: tl.constexpr,
    ):
        """Window of sequence ``i``'s slot := the last ``W-1`` of ``[window (zeros if fresh); x_i]``."""
        i = tl.program_id(0)
        offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = offs_c < C
        s0 = tl.load(cu_ptr + i).to(tl.int64)
        s1 = tl.load(cu_ptr + i + 1).to(tl.int64)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        kk = tl.arange(0, WP)
        src = (s1 - s0) - WM1 + kk  # < 0: old window entry WM1 + src, else token s0 + src
        mk = mc[:, None] & (kk[None, :] < WM1)
        rd = mk & (src[None, :] < 0)
        if HAS_FRESH:
            rd = rd & (tl.zeros([BC, WP], dtype=tl.int32) + tl.load(fresh_ptr + i).to(tl.int32) == 0)
        base = (slot * C + offs_c[:, None]) * WM1
        old = tl.load(win_ptr + base + WM1 + src[None, :], mask=rd, other=0.0)
        xv = tl.load(x_ptr + (s0 + src[None, :]) * sx + offs_c[:, None], mask=mk & (src[None, :] >= 0), other=0.0)
        new = tl.where(src[None, :] < 0, old, xv.to(old.dtype))
        tl.debug_barrier()  # every lane has read the old window before any lane overwrites it
        tl.store(win_ptr + base + kk[None, :], new, mask=mk)


def conv_prefill_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor,
                        window_pool, slots: Tensor, fresh: Tensor | None = None,
                        activation: str | None = None, check: bool | None = None,
                        block_t: int = 32, block_c: int = 128) -> Tensor:
    """Kernel form of :func:`replayssm.ops.conv.naive.conv_prefill_varlen`: ``x [Nt, C]`` (last
    axis contiguous; rows may be strided) -> ``out [Nt, C]`` (x dtype), each sequence after
    its window (zeros if fresh); then each slot's window holds the last ``W-1`` inputs of
    ``[window; x_i]``.  Two launches (conv over ``ceil(Nt/block_t) × ceil(C/block_c)``
    programs, then the window update over ``N × ceil(C/block_c)``)."""
    pool, Nt, C, W, weight, N, check = check_varlen_args(x, weight, bias, cu_seqlens, window_pool, activation, check)
    if not pool.is_contiguous() or pool.device != x.device:
        raise ValueError("window_pool must be contiguous and on the inputs' device")
    weight = weight.contiguous()
    sl, fr = check_slots(pool, slots, fresh, N, x.device, check)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(Nt, C, dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    if W == 1:
        return _no_window(x, weight, bias, activation) if Nt else y
    cu = cu_seqlens.contiguous()
    fptr = fr.view(torch.uint8) if fr is not None else cu
    sx = x.stride(0) if Nt > 1 else C
    BC = min(next_pow2(block_c), next_pow2(C))
    if Nt:
        BT = 16 if Nt <= 16 else next_pow2(block_t)  # two compiled variants for any token count
        _conv_varlen_kernel[(triton.cdiv(Nt, BT), triton.cdiv(C, BC))](
            x, weight, bias if bias is not None else weight, y, cu, pool, sl, fptr, Nt, C, N, sx,
            LOGN=search_steps(N), WM1=W - 1, BT=BT, BC=BC, HAS_BIAS=bias is not None,
            SILU=activation in ("silu", "swish"), HAS_FRESH=fr is not None, num_warps=4)
    _conv_varlen_window_kernel[(N, triton.cdiv(C, BC))](
        x, cu, pool, sl, fptr, C, sx, WM1=W - 1, WP=max(2, next_pow2(W - 1)), BC=BC,
        HAS_FRESH=fr is not None, num_warps=4)
    return y
