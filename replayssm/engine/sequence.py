"""One request's host-side record: tokens, status, slot, mode and speculation stats."""

from __future__ import annotations

import dataclasses

import enum
import itertools

import torch

from .config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued, no slot yet
    RUNNING = "running"      # holds a slot; prefilled
    FINISHED = "finished"
    REJECTED = "rejected"    # could never fit: finished with an error


_ids = itertools.count()


def fresh_request_id(in_use) -> int:
    """The next automatic request id that is not in ``in_use`` (a caller may have named a
    request with an int the counter has not reached yet)."""
    while True:
        i = next(_ids)
        if i not in in_use:
            return i


class Sequence:
    """A request moving through the engine.

    ``prompt_ids`` and ``output_ids`` are plain Python lists.  The model cache holds every
    token of ``all_ids`` except the last one (``pending``), which is fed on the next step.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None):
        self.request_id = next(_ids) if request_id is None else request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.mode: str | None = None        # cache form of the slot: recurrent | replay | kv
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.reserved_bytes = 0             # block bytes of the budget it holds now
        self.shared_bytes = 0               # its attention blocks the prefix store holds (not reserved)
        # scheduling: arrival order (FCFS within a priority) and preemption (swapped out to host)
        self.arrival = 0
        self.swapped = False                # its cache is in host memory under swap_key
        self.swap_key: int | None = None
        self.swap_need = 0                  # block bytes it takes to swap it back in
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.stop_text_cut: int | None = None
        # speculation statistics
        self.num_steps = 0                  # forward steps that produced tokens for this seq
        self.num_verify_steps = 0
        self.num_drafted = 0
        self.num_accepted_drafts = 0
        self.accepted_lengths: list[int] = []
        self.prompt_text: str | None = None  # the prompt string, when given as text
        self.token_cap: int | None = None   # total-token limit set at admission (budget)
        # draft-model drafters: tokens of all_ids already in the draft model's cache
        self.draft_cached = 0
        self.num_prefilled = 0              # prompt tokens in the cache (chunked prefill)
        self.prefix = None                  # its part in the prefix cache (engine.prefix.SeqPrefix)
        # n samples of one request: the group shares a prompt (one prefill, then a cache fork)
        self.group_id = self.request_id     # the request's id (samples: the first one's)
        self.index = 0                      # sample index within the group
        self.group: list[Sequence] = [self]
        self.detok = None                   # engine.detokenizer.Detokenizer (string output)
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # structured outputs / min_tokens / bad_words / logit_bias (engine.structured), or None
        self.constraint = None

    @classmethod
    def request(cls, prompt_ids: list[int], params: SamplingParams, request_id, text: str | None = None,
                detok=None) -> "Sequence":
        """A request's sequences: the first sample and its ``params.n - 1`` siblings (own
        generators — seeds ``seed + i`` — one shared prefill), each with the prompt ``text``
        and a fresh incremental detokenizer from ``detok(prompt_ids)`` (None: no text)."""
        seq = cls(prompt_ids, params, request_id=request_id)
        for i in range(1, params.n):
            sp = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            sib = cls(prompt_ids, sp, request_id=(seq.request_id, i))
            sib.group_id, sib.index, sib.group = seq.request_id, i, seq.group
            seq.group.append(sib)
        for s in seq.group:
            s.prompt_text = text
            s.detok = detok(prompt_ids) if detok is not None else None
        return seq

    @classmethod
    def failed(cls, params: SamplingParams, error: str, prompt_text: str | None = None) -> "Sequence":
        """A request refused before it was queued (e.g. an invalid prompt): finished, with
        ``finish_reason="error"`` and the reason in ``error``; it never holds a slot."""
        seq = cls([], params)
        seq.status = SequenceStatus.REJECTED
        seq.finish_reason = "error"
        seq.error = error
        seq.prompt_text = prompt_text
        return seq

    # -- token views ---------------------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        """``prompt_ids + output_ids`` (a new list: per-step code uses :meth:`token_at` /
        :meth:`last_ids`, which do not copy the context)."""
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """Token ``i`` of ``all_ids`` (``0 <= i < num_tokens``) without building it."""
        P = len(self.prompt_ids)
        return self.prompt_ids[i] if i < P else self.output_ids[i - P]

    def last_ids(self, k: int) -> list[int]:
        """The last ``k >= 1`` tokens of ``all_ids`` without building it."""
        out = self.output_ids[-k:]
        return self.prompt_ids[len(self.prompt_ids) - (k - len(out)):] + out if len(out) < k else out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the cache yet (chunked prefill)."""
        return self.num_prefilled < len(self.prompt_ids)

    @property
    def num_cached(self) -> int:
        """Tokens the model cache holds for this sequence (all but the pending last one)."""
        return self.num_tokens - 1

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def priority(self) -> int:
        """Scheduling priority (lower runs first; :attr:`SamplingParams.priority`)."""
        return self.params.priority

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per forward step (1.0 without speculation)."""
        if not self.accepted_lengths:
            return 1.0 if self.output_ids else 0.0
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, status={self.status.value}, slot={self.slot}, "
                f"prompt={len(self.prompt_ids)}, out={len(self.output_ids)})")
