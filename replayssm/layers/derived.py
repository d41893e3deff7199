"""Parameter-derived tensors cached on their module, and the fused-gates switch.

A mixer needs a few tensors computed from its parameters on every call (``A = -exp(A_log)``
in the compute dtype, ``D`` / ``dt_bias`` cast to it, KDA's concatenated conv weight).
:func:`derived` computes each once and keeps it on the module, keyed by the parameters'
storage address, version counter, dtype and shape: an in-place load (``copy_``), a
``.to()`` / ``param.data = ..`` replacement or a dtype change recomputes it on the next call.
During CUDA-graph capture a missing entry is computed into the graph and not kept (its
contents exist only once the graph replays); capture after a warm-up call reads the kept
tensor, whose address stays fixed while the parameters do.

``REPLAYSSM_FUSED_GATES=0`` (read per call) restores the previous per-call path: nothing
cached, the gate math as separate PyTorch operators.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import Tensor, nn

from ..runtime import capturing


def fused_gates() -> bool:
    """Whether the cached parameters and the one-launch gate op are on (the default)."""
    return os.environ.get("REPLAYSSM_FUSED_GATES", "1").strip() != "0"


def _stamp(p: Tensor):
    try:
        version = p._version
    except RuntimeError:   # an inference tensor has no version counter: never kept
        return None
    return (p.data_ptr(), version, p.dtype, p.device, tuple(p.shape))


def derived(module: nn.Module, key, params: tuple[Tensor, ...], fn: Callable[[], Tensor]) -> Tensor:
    """``fn()`` (a function of ``params``), cached on ``module`` under ``key`` while none of
    ``params`` changed (module docstring)."""
    cache = module.__dict__.setdefault("_derived_cache", {})
    stamp = tuple(_stamp(p) for p in params)
    hit = cache.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    with torch.no_grad():
        value = fn()
    if None not in stamp and not capturing():
        cache[key] = (stamp, value)
    return value
