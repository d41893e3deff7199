"""Routed experts of a mixture-of-experts block: the reference op (float64-capable).

``x [N, D]`` tokens, ``idx [N, k]`` chosen experts (any order, distinct per token),
``w [N, k]`` routing weights, expert weights in the HF layout ``w1 [E, n1, D]`` (rows
``[gate | up]`` when ``gated``, ``n1 = 2I``; else ``n1 = I``) and ``w2 [E, D_out, I]``:

    out[t] = Σ_k w[t, k] · expert_{idx[t, k]}(x[t])
    expert_e(x) = w2[e] · (act(g) ⊙ u)  with [g | u] = w1[e] x      (gated, Qwen3-Next SwiGLU)
    expert_e(x) = w2[e] · act(w1[e] x)                                (plain, Nemotron-H relu²)

The reference runs each expert that was chosen at least once on exactly the tokens that
chose it (token lists from one stable sort of the routed pairs; a host loop over the hit
experts), never an expert on tokens that did not choose it.  Each expert's contribution is
weighted and accumulated in ascending expert order in fp32 (fp64 for fp64 inputs), as
transformers' eager experts loop does, then cast to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...runtime import compute_dtype
from ..common import shape_str
from ..fp8 import naive as fp8
from ..fp8.naive import FP8

__all__ = ["experts", "activation", "check_experts", "ACTIVATIONS"]

ACTIVATIONS = ("silu", "swish", "relu2", "relu", "gelu")


def activation(name: str):
    """The elementwise activation called ``name`` (one of :data:`ACTIVATIONS`)."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    if name == "relu":
        return F.relu
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r} (one of {ACTIVATIONS})")


def check_experts(x, idx, w, w1, w2, act: str, gated: bool) -> tuple[int, int, int, int]:
    """Shapes of :func:`experts`' arguments; returns ``(N, k, E, I)``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r} (one of {ACTIVATIONS})")
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [N, D], got {shape_str(x)}")
    N, D = x.shape
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.shape[0] != N or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be an integer tensor [N={N}, k], got {shape_str(idx)}")
    k = idx.shape[1]
    if not isinstance(w, Tensor) or tuple(w.shape) != (N, k) or not w.is_floating_point():
        raise ValueError(f"w must be a floating tensor of idx's shape {(N, k)}, got {shape_str(w)}")
    if not isinstance(w1, Tensor) or w1.dim() != 3 or w1.shape[2] != D:
        raise ValueError(f"w1 must be [E, n1, D={D}], got {shape_str(w1)}")
    E, n1, _ = w1.shape
    if gated and n1 % 2:
        raise ValueError(f"gated experts need w1 rows [gate | up] (even count), got {n1}")
    I = n1 // 2 if gated else n1
    if not isinstance(w2, Tensor) or w2.dim() != 3 or w2.shape[0] != E or w2.shape[2] != I:
        raise ValueError(f"w2 must be [E={E}, D_out, I={I}], got {shape_str(w2)}")
    for name, t in (("idx", idx), ("w", w), ("w1", w1), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return N, k, E, I


def dequantized(x: Tensor, w1: Tensor, w2: Tensor, w1_scale, w2_scale, block, gated: bool):
    """``(w1, w2)`` in ``x``'s dtype: FP8 expert weights dequantized (their scales in the
    layout of :func:`replayssm.ops.fp8.naive.quantize_experts`, ``[gate | up]`` as 2 parts),
    float weights as they are."""
    if w1.dtype != FP8 and w2.dtype != FP8:
        if w1_scale is not None or w2_scale is not None:
            raise ValueError("expert scales given for float (not FP8) expert weights")
        return w1, w2
    if w1.dtype != FP8 or w2.dtype != FP8 or w1_scale is None or w2_scale is None:
        raise ValueError("FP8 experts need both w1 and w2 in float8_e4m3fn with w1_scale and w2_scale")
    cdt = compute_dtype(x.dtype)
    return (fp8.dequantize_experts(w1, w1_scale, block, 2 if gated else 1, cdt).to(x.dtype),
            fp8.dequantize_experts(w2, w2_scale, block, 1, cdt).to(x.dtype))


def experts(x: Tensor, idx: Tensor, w: Tensor, w1: Tensor, w2: Tensor, *, act: str = "silu",
            gated: bool = True, w1_scale: Tensor | None = None, w2_scale: Tensor | None = None,
            block=None) -> Tensor:
    """``out [N, D_out]`` (``x``'s dtype): the weighted sum of each token's chosen experts.
    FP8 experts (``w1``/``w2`` in e4m3 with ``w1_scale``/``w2_scale``, block-scaled with
    ``block=(bo, bi)`` or per-tensor per expert with ``block=None``) are dequantized first."""
    N, k, E, I = check_experts(x, idx, w, w1, w2, act, gated)
    w1, w2 = dequantized(x, w1, w2, w1_scale, w2_scale, block, gated)
    cdt = compute_dtype(x.dtype, w.dtype)
    out = torch.zeros(N, w2.shape[1], dtype=cdt, device=x.device)
    if N == 0 or k == 0:
        return out.to(x.dtype)
    f = activation(act)
    flat = idx.reshape(-1).long()
    order = torch.sort(flat, stable=True)[1]                        # pairs grouped by expert
    counts = torch.bincount(flat, minlength=E).tolist()
    wf = w.reshape(-1)
    off = 0
    for e, c in enumerate(counts):                                   # ascending expert order
        if c == 0:
            continue
        pairs = order[off:off + c]
        off += c
        tok = pairs // k
        hx = F.linear(x[tok], w1[e])
        h = f(hx[:, :I]) * hx[:, I:] if gated else f(hx)
        y = F.linear(h, w2[e])
        out.index_add_(0, tok, y.to(cdt) * wf[pairs].to(cdt)[:, None])
    return out.to(x.dtype)
