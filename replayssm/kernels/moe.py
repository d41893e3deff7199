"""Fused routed experts (contract of :func:`replayssm.ops.moe.naive.experts`): tokens sorted
by expert on the device, one grouped-GEMM launch per projection over the routed experts only.

1. ``torch.sort`` (stable) of the ``P = N·k`` routed pairs by expert id.
2. :func:`_moe_plan_kernel` (one program): each expert's first sorted row ``start[e]`` (a
   vectorised binary search over the sorted ids) and the running count of its row tiles
   ``tile_end[e] = Σ_{e' <= e} ceil(count[e'] / BLOCK_M)``.
3. :func:`_moe_up_kernel`: program ``(t, n)`` finds the expert owning row tile ``t`` (exits if
   none: the grid is the upper bound ``cdiv(P, BLOCK_M) + min(E, P)`` tiles), gathers its
   tokens' rows of ``x`` and writes ``h = act(x W_gᵀ) ⊙ (x W_uᵀ)`` (or ``act(x W_1ᵀ)``) for
   its ``BLOCK_N`` columns, in sorted order.
4. :func:`_moe_down_kernel`: ``y[pair] = w_pair · (h W_2ᵀ)`` in fp32, scattered back to pair
   order; the ``k`` contributions of a token are then summed (fixed order, deterministic).

Nothing reads a routing decision on the host: the launch grid depends on shapes only, so a
call captures in a CUDA graph.  Products accumulate in fp32 on tensor cores (full-fp32
products for fp32 weights); ``h`` is rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.moe.naive import check_experts
from ._triton import HAVE_TRITON, count_args, interpreting, next_pow2, triton, tl

__all__ = ["experts", "SUPPORTED_ACTS"]

#: activations the kernels implement (others run the reference op)
SUPPORTED_ACTS = {"silu": 0, "swish": 0, "relu2": 1, "relu": 2}
#: which calls the kernel takes (others run the reference: kernels.dispatch)
SUPPORTS: dict = {}   # "experts": _fp8_supported (below): the activations and FP8 blocks it takes

if HAVE_TRITON:
    from .fp8_gemm import e4m3

    @triton.jit
    def _lower_bound(sorted_ptr, P, E, steps, val):
        """First index of the sorted ids ``[P]`` holding an id >= ``val`` (vectorised)."""
        lo = tl.zeros(val.shape, tl.int32)
        hi = tl.zeros(val.shape, tl.int32) + P
        for _ in range(steps):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(sorted_ptr + mid, mask=active & (mid < P), other=E)
            below = v < val
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & ~below, mid, hi)
        return lo

    @triton.jit(**count_args("P", "steps"))
    def _moe_plan_kernel(sorted_ptr, start_ptr, tend_ptr, P, E, steps, BLOCK_M: tl.constexpr, EP: tl.constexpr):
        """``start[e]`` (e = 0..E) and ``tile_end[e]`` from the sorted expert ids."""
        ee = tl.arange(0, EP)
        st = _lower_bound(sorted_ptr, P, E, steps, ee)
        en = _lower_bound(sorted_ptr, P, E, steps, ee + 1)
        tl.store(start_ptr + ee, st, mask=ee <= E)
        tiles = tl.where(ee < E, (en - st + BLOCK_M - 1) // BLOCK_M, 0)
        tl.store(tend_ptr + ee, tl.cumsum(tiles, 0), mask=ee < E)

    @triton.jit
    def _owner(start_ptr, tend_ptr, t, E, BLOCK_M: tl.constexpr, EP: tl.constexpr):
        """``(e, row0, row_end)`` of row tile ``t`` (``e >= E``: no such tile)."""
        ee = tl.arange(0, EP)
        em = ee < E
        tend = tl.load(tend_ptr + ee, mask=em, other=2147483647)
        st = tl.load(start_ptr + ee, mask=em, other=0)
        en = tl.load(start_ptr + ee + 1, mask=em, other=0)
        tiles = (en - st + BLOCK_M - 1) // BLOCK_M
        e = tl.sum((tend <= t).to(tl.int32), 0)
        sel = ee == e
        row0 = tl.sum(tl.where(sel, st + (t - (tend - tiles)) * BLOCK_M, 0), 0)
        rend = tl.sum(tl.where(sel, en, 0), 0)
        return e, row0, rend

    @triton.jit
    def _act(x, ACT: tl.constexpr):
        if ACT == 0:
            x = x * tl.sigmoid(x)
        elif ACT == 1:
            x = tl.maximum(x, 0.0)
            x = x * x
        else:
            x = tl.maximum(x, 0.0)
        return x

    @triton.jit
    def _quant_rows(a, QUANT_A: tl.constexpr, EXACT: tl.constexpr):
        """``(q, s)``: each row of the activation tile in e4m3 with ``s = amax / 448`` (the
        dynamic per-token-group scheme, group = the K tile); ``(a, 1)`` without ``QUANT_A``."""
        if QUANT_A:   # (an explicit else: code after a taken return is still compiled, and must type-check)
            af = a.to(tl.float32)
            sa = tl.maximum(tl.max(tl.abs(af), 1), 1e-30) / 448.0
            return e4m3(af / sa[:, None], EXACT), sa
        else:
            return a, tl.full([a.shape[0]], 1.0, tl.float32)

    @triton.jit
    def _fp8_dot(a, aq, sa, w8, sw, QUANT_A: tl.constexpr, PREC: tl.constexpr):
        """One K tile of an FP8 expert: ``(q_a · q_w) ⊙ (s_a ⊗ s_w)`` on FP8 tensor cores, or
        the e4m3 weights widened to the activation dtype (``(a · q_w) ⊙ s_w``)."""
        if QUANT_A:
            return tl.dot(aq, w8) * (sa[:, None] * sw[None, :])
        else:
            return tl.dot(a, w8.to(tl.float32).to(a.dtype), input_precision=PREC) * sw[None, :]

    @triton.jit
    def _moe_up_kernel(
        x_ptr, pair_ptr, start_ptr, tend_ptr, w1_ptr, h_ptr, s1_ptr,
        E, TOPK, D, I, x_stride, BO, BI, NB, NK,
        GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, EP: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr, QUANT_A: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        e, row0, rend = _owner(start_ptr, tend_ptr, t, E, BLOCK_M, EP)
        if e < E:
            rows = row0 + tl.arange(0, BLOCK_M)
            rm = rows < rend
            pair = tl.load(pair_ptr + rows, mask=rm, other=0)
            tok = (pair // TOPK).to(tl.int64)
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = n < I
            n1 = I * 2 if GATED else I
            wbase = w1_ptr + e.to(tl.int64) * n1 * D
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            sbase = s1_ptr + e.to(tl.int64) * ((2 if GATED else 1) * NB * NK)
            for k0 in range(0, D, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                km = kk < D
                a = tl.load(x_ptr + tok[:, None] * x_stride + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                wm = km[:, None] & nm[None, :]
                if FP8:   # e4m3 weights (read as uint8), one scale per column and K tile
                    wg = tl.load(wbase + n[None, :].to(tl.int64) * D + kk[:, None], mask=wm, other=0)
                    sg = tl.load(sbase + (n // BO) * NK + k0 // BI, mask=nm, other=0.0)
                    aq, sa = _quant_rows(a, QUANT_A, EXACT)
                    acc += _fp8_dot(a, aq, sa, wg.to(tl.float8e4nv, bitcast=True), sg, QUANT_A, PREC)
                    if GATED:
                        wu = tl.load(wbase + (I + n)[None, :].to(tl.int64) * D + kk[:, None], mask=wm, other=0)
                        su = tl.load(sbase + (NB + n // BO) * NK + k0 // BI, mask=nm, other=0.0)
                        acc_u += _fp8_dot(a, aq, sa, wu.to(tl.float8e4nv, bitcast=True), su, QUANT_A, PREC)
                else:
                    wg = tl.load(wbase + n[None, :].to(tl.int64) * D + kk[:, None], mask=wm, other=0.0)
                    acc += tl.dot(a.to(wg.dtype), wg, input_precision=PREC)
                    if GATED:
                        wu = tl.load(wbase + (I + n)[None, :].to(tl.int64) * D + kk[:, None], mask=wm, other=0.0)
                        acc_u += tl.dot(a.to(wu.dtype), wu, input_precision=PREC)
            h = _act(acc, ACT)
            if GATED:
                h = h * acc_u
            tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=rm[:, None] & nm[None, :])

    @triton.jit
    def _moe_down_kernel(
        h_ptr, pair_ptr, rw_ptr, start_ptr, tend_ptr, w2_ptr, y_ptr, s2_ptr,
        E, I, DO, BO, BI, NB, NK,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EP: tl.constexpr,
        PREC: tl.constexpr, FP8: tl.constexpr, QUANT_A: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        e, row0, rend = _owner(start_ptr, tend_ptr, t, E, BLOCK_M, EP)
        if e < E:
            rows = row0 + tl.arange(0, BLOCK_M)
            rm = rows < rend
            pair = tl.load(pair_ptr + rows, mask=rm, other=0).to(tl.int64)
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = n < DO
            wbase = w2_ptr + e.to(tl.int64) * DO * I
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            sbase = s2_ptr + e.to(tl.int64) * (NB * NK)
            for k0 in range(0, I, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                km = kk < I
                a = tl.load(h_ptr + rows[:, None].to(tl.int64) * I + kk[None, :], mask=rm[:, None] & km[None, :],
                            other=0.0)
                if FP8:
                    wt = tl.load(wbase + n[None, :].to(tl.int64) * I + kk[:, None], mask=km[:, None] & nm[None, :],
                                 other=0)
                    st = tl.load(sbase + (n // BO) * NK + k0 // BI, mask=nm, other=0.0)
                    aq, sa = _quant_rows(a, QUANT_A, EXACT)
                    acc += _fp8_dot(a, aq, sa, wt.to(tl.float8e4nv, bitcast=True), st, QUANT_A, PREC)
                else:
                    wt = tl.load(wbase + n[None, :].to(tl.int64) * I + kk[:, None], mask=km[:, None] & nm[None, :],
                                 other=0.0)
                    acc += tl.dot(a.to(wt.dtype), wt, input_precision=PREC)
            rw = tl.load(rw_ptr + pair, mask=rm, other=0.0)
            tl.store(y_ptr + pair[:, None] * DO + n[None, :], acc * rw[:, None], mask=rm[:, None] & nm[None, :])


def _block_m(P: int, E: int) -> int:
    """Rows per tile: about the mean number of tokens per expert, 16..64."""
    return max(16, min(64, next_pow2(-(-P // max(E, 1)))))


def _fp8_plan(w1: Tensor, w2: Tensor, w1_scale, w2_scale, block, gated: bool, D: int, I: int):
    """``(fp8, (BO, BI, NB1, NK1), (NB2, NK2), s1, s2, bk)`` of the expert scales (block or
    per-tensor layout of :func:`replayssm.ops.fp8.naive.quantize_experts`)."""
    from ..ops.fp8.naive import FP8, expert_scale_shape
    if w1.dtype != FP8:
        if w1_scale is not None or w2_scale is not None or w2.dtype == FP8:
            raise ValueError("expert scales go with FP8 (float8_e4m3fn) w1 and w2 only")
        return False, (1, 1, 1, 1), (1, 1), None, None, None
    if w2.dtype != FP8 or w1_scale is None or w2_scale is None:
        raise ValueError("FP8 experts need both w1 and w2 in float8_e4m3fn with w1_scale and w2_scale")
    E, n1, _ = w1.shape
    parts = 2 if gated else 1
    for name, s, want in (("w1_scale", w1_scale, expert_scale_shape(E, n1, D, block, parts)),
                          ("w2_scale", w2_scale, expert_scale_shape(E, w2.shape[1], I, block, 1))):
        if tuple(s.shape) != want:
            raise ValueError(f"{name} has shape {tuple(s.shape)}, expected {want} (block {block})")
    if block is None:
        return True, (1 << 30, 1 << 30, 1, 1), (1, 1), w1_scale, w2_scale, None
    bo, bi = int(block[0]), int(block[1])
    bk = min(bi & -bi, 128)
    return (True, (bo, bi, -(-I // bo), -(-D // bi)), (-(-w2.shape[1] // bo), -(-I // bi)),
            w1_scale, w2_scale, bk)


def _fp8_supported(*args, act="silu", block=None, **kw) -> bool:
    return act in SUPPORTED_ACTS and (block is None or (int(block[1]) & -int(block[1])) >= 16)


SUPPORTS["experts"] = _fp8_supported


def experts(x: Tensor, idx: Tensor, w: Tensor, w1: Tensor, w2: Tensor, *, act: str = "silu", gated: bool = True,
            w1_scale: Tensor | None = None, w2_scale: Tensor | None = None, block=None,
            block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
            num_warps: int | None = None, act_quant: bool | None = None) -> Tensor:
    """Kernel form of :func:`replayssm.ops.moe.naive.experts` (same arguments and result).

    FP8 experts (e4m3 ``w1``/``w2`` with per-expert ``w1_scale``/``w2_scale``, ``block`` or
    per-tensor) are read as bytes; each product tile is scaled by its column's weight scale
    (``BLOCK_K`` divides the block's columns).  With ``act_quant`` (default for bf16/fp16
    activations) the token rows (and ``h``) are quantized per K tile on the fly and multiplied
    on FP8 tensor cores; without it the e4m3 tiles are widened to the activation dtype.
    Kernel-only keywords: ``block_m`` (rows per expert tile), ``block_n``, ``block_k``,
    ``num_warps``, ``act_quant``.  Launch parameters depend on shapes only (CUDA-graph safe).
    """
    N, k, E, I = check_experts(x, idx, w, w1, w2, act, gated)
    if act not in SUPPORTED_ACTS:
        raise ValueError(f"the fused experts support {sorted(SUPPORTED_ACTS)}, got {act!r}")
    fp8, (BO, BI, NB1, NK1), (NB2, NK2), s1, s2, bk8 = _fp8_plan(w1, w2, w1_scale, w2_scale, block, gated,
                                                                 x.shape[1], I)
    if fp8 and bk8 is not None and bk8 < 16:
        raise ValueError(f"block {block}: the fused experts need a column block divisible by 16")
    DO = w2.shape[1]
    P = N * k
    if P == 0:
        return torch.zeros(N, DO, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    dev = x.device
    sorted_ids, order = torch.sort(idx.reshape(-1).to(torch.int32), stable=True)
    order = order.to(torch.int32)
    BM = max(16, next_pow2(block_m)) if block_m else _block_m(P, E)
    EP = next_pow2(E + 1)
    start = torch.empty(EP, dtype=torch.int32, device=dev)
    tend = torch.empty(EP, dtype=torch.int32, device=dev)
    _moe_plan_kernel[(1,)](sorted_ids, start, tend, P, E, max(1, P.bit_length()), BLOCK_M=BM, EP=EP, num_warps=4)
    tiles = -(-P // BM) + min(E, P)
    prec = "ieee" if torch.float32 in (x.dtype, w1.dtype) else "tf32"
    D = x.shape[1]
    h = torch.empty(P, I, dtype=x.dtype, device=dev)
    BN = block_n or (64 if I >= 64 else max(16, next_pow2(I)))
    BK = block_k or min(128, max(16, next_pow2(D)))
    BK2 = block_k or min(64, max(16, next_pow2(I)))
    if bk8 is not None:   # one weight scale per K tile
        BK, BK2 = min(BK, bk8), min(BK2, bk8)
    warps = num_warps or 4
    qa = fp8 and (act_quant if act_quant is not None else x.dtype in (torch.bfloat16, torch.float16))
    w1k, w2k = (w1.view(torch.uint8), w2.view(torch.uint8)) if fp8 else (w1, w2)
    s1 = s1.float().contiguous() if fp8 else h
    s2 = s2.float().contiguous() if fp8 else h
    _moe_up_kernel[(tiles, -(-I // BN))](
        x, order, start, tend, w1k, h, s1, E, k, D, I, x.stride(0), BO, BI, NB1, NK1,
        GATED=gated, ACT=SUPPORTED_ACTS[act], BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, EP=EP, PREC=prec,
        FP8=fp8, QUANT_A=qa, EXACT=interpreting(), num_warps=warps)
    y = torch.empty(P, DO, dtype=torch.float32, device=dev)
    BN2 = block_n or min(128, max(16, next_pow2(DO)))
    _moe_down_kernel[(tiles, -(-DO // BN2))](
        h, order, w.reshape(-1).float().contiguous(), start, tend, w2k, y, s2, E, I, DO, BO, BI, NB2, NK2,
        BLOCK_M=BM, BLOCK_N=BN2, BLOCK_K=BK2, EP=EP, PREC=prec, FP8=fp8, QUANT_A=qa, EXACT=interpreting(),
        num_warps=warps)
    return y.view(N, k, DO).sum(1).to(x.dtype)
