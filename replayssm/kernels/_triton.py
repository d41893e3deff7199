"""Triton availability and small helpers shared by the kernel modules.

Importing this module never fails: without Triton, ``HAVE_TRITON`` is False and the
kernel modules define nothing callable (dispatch falls back to the naive ops).
Set ``TRITON_INTERPRET=1`` *before* importing triton to run the kernels on CPU tensors.
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the environment
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def pad16(x: int) -> int:
    """Power of two >= max(x, 16): the smallest tile ``tl.dot`` accepts on every target."""
    return max(16, next_pow2(x))


def usable(*tensors) -> bool:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if not HAVE_TRITON:
        return False
    devs = {t.device.type for t in tensors if t is not None}
    if devs == {"cuda"}:
        return True
    return devs == {"cpu"} and interpreting()


def dot_precision(dtype) -> str:
    """``tl.dot`` precision for fp32 operands: full fp32 (``ieee``)."""
    return "ieee"
