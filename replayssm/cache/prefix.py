"""The prefix store: what a cached prompt prefix keeps of each SSM layer, in token blocks.

A cached prefix resumes exactly at any token ``p`` from a **checkpoint** state at ``c <= p``
plus the **per-token layer inputs** since it (``docs/MATH.md``: the replay form's state is
the checkpoint folded with its ring entries).  So per SSM layer the store keeps, in blocks of
``block_size`` tokens (flat over ``blocks × block_size`` like the KV-only pools, block 0 the
null block that unassigned tokens are written to):

* ``entries``: what the conv inputs do not give of every token's ring entry.  GDN: the
  whole entry ``(u, k, g)`` in the KV-only pool layout
  (:class:`~replayssm.cache.paged.GDNPagedBuffers`; ``u`` depends on the state), which the
  KV-only ops (``kv_fold``) read directly.  Mamba-2: only ``Δ``
  (:class:`Mamba2StoredEntries`); ``x`` and ``B`` are ``silu(conv(...))`` of the conv
  inputs and are rebuilt when a resume or a checkpoint reads them, which halves the
  store (``SSMLayer.prefix_entries``);
* ``preconv``: every token's input to the short conv ``[NB*bs, C]`` (the conv window at any
  position ``p`` is the ``W-1`` inputs before it);
* ``ckpt``: checkpoint states ``[NC, *state]`` (row 0 the null checkpoint), one per
  checkpoint interval of a cached chain, and one per **state point** (a finished request's
  state after its prompt and reply, :func:`replayssm.models.prefix.save_states`);
* ``ckpt_window``: the conv window ``[NC, C, W-1]`` of a state point's checkpoint row (a
  state point keeps no per-token entries, so its conv window cannot come from ``preconv``).

Attention layers keep nothing here: their key/value blocks are shared with the sequences
through the attention pool's reference counts (:class:`~replayssm.cache.paged.PagedIndex`).

:class:`PrefixTable` is the bookkeeping all SSM layers share: per slot, which store block
each logical block of its prompt is captured into during prefill (0: not captured).  The
host (the engine's prefix index) assigns store blocks between steps; a prefill writes every
packed token's entries to ``table[slot, pos // bs] * bs + pos % bs`` without any condition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..runtime import canonical_device
from .paged import NULL_BLOCK, PagedPlan


@dataclass
class Mamba2StoredEntries:
    """The stored part of Mamba-2 ring entries: ``dt [NB*bs, H]`` (compute dtype); ``x`` and
    ``B`` are rebuilt from the conv inputs."""

    dt: Tensor

    def tensors(self) -> list[Tensor]:
        return [self.dt]


@dataclass
class PrefixPools:
    """One SSM layer's part of the prefix store (see the module docstring)."""

    entries: object      # GDNPagedBuffers | Mamba2StoredEntries, [NB*bs, ...]
    preconv: Tensor      # [NB*bs, C] pre-conv inputs
    ckpt: Tensor         # [NC, *state] checkpoint states (the cache's ssm_state_dtype)
    ckpt_window: Tensor  # [NC, C, W-1] conv windows of state points (rows of other checkpoints unused)

    def tensors(self) -> list[Tensor]:
        return [*self.entries.tensors(), self.preconv, self.ckpt, self.ckpt_window]

    def token_tensors(self) -> list[Tensor]:
        """The per-token pools (entries, then the pre-conv inputs), ``[NB*bs, ...]`` each."""
        return [*self.entries.tensors(), self.preconv]


class PrefixTable:
    """Capture table and sizes of the prefix store (shared by every SSM layer).

    Args:
        num_slots: slots of the model cache, null slot 0 included (``P``).
        block_size: tokens per block (the cache spec's ``block_size``).
        num_blocks: store blocks *including* the null block 0.
        num_checkpoints: checkpoint rows *including* the null row 0.
        max_blocks: logical blocks per slot (``ceil(max_seq_len / block_size)``).
    """

    def __init__(self, num_slots: int, block_size: int, num_blocks: int, num_checkpoints: int, max_blocks: int,
                 device):
        for name, v, lo in (("num_slots", num_slots, 2), ("block_size", block_size, 1),
                            ("prefix_blocks", num_blocks, 2), ("prefix_checkpoints", num_checkpoints, 1),
                            ("max_blocks", max_blocks, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.block_size, self.num_blocks, self.num_checkpoints = block_size, num_blocks, num_checkpoints
        self.max_blocks = max_blocks
        self.device = canonical_device(device)
        self.table = torch.zeros(num_slots, max_blocks, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ host bookkeeping
    def check_block(self, b: int, what: str = "store block") -> int:
        if not isinstance(b, int) or isinstance(b, bool) or not NULL_BLOCK < b < self.num_blocks:
            raise ValueError(f"{what} must be an int in [1, {self.num_blocks - 1}], got {b!r}")
        return b

    def check_checkpoint(self, c: int) -> int:
        if not isinstance(c, int) or isinstance(c, bool) or not 0 < c < self.num_checkpoints:
            raise ValueError(f"checkpoint must be an int in [1, {self.num_checkpoints - 1}], got {c!r}")
        return c

    def assign(self, slot: int, pairs) -> None:
        """Capture logical block ``k`` of ``slot`` into store block ``b`` for each ``(k, b)``
        of ``pairs`` (``b = 0``: stop capturing it)."""
        pairs = [(int(k), int(b)) for k, b in pairs]
        for k, b in pairs:
            if not 0 <= k < self.max_blocks:
                raise ValueError(f"logical block {k} outside [0, {self.max_blocks - 1}]")
            if b != NULL_BLOCK:
                self.check_block(b)
        if pairs:
            ks = torch.tensor([k for k, _ in pairs], dtype=torch.long, device=self.device)
            self.table[slot, ks] = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)

    def clear(self, slots: Tensor) -> None:
        """Stop every capture of ``slots`` (a released slot)."""
        self.table[slots] = NULL_BLOCK

    # ------------------------------------------------------------------ device views
    def rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Flat store rows of tokens at ``positions [Nt]`` of ``slots [Nt]`` (the null block's
        rows for tokens of blocks no one captures)."""
        bs = self.block_size
        col = (positions // bs).clamp(max=self.max_blocks - 1)
        return self.table[slots, col] * bs + positions % bs

    def chains_plan(self, chains: list[tuple[list[int], int]]) -> PagedPlan:
        """A :class:`~replayssm.cache.paged.PagedPlan` with one row per ``(blocks, length)``:
        row ``i`` holds ``length`` entries in store ``blocks`` (logical order); the block
        table is padded with the null block."""
        width = max([len(b) for b, _ in chains] + [1])
        for blocks, length in chains:
            if not 0 <= length <= len(blocks) * self.block_size:
                raise ValueError(f"{length} entries do not fit {len(blocks)} blocks of {self.block_size}")
            for b in blocks:
                self.check_block(b)
        table = torch.tensor([list(b) + [NULL_BLOCK] * (width - len(b)) for b, _ in chains], dtype=torch.long)
        lengths = torch.tensor([n for _, n in chains], dtype=torch.long)
        zero = torch.zeros(len(chains), dtype=torch.long)
        return PagedPlan(zero.to(self.device), lengths.to(self.device), table.to(self.device), 1, self.block_size)

    def window_rows(self, blocks: list[int], start: int, stop: int, width: int) -> tuple[Tensor, Tensor]:
        """Store rows of the ``width`` tokens ending at each position ``start .. stop-1`` of
        the chain ``blocks`` (``[stop - start, width]``, the last column the position itself)
        and which of them exist (``>= 0``; the others point at the null block's row 0)."""
        bs = self.block_size
        if not 0 <= start <= stop <= len(blocks) * bs:
            raise ValueError(f"positions [{start}, {stop}) outside a chain of {len(blocks)} blocks of {bs}")
        j = torch.arange(start, stop, dtype=torch.long)[:, None] + torch.arange(1 - width, 1, dtype=torch.long)
        valid = j >= 0
        jj = j.clamp(min=0)
        b = torch.tensor(list(blocks) or [NULL_BLOCK], dtype=torch.long)
        rows = torch.where(valid, b[jj // bs] * bs + jj % bs, torch.zeros_like(jj))
        return rows.to(self.device), valid.to(self.device)

    def chain_rows(self, blocks: list[int], start: int, stop: int) -> Tensor:
        """Flat store rows of positions ``start .. stop-1`` of the chain ``blocks`` (block
        ``i`` holds positions ``i*bs .. (i+1)*bs-1``); ``[stop - start]``."""
        bs = self.block_size
        if not 0 <= start <= stop <= len(blocks) * bs:
            raise ValueError(f"positions [{start}, {stop}) outside a chain of {len(blocks)} blocks of {bs}")
        j = torch.arange(start, stop, dtype=torch.long)
        b = torch.tensor(list(blocks) or [NULL_BLOCK], dtype=torch.long)
        return (b[j // bs] * bs + j % bs).to(self.device)
