"""How big the prefix store is: its checkpoint interval and blocks (part of the engine's
memory plan, :mod:`replayssm.engine.cache_plan`)."""

from __future__ import annotations

from dataclasses import dataclass


def default_checkpoint_interval(layout, max_seq_len: int) -> int:
    """Checkpoint interval ``C`` (tokens, a multiple of the block size): ``S / C ≈ E / 4``
    with ``S`` one checkpoint and ``E`` one token's whole ring entries and conv inputs over
    all SSM layers (``C ≈ 4 S / E``; what a resume reads per folded token, and what the store
    kept per token before Mamba-2 entries were rebuilt from the conv inputs, so the interval
    and a hit's fold length stay where they were measured).  Loading a hit folds fewer than
    ``C`` entries per layer."""
    bs = layout.block_size
    per_token = max(1, layout.fold_token_bytes or layout.prefix_block_bytes // bs)
    blocks = max(1, round(4 * layout.checkpoint_bytes / (per_token * bs)))
    return min(blocks, max(1, -(-max_seq_len // bs))) * bs


@dataclass(frozen=True)
class StorePlan:
    """Size of the prefix store: ``blocks`` store blocks, ``checkpoints`` checkpoint rows, the
    checkpoint ``interval`` and the ``bytes`` it takes (store, checkpoints, the attention
    blocks the cache may hold, null rows included)."""

    blocks: int
    checkpoints: int
    interval: int
    bytes: int


def plan_store(layout, *, budget: int | None, fraction: float, blocks: int | None, interval: int | None,
               num_slots: int, max_seq_len: int) -> StorePlan:
    """How big the prefix store is: ``blocks`` when given; else ``fraction`` of the memory
    ``budget``; without a budget, one full context per slot (``num_slots * max_seq_len``
    tokens).  Checkpoint rows: one per ``interval`` tokens of the store, plus two."""
    bs = layout.block_size
    C = interval or default_checkpoint_interval(layout, max_seq_len)
    per_block = layout.prefix_block_bytes + layout.attn_block_bytes + layout.checkpoint_bytes * bs / C
    fixed = layout.prefix_block_bytes + 3 * layout.checkpoint_bytes + (num_slots + 1) * layout.prefix_slot_bytes
    if blocks is None:
        if budget is None:
            blocks = num_slots * -(-max_seq_len // bs)
        else:
            blocks = int((fraction * budget - fixed) // per_block)
            if blocks < 1:
                raise ValueError(f"prefix_cache_fraction={fraction} of memory_budget {budget} B holds no block of the "
                                 f"prefix store ({int(per_block + fixed)} B); raise either, or set prefix_cache_blocks")
    ckpts = -(-blocks * bs // C) + 2
    total = ((blocks + 1) * layout.prefix_block_bytes + blocks * layout.attn_block_bytes
             + (ckpts + 1) * layout.checkpoint_bytes + (num_slots + 1) * layout.prefix_slot_bytes)
    return StorePlan(int(blocks), int(ckpts), int(C), int(total))
