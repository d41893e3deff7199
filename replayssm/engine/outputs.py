"""What a request returns: :class:`RequestOutput` (tokens, text, finish reason, speculation stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class RequestOutput:
    request_id: object
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    num_steps: int = 0               # forward steps that produced tokens (prefill included)
    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0            # accepted draft tokens
    mean_accepted_length: float = 1.0  # tokens produced per decode/verify step
    accepted_lengths: list = field(default_factory=list)
    index: int = 0                   # sample index (SamplingParams.n > 1)
    # per generated token (SamplingParams.logprobs): (logprob, [(token id, logprob), ...])
    logprobs: list | None = None
    samples: list = field(default_factory=list)   # generate() with n > 1: every sample's output

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def request_output(seq: Sequence) -> RequestOutput:
    """A snapshot of ``seq`` (cumulative tokens; the incrementally decoded text when the
    model has a tokenizer)."""
    text = ""
    if seq.detok is not None:
        if seq.is_finished and seq.stop_text_cut is None:
            seq.detok.flush()   # the end: release trailing bytes of an incomplete character
        text = seq.detok.text
    steps = seq.accepted_lengths
    return RequestOutput(
        request_id=seq.group_id, index=seq.index,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        prompt=seq.prompt_text, prompt_token_ids=seq.prompt_ids,
        text=text, token_ids=list(seq.output_ids), finish_reason=seq.finish_reason, error=seq.error,
        num_steps=seq.num_steps, num_verify_steps=seq.num_verify_steps, num_drafted=seq.num_drafted,
        num_accepted=seq.num_accepted_drafts,
        mean_accepted_length=(sum(steps) / len(steps)) if steps else 1.0,
        accepted_lengths=list(steps))
