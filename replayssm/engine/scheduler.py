"""Continuous batching with chunked prefill: which requests run in the next step.

A step processes at most ``max_num_batched_tokens`` tokens.  Running requests come first,
each with one decode or speculative step (``T`` tokens); the rest of the budget — at least a
quarter of it, so prompts always progress — goes to prompts in chunks: first the prompts
already partly in the cache, then newly admitted requests.  A long prompt therefore
neither blocks decoding for everyone nor needs activations for all its tokens at once; each
chunk continues from the state the previous one left.

Admission is first-come first-served under the limits the
:class:`~replayssm.engine.block_manager.BlockManager` checks: a free slot and the memory
budget.  A request that can never fit (its prompt alone exceeds ``max_seq_len`` or the
budget) is rejected with an error on its output; the others carry on.  One that fits only
with fewer new tokens is admitted with a token cap (finish reason ``"length"``).  The ``n``
samples of a request are admitted together; they wait for the first sample's prefill and
then copy its cache.
"""

from __future__ import annotations

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
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 8192):
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.peak_running = 0

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

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Decode every running sequence, then spend the rest of the token budget on prompt
        chunks: continuing ones first, then newly admitted sequences (FCFS)."""
        batch = ScheduledBatch(running=[s for s in self.running if not s.is_finished and not s.prefilling])
        budget = self.max_num_batched_tokens
        left = max(budget - len(batch.running) * self.blocks.memory.verify_tokens, budget // 4, 1)
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
                break  # wait for running sequences to finish (FCFS: no overtaking)
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
