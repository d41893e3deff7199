"""Continuous batching: requests join and leave between steps.

Admission is first-come first-served under three limits: free state slots, a prefill
token budget per step, and the memory budget (each sequence reserves its estimated bytes
for its whole life: fixed part + per-token part for ``min(prompt + max_tokens + T,
max_seq_len)`` tokens).  A request that can never fit — its prompt alone exceeds the budget
or ``max_seq_len`` — is rejected with an error on its output; the others carry on.  One
that fits only with fewer new tokens is admitted with a token cap (finish reason
``"length"``).
"""

from __future__ import annotations

from collections import deque

from .memory import MemoryModel, fmt_bytes
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, num_slots: int, memory: MemoryModel, budget: int | None, max_seq_len: int,
                 max_prefill_tokens: int = 4096):
        self.free_slots = list(range(num_slots, 0, -1))   # slots 1..num_slots (0 is null)
        self.num_slots = num_slots
        self.memory, self.budget = memory, budget
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self.peak_running = 0
        self.rejected: list[Sequence] = []

    # limit on a sequence's total tokens (prompt + generated), leaving room for one verify
    @property
    def token_limit(self) -> int:
        return self.max_seq_len - self.memory.verify_tokens

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _reject(self, seq: Sequence, why: str) -> None:
        seq.status = SequenceStatus.REJECTED
        seq.finish_reason = "rejected"
        seq.error = why
        self.rejected.append(seq)

    def _plan(self, seq: Sequence) -> tuple[int, int] | None:
        """(bytes to reserve, token cap) or None after rejecting the sequence."""
        n_prompt = seq.num_prompt_tokens
        T = self.memory.verify_tokens
        if n_prompt + 1 > self.token_limit:
            self._reject(seq, f"prompt of {n_prompt} tokens does not fit max_seq_len={self.max_seq_len} "
                              f"(needs {n_prompt + 1 + T} with one verify window)")
            return None
        want = min(n_prompt + seq.params.max_tokens, self.token_limit)
        need = self.memory.need(want + T)
        if self.budget is None or need <= self.budget:
            return need, want
        prompt_need = self.memory.need(n_prompt + 1 + T)
        if prompt_need > self.budget:
            self._reject(seq, f"prompt of {n_prompt} tokens needs {fmt_bytes(prompt_need)} of cache, more than "
                              f"the whole memory budget of {fmt_bytes(self.budget)}")
            return None
        per = max(self.memory.per_token, 1)
        cap = n_prompt + 1 + (self.budget - prompt_need) // per
        return self.memory.need(cap + T), int(min(cap, want))

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences; returns the newly admitted ones (to prefill)."""
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            plan = self._plan(seq)
            if plan is None:
                self.waiting.popleft()
                continue
            need, cap = plan
            if self.budget is not None and self.reserved + need > self.budget:
                break  # wait for running sequences to finish (FCFS: no overtaking)
            if seq.index == 0 and len(seq.group) > len(self.free_slots):
                break  # the n samples of a request start together (one shared prefill)
            shared = seq.index > 0 and seq.group[0] in admitted   # prefilled with its first sample
            if admitted and not shared and tokens + seq.num_prompt_tokens > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.reserved_bytes = need
            seq.token_cap = cap
            seq.status = SequenceStatus.RUNNING
            self.reserved += need
            tokens += 0 if shared else seq.num_prompt_tokens
            admitted.append(seq)
            self.running.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))
        return admitted

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
        self.reserved -= seq.reserved_bytes
        seq.reserved_bytes = 0
