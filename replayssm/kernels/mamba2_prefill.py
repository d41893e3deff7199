"""Triton kernels for Mamba-2 prefill over a packed batch of variable-length sequences
(the SSD chunked scan; contract of :func:`replayssm.ops.mamba2.naive.chunked_prefill_varlen`).

Launch 1 (``precompute_cb``, default) computes ``C Bᵀ`` of every (chunk, group) once, for
all heads of the group; launch 2 is the scan below.

One program owns one (sequence, head, d-block): it holds the state block ``S [BD, n]`` in
fp32 registers and walks the sequence's chunks of ``Q = block_t`` tokens in order, so the
state is passed from chunk to chunk without ever leaving the chip (no per-chunk state
tensors in memory, one launch).  Chunks restart at every sequence start.  Per chunk, with
``l = A·Δ`` and the in-chunk inclusive cumulative sum ``cum`` (non-increasing: ``l <= 0``)::

    y_i  = Σ_{j<=i} e^{cum_i − cum_j} Δ_j (C_i·B_j) x_j        (C Bᵀ masked, one tl.dot)
         + e^{cum_i} (S C_i)                                    (state read-out, one tl.dot)
         + D x_i
    S   <- e^{cum_Q} S + Σ_j e^{cum_Q − cum_j} Δ_j x_j B_jᵀ      (one tl.dot)

Every decay is ``exp`` of a non-positive segment sum; the masked upper triangle is set to
``-inf`` before ``exp``.  Tokens past a sequence's end are masked loads (``Δ = 0``, ``x = 0``),
so the last chunk may be short.  ``tl.dot`` operands are the activation dtype (bf16/fp16:
tensor cores; the fp32 state is rounded to it for the read-out, as the peers do) or fp32
with ``precision`` (``"ieee"`` default, ``"tf32"``); accumulation is always fp32.

State source (:mod:`replayssm.ops.varlen`): ``initial_state [N,H,d,n]`` / zeros, final
states returned; or the pool form ``state_pool [P,H,d,n]`` fp32 with ``slots [N]`` and
``fresh [N]``: each sequence reads ``state_pool[slot]`` (never for fresh rows) and writes its
final state there, in place.  Grid: one axis, ``N·H·ceil(d/BD)`` programs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.mamba2.naive import check_prefill_varlen
from ._triton import HAVE_TRITON, count_args, next_pow2, pad16, search_steps, triton, tl

__all__ = ["chunked_prefill_varlen", "DEFAULTS"]

#: default tile sizes (tuned on the H100 for the 2.7B shapes; see docs/BENCHMARKS.md).  ``block_t``
#: and ``block_d`` of None follow :func:`pick_tiles`.
DEFAULTS = dict(block_t=None, block_d=None, num_warps=4, num_stages=2, precompute_cb=True)


def pick_tiles(N: int, H: int, d: int, device) -> tuple[int, int]:
    """``(block_t, block_d)``: 64-token chunks; whole heads (``block_d = 64``) when the batch
    gives at least two programs per SM, else half heads so a short batch still fills the GPU
    (H100, 2.7B shapes, bench prefill 2026-11-23: 1×8192 0.57 ms with half heads vs 0.59 ms
    whole; 16×2048 0.89 vs 1.40 ms the other way round)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    if N * H * -(-d // 64) >= 2 * sms:
        return 64, 64
    return 64, 32


if HAVE_TRITON:

    @triton.jit(**count_args("N"))
    def _m2_cb_kernel(
        B_ptr, C_ptr, cu_ptr, cb_ptr, N, G, n, sb, sc,
        LOGN: tl.constexpr, Q: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
    ):
        """``C Bᵀ [Q, Q]`` (fp32) of one (chunk, group), shared by the group's heads.  Sequence
        ``i``'s chunks take the slots ``cu[i] // Q + i + c`` (found by a binary search)."""
        pid = tl.program_id(0)
        g = pid % G
        cs = pid // G
        lo = cs * 0
        hi = lo + N
        for _ in tl.static_range(LOGN):
            mid = (lo + hi) // 2
            go = tl.load(cu_ptr + mid).to(tl.int32) // Q + mid <= cs
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        s0 = tl.load(cu_ptr + lo).to(tl.int64)
        s1 = tl.load(cu_ptr + lo + 1).to(tl.int64)
        t0 = s0 + (cs - (s0.to(tl.int32) // Q + lo)).to(tl.int64) * Q
        if t0 < s1:
            offs_q = tl.arange(0, Q)
            offs_n = tl.arange(0, BN)
            t = t0 + offs_q
            m = (t < s1)[:, None] & (offs_n < n)[None, :]
            Bm = tl.load(B_ptr + t[:, None] * sb + g * n + offs_n[None, :], mask=m, other=0.0)
            Cm = tl.load(C_ptr + t[:, None] * sc + g * n + offs_n[None, :], mask=m, other=0.0)
            CB = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
            tl.store(cb_ptr + (cs.to(tl.int64) * G + g) * (Q * Q) + offs_q[:, None] * Q + offs_q[None, :], CB)

    @triton.jit
    def _m2_prefill_kernel(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, cb_ptr,
        cu_ptr, sin_ptr, sout_ptr, slot_ptr, fresh_ptr,
        H, G, d, n, HPG, ND, sx, sdt, sb, sc,
        Q: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
        HAS_D: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SLOT: tl.constexpr, HAS_FRESH: tl.constexpr,
        PRE_CB: tl.constexpr, PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        db = pid % ND
        hd = (pid // ND) % H
        i = pid // (ND * H)
        g = hd // HPG
        s0 = tl.load(cu_ptr + i).to(tl.int64)
        s1 = tl.load(cu_ptr + i + 1).to(tl.int64)
        if HAS_SLOT:
            row = tl.load(slot_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        offs_d = db * BD + tl.arange(0, BD)
        offs_n = tl.arange(0, BN)
        offs_q = tl.arange(0, Q)
        md = offs_d < d
        mn = offs_n < n
        m2 = md[:, None] & mn[None, :]
        soff = ((row * H + hd) * d + offs_d[:, None]) * n + offs_n[None, :]
        if HAS_INIT:
            ld = m2
            if HAS_FRESH:
                fr = tl.load(fresh_ptr + i).to(tl.int32)
                ld = ld & (tl.zeros([BD, BN], dtype=tl.int32) + fr == 0)
            S = tl.load(sin_ptr + soff, mask=ld, other=0.0).to(tl.float32)       # [BD, BN]
        else:
            S = tl.zeros([BD, BN], dtype=tl.float32)
        A = tl.load(A_ptr + hd).to(tl.float32)
        if HAS_D:
            Dh = tl.load(D_ptr + hd).to(tl.float32)
        DT = x_ptr.dtype.element_ty
        causal = offs_q[:, None] >= offs_q[None, :]
        nchunks = tl.cdiv(s1 - s0, Q)
        cb_row = (s0 // Q + i) * G + g  # CB slot of the sequence's first chunk (PRE_CB)
        for c in range(nchunks):
            t = s0 + c * Q + offs_q                                                # [Q] tokens
            mt = t < s1
            dt = tl.load(dt_ptr + t * sdt + hd, mask=mt, other=0.0).to(tl.float32)
            cum = tl.cumsum(A * dt, 0)                                            # non-increasing
            last = tl.min(cum, 0)                                                 # = cum[Q-1]
            x = tl.load(x_ptr + t[:, None] * sx + hd * d + offs_d[None, :], mask=mt[:, None] & md[None, :],
                        other=0.0)                                                # [Q, BD]
            Bm = tl.load(B_ptr + t[:, None] * sb + g * n + offs_n[None, :], mask=mt[:, None] & mn[None, :],
                         other=0.0)                                               # [Q, BN]
            Cm = tl.load(C_ptr + t[:, None] * sc + g * n + offs_n[None, :], mask=mt[:, None] & mn[None, :],
                         other=0.0)
            if PRE_CB:
                CB = tl.load(cb_ptr + (cb_row + c * G) * (Q * Q) + offs_q[:, None] * Q + offs_q[None, :])
            else:
                CB = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)               # [Q(i), Q(j)]
            seg = tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))
            M = CB * tl.exp(seg) * dt[None, :]
            y = tl.dot(M.to(DT), x, input_precision=PREC)                         # [Q, BD]
            y += tl.exp(cum)[:, None] * tl.dot(Cm, tl.trans(S.to(DT)), input_precision=PREC)
            if HAS_D:
                y += Dh * x.to(tl.float32)
            tl.store(y_ptr + t[:, None] * (H * d) + hd * d + offs_d[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=mt[:, None] & md[None, :])
            wgt = tl.exp(last - cum) * dt                                         # [Q], 0 past the end
            xw = (x.to(tl.float32) * wgt[:, None]).to(DT)
            S = tl.exp(last) * S + tl.dot(tl.trans(xw), Bm, input_precision=PREC)
        tl.store(sout_ptr + soff, S.to(sout_ptr.dtype.element_ty), mask=m2)


def _rows(t: Tensor, inner: int) -> tuple[Tensor, int]:
    """``t`` with its trailing ``inner`` elements per token contiguous, and its token stride."""
    if t.dim() == 3:
        ok = t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])
    else:
        ok = t.stride(-1) == 1
    if not ok or (t.shape[0] > 1 and t.stride(0) < inner):
        t = t.contiguous()
    return t, (t.stride(0) if t.shape[0] > 1 else inner)


def chunked_prefill_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                           *, cu_seqlens: Tensor, initial_state: Tensor | None = None, chunk_size: int = 64,
                           state_pool: Tensor | None = None, slots: Tensor | None = None,
                           fresh: Tensor | None = None, check: bool | None = None,
                           block_t: int | None = None, block_d: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           precision: str = "ieee", precompute_cb: bool | None = None):
    """Kernel form of :func:`replayssm.ops.mamba2.naive.chunked_prefill_varlen` (same
    arguments and returns; states read and written in their
    dtype, fp32/bf16/fp16, math in fp32; a returned final state is fp32).

    ``chunk_size`` is validated for the reference's contract; the kernel's own chunk is
    ``block_t`` (a power of two in [16, 128]; results differ from the reference only by
    rounding).  Kernel-only tuning: ``block_t``, ``block_d`` (d-block per program),
    ``num_warps``, ``num_stages``, ``precision`` (``tl.dot`` precision of fp32 operands),
    ``precompute_cb`` (``C Bᵀ`` of every (chunk, group) by a first launch, shared by the
    group's heads and d-blocks, instead of one ``tl.dot`` per program and chunk).
    Activations may be strided along the token axis (e.g. slices of a projection) as long
    as each token's ``[H, d]`` / ``[G, n]`` block is contiguous.
    """
    Nt, H, d, G, n, N, sl, fr, check = check_prefill_varlen(x, dt, A, B, C, D, cu_seqlens, chunk_size,
                                                            initial_state, state_pool, slots, fresh, check)
    src = state_pool if state_pool is not None else initial_state
    if src is not None and src.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the prefill kernel keeps fp32/bf16/fp16 states (math in fp32), got {src.dtype} "
                         f"(fp64 runs the reference op)")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the prefill kernel takes fp16/bf16/fp32 activations, got {x.dtype}")
    auto_t, auto_d = pick_tiles(cu_seqlens.numel() - 1, H, d, x.device)
    Q = (DEFAULTS["block_t"] or auto_t) if block_t is None else int(block_t)
    if Q < 16 or Q > 128 or Q & (Q - 1):
        raise ValueError(f"block_t must be a power of two in [16, 128], got {block_t!r}")
    BD = max(16, min(next_pow2(block_d or DEFAULTS["block_d"] or auto_d), next_pow2(d)))
    BN = pad16(n)
    y = torch.empty(Nt, H, d, dtype=x.dtype, device=x.device)
    pool_form = state_pool is not None
    final = state_pool if pool_form else torch.empty(N, H, d, n, dtype=torch.float32, device=x.device)
    if N == 0:
        return y, (None if pool_form else final)
    xr, sx = _rows(x, H * d)
    dtr, sdt = _rows(dt, H)
    Br, sb = _rows(B, G * n)
    Cr, sc = _rows(C, G * n)
    sin = src.contiguous() if src is not None else final
    if pool_form and not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous for the Triton kernel")
    cu = cu_seqlens.contiguous()
    ND = triton.cdiv(d, BD)
    pre = DEFAULTS["precompute_cb"] if precompute_cb is None else bool(precompute_cb)
    cb = y
    if pre and Nt:
        cb = torch.empty((Nt // Q + N) * G, Q, Q, dtype=torch.float32, device=x.device)
        _m2_cb_kernel[((Nt // Q + N) * G,)](Br, Cr, cu, cb, N, G, n, sb, sc, LOGN=search_steps(N), Q=Q,
                                           BN=BN, PREC=precision, num_warps=4)
    _m2_prefill_kernel[(N * H * ND,)](
        xr, dtr, A.contiguous(), Br, Cr, D.contiguous() if D is not None else A, y, cb,
        cu, sin, final, sl if pool_form else cu, fr.view(torch.uint8) if fr is not None else cu,
        H, G, d, n, H // G, ND, sx, sdt, sb, sc,
        Q=Q, BD=BD, BN=BN, HAS_D=D is not None, HAS_INIT=src is not None, HAS_SLOT=pool_form,
        HAS_FRESH=fr is not None, PRE_CB=pre, PREC=precision,
        num_warps=num_warps or DEFAULTS["num_warps"], num_stages=num_stages or DEFAULTS["num_stages"])
    return y, (None if pool_form else final)
