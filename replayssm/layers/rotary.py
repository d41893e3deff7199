"""Rotary position embedding (rotate-half form) with a partial rotary dimension and the
rope scalings real checkpoints use (``rope_parameters`` / ``rope_scaling``):

* ``default``: ``inv_freq_i = theta^(-2i/d)`` (``d`` = rotary dim).
* ``linear``: ``inv_freq / factor`` (position interpolation).
* ``yarn`` (YaRN, arXiv 2309.00071): per frequency a blend of the interpolated
  ``inv_freq / factor`` and the original ``inv_freq`` by a linear ramp over the dims between
  the correction bounds of ``beta_fast`` / ``beta_slow`` rotations within
  ``original_max_position_embeddings`` (floored / ceiled when ``truncate``); cos and sin are
  scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the ratio of the
  ``mscale`` / ``mscale_all_dim`` forms when both are given).

The inverse frequencies are computed in fp32 as transformers does at construction; the
angles ``pos · inv_freq`` in at least fp32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: rope types :class:`Rotary` implements (configs are checked against this when parsed)
ROPE_TYPES = ("default", "linear", "yarn")


def _default_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rotary_dim: int, theta: float, s: dict) -> tuple[Tensor, float]:
    """YaRN ``(inv_freq [rotary_dim // 2] fp32, attention_factor)`` for scaling dict ``s``
    (``factor``, ``original_max_position_embeddings``; optional ``attention_factor``,
    ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``, ``truncate`` (True))."""
    d, factor, omax = rotary_dim, float(s["factor"]), s["original_max_position_embeddings"]
    att = s.get("attention_factor")
    if att is None:
        ms, msa = s.get("mscale"), s.get("mscale_all_dim")
        att = _yarn_mscale(factor, ms) / _yarn_mscale(factor, msa) if ms and msa else _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot):   # the dim whose wavelength fits ``rot`` rotations into omax positions
        return d * math.log(omax / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    # device="cpu": models are built under ``torch.device("meta")``
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo), 0, 1)
    pos = theta ** (torch.arange(0, d, 2, device="cpu").to(torch.float32) / d)
    extra = 1 - ramp                       # weight of the original (extrapolated) frequency
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv, float(att)


class Rotary:
    """RoPE on the first ``rotary_dim`` channels of each head.

    ``scaling``: None (or ``rope_type`` ``default``), or a dict with ``rope_type`` ``linear``
    (``factor``) or ``yarn`` (see :func:`yarn_inv_freq`); other types raise ``ValueError``.
    ``x_rot = x·cos + rotate_half(x)·sin`` with cos/sin times the attention factor (YaRN).
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, scaling: dict | None = None):
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
        self.rotary_dim = rotary_dim
        self._inv: dict = {}
        self.attention_scaling = 1.0
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "default":
            self.inv_freq = _default_inv_freq(rotary_dim, theta)
        elif kind == "linear":
            self.inv_freq = _default_inv_freq(rotary_dim, theta) / float(scaling["factor"])
        elif kind == "yarn":
            self.inv_freq, self.attention_scaling = yarn_inv_freq(rotary_dim, theta, scaling)
        else:
            raise ValueError(f"rope_type {kind!r} is not supported (one of {', '.join(ROPE_TYPES)})")

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [B, T]`` -> cos, sin ``[B, T, rotary_dim]`` in ``dtype``."""
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        key = (positions.device, cdt)
        inv = self._inv.get(key)
        if inv is None:  # one host->device copy per device (at the first prefill), none per step
            inv = self._inv[key] = self.inv_freq.to(device=positions.device, dtype=cdt)
        f = positions.to(cdt)[..., None] * inv
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [B, T, heads, head_dim]`` with cos/sin ``[B, T, rotary_dim]``."""
        r = self.rotary_dim
        xr, xp = x[..., :r], x[..., r:]
        c, s = cos[:, :, None], sin[:, :, None]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        rot = torch.cat([-x2, x1], -1)
        return torch.cat([xr * c + rot * s, xp], -1)
