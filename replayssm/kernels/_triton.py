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


if HAVE_TRITON:

    @triton.jit
    def history_entries(slot_ptr, start_ptr, hist_ptr, bt_ptr, r, L, MAXB,
                        LP: tl.constexpr, PAGED: tl.constexpr):
        """Where row ``r``'s committed history lives: ``(slot, h, mj [LP], e [LP])`` with
        ``e[j]`` the flat entry index of history entry ``j < h`` — ring form:
        ``slot * L + (start + j) % L``; ``PAGED``: block ``bt[r, j // L]``, offset ``j % L``
        (``L`` is then the block size)."""
        slot = tl.load(slot_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        jj = tl.arange(0, LP)
        mj = jj < h
        if PAGED:
            blk = tl.load(bt_ptr + r.to(tl.int64) * MAXB + jj // L, mask=mj, other=0).to(tl.int64)
            e = blk * L + jj % L
        else:
            start = tl.load(start_ptr + r).to(tl.int64)
            e = slot * L + (start + jj) % L
        return slot, h, mj, e

else:  # pragma: no cover
    history_entries = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def pad16(x: int) -> int:
    """Power of two >= max(x, 16): the smallest tile ``tl.dot`` accepts on every target."""
    return max(16, next_pow2(x))


def tile(size: int, block: int | None, default: int) -> int:
    """Tile width along an axis of ``size``: ``block`` (else ``default``) rounded up to a power
    of two and clamped to [16, next_pow2(size)] (``tl.dot`` needs 16)."""
    return max(16, min(next_pow2(block if block else default), next_pow2(size)))


def contiguous(t):
    """``t.contiguous()`` (None stays None): the kernels index flat row-major buffers."""
    return None if t is None else t.contiguous()


def check_ring(named: tuple, plan, Bt: int, T: int) -> None:
    """Each ``(name, tensor, expected shape)`` of a layer's buffers has that shape and is
    contiguous, and ``plan`` matches ``Bt`` rows of ``T`` new tokens."""
    for name, t, shape in named:
        if tuple(t.shape) != shape:
            raise ValueError(f"buf.{name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.is_contiguous():
            raise ValueError(f"buf.{name} must be contiguous for the Triton kernels")
    if plan.batch != Bt or plan.num_new != T:
        raise ValueError(f"plan ({plan.batch} rows, {plan.num_new} new) does not match inputs ({Bt}, {T})")


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
