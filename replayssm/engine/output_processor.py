"""After the model: new tokens become a request's output — stop criteria, incremental
detokenization with stop strings, finish reasons, per-token logprobs.

:class:`OutputProcessor` runs on the host once per step for the sequences that got tokens
(``append``); :func:`logprob_rows` turns the step's one transfer of logprobs into per-row
lists.  What a caller sees is :func:`~replayssm.engine.outputs.request_output`.
"""

from __future__ import annotations

import time

from .detokenizer import find_stop
from .sequence import Sequence


def logprob_rows(chosen: list, vals: list, idx: list) -> list:
    """Host lists of one row per token -> ``[(logprob, [(token id, logprob), ...]), ...]``:
    the sampled token's logprob and the top alternatives."""
    return [(c, list(zip(i, v))) for c, v, i in zip(chosen, vals, idx)]


class OutputProcessor:
    """Appends accepted tokens to sequences and decides when they finish.

    ``eos_token_id``: an id, a list of ids, or None (the model config's); ``token_limit``:
    the most tokens a sequence may hold (the scheduler's, when a request has no cap of its
    own); ``sampler``: told which tokens a sequence produced (penalty statistics);
    ``stats``: the engine's counters (``generated``)."""

    def __init__(self, eos_token_id, token_limit: int, sampler, stats: dict):
        self.eos_token_id = eos_token_id
        self.token_limit, self.sampler, self.stats = token_limit, sampler, stats

    @property
    def eos_token_id(self):
        return self._eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, eos) -> None:
        self._eos_token_id = eos
        self.eos = frozenset(eos) if isinstance(eos, (list, tuple, set)) else (
            frozenset() if eos is None else frozenset([eos]))

    def append(self, s: Sequence, toks: list[int], lps: list | None = None) -> None:
        """Append ``toks`` until one ends the request (EOS, a stop token, the length limit,
        or a stop string completed in the incrementally decoded text: the text is cut before
        the stop string and later tokens of the step are dropped)."""
        cap = s.token_cap if s.token_cap is not None else self.token_limit
        kept = 0
        for t in toks:
            t = int(t)
            s.output_ids.append(t)
            if s.logprobs is not None and lps is not None and kept < len(lps):
                s.logprobs.append(lps[kept])
            kept += 1
            self.stats["generated"] += 1
            s.finish_reason = self._finish_reason(s, t, cap)
            if s.finish_reason is not None:
                break
        self.sampler.observe(s, toks[:kept])

    def _finish_reason(self, s: Sequence, t: int, cap: int) -> str | None:
        """Why ``s`` ends with token ``t`` just appended, or None (stop strings: the text is
        cut at the match)."""
        p = s.params
        if t in p.stop_token_ids or (t in self.eos and not p.ignore_eos):
            return "stop"
        if s.detok is not None:
            piece = s.detok.push(t)
            # stop strings count once more than min_tokens tokens were generated (vLLM)
            cut = find_stop(s.detok.text, len(piece), p.stop) if len(s.output_ids) > p.min_tokens else None
            if cut is not None:
                s.stop_text_cut = cut
                s.detok.text = s.detok.text[:cut]
                return "stop"
        c = s.constraint
        if c is not None:
            t0 = time.perf_counter()
            done = c.advance(t)
            self.stats["grammar_advance_s"] = self.stats.get("grammar_advance_s", 0.0) + time.perf_counter() - t0
            if done:   # the grammar is complete: only EOS could follow
                return "stop"
        if len(s.output_ids) >= p.max_tokens or s.num_tokens >= cap:
            return "length"
        return None
