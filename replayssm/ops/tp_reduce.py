"""Reference of the tensor-parallel sub-block finish (``kernels.tp_reduce``): plain PyTorch.

Rank ``r``'s partial ``p_r [R, N]`` and, for a deferred gated norm, its sums of squares
``q_r [R]`` (ranks ``g·k .. g·k+k-1`` share norm group ``g``, ``k = ranks_per_group``)::

    c_g = rsqrt((Σ_{r∈g} q_r) / group_size + gate_eps)
    o   = (Σ_g c_g Σ_{r∈g} p_r).to(p.dtype)          (sums in at least fp32)
    s   = (h + o) in sum_dtype;   y = norm(s.to(weight.dtype))
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime import compute_dtype

__all__ = ["reduce_add_norm", "rms_norm"]


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    """``w · rms(x)`` (``rms`` rounded to ``x``'s dtype first) or ``(1 + w) · rms(x)``, in
    ``x``'s dtype, computed in at least fp32 (the blocks' RMSNorm)."""
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xn * (1.0 + weight.to(cdt))).to(x.dtype)
    return weight.to(x.dtype) * xn.to(x.dtype)


def reduce_add_norm(parts: list[Tensor], sumsq: list[Tensor] | None = None, ranks_per_group: int | None = None,
                    group_size: int = 1, gate_eps: float = 0.0, residual: Tensor | None = None,
                    sum_dtype: torch.dtype | None = None, weight: Tensor | None = None, eps: float = 0.0,
                    zero_centered: bool = False, dtype: torch.dtype | None = None):
    """``(y, s, o)`` of the module docstring (``y`` None without ``weight``, ``s`` None
    without ``residual``); ``dtype``: compute in it instead (float64 for tests)."""
    W = len(parts)
    k = ranks_per_group or W
    if W < 1 or W % k:
        raise ValueError(f"{W} ranks do not split into groups of {k}")
    cdt = dtype or compute_dtype(parts[0].dtype)
    acc = 0
    for g in range(W // k):
        part = sum(parts[r].to(cdt) for r in range(g * k, g * k + k))
        if sumsq is not None:
            tot = sum(sumsq[r].to(cdt) for r in range(g * k, g * k + k))
            part = part * torch.rsqrt(tot / group_size + gate_eps)[..., None]
        acc = acc + part
    o = acc.to(parts[0].dtype) if dtype is None else acc
    s = y = None
    x = o
    if residual is not None:
        s = residual.to(dtype or sum_dtype or residual.dtype) + o
        x = s
    if weight is not None:
        y = rms_norm(x if dtype is not None else x.to(weight.dtype), weight, eps, zero_centered)
    return y, s, o
