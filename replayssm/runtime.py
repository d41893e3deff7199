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


#: device types the package runs on (the reference ops run anywhere torch does; these are
#: the ones it is tested on)
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def check_device(device) -> torch.device:
    """``device`` validated and in canonical form; ``ValueError`` naming it otherwise.

    Accepts what ``torch.device`` accepts (a string, a ``torch.device``, an int ordinal)
    for the types in :data:`SUPPORTED_DEVICE_TYPES`.  Rejected, before anything is
    allocated: strings torch does not know (``"tpu"``), the data-less ``"meta"`` device,
    other device types, CUDA when this torch build has no usable CUDA, and CUDA ordinals
    past the visible devices.
    """
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0' (or a torch.device), "
                         f"got {device!r}")
    if isinstance(device, int):
        device = f"cuda:{device}"  # an accelerator ordinal, as torch.device reads it here
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {device!r} is not a device torch knows; replayssm runs on "
                         f"{' and '.join(SUPPORTED_DEVICE_TYPES)} (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if d.type == "meta":
        raise ValueError("device 'meta' holds no data and cannot run a model; use 'cpu' or 'cuda'")
    if d.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"device {str(d)!r} is not supported: replayssm runs on "
                         f"{' and '.join(SUPPORTED_DEVICE_TYPES)}")
    if d.type == "cuda":
        if not _cuda_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"device {str(d)!r} requested but CUDA is not available ({why}); use device='cpu'")
        n = torch.cuda.device_count()
        if d.index is not None and not 0 <= d.index < n:
            raise ValueError(f"device {str(d)!r} does not exist: {n} CUDA device(s) visible "
                             f"(cuda:0 .. cuda:{n - 1})")
    return canonical_device(d)


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


def host_to_device(t: Tensor, device) -> Tensor:
    """``t`` on ``device`` without the host waiting for queued device work: a host tensor
    bound for CUDA is staged through pinned memory (a copy from pageable memory would wait
    for the stream), then copied asynchronously; anything else is a plain ``.to``."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


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
