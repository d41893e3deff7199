"""Triton kernel for the gated RMSNorm of the SSM layers (one launch instead of ~6).

Same numbers as :class:`replayssm.layers.norms.GatedRMSNorm` up to fp32 rounding, including
its intermediate roundings to the activation dtype:

* ``gate_first`` (Mamba-2): ``y = w · rms_g(x · silu(z))``;
* otherwise (Qwen3-Next GDN): ``y = (w · rms(x)) · silu(z)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, next_pow2, triton, tl

__all__ = ["gated_rmsnorm"]

if HAVE_TRITON:

    @triton.jit
    def _gated_rmsnorm_kernel(
        x_ptr, z_ptr, w_ptr, y_ptr, GS, x_stride, z_stride, N, eps,
        BG: tl.constexpr, GATE_FIRST: tl.constexpr,
    ):
        grp = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        j = tl.arange(0, BG)
        m = j < GS
        offs = grp * GS + j
        x = tl.load(x_ptr + r * x_stride + offs, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r * z_stride + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        act = y_ptr.dtype.element_ty
        sz = z * tl.sigmoid(z)
        if GATE_FIRST:
            x = x * sz
        xn = x * tl.rsqrt(tl.sum(x * x, 0) / GS + eps)
        y = (xn.to(act).to(tl.float32) * w).to(act)
        if not GATE_FIRST:
            y = (y.to(tl.float32) * sz).to(act)
        tl.store(y_ptr + r * N + offs, y, mask=m)


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
        _gated_rmsnorm_kernel[(N // group_size, R)](
            x2, z2, weight, y, group_size, x2.stride(0), z2.stride(0), N, float(eps),
            BG=BG, GATE_FIRST=bool(gate_first), num_warps=min(16, max(1, BG // 256)))
    return y.reshape(shape)
