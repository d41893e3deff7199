"""Rotary position embedding (rotate-half form) with a partial rotary dimension."""

from __future__ import annotations

import torch
from torch import Tensor


class Rotary:
    """RoPE on the first ``rotary_dim`` channels of each head.

    ``inv_freq_i = theta^(-2i/rotary_dim)`` computed in fp32 (as transformers does);
    angles ``pos · inv_freq`` in at least fp32; ``x_rot = x·cos + rotate_half(x)·sin``.
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float):
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
        self.rotary_dim = rotary_dim
        self._inv: dict = {}
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [B, T]`` -> cos, sin ``[B, T, rotary_dim]`` in ``dtype``."""
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        key = (positions.device, cdt)
        inv = self._inv.get(key)
        if inv is None:  # one host->device copy per device (at the first prefill), none per step
            inv = self._inv[key] = self.inv_freq.to(device=positions.device, dtype=cdt)
        f = positions.to(cdt)[..., None] * inv
        emb = torch.cat([f, f], -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [B, T, heads, head_dim]`` with cos/sin ``[B, T, rotary_dim]``."""
        r = self.rotary_dim
        xr, xp = x[..., :r], x[..., r:]
        c, s = cos[:, :, None], sin[:, :, None]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        rot = torch.cat([-x2, x1], -1)
        return torch.cat([xr * c + rot * s, xp], -1)
