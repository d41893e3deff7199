"""Blockwise walks over the paged KV entries a batch actually holds (KV-only reference ops).

The KV-only ops (``kv_verify``, ``kv_tree_verify``, ``kv_to_state`` of
:mod:`replayssm.ops.mamba2.naive` and :mod:`replayssm.ops.gdn.naive`) never gather a row's
whole block table: they visit the block columns that hold committed entries in some row,
``ceil(max(length) / bs)`` of them, a run of whole blocks at a time, so memory and time
follow the context actually held, not ``max_seq_len`` or the table width.  A run holds at
most ``budget // per_entry`` entries (at least one block), which bounds the scratch one
run needs whatever the context length.

Decays across runs are accumulated as sums of non-positive log-decays (a running total of
the runs already visited plus an in-run suffix sum): no difference of long prefix sums.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from ..runtime import capturing

#: elements of scratch one run of blocks may use (about 32 MiB of float64)
RUN_BUDGET = 1 << 22
#: the same for ``kv_fold`` (prefix-store checkpoints and resumes: eager, never inside a CUDA
#: graph, one call per layer over up to a checkpoint interval of tokens for many rows).  Its
#: runs are sequential, each a dozen launches and a few full passes over its scratch, so at
#: ``RUN_BUDGET`` a 16-row, 416-token fold of a Nemotron-H layer took 26 runs (H100,
#: 2026-11-23: the fold and its rebuild were most of a 1–1.6 s prefix checkpoint step)
FOLD_BUDGET = 1 << 26


def held_blocks(pplan) -> int:
    """Block columns holding committed entries in some row: ``ceil(max length / bs)``.

    Reads the lengths on the host (one sync); while a CUDA graph is being captured it
    cannot, and returns the table width instead (same numbers, more work).
    """
    if pplan.batch == 0:
        return 0
    if capturing():
        return pplan.max_blocks
    n = int(pplan.length.max())
    return max(0, min(pplan.max_blocks, -(-n // pplan.block_size)))


def runs(pplan, per_entry: int, reverse: bool = False,
         budget: int = RUN_BUDGET) -> Iterator[tuple[Tensor, Tensor]]:
    """Runs of whole held blocks, oldest first (``reverse``: newest first).

    Yields ``(pos [Bt, E], valid [Bt, E])``: flat pool indices of logical entries
    ``j0 .. j0+E-1`` of every row and ``valid = j < length``.  Entries past a row's length
    (the tail of its last block, or the null block its table points at) are invalid: mask
    them with ``torch.where``, they may hold anything.  ``per_entry`` is the scratch one
    entry of a run costs (elements, over the batch), so ``E * per_entry <= budget`` when
    one block fits.
    """
    nb = held_blocks(pplan)
    if nb == 0:
        return
    bs = pplan.block_size
    step = max(1, min(nb, budget // max(1, per_entry * bs)))
    starts = list(range(0, nb, step))
    if reverse:
        starts.reverse()
    dev = pplan.slot.device
    for c0 in starts:
        c1 = min(nb, c0 + step)
        j = torch.arange(c0 * bs, c1 * bs, device=dev).expand(pplan.batch, -1)
        yield pplan.positions(j), j < pplan.length[:, None]


def suffix_after(l: Tensor, dim: int = 1) -> Tensor:
    """Exclusive reverse cumulative sum: ``out[j] = Σ_{v > j} l[v]`` along ``dim``.

    Formed by adding terms (flip, cumsum, shift), never by subtracting prefix sums, so for
    non-positive log-decays each value is accurate relative to itself.
    """
    inc = torch.flip(torch.cumsum(torch.flip(l, [dim]), dim), [dim])  # Σ_{v >= j}
    tail = torch.zeros_like(inc.narrow(dim, 0, 1))
    return torch.cat([inc.narrow(dim, 1, inc.shape[dim] - 1), tail], dim)


def path_logs(mask: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    """Log-decays along a chain or tree of ``N`` new entries.

    mask ``[Bt, N, N]`` bool, ``mask[t, s]`` = s is t or one of its ancestors (a causal
    chain is the lower triangle); l ``[Bt, N, H]`` log-decays.  Returns
    ``E [Bt, N, N, H]`` with ``E[t, s] = Σ_{v on the path (s, t]} l_v`` (meaningful where
    ``mask[t, s]``) and ``cum [Bt, N, H] = Σ_{v: mask[t, v]} l_v`` (from the last committed
    entry through t).  Both are sums of terms, no differences.
    """
    N = mask.shape[-1]
    eye = torch.eye(N, dtype=torch.bool, device=mask.device)
    m = mask.to(l.dtype)
    strict = (mask & ~eye).to(l.dtype)  # [v, s]: s is a strict ancestor of v
    E = torch.einsum("btv,bvs,bvh->btsh", m, strict, l)
    cum = torch.einsum("btv,bvh->bth", m, l)
    return E, cum
