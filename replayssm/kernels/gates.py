"""Triton kernel of the recurrent mixers' gate preparation: one launch per layer and step.

:func:`gates` computes :func:`replayssm.ops.gates.naive.gates` (bias add, softplus, the
optional clamp, the optional per-head ``A`` factor and the optional ``sigmoid`` of a second
input) in one pass over the projection's rows, reading the gate columns where the projection
left them (any strides).  In eager PyTorch the same math is 5-9 elementwise launches per layer
(casts of the activations and parameters, add, softplus, clamp, exp, neg, mul, sigmoid).

Same numbers as the reference up to fp32 rounding (fp64 inputs compute in fp64); softplus is
``v`` for ``v > 20``, else ``log1p(e^v)`` (computed as ``log(u) · e^v / (u - 1)``,
``u = 1 + e^v``, accurate to a few ulps where ``e^v`` is tiny).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.gates.naive import check_gates, clamps
from ..runtime import compute_dtype
from ._triton import HAVE_TRITON, next_pow2, triton, tl

__all__ = ["gates", "SUPPORTS"]

#: rows per program
BR = 16
#: the most gate columns one program covers (wider rows take several programs)
MAX_BC = 256

if HAVE_TRITON:

    @triton.jit
    def _gates_kernel(x_ptr, bias_ptr, a_ptr, g_ptr, b_ptr, beta_ptr, R, T, C, HB, GROUP,
                      xs0, xs1, xs2, bs0, bs1, bs2, lo, hi,
                      BR: tl.constexpr, BC: tl.constexpr, BB: tl.constexpr, HAS_A: tl.constexpr,
                      CLAMP: tl.constexpr, HAS_BETA: tl.constexpr, F64: tl.constexpr):
        """Rows ``r = b·T + t`` of ``x [Bt, T, C]`` (strides ``xs*``); program ``(i, j)``
        writes rows ``i·BR ..`` and columns ``j·BC ..`` of ``g [R, C]``; programs ``(i, 0)``
        also write ``beta [R, HB]``."""
        cdt = tl.float64 if F64 else tl.float32
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        rm = rows < R
        bi, ti = rows // T, rows % T
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + (bi * xs0 + ti * xs1)[:, None] + cols[None, :].to(tl.int64) * xs2, mask=m, other=0.0)
        v = x.to(cdt) + tl.load(bias_ptr + cols, mask=cm, other=0.0).to(cdt)[None, :]
        e = tl.exp(v)
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        s = tl.where(v > 20.0, v, lp)
        if CLAMP:
            s = tl.minimum(tl.maximum(s, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                           propagate_nan=tl.PropagateNan.ALL)
        if HAS_A:
            s = tl.load(a_ptr + cols // GROUP, mask=cm, other=0.0).to(cdt)[None, :] * s
        tl.store(g_ptr + rows[:, None] * C + cols[None, :], s.to(g_ptr.dtype.element_ty), mask=m)
        if HAS_BETA:
            if tl.program_id(1) == 0:
                hb = tl.arange(0, BB)
                mb = rm[:, None] & (hb < HB)[None, :]
                b = tl.load(b_ptr + (bi * bs0 + ti * bs1)[:, None] + hb[None, :].to(tl.int64) * bs2, mask=mb,
                            other=0.0).to(cdt)
                tl.store(beta_ptr + rows[:, None] * HB + hb[None, :],
                         tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mb)


def _as3(t: Tensor) -> tuple[Tensor, int, int, int, int]:
    """``t`` with one to three dims as ``(t, T, stride_b, stride_t, stride_c)`` of a
    ``[Bt, T, C]`` view (missing leading dims have one element)."""
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1), t.stride(2)
    if t.dim() == 2:
        return t, 1, t.stride(0), 0, t.stride(1)
    return t, 1, 0, 0, t.stride(0)


def gates(x: Tensor, bias: Tensor, A: Tensor | None = None, *, group: int = 1,
          time_step_limit=(0.0, float("inf")), beta_in: Tensor | None = None,
          check: bool = True) -> tuple[Tensor, Tensor | None]:
    """:func:`replayssm.ops.gates.naive.gates` in one launch (``x`` of one to three dims)."""
    if check:
        check_gates(x, bias, A, group, time_step_limit, beta_in)
    if x.dim() > 3:
        raise ValueError(f"gates kernel: x has {x.dim()} dims, at most 3 ([Bt, T, C])")
    cdt = compute_dtype(x.dtype)
    C = x.shape[-1]
    g = torch.empty(x.shape, dtype=cdt, device=x.device)
    beta = None if beta_in is None else torch.empty(beta_in.shape, dtype=beta_in.dtype, device=x.device)
    R = x.numel() // C if C else 0
    if R == 0 or C == 0:
        return g, beta
    bias = bias.to(cdt).contiguous()          # no-ops for the layers' cached parameters
    if A is not None:
        A = A.reshape(-1).to(cdt).contiguous()
    _, T, xs0, xs1, xs2 = _as3(x)
    HB, bs = 0, (0, 0, 0)
    if beta_in is not None:
        HB = beta_in.shape[-1]
        _, Tb, *bs = _as3(beta_in)
    BC = min(next_pow2(C), MAX_BC)
    lo, hi = (float(v) for v in time_step_limit)
    _gates_kernel[(triton.cdiv(R, BR), triton.cdiv(C, BC))](
        x, bias, A if A is not None else bias, g, beta_in if beta_in is not None else x,
        beta if beta is not None else g, R, T, C, HB, group, xs0, xs1, xs2, *bs,
        lo, hi, BR=BR, BC=BC, BB=max(next_pow2(HB), 2),
        HAS_A=A is not None, CLAMP=clamps(time_step_limit), HAS_BETA=beta_in is not None,
        F64=cdt == torch.float64, num_warps=4)
    return g, beta


#: calls the kernel takes (others run the reference): at most three dims
SUPPORTS = {"gates": lambda x, *args, **kw: x.dim() <= 3}
