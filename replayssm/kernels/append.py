"""One Triton launch that appends a step's T new entries to a layer's input buffers.

Both families buffer three per-token tensors (Mamba-2 ``(x, B, dt)``, GDN ``(u, k, g)``).
Entry ``s`` of row ``r`` goes to ring position ``(start + h + s) mod L`` of the row's slot, or
(paged, KV-only form) to position ``h + s`` through the row's block table.  The verify
kernels never write the buffers themselves: a flushing row with ``h + T > L`` overwrites
entries that other programs of the verify kernel still read, so the append runs after it
(stream order).
"""

from __future__ import annotations

from torch import Tensor

from ._triton import HAVE_TRITON, flat_grid, next_pow2, token_rows, triton, tl

if HAVE_TRITON:

    @triton.jit
    def _copy_row(dst_ptr, src_ptr, e, tok, W, S, BW: tl.constexpr):
        for o in range(0, W, BW):
            offs = o + tl.arange(0, BW)
            m = offs < W
            v = tl.load(src_ptr + tok * S + offs, mask=m)
            tl.store(dst_ptr + e * W + offs, v.to(dst_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _append3_kernel(
        r0_ptr, r1_ptr, r2_ptr, slot_ptr, start_ptr, hist_ptr, bt_ptr, v0_ptr, v1_ptr, v2_ptr,
        T, L, W0, W1, W2, MAXB, S0, S1, S2,
        B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, PAGED: tl.constexpr,
    ):
        pid = tl.program_id(0)  # flat grid, a row's entries side by side: no limit on rows or T
        r = (pid // T).to(tl.int64)
        s = pid % T
        h = tl.load(hist_ptr + r).to(tl.int64)
        if PAGED:
            j = h + s
            e = tl.load(bt_ptr + r * MAXB + j // L).to(tl.int64) * L + j % L
        else:
            slot = tl.load(slot_ptr + r).to(tl.int64)
            start = tl.load(start_ptr + r).to(tl.int64)
            e = slot * L + (start + h + s) % L
        tok = r * T + s
        _copy_row(r0_ptr, v0_ptr, e, tok, W0, S0, B0)
        _copy_row(r1_ptr, v1_ptr, e, tok, W1, S1, B1)
        _copy_row(r2_ptr, v2_ptr, e, tok, W2, S2, B2)


def append_entries(rings: tuple[Tensor, Tensor, Tensor], values: tuple[Tensor, Tensor, Tensor],
                   slot: Tensor, start: Tensor, hist: Tensor, block_table: Tensor | None, L: int) -> None:
    """Append ``values[i] [Bt, T, ...]`` into ``rings[i]`` (``[P, L, ...]`` rings, or paged pools
    ``[num_blocks * L, ...]`` when ``block_table [Bt, max_blocks]`` is given; ``L`` is then the
    block size).  ``hist [Bt]`` is the position of entry 0 (the fill level / context length).
    Values may be strided views whose tokens are rows of a larger tensor (no copy is made)."""
    Bt, T = values[0].shape[:2]
    if Bt == 0 or T == 0:
        return
    vals, strides = zip(*(token_rows(v, 2) for v in values))
    widths = [v[0, 0].numel() for v in vals]
    paged = block_table is not None
    bt = block_table.contiguous() if paged else slot
    _append3_kernel[flat_grid(T, Bt)](
        *rings, slot, start, hist, bt, *vals, T, L, *widths, bt.shape[1] if paged else 1, *strides,
        B0=min(2048, next_pow2(widths[0])), B1=min(2048, next_pow2(widths[1])),
        B2=min(1024, next_pow2(widths[2])), PAGED=paged, num_warps=4)
