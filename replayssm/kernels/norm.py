"""Triton kernel for the gated RMSNorm of the SSM layers (one launch instead of ~6).

Same numbers as :class:`replayssm.layers.norms.GatedRMSNorm` up to fp32 rounding, including
its intermediate roundings to the activation dtype:

* ``gate_first`` (Mamba-2): ``y = w · rms_g(x · silu(z))``;
* otherwise (Qwen3-Next GDN): ``y = (w · rms(x)) · silu(z)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, count_args, flat_grid, next_pow2, triton, tl

__all__ = ["gated_rmsnorm"]

if HAVE_TRITON:

    @triton.jit(**count_args("R"))
    def _gated_rmsnorm_kernel(
        x_ptr, z_ptr, w_ptr, y_ptr, R, NG, GS, x_stride, z_stride, N, eps,
        BR: tl.constexpr, BG: tl.constexpr, GATE_FIRST: tl.constexpr,
    ):
        """One ``[BR rows, group]`` tile per program on a flat grid (groups fastest): the row
        count (tokens × heads in a prefill) never meets a grid-axis limit."""
        pid = tl.program_id(0)
        grp = pid % NG
        rows = (pid // NG).to(tl.int64) * BR + tl.arange(0, BR)
        j = tl.arange(0, BG)
        m = (rows < R)[:, None] & (j < GS)[None, :]
        offs = grp * GS + j
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows[:, None] * z_stride + offs[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=j < GS, other=0.0).to(tl.float32)
        act = y_ptr.dtype.element_ty
        sz = z * tl.sigmoid(z)
        if GATE_FIRST:
            x = x * sz
        xn = x * tl.rsqrt(tl.sum(x * x, 1) / GS + eps)[:, None]
        y = (xn.to(act).to(tl.float32) * w[None, :]).to(act)
        if not GATE_FIRST:
            y = (y.to(tl.float32) * sz).to(act)
        tl.store(y_ptr + rows[:, None] * N + offs[None, :], y, mask=m)


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                  gate_first: bool) -> Tensor:
    """``x, z [..., N]`` (same shape; rows may be strided), ``weight [N]`` -> ``y [..., N]``
    in ``x``'s dtype (the weight must share it)."""
    if x.shape != z.shape:
        raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    N = x.shape[-1]
    if N % group_size:
        raise ValueError(f"norm dim {N} is not a multiple of group size {group_size}")
    shape = x.shape
    x2, z2 = x.reshape(-1, N), z.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    R = x2.shape[0]
    y = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        BG = next_pow2(group_size)
        BR = min(next_pow2(R), max(1, 2048 // BG))  # ~2K elements per program for short groups
        NG = N // group_size
        _gated_rmsnorm_kernel[flat_grid(NG, triton.cdiv(R, BR))](
            x2, z2, weight, y, R, NG, group_size, x2.stride(0), z2.stride(0), N, float(eps),
            BR=BR, BG=BG, GATE_FIRST=bool(gate_first), num_warps=min(16, max(1, BR * BG // 256)))
    return y.reshape(shape)
