"""RMS norms (plain, zero-centred, gated) computed in at least fp32.

``rms(x) = x / sqrt(mean(x²) + eps)`` over the last axis (or over groups of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.dispatch import fused_ok
from ..kernels.norm import gated_rmsnorm, rmsnorm
from ..runtime import compute_dtype


def _rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``y = w · rms(x)`` (``zero_centered=False``; HF Mamba2/NemotronH) or
    ``y = (1 + w) · rms(x)`` (``zero_centered=True``; Qwen3-Next, weight initialised at 0)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x: Tensor) -> Tensor:
        if fused_ok(x, self.weight):
            return rmsnorm(x, self.weight, self.eps, self.zero_centered)[0]
        return self.reference(x)

    def add_forward(self, h: Tensor, r: Tensor, dtype: torch.dtype, sum_dtype: torch.dtype | None = None):
        """The residual add and this norm in one pass: ``s = h + r`` in ``sum_dtype``
        (default: ``h``'s and ``r``'s promoted), ``y = norm(s.to(dtype))``; returns ``(y, s)``."""
        sdt = sum_dtype or torch.promote_types(h.dtype, r.dtype)
        if fused_ok(r, self.weight) and r.dtype == dtype and h.dtype != torch.float64 and sdt != torch.float64:
            return rmsnorm(h, self.weight, self.eps, self.zero_centered, residual=r, sum_dtype=sdt)
        s = h.to(sdt) + r
        return self(s.to(dtype)), s

    def reference(self, x: Tensor) -> Tensor:
        """The plain PyTorch form (CPU, float64, and the kernel's test reference)."""
        cdt = compute_dtype(x.dtype)
        xn = _rms(x.to(cdt), self.eps)
        if self.zero_centered:
            return (xn * (1.0 + self.weight.to(cdt))).to(x.dtype)
        return self.weight * xn.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated RMSNorm over groups of ``group_size`` channels.

    ``gate_first=True`` (Mamba-2 / Nemotron-H, mamba_ssm ``norm_before_gate=False``):
    ``y = w · rms_g(x · silu(z))``.  ``gate_first=False`` (Qwen3-Next GDN):
    ``y = (w · rms(x)) · silu(z)``.
    """

    def __init__(self, dim: int, eps: float, group_size: int | None = None, gate_first: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.gate_first = eps, gate_first
        self.group_size = group_size or dim
        if dim % self.group_size:
            raise ValueError(f"norm dim {dim} is not a multiple of group size {self.group_size}")

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        if fused_ok(x, z, self.weight):
            return gated_rmsnorm(x, z, self.weight, self.eps, self.group_size, self.gate_first)
        return self.reference(x, z)

    def reference(self, x: Tensor, z: Tensor) -> Tensor:
        """The plain PyTorch form (CPU, float64, and the kernel's test reference)."""
        dt = x.dtype
        cdt = compute_dtype(dt)
        xf = x.to(cdt)
        if self.gate_first:
            xf = xf * F.silu(z.to(cdt))
            shp = xf.shape
            xf = _rms(xf.reshape(*shp[:-1], -1, self.group_size), self.eps).reshape(shp)
            return self.weight * xf.to(dt)
        y = self.weight * _rms(xf, self.eps).to(dt)
        return (y * F.silu(z.to(cdt))).to(dt)
