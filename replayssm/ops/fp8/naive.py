"""FP8 e4m3 quantization and the FP8 linear / expert weights: reference ops (float64-capable).

Two weight layouts (both store ``q`` as ``torch.float8_e4m3fn``, scales in float32):

* block-scaled, block ``(bo, bi)``: ``W [out, in] ≈ q ⊙ S↑`` with one inverse scale per
  block, ``S [ceil(out/bo), ceil(in/bi)]`` and ``S↑[r, c] = S[r // bo, c // bi]`` (edge blocks
  may be partial); quantization takes ``S = amax(|W_blk|) / 448`` (1 for an all-zero block);
* per-tensor: ``W ≈ s · q`` with one scalar ``s`` (optionally an activation scale too).

Stacked experts ``w [E, n, K]`` hold ``parts`` row groups (``[gate | up]``: 2) quantized as
separate tensors: block scales ``[E, parts · ceil((n/parts)/bo), ceil(K/bi)]`` (each part's
grid, concatenated), per-tensor scales ``[E, parts]``.

Activations (the GPU kernels' dynamic scheme) are quantized per token and group of ``g``
channels: ``a ≈ s_a · q_a`` with ``s_a = amax(|a_grp|) / 448``.  The reference
:func:`linear` and :func:`dequantize_experts` dequantize the weights only (in the compute
dtype of the activations, float64 for float64) and leave activations as they are: the
scheme of the GPU GEMM's weight-only launches (``gemv``, decode).  :func:`linear_act_quant`
is the float64 reference of its FP8-activation launches (``dot``, ``cublas``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...runtime import compute_dtype

__all__ = ["FP8", "FP8_MAX", "linear", "quantize_block", "dequantize_block", "quantize_tensor",
           "dequantize_tensor", "quantize_groups", "dequantize_groups", "expand_scale", "scale_grid",
           "quantize_experts", "dequantize_experts", "expert_scale_shape", "linear_act_quant", "check_block"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value


def check_block(block) -> tuple[int, int]:
    """``block`` as ``(bo, bi)`` of positive ints, else ValueError."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be two positive ints (rows, columns), got {block!r}")
    return int(block[0]), int(block[1])


def scale_grid(shape, block) -> tuple[int, int]:
    """``(ceil(out/bo), ceil(in/bi))`` for a weight of ``shape [out, in]``."""
    bo, bi = check_block(block)
    return -(-shape[0] // bo), -(-shape[1] // bi)


def expand_scale(scale: Tensor, out: int, d_in: int, block) -> Tensor:
    """``S↑ [..., out, in]``: each block's scale repeated over its block (edges cropped)."""
    bo, bi = check_block(block)
    return scale.repeat_interleave(bo, -2)[..., :out, :].repeat_interleave(bi, -1)[..., :d_in]


def _q(x: Tensor) -> Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_block(w: Tensor, block) -> tuple[Tensor, Tensor]:
    """``(q [out, in] e4m3, S [ceil(out/bo), ceil(in/bi)] fp32)`` of a float weight."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_block takes a float [out, in] weight, got {tuple(w.shape)} {w.dtype}")
    bo, bi = check_block(block)
    out, d_in = w.shape
    nbo, nbi = scale_grid(w.shape, block)
    wf = w.double()
    pad = F.pad(wf.abs(), (0, nbi * bi - d_in, 0, nbo * bo - out))
    amax = pad.view(nbo, bo, nbi, bi).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = _q(wf / expand_scale(s.double(), out, d_in, block))
    return q, s


def dequantize_block(q: Tensor, scale: Tensor, block, dtype=torch.float32) -> Tensor:
    """``q ⊙ S↑`` in ``dtype`` (computed in float64, then cast)."""
    out, d_in = q.shape[-2:]
    return (q.double() * expand_scale(scale.double(), out, d_in, block)).to(dtype)


def quantize_tensor(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(q e4m3, s [] fp32)`` with ``s = amax(|W|) / 448`` (1 for a zero tensor)."""
    if not w.is_floating_point():
        raise ValueError(f"quantize_tensor takes a float tensor, got {w.dtype}")
    amax = w.double().abs().max() if w.numel() else torch.zeros((), dtype=torch.float64)
    s = (amax / FP8_MAX if amax > 0 else torch.ones((), dtype=torch.float64)).float()
    return _q(w.double() / s.double()), s


def dequantize_tensor(q: Tensor, scale: Tensor, dtype=torch.float32) -> Tensor:
    """``s · q`` in ``dtype``."""
    return (q.double() * scale.double()).to(dtype)


def quantize_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Per-token-group activation quantization: ``x [..., K]`` -> ``(q [..., K] e4m3,
    s [..., ceil(K/group)] fp32)`` with ``s = amax(|x_grp|) / 448`` (1 for a zero group)."""
    K = x.shape[-1]
    G = -(-K // group)
    xf = F.pad(x.double(), (0, G * group - K)).reshape(*x.shape[:-1], G, group)
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = _q(xf / s.double()[..., None]).reshape(*x.shape[:-1], G * group)[..., :K]
    return q, s


def dequantize_groups(q: Tensor, s: Tensor, group: int, dtype=torch.float64) -> Tensor:
    """``s_grp · q`` for :func:`quantize_groups`' output."""
    K = q.shape[-1]
    return (q.double() * s.double().repeat_interleave(group, -1)[..., :K]).to(dtype)


def _weight(weight: Tensor, scale: Tensor, block, dtype) -> Tensor:
    if block is None:
        return dequantize_tensor(weight, scale, dtype)
    return dequantize_block(weight, scale, block, dtype)


def linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, *, block=None,
           input_scale: Tensor | None = None) -> Tensor:
    """``y = x Ŵᵀ (+ b)`` with ``Ŵ`` the dequantized FP8 ``weight [out, in]``: block-scaled
    (``block=(bo, bi)``, ``scale [ceil(out/bo), ceil(in/bi)]``) or per-tensor (``block=None``,
    ``scale []``).  The reference runs in ``x``'s compute dtype (weights dequantized, then cast
    to ``x``'s dtype; activations unquantized, so ``input_scale`` is unused here)."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [out, in], got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight takes {weight.shape[1]}")
    want = () if block is None else scale_grid(weight.shape, block)
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {want} for weight "
                         f"{tuple(weight.shape)} (block {block})")
    w = _weight(weight, scale, block, compute_dtype(x.dtype)).to(x.dtype)
    return F.linear(x, w, bias)


def linear_act_quant(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, *, block=None,
                     group: int = 128) -> Tensor:
    """The GPU kernel's dynamic scheme in float64: ``x`` quantized per token group of
    ``group`` channels (:func:`quantize_groups`) and dequantized, times ``Ŵᵀ`` (for tests)."""
    q, s = quantize_groups(x, group)
    xa = dequantize_groups(q, s, group, torch.float64)
    y = F.linear(xa, _weight(weight, scale, block, torch.float64), None if bias is None else bias.double())
    return y.to(x.dtype)


def quantize_experts(w: Tensor, block, parts: int = 1) -> tuple[Tensor, Tensor]:
    """Stacked experts ``w [E, n, K]`` (``parts`` row groups) -> ``(q e4m3, scales)``: block
    scales ``[E, parts · nb, nk]`` or, ``block=None``, per-tensor scales ``[E, parts]``."""
    E, n, K = w.shape
    if n % parts:
        raise ValueError(f"{n} rows do not split into {parts} parts")
    qs, ss = [], []
    for e in range(E):
        for p in w[e].chunk(parts, 0):
            q, s = quantize_tensor(p) if block is None else quantize_block(p, block)
            qs.append(q)
            ss.append(s)
    q = torch.stack([torch.cat(qs[e * parts:(e + 1) * parts], 0) for e in range(E)])
    if block is None:
        return q, torch.stack(ss).view(E, parts)
    return q, torch.stack([torch.cat(ss[e * parts:(e + 1) * parts], 0) for e in range(E)])


def expert_scale_shape(E: int, n: int, K: int, block, parts: int) -> tuple[int, ...]:
    """The scale shape :func:`quantize_experts` makes for ``[E, n, K]``."""
    if block is None:
        return (E, parts)
    nb, nk = scale_grid((n // parts, K), block)
    return (E, parts * nb, nk)


def dequantize_experts(q: Tensor, scale: Tensor, block, parts: int = 1, dtype=torch.float32) -> Tensor:
    """``[E, n, K]`` in ``dtype`` from :func:`quantize_experts`' layout (fp64 arithmetic)."""
    E, n, K = q.shape
    want = expert_scale_shape(E, n, K, block, parts)
    if tuple(scale.shape) != want:
        raise ValueError(f"expert scales have shape {tuple(scale.shape)}, expected {want} for experts "
                         f"{tuple(q.shape)} ({parts} part(s), block {block})")
    m = n // parts
    if block is None:
        s = scale.double().repeat_interleave(m, 1)[:, :, None]
    else:
        nb = want[1] // parts
        s = torch.cat([expand_scale(scale[:, p * nb:(p + 1) * nb].double(), m, K, block) for p in range(parts)], 1)
    return (q.double() * s).to(dtype)
