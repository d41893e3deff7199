"""Triton kernels for the RMS norms (one launch each instead of ~6-8 PyTorch operators).

Same numbers as :mod:`replayssm.layers.norms` up to fp32 rounding, including its
intermediate roundings to the activation dtype:

* :func:`gated_rmsnorm`, the SSM layers' gated norm: ``gate_first`` (Mamba-2):
  ``y = w · rms_g(x · silu(z))``; otherwise (Qwen3-Next GDN): ``y = (w · rms(x)) · silu(z)``;
* :func:`gated_sumsq` and ``gated_rmsnorm(..., sumsq=)``, the same norm split around a
  tensor-parallel all-reduce when a norm group spans ranks: each rank sums ``(x · silu(z))²``
  over its channels, the sums are all-reduced, and the norm divides by the group's total;
* :func:`rmsnorm`, the blocks' norm, ``y = w · rms(x)`` or zero-centred ``y = (1 + w) ·
  rms(x)``, optionally with the residual add before it: ``s = h + r``, ``y = norm(s)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, count_args, flat_grid, next_pow2, triton, tl

__all__ = ["gated_rmsnorm", "gated_sumsq", "rmsnorm"]

if HAVE_TRITON:

    @triton.jit(**count_args("R"))
    def _gated_rmsnorm_kernel(
        x_ptr, z_ptr, w_ptr, y_ptr, ss_ptr, R, NG, GS, x_stride, z_stride, N, eps, inv_total,
        BR: tl.constexpr, BG: tl.constexpr, GATE_FIRST: tl.constexpr, GIVEN_SS: tl.constexpr,
    ):
        """One ``[BR rows, group]`` tile per program on a flat grid (groups fastest): the row
        count (tokens × heads in a prefill) never meets a grid-axis limit.  ``GIVEN_SS``: the
        group's sum of squares per row comes from ``ss_ptr [R]`` (summed over ranks), divided
        by the group's global size (``1 / inv_total``)."""
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
        if GIVEN_SS:
            ss = tl.load(ss_ptr + rows, mask=rows < R, other=0.0)
            xn = x * tl.rsqrt(ss * inv_total + eps)[:, None]
        else:
            xn = x * tl.rsqrt(tl.sum(x * x, 1) / GS + eps)[:, None]
        y = (xn.to(act).to(tl.float32) * w[None, :]).to(act)
        if not GATE_FIRST:
            y = (y.to(tl.float32) * sz).to(act)
        tl.store(y_ptr + rows[:, None] * N + offs[None, :], y, mask=m)


    @triton.jit(**count_args("R"))
    def _gated_sumsq_kernel(x_ptr, z_ptr, w_ptr, u_ptr, ss_ptr, R, N, x_stride, z_stride,
                            BR: tl.constexpr, BN: tl.constexpr, WRITE_U: tl.constexpr):
        """``ss[r] = Σ_j (x[r, j] · silu(z[r, j]))²`` (fp32), ``BR`` rows per program;
        ``WRITE_U``: also ``u = w · x · silu(z)`` (the norm's input before its row scale)."""
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        j = tl.arange(0, BN)
        m = (rows < R)[:, None] & (j < N)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + j[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows[:, None] * z_stride + j[None, :], mask=m, other=0.0).to(tl.float32)
        x = x * (z * tl.sigmoid(z))
        tl.store(ss_ptr + rows, tl.sum(x * x, 1), mask=rows < R)
        if WRITE_U:
            w = tl.load(w_ptr + j, mask=j < N, other=0.0).to(tl.float32)
            tl.store(u_ptr + rows[:, None] * N + j[None, :], (x * w[None, :]).to(u_ptr.dtype.element_ty), mask=m)


    @triton.jit
    def rmsnorm_row(x, w_ptr, y_row, j, m, N, eps, ZERO_CENTERED: tl.constexpr):
        """One row's RMSNorm into ``y_row`` (its dtype is the activation dtype): ``x`` (fp32,
        lanes ``j``, valid ``m``) rounded to the activation dtype, then ``y = w · rms(x)``
        (``rms`` rounded to the activation dtype before the product) or ``(1 + w) · rms(x)``."""
        act = y_row.dtype.element_ty
        x = x.to(act).to(tl.float32)
        xn = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(w_ptr + j, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            y = xn * (1.0 + w)
        else:
            y = xn.to(act).to(tl.float32) * w
        tl.store(y_row + j, y.to(act), mask=m)

    @triton.jit
    def _rmsnorm_kernel(
        h_ptr, r_ptr, w_ptr, y_ptr, s_ptr, N, h_stride, r_stride, eps,
        BN: tl.constexpr, ADD: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    ):
        """One row per program: ``s = h + r`` (rounded to ``s``'s dtype, stored) when ``ADD``;
        the norm's input is ``s`` (else ``h``) rounded to the activation dtype (``y``'s);
        ``y = w · rms(x)`` (``rms`` rounded to the activation dtype before the product) or
        ``y = (1 + w) · rms(x)``."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BN)
        m = j < N
        x = tl.load(h_ptr + row * h_stride + j, mask=m, other=0.0).to(tl.float32)
        if ADD:
            x += tl.load(r_ptr + row * r_stride + j, mask=m, other=0.0).to(tl.float32)
            s = x.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * N + j, s, mask=m)
            x = s.to(tl.float32)
        rmsnorm_row(x, w_ptr, y_ptr + row * N, j, m, N, eps, ZERO_CENTERED)


def _rows(t: Tensor, N: int) -> Tensor:
    """``t [..., N]`` as ``[rows, N]`` with unit stride along ``N`` (rows may stay strided)."""
    t2 = t.reshape(-1, N)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm(h: Tensor, weight: Tensor, eps: float, zero_centered: bool, residual: Tensor | None = None,
            sum_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """``h [..., N]`` (rows may be strided; any float dtype), ``weight [N]`` in the
    activation dtype -> ``(y, s)``: ``y [..., N]`` in ``weight``'s dtype, the norm of ``s = h +
    residual`` (stored in ``sum_dtype``, default ``h``'s) when ``residual`` is given, else of
    ``h`` (``s`` is then None)."""
    N = h.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match the last axis of {tuple(h.shape)}")
    if residual is not None and residual.shape != h.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and input {tuple(h.shape)} differ")
    shape = h.shape
    h2 = _rows(h, N)
    R = h2.shape[0]
    y = torch.empty(R, N, dtype=weight.dtype, device=h.device)
    s = r2 = None
    if residual is not None:
        r2 = _rows(residual, N)
        s = torch.empty(R, N, dtype=sum_dtype or h.dtype, device=h.device)
    if R:
        BN = next_pow2(N)
        _rmsnorm_kernel[(R,)](
            h2, r2 if r2 is not None else h2, weight, y, s if s is not None else y, N, h2.stride(0),
            r2.stride(0) if r2 is not None else 0, float(eps), BN=BN, ADD=residual is not None,
            ZERO_CENTERED=bool(zero_centered), num_warps=min(16, max(1, BN // 512)))
    return y.reshape(shape), (s.reshape(shape) if s is not None else None)


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                  gate_first: bool, sumsq: Tensor | None = None, total: int | None = None) -> Tensor:
    """``x, z [..., N]`` (same shape; rows may be strided), ``weight [N]`` -> ``y [..., N]``
    in ``x``'s dtype (the weight must share it).

    ``sumsq [...]`` (fp32, with ``total``; ``gate_first`` only): the rows lie in one norm
    group of ``total`` channels spread over ranks, ``sumsq`` is that group's sum of
    ``(x · silu(z))²`` over all of them, and ``y = w · x silu(z) / sqrt(sumsq / total + eps)``
    (``group_size`` must then be ``N``)."""
    if x.shape != z.shape:
        raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    N = x.shape[-1]
    if N % group_size:
        raise ValueError(f"norm dim {N} is not a multiple of group size {group_size}")
    if sumsq is not None and (group_size != N or not gate_first or total is None
                              or sumsq.shape != x.shape[:-1] or sumsq.dtype != torch.float32):
        raise ValueError(f"a given sum of squares needs one gate-first group over the whole row, fp32 sums of "
                         f"shape {tuple(x.shape[:-1])} and the group's total size; got group_size={group_size} "
                         f"of {N}, sums {tuple(sumsq.shape)} {sumsq.dtype}, total={total}")
    shape = x.shape
    x2, z2 = _rows(x, N), _rows(z, N)
    R = x2.shape[0]
    y = torch.empty(R, N, dtype=x.dtype, device=x.device)
    ss = sumsq.reshape(R).contiguous() if sumsq is not None else y
    if R:
        BG = next_pow2(group_size)
        BR = min(next_pow2(R), max(1, 2048 // BG))  # ~2K elements per program for short groups
        NG = N // group_size
        _gated_rmsnorm_kernel[flat_grid(NG, triton.cdiv(R, BR))](
            x2, z2, weight, y, ss, R, NG, group_size, x2.stride(0), z2.stride(0), N, float(eps),
            1.0 / float(total or group_size), BR=BR, BG=BG, GATE_FIRST=bool(gate_first),
            GIVEN_SS=sumsq is not None, num_warps=min(16, max(1, BR * BG // 256)))
    return y.reshape(shape)


def gated_sumsq(x: Tensor, z: Tensor, weight: Tensor | None = None, out: Tensor | None = None):
    """``x, z [..., N]`` -> ``Σ_j (x · silu(z))²`` per row, ``[...]`` fp32 (the local part of
    a norm group that spans tensor-parallel ranks; written into ``out [rows]`` fp32 when
    given).  With ``weight [N]``: returns ``(u, sums)``, ``u = w · x · silu(z)`` in ``x``'s
    dtype (the gated norm with its row scale deferred past the output projection)."""
    if x.shape != z.shape:
        raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    N = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (N,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match {N} channels")
    x2, z2 = _rows(x, N), _rows(z, N)
    R = x2.shape[0]
    if out is not None and (out.dtype != torch.float32 or out.numel() != R or not out.is_contiguous()):
        raise ValueError(f"out must be {R} contiguous fp32 sums, got {tuple(out.shape)} {out.dtype}")
    ss = out.view(R) if out is not None else torch.empty(R, dtype=torch.float32, device=x.device)
    u = torch.empty(R, N, dtype=x.dtype, device=x.device) if weight is not None else None
    if R:
        BN = next_pow2(N)
        BR = min(next_pow2(R), max(1, 4096 // BN))
        _gated_sumsq_kernel[(triton.cdiv(R, BR),)](x2, z2, weight if weight is not None else x2,
                                                   u if u is not None else x2, ss, R, N, x2.stride(0), z2.stride(0),
                                                   BR=BR, BN=BN, WRITE_U=weight is not None,
                                                   num_warps=min(16, max(1, BR * BN // 512)))
    sums = ss.reshape(x.shape[:-1])
    return sums if weight is None else (u.reshape(x.shape), sums)
