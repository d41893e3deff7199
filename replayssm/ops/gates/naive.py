"""Reference of the gate preparation the recurrent mixers run per token (one launch on the
GPU: :func:`replayssm.kernels.gates.gates`).

For activations ``x [.., C]`` (a slice of a projection's output, any strides)::

    s = softplus(x + bias)                 (fp32+, softplus(v) = v for v > 20, else log(1 + e^v))
    s = clamp(s, lo, hi)                   (only when lo > 0 or hi < inf: Mamba-2's time_step_limit)
    g = A[c // group] · s                  (A given: GDN / KDA's g = -exp(A_log) · softplus(..))
    beta = sigmoid(beta_in)                (beta_in given; in beta_in's dtype)

Mamba-2's Δ is ``g`` without ``A``; GDN's ``(g, β)`` has ``group = 1``; KDA's ``g`` has
``group = K`` (one ``A`` per head of ``K`` channels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...runtime import compute_dtype

__all__ = ["gates", "check_gates", "clamps"]


def check_gates(x: Tensor, bias: Tensor, A: Tensor | None, group: int, time_step_limit, beta_in: Tensor | None):
    """``ValueError`` naming the first bad argument of :func:`gates`."""
    if not isinstance(x, Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise ValueError("gates: x must be a floating tensor [.., C]")
    C = x.shape[-1]
    if bias.shape != (C,):
        raise ValueError(f"gates: bias has shape {tuple(bias.shape)}, expected ({C},)")
    if not isinstance(group, int) or group < 1 or C % group:
        raise ValueError(f"gates: group {group!r} must be a positive divisor of C={C}")
    if A is not None and A.numel() != C // group:
        raise ValueError(f"gates: A has {A.numel()} elements, expected C // group = {C // group}")
    lo, hi = time_step_limit
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"gates: bad time_step_limit {time_step_limit!r}")
    if beta_in is not None and (beta_in.shape[:-1] != x.shape[:-1] or not beta_in.is_floating_point()):
        raise ValueError(f"gates: beta_in {tuple(beta_in.shape)} must be floating with x's leading "
                         f"dims {tuple(x.shape[:-1])}")
    for name, t in (("bias", bias), ("A", A), ("beta_in", beta_in)):
        if t is not None and t.device != x.device:
            raise ValueError(f"gates: {name} is on {t.device}, x on {x.device}")


def clamps(time_step_limit) -> bool:
    """Whether ``time_step_limit`` clamps at all (the layers' rule: ``lo > 0`` or ``hi < inf``)."""
    lo, hi = time_step_limit
    return lo > 0.0 or hi != float("inf")


def gates(x: Tensor, bias: Tensor, A: Tensor | None = None, *, group: int = 1,
          time_step_limit=(0.0, float("inf")), beta_in: Tensor | None = None,
          check: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(g [.., C] in the compute dtype, beta [.., HB] in beta_in's dtype or None)``
    (module docstring)."""
    if check:
        check_gates(x, bias, A, group, time_step_limit, beta_in)
    cdt = compute_dtype(x.dtype)
    s = F.softplus(x.to(cdt) + bias.to(cdt))
    if clamps(time_step_limit):
        s = s.clamp(min=time_step_limit[0], max=time_step_limit[1])
    if A is not None:
        C = x.shape[-1]
        s = (A.to(cdt).reshape(C // group, 1) * s.reshape(*s.shape[:-1], C // group, group)).reshape(s.shape)
    return s, (None if beta_in is None else torch.sigmoid(beta_in))
