"""Triton kernel for the decode step of the causal depthwise conv (Mamba-2 / GDN short conv).

Same contract as :func:`replayssm.cache.conv.conv_decode`: for one always-accepted token
``x [Bt, C]`` per row, ``out = act(bias + Σ_{k<W-1} w[:, k] window[slot, :, k] + w[:, W-1] x)``
and the window ``[P, C, W-1]`` (oldest first) shifts left by one with ``x`` appended — one
launch instead of gather + concat + conv + gather + scatter.  fp32 arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, next_pow2, triton, tl

__all__ = ["conv_decode"]

if HAVE_TRITON:

    @triton.jit
    def _conv_decode_kernel(
        win_ptr, slot_ptr, x_ptr, w_ptr, b_ptr, y_ptr,
        C, x_stride,
        WM1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        cb = tl.program_id(0)
        r = tl.program_id(1)
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


def conv_decode(win, slot: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None,
                activation: str | None = None, check: bool | None = None) -> Tensor:
    """``x [Bt, C]`` (last axis contiguous; rows may be strided) -> ``out [Bt, C]`` (x dtype);
    the window of each row's slot advances by one in place."""
    if x.dim() != 2:
        raise ValueError(f"x must be [Bt, C], got {tuple(x.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unknown activation {activation!r}")
    Bt, C = x.shape
    window = win.window
    W = window.shape[2] + 1
    if window.shape[1] != C:
        raise ValueError(f"x has {C} channels, the window {window.shape[1]}")
    weight = weight.reshape(C, -1)
    if weight.shape[1] != W:
        raise ValueError(f"weight has {weight.shape[1]} taps, the window needs {W}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(Bt, C, dtype=x.dtype, device=x.device)
    if Bt == 0:
        return y
    if W == 1:  # no window: out = act(bias + w x)
        out = x.float() * weight[:, 0].float() + (bias.float() if bias is not None else 0.0)
        out = out * torch.sigmoid(out) if activation in ("silu", "swish") else out
        return out.to(x.dtype)
    BC = min(256, next_pow2(C))
    _conv_decode_kernel[(triton.cdiv(C, BC), Bt)](
        window, slot, x, weight.contiguous(), bias if bias is not None else weight, y,
        C, x.stride(0), WM1=W - 1, WP=next_pow2(W), BC=BC, HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"), num_warps=4)
    return y
