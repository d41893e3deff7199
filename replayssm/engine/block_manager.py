"""Slots, paged blocks and the memory budget: which sequence holds what, between steps.

One :class:`BlockManager` owns every host-side allocation decision of the engine:

* **slots** of the model cache (``1 .. num_slots``; 0 is the null slot), one per running
  sequence; their fixed memory (states, rings, conv windows) is allocated up front;
* the **memory budget**: what remains of it after the slots' fixed parts is the block pools'
  (attention KV of hybrids, KV-only entries).  An admitted sequence reserves the block bytes
  of ``min(prompt + max_tokens + T, max_seq_len)`` tokens for its whole life
  (:class:`~replayssm.engine.cache_plan.MemoryModel`, from the caches' measured layouts) — or of
  fewer, with a token cap, when only that fits;
* the **blocks** themselves, reserved before each step for the entries it appends
  (``cache.reserve``; the cache picks the pools the slot uses);
* with prefix caching (``prefix``, a :class:`~replayssm.engine.prefix_cache.PrefixCache`),
  the prefix store holds its own share of the budget (``prefix_bytes``: store blocks,
  checkpoints and the attention blocks it caches); a request whose prompt starts with a
  cached prefix reserves the attention blocks it shares no more, and its own attention
  blocks that become cached move from its reservation to the store's share.

Everything here runs between model calls; a step itself reads only device data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_plan import CachePlan, fmt_bytes
from .sequence import Sequence


@dataclass(frozen=True)
class Admission:
    """A sequence may be admitted: reserve ``need`` bytes, allow ``cap`` total tokens."""

    need: int
    cap: int
    match: object = None   # prefix-cache hit (engine.prefix_cache.Match) of a request's first sample


class BlockManager:
    """Slots, blocks and bytes of one model ``cache`` sized by ``plan``; ``prefix``: the
    prefix cache (or None), whose store holds ``plan.store_bytes`` of the budget."""

    def __init__(self, cache, plan: CachePlan, prefix=None):
        self.cache, self.memory, self.budget = cache, plan.memory, plan.budget
        self.num_slots, self.max_seq_len = plan.num_slots, plan.spec.max_seq_len
        prefix_bytes = plan.store_bytes
        self.free_slots = list(range(self.num_slots, 0, -1))   # slots 1..num_slots (0 is null)
        self.reserved = 0
        self.uses_pages = cache.uses_pages
        self.prefix, self.prefix_bytes = prefix, prefix_bytes
        if prefix is not None:
            prefix.on_transfer = self._cached_blocks

    # -- admission ---------------------------------------------------------------------------
    @property
    def token_limit(self) -> int:
        """Most tokens (prompt + generated) a sequence may hold: one verify window stays free."""
        return self.max_seq_len - self.memory.verify_tokens

    @property
    def pool_bytes(self) -> int | None:
        """Budget left for the block pools once every slot's fixed part is allocated."""
        if self.budget is None:
            return None
        return self.budget - self.num_slots * self.memory.fixed - self.prefix_bytes

    def plan(self, seq: Sequence) -> Admission | str:
        """What admitting ``seq`` takes (its block bytes), or why it can never fit (a message)."""
        n_prompt = seq.num_prompt_tokens
        T = self.memory.verify_tokens
        if n_prompt + 1 > self.token_limit:
            return (f"prompt of {n_prompt} tokens does not fit max_seq_len={self.max_seq_len} "
                    f"(needs {n_prompt + 1 + T} with one verify window)")
        match = self.prefix.match(seq) if self.prefix is not None and seq.index == 0 else None
        shared = len(match.full) * self.memory.attn_block_bytes if match is not None else 0   # cached blocks
        want = min(n_prompt + seq.params.max_tokens, self.token_limit)
        need = self.memory.dynamic(want + T) - shared
        pool = self.pool_bytes
        if pool is None or need <= pool:
            return Admission(need, want, match)
        prompt_need = self.memory.dynamic(n_prompt + 1 + T) - shared
        if prompt_need > pool:
            return (f"prompt of {n_prompt} tokens needs {fmt_bytes(prompt_need)} of KV blocks, more than the "
                    f"{fmt_bytes(pool)} the memory budget of {fmt_bytes(self.budget)} leaves after "
                    f"{self.num_slots} slots")
        bs = self.memory.block_size
        cap = (pool + shared) // (bs * self.memory.per_token) * bs - T     # the most tokens whole blocks hold
        return Admission(self.memory.dynamic(cap + T) - shared, int(min(cap, want)), match)

    def can_allocate(self, adm: Admission) -> bool:
        pool = self.pool_bytes
        return bool(self.free_slots) and (pool is None or self.reserved + adm.need <= pool)

    def allocate(self, seq: Sequence, adm: Admission) -> None:
        """Give ``seq`` a slot and reserve its bytes."""
        seq.slot = self.free_slots.pop()
        seq.reserved_bytes = adm.need
        seq.token_cap = adm.cap
        self.reserved += adm.need
        if adm.match is not None:
            self.prefix.admit(seq, adm.match)

    def _cached_blocks(self, seq: Sequence, blocks: int) -> None:
        """``blocks`` of ``seq``'s own attention blocks became cached: their bytes leave its
        reservation (the prefix store's share holds them now)."""
        b = min(seq.reserved_bytes, blocks * self.memory.attn_block_bytes)
        seq.reserved_bytes -= b
        self.reserved -= b

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s slot (cache rows reset, KV blocks returned) and its bytes."""
        if self.prefix is not None:
            self.prefix.finish(seq)
        if seq.slot is not None:
            self.cache.release(torch.tensor([seq.slot], dtype=torch.long, device=self.cache.device))
            self.free_slots.append(seq.slot)
            seq.slot = None
        self.reserved -= seq.reserved_bytes
        seq.reserved_bytes = 0

    # -- KV-only blocks ------------------------------------------------------------------------
    def reserve_tokens(self, seqs: list[Sequence], extra: int) -> list[Sequence]:
        """Reserve blocks for a step of ``extra`` entries past each sequence's cached tokens."""
        return self.reserve([(s, s.num_cached + extra) for s in seqs])

    def reserve(self, totals: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Reserve paged blocks so each sequence holds its given total of tokens (attention KV,
        KV-only entries).  The budget makes this succeed; if a pool still runs dry, that
        request ends with an error and the others go on.  Returns the sequences that can run."""
        if not self.uses_pages:
            return [s for s, _ in totals]
        ok = []
        try:
            for s, n in totals:
                try:   # the cache reserves in the pools the slot uses (attention KV, KV-only entries)
                    self.cache.reserve(s.slot, min(n, self.max_seq_len), defer=True)
                except (RuntimeError, ValueError) as e:  # PoolExhausted is a ValueError
                    s.error = f"KV-only block pool exhausted: {e}"
                    s.finish_reason = "error"
                    continue
                ok.append(s)
        finally:   # the step's new blocks in one block-table write per pool
            self.cache.write_pending()
        return ok

    def switch_to_state(self, seqs: list[Sequence]) -> None:
        """KV-only -> state form for ``seqs`` (one flush each; their blocks are freed)."""
        if not seqs:
            return
        self.cache.switch_to_state(torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.cache.device))
        for s in seqs:
            s.mode = self.cache.mode_of(s.slot)
