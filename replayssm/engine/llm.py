"""The offline API: :class:`LLM` (``generate``, ``stream``), a thin loop over
:class:`~replayssm.engine.engine.LLMEngine`'s steps."""

from __future__ import annotations

from typing import Iterator

from tqdm.auto import tqdm

from .config import SamplingParams, sampling_params_list
from .engine import LLMEngine
from .inputs import prompt_list
from .outputs import RequestOutput
from .sequence import Sequence

__all__ = ["LLM", "RequestOutput"]


class LLM(LLMEngine):
    """Generate with a Mamba-2 / Gated DeltaNet model (constructor: :class:`LLMEngine`)."""

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt or a list) to completion; one output per prompt, in order.
        A prompt that fails validation gets an output with ``finish_reason="error"`` and the
        message in ``error``, and the others run; bad arguments of the call itself raise."""
        prompts = prompt_list(prompts)
        params = sampling_params_list(sampling_params, len(prompts))
        seqs = []
        for p, sp in zip(prompts, params):
            try:
                seqs.append(self.add_request(p, sp))
            except ValueError as e:  # this request fails alone
                seqs.append(Sequence.failed(sp, str(e), p if isinstance(p, str) else None))
        bar = tqdm(total=len(seqs), desc="generate", unit="req") if use_tqdm else None
        done = 0
        while self.has_unfinished():
            self._step()
            if bar is not None:
                n = sum(all(m.is_finished for m in s.group) for s in seqs)
                bar.update(n - done)
                done = n
        if bar is not None:
            bar.close()
        outs = []
        for s in seqs:
            out = self.output(s)
            if len(s.group) > 1:
                out.samples = [self.output(m) for m in s.group]
            outs.append(out)
        return outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Generate one request, yielding lists of new token ids as they are accepted
        (``self.last_output`` holds its :class:`RequestOutput` afterwards)."""
        seq = self.add_request(prompt, params)
        while not seq.is_finished:
            before = len(seq.output_ids)
            self._step()
            if len(seq.output_ids) > before:
                yield seq.output_ids[before:]
        self.last_output = self.output(seq)
