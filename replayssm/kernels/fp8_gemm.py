"""FP8 linear layer on the GPU (contract of :func:`replayssm.ops.fp8.naive.linear`).

``y = x Ŵᵀ (+ b)`` with ``Ŵ = q ⊙ S↑`` (block ``(bo, bi)``) or ``s · q`` (per-tensor):

* :func:`_fp8_linear_kernel` (Triton): program ``(m, n)`` walks ``K`` in tiles of
  ``BLOCK_K`` (a divisor of ``bi``, so one weight scale per column and K tile).  With
  ``QUANT_A`` activations are quantized per token and group of ``BLOCK_K`` channels
  (``s_a = amax / 448``, the dynamic per-token-group scheme): in the GEMM's own tiles for
  decode-sized ``M``, by :func:`_act_quant_kernel` in one pass beforehand from
  :data:`PREQUANT_M` rows on (prefill: no re-quantization per column tile); then
  ``acc += (q_a · q_wᵀ) ⊙ (s_a ⊗ s_w)`` runs on FP8 tensor cores; without it the e4m3 tile is
  widened to the activation dtype (``acc += (a · q_wᵀ) ⊙ s_w``, weight-only).  Accumulation in
  fp32, output in ``x``'s dtype.
* per-tensor weights with ``K``, ``N`` multiples of 16 use ``torch._scaled_mm``: activations
  quantized with the checkpoint's static ``input_scale`` (tensor-wise scales) or per token
  (row-wise scales) when it has none.

Decode shapes (few row tiles, few column tiles) split ``K`` over several programs so the
weight streams from every SM; the fp32 partial sums are added in a fixed order.  Launch
parameters depend on shapes only (CUDA-graph safe; no host sync).  Weights are read
as ``uint8`` and bit-cast in the kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.fp8.naive import FP8, FP8_MAX, scale_grid
from ._triton import HAVE_TRITON, interpreting, next_pow2, persistent_programs, triton, tl

__all__ = ["linear", "k_tile", "e4m3"]

_HUGE = 1 << 30   # "block" extent of a per-tensor scale
#: rows from which activations are quantized in a pass of their own (prefill), not per tile
PREQUANT_M = 65


def k_tile(block) -> int | None:
    """``BLOCK_K`` for a weight of ``block``: the largest power of two <= 128 dividing ``bi``
    (per-tensor: 128); None when that is below 16 (the call then runs the reference)."""
    if block is None:
        return 128
    bi = int(block[1])
    t = bi & -bi
    t = min(t, 128)
    return t if t >= 16 else None


#: which calls the kernel takes (others run the reference: kernels.dispatch)
SUPPORTS = {"linear": lambda x, weight, scale, bias=None, *, block=None, **kw:
            k_tile(block) is not None and x.dtype != torch.float64}

if HAVE_TRITON:

    @triton.jit
    def e4m3(q, EXACT: tl.constexpr):
        """``q`` (fp32, ``|q| <= 448``) rounded to e4m3, to nearest even.  ``EXACT`` (under the
        CPU interpreter, whose fp32 -> e4m3 cast misplaces values that round up to the next
        power of two) rounds on the e4m3 grid in fp32 first, so the cast is exact."""
        if EXACT:
            e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(q), 1e-30))), -6.0)
            step = tl.exp2(e - 3.0)
            y = q / step                                   # exact: a power-of-two step
            r = tl.floor(y + 0.5)
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)  # ties to even
            q = r * step
        return q.to(tl.float8e4nv)

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, sxm, G, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
        """Row ``m``, group ``g``: ``s = amax(|x|) / 448``, ``q = x / s`` in e4m3 (stored as bytes)."""
        m = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        kk = g * BLOCK_K + tl.arange(0, BLOCK_K)
        km = kk < K
        x = tl.load(x_ptr + m * sxm + kk, mask=km, other=0.0).to(tl.float32)
        sa = tl.maximum(tl.max(tl.abs(x), 0), 1e-30) / 448.0
        q = e4m3(x / sa, EXACT).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + m * K + kk, q, mask=km)
        tl.store(s_ptr + m * G + g, sa)

    @triton.jit
    def _fp8_linear_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, xs_ptr, M, N, K, sxm, BO, BI, NBI, KSPLIT, G,
        HAS_BIAS: tl.constexpr, QUANT_A: tl.constexpr, A_FP8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)          # split-K: this program's K range, partial sums to y[pid_k]
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mm = rm < M
        nm = rn < N
        srow = (rn // BO) * NBI
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * KSPLIT
        for k0 in range(k_lo, tl.minimum(K, k_lo + KSPLIT), BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :], mask=mm[:, None] & km[None, :],
                        other=0.0)
            w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=km[:, None] & nm[None, :],
                        other=0).to(tl.float8e4nv, bitcast=True)
            ws = tl.load(s_ptr + srow + k0 // BI, mask=nm, other=0.0)
            if A_FP8:   # activations quantized beforehand (_act_quant_kernel): bytes + one scale per group
                aq = a.to(tl.float8e4nv, bitcast=True)
                sa = tl.load(xs_ptr + rm.to(tl.int64) * G + k0 // BLOCK_K, mask=mm, other=0.0)
                acc += tl.dot(aq, w) * (sa[:, None] * ws[None, :])
            elif QUANT_A:
                af = a.to(tl.float32)
                sa = tl.maximum(tl.max(tl.abs(af), 1), 1e-30) / 448.0
                aq = e4m3(af / sa[:, None], EXACT)
                acc += tl.dot(aq, w) * (sa[:, None] * ws[None, :])
            else:
                acc += tl.dot(a, w.to(tl.float32).to(a.dtype), input_precision=PREC) * ws[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        y_ptr += pid_k.to(tl.int64) * M * N
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def _tiles(M: int, N: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` from the shapes: narrow column tiles for
    decode (many programs streaming the weight), square ones for prefill."""
    if M <= 16:
        return 16, (32 if N <= 8192 else 64), 4, 4
    if M <= 64:
        return next_pow2(M), 64, 4, 4
    return 128, 128, 8, 3


def _split_k(device, programs: int, K: int, BK: int) -> int:
    """K splits for a launch of ``programs`` tiles: enough for about two programs per SM
    (decode shapes with few column tiles), each split at least 4 K tiles long."""
    want = persistent_programs(device, 1 << 30, 2) if device.type == "cuda" else 1
    tiles = -(-K // BK)
    return max(1, min(-(-want // max(programs, 1)), tiles // 4, 16))


def _scaled_mm_ok(x: Tensor, weight: Tensor, block) -> bool:
    return (block is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and hasattr(torch, "_scaled_mm"))


def _scaled_mm(x2: Tensor, weight: Tensor, scale: Tensor, bias, input_scale) -> Tensor:
    """Per-tensor FP8 GEMM through ``torch._scaled_mm`` (static or per-token activation scales)."""
    xf = x2.float()
    if input_scale is not None:
        sa = input_scale.float().reshape(())
        sb = scale.float().reshape(())
    else:
        sa = (xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX)
        sb = scale.float().reshape(1, 1).expand(1, weight.shape[0]).contiguous()
    q = (xf / sa).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = x2.dtype if input_scale is not None else torch.bfloat16   # row-wise scales: bf16 output only
    y = torch._scaled_mm(q, weight.t(), scale_a=sa, scale_b=sb, out_dtype=out).to(x2.dtype)
    return y if bias is None else y + bias


def linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, *, block=None,
           input_scale: Tensor | None = None, act_quant: bool | None = None, block_m: int | None = None,
           block_n: int | None = None, num_warps: int | None = None, split_k: int | None = None) -> Tensor:
    """Kernel form of :func:`replayssm.ops.fp8.naive.linear` (same arguments and result up to
    rounding).  Kernel-only keywords: ``act_quant`` (default for bf16/fp16: FP8 activations,
    dynamic per-token groups; False: weight-only), ``block_m``, ``block_n``, ``num_warps``,
    ``split_k`` (K ranges summed in fp32 afterwards, in a fixed order; default from the shape)."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [out, in], got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, weight takes {K}")
    want = () if block is None else scale_grid(weight.shape, block)
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {want} (block {block})")
    BK = k_tile(block)
    if BK is None:
        raise ValueError(f"block {block}: the kernel needs a column block divisible by 16")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if act_quant is not False and _scaled_mm_ok(x2, weight, block) and block_m is None:
        return _scaled_mm(x2, weight, scale, bias, input_scale).reshape(*lead, N)
    if M == 0:
        return torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    bm, bn, warps, stages = _tiles(M, N)
    BM = max(16, next_pow2(block_m)) if block_m else bm
    BN = max(16, next_pow2(block_n)) if block_n else bn
    BO, BI = (_HUGE, _HUGE) if block is None else (int(block[0]), int(block[1]))
    NBI = 1 if block is None else want[1]
    quant = act_quant if act_quant is not None else x.dtype != torch.float32
    grid_mn = -(-M // BM) * -(-N // BN)
    S = max(1, int(split_k)) if split_k else _split_k(x.device, grid_mn, K, BK)
    KS = -(-(-(-K // BK)) // S) * BK               # K per split, whole tiles
    S = -(-K // KS)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if S == 1 else \
        torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    G = -(-K // BK)
    pre = bool(quant) and M >= PREQUANT_M          # many row tiles: quantize each row group once
    a, xs, sxa = x2, y, x2.stride(0)
    if pre:
        a = torch.empty(M, K, dtype=torch.uint8, device=x.device)
        xs = torch.empty(M, G, dtype=torch.float32, device=x.device)
        _act_quant_kernel[(M, G)](x2, a, xs, K, x2.stride(0), G, BLOCK_K=BK, EXACT=interpreting(),
                                  num_warps=1 if BK <= 64 else 2)
        sxa = K
    _fp8_linear_kernel[(-(-M // BM), -(-N // BN), S)](
        a, weight.view(torch.uint8), scale.float().contiguous(), bias if bias is not None else y, y, xs,
        M, N, K, sxa, BO, BI, NBI, KS, G, HAS_BIAS=bias is not None and S == 1, QUANT_A=bool(quant),
        A_FP8=pre, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        EXACT=interpreting(), num_warps=num_warps or warps, num_stages=stages)
    if S > 1:
        y = y.sum(0) if bias is None else y.sum(0) + bias.float()
        y = y.to(x.dtype)
    return y.reshape(*lead, N)
