"""Prefix caching of chat replies (issue 35): a finished request's state after its prompt
and reply is cached as a state point, so the next turn (prompt + reply + a new message)
resumes at the end of the reply.  Greedy output is the full forward's in every decode form,
with speculation, for Mamba-2, Qwen3-Next (GDN) and Nemotron-H (attention); store capacity,
aborts, requests without output, and poisoned store rows."""

from __future__ import annotations

import warnings

import pytest
import torch

from test_prefix_cache import BS, N, _llm, _poison_frees, expected, loaded  # noqa: F401  (fixtures)

from replayssm import SamplingParams, SpeculativeConfig

USER = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]


def _gen(llm, prompt, n=N):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return llm.generate([prompt], SamplingParams(max_tokens=n))[0].token_ids


def _chat(llm, expected, arch, first, turns=3, n=N):
    """``turns`` chat turns (each prompt: the previous prompt, its reply, a new message);
    returns the prompt tokens each turn resumed from the cache."""
    prompt, hits = list(first), []
    for t in range(turns):
        before = llm.stats["prefix_hit_tokens"]
        out = _gen(llm, prompt, n)
        assert out == expected(arch, prompt)[:n], (t, prompt)
        hits.append(llm.stats["prefix_hit_tokens"] - before)
        prompt = prompt + out + USER[t % len(USER)]
    return hits


FIRST = [(7 * i + 3) % 61 for i in range(13)]


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next", "nemotron_h"])
def test_next_turn_resumes_at_the_end_of_the_reply(loaded, expected, arch, mode):
    llm = _llm(loaded[arch], mode)
    hits = _chat(llm, expected, arch, FIRST)
    # turn k+1 resumes at prompt_k + reply_k minus the reply's last token (never fed)
    lens = [len(FIRST)]
    for t in range(2):
        lens.append(lens[-1] + N + len(USER[t]))
    assert hits == [0, lens[0] + N - 1, lens[1] + N - 1]
    s = llm.prefix_stats()
    assert s["prefix_states_saved"] == 3 and s["prefix_state_hits"] == 2
    assert llm.scheduler.reserved == 0 and all(b.ref == 0 for b in llm.prefix_cache.index._by_hash.values())
