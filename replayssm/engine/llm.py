"""The offline API: :class:`LLM` (``generate``, ``stream``), a thin loop over
:class:`~replayssm.engine.engine.LLMEngine`'s steps."""

from __future__ import annotations

from typing import Iterator

from tqdm.auto import tqdm

from .config import SamplingParams
from .engine import LLMEngine
from .outputs import RequestOutput

__all__ = ["LLM", "RequestOutput"]


class LLM(LLMEngine):
    """Generate with a Mamba-2 / Gated DeltaNet model (constructor: :class:`LLMEngine`)."""

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (a string, a list of ids, or a list of either) to completion; every
        prompt is validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        for p in prompts:
            self.encode(p)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
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
