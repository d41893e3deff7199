"""Device helpers shared by every part of the package (imports nothing else from replayssm).

* :func:`canonical_device` / :func:`same_device`: devices as tensors report them, so a
  user's ``"cuda"`` compares equal to the ``cuda:0`` of the tensors it created, and
  ``"cpu:0"`` to ``cpu``.
* :func:`compute_dtype`: the dtype math runs in (fp64 stays fp64, everything else fp32).
* :func:`capturing` / :func:`want_check`: host-side validation (which syncs) is on by
  default for CPU tensors only, and always off while a CUDA graph is being captured.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def compute_dtype(*xs) -> torch.dtype:
    """The dtype math runs in: float64 if any of ``xs`` (dtypes or tensors; None ignored)
    is float64, else float32 (bf16/fp16 activations are upcast)."""
    for x in xs:
        if (x.dtype if isinstance(x, Tensor) else x) == torch.float64:
            return torch.float64
    return torch.float32


def canonical_device(device) -> torch.device:
    """``device`` as the tensors placed on it report it.

    ``"cuda"`` (no index) becomes ``cuda:<current device>`` (left as is when CUDA is not
    available, so the error comes from the first allocation); ``"cpu:0"`` becomes ``cpu``
    (CPU tensors carry no index).  Accepts a ``torch.device``, a string or an int (an
    accelerator ordinal, as ``torch.device`` reads it).
    """
    d = device if isinstance(device, torch.device) else torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is None:
        if d.type == "cuda":
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return d
        mod = getattr(torch, d.type, None)  # xpu and other backends with a current device
        try:
            if mod is not None and mod.is_available():
                return torch.device(d.type, mod.current_device())
        except Exception:  # pragma: no cover - backend without current_device()
            pass
    return d


def same_device(a, b) -> bool:
    """Whether two devices (``torch.device``, strings, ints, or tensors) are the same device."""
    a = a.device if isinstance(a, Tensor) else a
    b = b.device if isinstance(b, Tensor) else b
    return canonical_device(a) == canonical_device(b)


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (never on CPU-only hosts)."""
    if not _cuda_available():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # pragma: no cover
        return False


def want_check(check: bool | None, *tensors: Tensor) -> bool:
    """Host-side value checks: never during CUDA-graph capture; else ``check`` if given,
    else on iff every tensor is on the CPU."""
    if capturing():
        return False
    if check is not None:
        return bool(check)
    return all(t.device.type == "cpu" for t in tensors if isinstance(t, Tensor))
