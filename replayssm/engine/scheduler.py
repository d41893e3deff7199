"""Continuous batching with chunked prefill: which requests run in the next step.

A step processes at most ``max_num_batched_tokens`` tokens.  Running requests come first,
each with one decode or speculative step (``T`` tokens); the rest of the budget — at least a
quarter of it, so prompts always progress — goes to prompts in chunks: first the prompts
already partly in the cache, then newly admitted requests.  A long prompt therefore
neither blocks decoding for everyone nor needs activations for all its tokens at once; each
chunk continues from the state the previous one left.

Admission is in priority order (``SamplingParams.priority``, lower first), first-come
first-served within a priority, under the limits the
:class:`~replayssm.engine.block_manager.BlockManager` checks: a free slot and the memory
budget.  With ``preemption_mode="swap"`` a request is admitted on its prompt's blocks and
its reservation grows before each step; when the growth of the running sequences does not
fit, the scheduler preempts (lowest priority first, then the latest arrival, as vLLM): the
victim's cache goes to host memory and it waits at the front of its priority in the queue,
to be swapped back into any free slot when its blocks fit again — and continue exactly.
A request that can never fit (its prompt alone exceeds ``max_seq_len`` or the budget) is
rejected with an error on its output; the others carry on.  One that fits only
with fewer new tokens is admitted with a token cap (finish reason ``"length"``).  The ``n``
samples of a request are admitted together; they wait for the first sample's prefill and
then copy its cache.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: prompt chunks to prefill (``(sequence, tokens)``; 0 tokens: a sample
    waiting for its first sample's prefill), running sequences to advance, and the requests
    rejected at admission (finished with an error)."""

    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)


class Scheduler:
    """What runs in each step (see the module docstring).  ``stats``: the engine's counters
    (``"preemptions"``: sequences swapped out)."""

    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 8192, stats: dict | None = None):
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.peak_running = 0
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("preemptions", 0)
        self._arrivals = itertools.count()

    # views of the block manager's bookkeeping (what tests and metrics read)
    @property
    def free_slots(self) -> list[int]:
        return self.blocks.free_slots

    @property
    def reserved(self) -> int:
        return self.blocks.reserved

    @property
    def token_limit(self) -> int:
        return self.blocks.token_limit

    @staticmethod
    def _order(seq: Sequence) -> tuple:
        """Scheduling order: priority, then arrival (the samples of a request share their
        first sample's arrival and follow it)."""
        return seq.priority, seq.arrival, seq.index

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival = seq.group[0].arrival if seq.index > 0 else next(self._arrivals)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue, kept in :meth:`_order` (a preempted sequence goes before
        every later arrival of its priority)."""
        key = self._order(seq)
        i = len(self.waiting)
        while i > 0 and self._order(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """Swap the running ``seq`` out (between steps: its cache to host memory, its slot and
        blocks freed) and queue it again; it continues exactly when swapped back in.  Only
        with ``preemption_mode="swap"``, for a sequence past its prompt (else ``ValueError``,
        nothing changed)."""
        if seq not in self.running:
            raise ValueError(f"only a running sequence can be preempted, got {seq!r}")
        self.blocks.swap_out(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)
        self.stats["preemptions"] += 1

    def _make_room(self) -> None:
        """Grow the reservations of the sequences about to decode by this step's tokens
        (one verify window), highest priority first; where the pools run dry, preempt the
        lowest-priority, latest sequences (possibly the one growing)."""
        if not self.blocks.grows:   # whole-life reservations, or nothing grows per token
            return
        T = self.blocks.memory.verify_tokens
        cands = sorted((s for s in self.running if not s.is_finished and not s.prefilling), key=self._order)
        i = 0
        while i < len(cands):
            s = cands[i]
            need = self.blocks.grow_need(s, s.num_cached + T)
            gone = False
            while need and self.blocks.free_bytes is not None and need > self.blocks.free_bytes:
                victim = cands.pop()
                self.preempt(victim)
                if victim is s:
                    gone = True
                    break
            if not gone:
                if need:
                    self.blocks.grow(s, need)
                i += 1

    def grow_ahead(self, seqs: list[Sequence]) -> bool:
        """Grow the reservations of ``seqs`` for the step after the one in flight (async
        scheduling: their pending token and one verify window, what :meth:`_make_room` grows
        them to once that token is appended) without preempting; False, nothing grown, when
        that does not fit."""
        b = self.blocks
        if not b.grows:
            return True
        T = b.memory.verify_tokens
        need = [b.grow_need(s, s.num_cached + 1 + T) for s in seqs]
        if b.free_bytes is not None and sum(need) > b.free_bytes:
            return False
        for s, n in zip(seqs, need):
            if n:
                b.grow(s, n)
        return True

    def admits_nothing(self) -> bool:
        """Whether :meth:`schedule` would admit no waiting request now (none waits, no slot is
        free, a request's samples need more free slots than there are, or, without a prefix
        cache, the first one's bytes do not fit; with one, a prefix match has side effects:
        False, the schedule decides)."""
        waiting, b = self.waiting, self.blocks
        if not waiting or not b.free_slots:
            return True
        head = waiting[0]
        if head.index == 0 and not head.swapped and len(head.group) > len(b.free_slots):
            return True   # a request's samples start together
        if b.prefix is not None:
            return False
        adm = b.plan(head)
        return not isinstance(adm, str) and not b.can_allocate(adm)

    def schedule(self) -> ScheduledBatch:
        """Make room for the running sequences' next step (preempting where the budget runs
        dry), decode every running sequence, then spend the rest of the token budget on
        prompt chunks: continuing ones first, then newly admitted (or swapped back in)
        sequences in priority order."""
        self._make_room()
        batch = ScheduledBatch(running=[s for s in self.running if not s.is_finished and not s.prefilling])
        budget = self.max_num_batched_tokens
        T = self.blocks.memory.verify_tokens
        left = max(budget - len(batch.running) * T, budget // 4, 1)
        for s in self.running:
            if s.is_finished or not s.prefilling:
                continue
            if s.index > 0 and s.num_prefilled == 0:   # waits for its first sample's prefill
                batch.prefill.append((s, 0))
                continue
            n = self._chunk(s, left)
            if n > 0:
                batch.prefill.append((s, n))
                left -= n
        while self.waiting:
            seq = self.waiting[0]
            adm = self.blocks.plan(seq)
            if isinstance(adm, str):
                self.waiting.popleft()
                seq.status = SequenceStatus.REJECTED
                seq.finish_reason, seq.error = "rejected", adm
                batch.rejected.append(seq)
                continue
            if not self.blocks.can_allocate(adm):
                break  # wait for running sequences to finish (no overtaking)
            if seq.swapped:   # back into a free slot; it decodes in this step
                if left < T and batch.running:
                    break
                self.waiting.popleft()
                self.blocks.allocate(seq, adm)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                batch.running.append(seq)
                left -= T
                continue
            if seq.index == 0 and len(seq.group) > len(self.free_slots):
                break  # the n samples of a request start together (one shared prefill)
            shared = seq.index > 0   # admitted right after its first sample: copies its prefill
            if not shared and left <= 0:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, adm)
            seq.status = SequenceStatus.RUNNING
            n = 0 if shared else self._chunk(seq, left)   # (a prefix-cache hit starts past 0)
            left -= n
            batch.prefill.append((seq, n))
            self.running.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))
        return batch

    def _chunk(self, seq: Sequence, left: int) -> int:
        """Prompt tokens of ``seq`` to prefill this step (with prefix caching, a chunk that
        crosses a checkpoint boundary may end on it: ``PrefixCache.align``)."""
        n = min(seq.num_prompt_tokens - seq.num_prefilled, left)
        prefix = self.blocks.prefix
        return prefix.align(seq, n) if prefix is not None and n > 0 else n

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (finished, aborted or failed): free its slot, blocks and bytes."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
