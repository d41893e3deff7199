"""Triton availability and small helpers shared by the kernel modules.

Importing this module never fails: without Triton, ``HAVE_TRITON`` is False and the
kernel modules define nothing callable (dispatch falls back to the naive ops).
Set ``TRITON_INTERPRET=1`` *before* importing triton to run the kernels on CPU tensors.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

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

    @triton.jit
    def tile_ids(N0, N1):
        """``(i0, i1, i2)`` of this program on a flat grid of ``N0 × N1 × N2`` programs
        (:func:`flat_grid`), ``i0`` fastest: the same launch order as a ``(N0, N1, N2)`` grid,
        without CUDA's 65535 limit on grid axes 1 and 2."""
        pid = tl.program_id(0)
        rest = pid // N0
        return pid % N0, rest % N1, rest // N1

    @triton.jit
    def count_flags(flag_ptr, Bt, BT: tl.constexpr):
        """Number of non-zero entries of ``flag [Bt]`` (read in chunks of ``BT``)."""
        n = tl.sum(tl.zeros([BT], dtype=tl.int32), 0)
        for c0 in range(0, Bt, BT):
            o = c0 + tl.arange(0, BT)
            n += tl.sum((tl.load(flag_ptr + o, mask=o < Bt, other=0) != 0).to(tl.int32), 0)
        return n

    @triton.jit
    def nth_flag(flag_ptr, Bt, i, BT: tl.constexpr):
        """Index of the ``(i+1)``-th non-zero entry of ``flag [Bt]`` (``i`` < their count): the
        number of positions whose running count of set flags is still ``<= i``.  A device-side
        compaction without a host sync or a scratch list."""
        r = tl.sum(tl.zeros([BT], dtype=tl.int32), 0)
        seen = r
        for c0 in range(0, Bt, BT):
            o = c0 + tl.arange(0, BT)
            f = (tl.load(flag_ptr + o, mask=o < Bt, other=0) != 0).to(tl.int32)
            r += tl.sum(((tl.cumsum(f, 0) + seen) <= i).to(tl.int32), 0)
            seen += tl.sum(f, 0)
        return r

else:  # pragma: no cover
    history_entries = tile_ids = count_flags = nth_flag = None

#: CUDA's limit on grid axes 1 and 2; axis 0 takes up to 2**31 - 1 programs.
GRID_YZ_MAX = 65535
GRID_X_MAX = 2 ** 31 - 1


def flat_grid(*counts: int) -> tuple[int]:
    """A one-axis grid of ``prod(counts)`` programs (decode them with :func:`tile_ids`): no
    count (rows, tokens × heads) can reach the 65535 limit of grid axes 1 and 2."""
    total = 1
    for c in counts:
        total *= int(c)
    if total > GRID_X_MAX:
        raise ValueError(f"{total} programs ({' x '.join(map(str, counts))}) exceed the CUDA grid ({GRID_X_MAX})")
    return (total,)


def flag_chunk(Bt: int) -> int:
    """Chunk width for :func:`count_flags` / :func:`nth_flag` over ``Bt`` rows."""
    return max(16, min(1024, next_pow2(Bt)))


_SMS: dict = {}


def persistent_programs(device, work: int, per_sm: int) -> int:
    """Programs of a persistent launch: ``per_sm`` per streaming multiprocessor (4 under the
    interpreter), never more than the ``work`` items it loops over."""
    if device.type != "cuda":
        sms = 1
    else:
        idx = device.index if device.index is not None else 0
        if idx not in _SMS:
            import torch

            _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _SMS[idx]
    return max(1, min(int(work), sms * per_sm if device.type == "cuda" else 4))


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def search_steps(n: int) -> int:
    """Unrolled binary-search steps over ``n`` sequences' boundaries, bucketed (7 up to 127
    sequences, then the bit length) so a serving engine's prefill batches of every size share
    one compiled kernel; extra steps are no-ops once the search has converged."""
    return max(7, int(n).bit_length())


#: the packed-batch kernels' counts (sequences, tokens, rows; a block table's width and row
#: stride) change every step: Triton must not specialise on them (``== 1``, ``% 16 == 0``),
#: or each new count compiles a variant
COUNT_ARGS = ("N", "Nt", "R", "P", "NtH", "steps", "MAXB", "sbt", "Bt", "NPROG")


def count_args(*names: str) -> dict:
    """``triton.jit`` keywords that keep the count arguments ``names`` unspecialised."""
    bad = [n for n in names if n not in COUNT_ARGS]
    if bad:
        raise ValueError(f"not a count argument: {bad}")
    return dict(do_not_specialize=list(names))


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


def token_rows(t: Tensor, lead: int) -> tuple[Tensor, int]:
    """``(t, token stride)`` for ``t [*lead dims, *inner]`` read as token rows: kept as it is
    (a strided view, e.g. a slice of a projection's output) when each token's inner block is
    contiguous and the ``lead`` dims flatten to one stride, else a contiguous copy."""
    inner = t.shape[lead:]
    ok, expect = True, 1
    for size, st in zip(reversed(inner), reversed(t.stride()[lead:])):
        ok &= size == 1 or st == expect
        expect *= size
    dims = [i for i in range(lead) if t.shape[i] != 1]
    for a, b in zip(dims, dims[1:]):
        span = 1
        for i in range(a + 1, b + 1):
            span *= t.shape[i]
        ok &= t.stride(a) == t.stride(b) * span
    if not ok or t.numel() == 0:
        return t.contiguous(), max(1, expect)
    return t, (t.stride(dims[-1]) if dims else max(1, expect))


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


def few_new_tokens(t, limit: int) -> bool:
    """Whether a KV-only verify call's lead input ``t [Bt, T, H, ·]`` carries at most ``limit``
    new tokens: those kernels' score tiles grow with the square of the padded ``T``, so
    longer steps (a KV-only prefill of a long chunk) run the reference op (a module's
    ``SUPPORTS``, :mod:`.dispatch`)."""
    return getattr(t, "dim", None) is not None and t.dim() == 4 and t.shape[1] <= limit


#: ``tl.dot`` input precisions for fp32 operands
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")


def verify_precision(dtype, precision: str | None = None, fold_precision: str = "tf32x3") -> str:
    """The ``tl.dot`` precision of a verify kernel's fp32 output products: ``precision`` when
    given; else ``tf32`` for 16-bit activations (a tf32 operand, 10-bit mantissa, errs below
    the bf16 rounding of the output itself) and ``tf32x3`` (fp32-level) for fp32 ones.
    Folds into a stored state keep their own ``fold_precision`` (checked here too)."""
    for name, p in (("precision", precision), ("fold_precision", fold_precision)):
        if p is not None and p not in DOT_PRECISIONS:
            raise ValueError(f"bad {name} {p!r}: expected one of {DOT_PRECISIONS}")
    return precision or ("tf32" if dtype.itemsize == 2 else "tf32x3")
