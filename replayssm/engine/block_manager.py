"""Slots, paged blocks and the memory budget: which sequence holds what, between steps.

One :class:`BlockManager` owns every host-side allocation decision of the engine:

* **slots** of the model cache (``1 .. num_slots``; 0 is the null slot), one per running
  sequence; their fixed memory (states, rings, conv windows) is allocated up front;
* the **memory budget**: what remains of it after the slots' fixed parts is the block pools'
  (attention KV of hybrids, KV-only entries), counted in bytes
  (:class:`~replayssm.engine.cache_plan.MemoryModel`, from the caches' measured layouts).
  With ``preemption_mode="off"`` an admitted sequence reserves the block bytes of
  ``min(prompt + max_tokens + T, max_seq_len)`` tokens for its whole life — or of fewer, with
  a token cap, when only that fits.  With ``"swap"`` (the default) it is admitted on the
  bytes of its prompt plus one token and one verify window, and its reservation grows
  before each step (:meth:`BlockManager.grow_need`); when a step's growth does not fit, the
  scheduler preempts sequences: :meth:`BlockManager.swap_out` copies a slot (and its
  drafter's) to host memory and frees its slot and bytes, :meth:`BlockManager.allocate`
  swaps it back into any free slot.  The bytes reserved never exceed the pools, so the
  blocks a step reserves are always there;
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

import itertools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .cache_plan import CachePlan, fmt_bytes
from .sequence import Sequence

_swap_keys = itertools.count(1)


@dataclass(frozen=True)
class Admission:
    """A sequence may be admitted: reserve ``need`` bytes, allow ``cap`` total tokens."""

    need: int
    cap: int
    match: object = None   # prefix-cache hit (engine.prefix_cache.Match) of a request's first sample
    shared: int = 0        # bytes of the hit's attention blocks (held by the prefix store)


class BlockManager:
    """Slots, blocks and bytes of one model ``cache`` sized by ``plan``; ``prefix``: the
    prefix cache (or None), whose store holds ``plan.store_bytes`` of the budget;
    ``preemption_mode``: ``"swap"`` (optimistic admission, preemption) or ``"off"``
    (whole-life reservation at admission)."""

    def __init__(self, cache, plan: CachePlan, prefix=None, preemption_mode: str = "swap"):
        if preemption_mode not in ("swap", "off"):
            raise ValueError(f"preemption_mode must be 'swap' or 'off', got {preemption_mode!r}")
        self.optimistic = preemption_mode == "swap"
        # cached attention blocks a sequence shares are not its bytes — except in the KV-only
        # form with tight (optimistic) reservations: its KV-only entries take a block of their
        # own pool per block of tokens all the same, and the bytes count both pools together
        self.discount_shared = not (self.optimistic and plan.spec.mode == "kv")
        # set by the engine: the drafter now (it swaps its own cache) and the sampler (penalty
        # statistics are per slot: rebuilt from the tokens when a sequence comes back)
        self.drafter_of = lambda: None
        self.sampler = None
        self.cache, self.memory, self.budget = cache, plan.memory, plan.budget
        self.num_slots, self.max_seq_len = plan.num_slots, plan.spec.max_seq_len
        prefix_bytes = plan.store_bytes
        self.free_slots = list(range(self.num_slots, 0, -1))   # slots 1..num_slots (0 is null)
        self.reserved = 0
        self.uses_pages = cache.uses_pages
        self.prefix, self.prefix_bytes = prefix, prefix_bytes
        self._releases: list[int] | None = None   # slots of a batched release (:meth:`batched_releases`)
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
        """What admitting ``seq`` takes (its block bytes), or why it can never fit (a message).
        A swapped-out sequence takes the bytes of what it holds plus one verify window."""
        if seq.swapped:
            return Admission(seq.swap_need, seq.token_cap)
        n_prompt = seq.num_prompt_tokens
        T = self.memory.verify_tokens
        if n_prompt + 1 > self.token_limit:
            return (f"prompt of {n_prompt} tokens does not fit max_seq_len={self.max_seq_len} "
                    f"(needs {n_prompt + 1 + T} with one verify window)")
        match = self.prefix.match(seq) if self.prefix is not None and seq.index == 0 else None
        shared = len(match.full) * self.memory.attn_block_bytes if match is not None and self.discount_shared else 0
        want = min(n_prompt + seq.params.max_tokens, self.token_limit)
        need = self.memory.dynamic(want + T) - shared
        pool = self.pool_bytes
        prompt_need = self.memory.dynamic(n_prompt + 1 + T) - shared
        # a sequence that may be preempted must fit alone with blocks of its own (it comes back
        # without the prefix store's)
        if pool is not None and prompt_need + (shared if self.optimistic else 0) > pool:
            return (f"prompt of {n_prompt} tokens needs {fmt_bytes(prompt_need)} of KV blocks, more than the "
                    f"{fmt_bytes(pool)} the memory budget of {fmt_bytes(self.budget)} leaves after "
                    f"{self.num_slots} slots")
        bs = self.memory.block_size
        if self.optimistic:
            # admitted on its prompt; grows per step.  Its cap: the most tokens the pools hold
            # for it alone without the prefix store's blocks (a preempted sequence comes back
            # with blocks of its own), so that it always fits once the others are preempted
            cap = want
            if pool is not None and self.memory.per_token and self.memory.dynamic(want + T) > pool:
                cap = min(want, pool // (bs * self.memory.per_token) * bs - T)
            return Admission(prompt_need, int(cap), match, shared)
        if pool is None or need <= pool:
            return Admission(need, want, match, shared)
        cap = (pool + shared) // (bs * self.memory.per_token) * bs - T     # the most tokens whole blocks hold
        return Admission(self.memory.dynamic(cap + T) - shared, int(min(cap, want)), match, shared)

    def can_allocate(self, adm: Admission) -> bool:
        pool = self.pool_bytes
        return bool(self.free_slots) and (pool is None or self.reserved + adm.need <= pool)

    def allocate(self, seq: Sequence, adm: Admission) -> None:
        """Give ``seq`` a slot and reserve its bytes (a swapped-out sequence is swapped back in
        there, with its drafter's cache)."""
        slot = self.free_slots.pop()
        if seq.swapped:
            try:
                self.cache.swap_in(slot, seq.swap_key)
            except Exception:
                self.free_slots.append(slot)
                raise
            seq.slot = slot
            drafter = self.drafter_of()
            if drafter is not None:
                drafter.swap_in(seq)
            if self.sampler is not None:
                self.sampler.start([seq])
                self.sampler.observe(seq, seq.output_ids)
            seq.swapped, seq.swap_key, seq.swap_need = False, None, 0
        else:
            seq.slot = slot
            seq.token_cap = adm.cap
        seq.reserved_bytes = adm.need
        seq.shared_bytes = adm.shared
        self.reserved += adm.need
        if adm.match is not None:
            self.prefix.admit(seq, adm.match)

    # -- growth and preemption ("swap") --------------------------------------------------------
    @property
    def free_bytes(self) -> int | None:
        """Pool bytes no sequence has reserved (None: no budget)."""
        pool = self.pool_bytes
        return None if pool is None else pool - self.reserved

    @property
    def grows(self) -> bool:
        """Whether reservations grow before a step: optimistic admission, and paged pools
        that take bytes per token (attention KV, KV-only entries)."""
        return self.optimistic and self.memory.per_token > 0

    def grow_need(self, seq: Sequence, tokens: int) -> int:
        """Bytes ``seq``'s reservation must grow by to hold ``tokens`` tokens (0 with
        whole-life reservations, or when it holds them already)."""
        if not self.optimistic:
            return 0
        want = self.memory.dynamic(min(tokens, self.max_seq_len)) - seq.shared_bytes
        return max(0, want - seq.reserved_bytes)

    def grow(self, seq: Sequence, nbytes: int) -> None:
        seq.reserved_bytes += nbytes
        self.reserved += nbytes

    def swap_out(self, seq: Sequence) -> None:
        """Preempt ``seq`` (between steps): its prefix-cache references go back, its slot (and
        its drafter's) is copied to host memory and freed, its bytes return to the pools.
        :meth:`plan` / :meth:`allocate` bring it back with the bytes of its tokens plus one
        verify window."""
        if not self.optimistic:
            raise ValueError("preemption needs preemption_mode='swap'")
        if seq.slot is None or seq.prefilling or seq.is_finished:
            raise ValueError(f"only a running sequence past its prompt can be preempted, got {seq!r}")
        if self.prefix is not None:
            self.prefix.finish(seq)
        key = next(_swap_keys)
        seq.swap_key = key
        drafter = self.drafter_of()
        if drafter is not None:
            drafter.swap_out(seq)
        self.cache.swap_out(seq.slot, key)
        self.free_slots.append(seq.slot)
        seq.slot = None
        seq.swapped = True
        seq.swap_need = self.memory.dynamic(min(seq.num_cached + self.memory.verify_tokens, self.max_seq_len))
        seq.num_preemptions += 1
        self.reserved -= seq.reserved_bytes
        seq.reserved_bytes = seq.shared_bytes = 0

    def _cached_blocks(self, seq: Sequence, blocks: int) -> None:
        """``blocks`` of ``seq``'s own attention blocks became cached: their bytes leave its
        reservation (the prefix store's share holds them now)."""
        if not self.discount_shared:
            return
        b = min(seq.reserved_bytes, blocks * self.memory.attn_block_bytes)
        seq.reserved_bytes -= b
        seq.shared_bytes += b
        self.reserved -= b

    def _release(self, slots: list[int]) -> None:
        # a host tensor: the cache reads the ids on the host anyway, and a device tensor's
        # read would wait for the queued steps (async scheduling keeps one on the device)
        self.cache.release(torch.tensor(slots, dtype=torch.long))

    @contextmanager
    def batched_releases(self):
        """Within the block, :meth:`free` collects the slots it frees and the cache releases
        them in one call on exit (one message to the workers under tensor parallelism, one
        set of index writes, instead of one per request when many finish in one step).  The
        freed slots must not be handed out again inside the block (the engine frees a step's
        finished requests, then admits at the next step)."""
        if self._releases is not None:   # nested: the outer block releases
            yield
            return
        self._releases = []
        try:
            yield
        finally:
            slots, self._releases = self._releases, None
            if slots:
                self._release(slots)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s slot (cache rows reset, KV blocks returned) and its bytes, or the
        host copy of a swapped-out one.  With prefix caching the state after its prompt and
        reply is cached first unless the engine did already (``PrefixCache.capture_end``; a
        failure there only warns: the sequence is freed all the same)."""
        if self.prefix is not None:
            try:
                self.prefix.capture_end(seq)
            except Exception as e:   # noqa: BLE001  (caching is an optimisation: never block the free)
                warnings.warn(f"prefix cache: the reply of request {seq.request_id} was not cached: {e}",
                              stacklevel=2)
            self.prefix.finish(seq)
        if seq.slot is not None:
            if self._releases is not None:
                self._releases.append(seq.slot)
            else:
                self._release([seq.slot])
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq.swapped:
            self.cache.drop_swapped(seq.swap_key)
            drafter = self.drafter_of()
            if drafter is not None:
                drafter.drop_swapped(seq)
            seq.swapped, seq.swap_key = False, None
        self.reserved -= seq.reserved_bytes
        seq.reserved_bytes = seq.shared_bytes = 0

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
        # one cache call for the step (the cache reserves in the pools each slot uses, then
        # writes the new blocks in one block-table write per pool); under tensor parallelism
        # one message to the workers instead of one per row
        errors = self.cache.reserve_step([s.slot for s, _ in totals], [min(n, self.max_seq_len) for _, n in totals])
        ok = []
        for (s, _), e in zip(totals, errors):
            if e is not None:   # PoolExhausted is a ValueError
                s.error = f"KV-only block pool exhausted: {e}"
                s.finish_reason = "error"
                continue
            ok.append(s)
        return ok

    def switch_to_state(self, seqs: list[Sequence]) -> None:
        """KV-only -> state form for ``seqs`` (one flush each; their blocks are freed)."""
        if not seqs:
            return
        self.cache.switch_to_state(torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.cache.device))
        for s in seqs:
            s.mode = self.cache.mode_of(s.slot)
