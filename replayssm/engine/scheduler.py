"""Continuous batching: which requests run in the next step.

Admission is first-come first-served under three limits, all checked by the
:class:`~replayssm.engine.block_manager.BlockManager`: a free slot, the memory budget, and a
prefill token budget per step (``max_prefill_tokens``).  A request that can never fit (its
prompt alone exceeds ``max_seq_len`` or the budget) is rejected with an error on its output;
the others carry on.  One that fits only with fewer new tokens is admitted with a token cap
(finish reason ``"length"``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: prompts to prefill, running sequences to advance, and the requests
    rejected at admission (finished with an error)."""

    prefill: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_prefill_tokens: int = 4096):
        self.blocks = blocks
        self.max_prefill_tokens = max_prefill_tokens
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
        """Admit waiting sequences (they prefill this step); the rest of the running ones
        advance by one decode or speculative step."""
        batch = ScheduledBatch(running=[s for s in self.running if not s.is_finished])
        tokens = 0
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
            shared = seq.index > 0 and any(seq.group[0] is s for s in batch.prefill)   # prefilled with sample 0
            if batch.prefill and not shared and tokens + seq.num_prompt_tokens > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, adm)
            seq.status = SequenceStatus.RUNNING
            tokens += 0 if shared else seq.num_prompt_tokens
            batch.prefill.append(seq)
            self.running.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (finished, aborted or failed): free its slot, blocks and bytes."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
