"""End to end: the engine (``replayssm.LLM``) over loaded checkpoints gives transformers'
greedy tokens in every decode mode, with and without speculation."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_utils as H


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h"])
def test_llm_greedy_equals_transformers_in_every_mode(name, tiny):
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    hf, path = tiny(name)
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3, 5]]
    n_new = 7
    ref = []
    hf64 = copy.deepcopy(hf).to(torch.float64)
    for p in prompts:
        with torch.no_grad(), H.Float32AsFloat64():
            out = hf64.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
        ref.append(out[0, len(p):].tolist())
    runs = [("recurrent", None), ("replay", None), ("kv", None), ("auto", None),
            ("replay", SpeculativeConfig(method="ngram", num_tokens=2)),
            ("kv", SpeculativeConfig(method="tree", num_tokens=2, draft_model=path)),
            ("recurrent", SpeculativeConfig(method="draft", num_tokens=2, draft_model=path))]
    for mode, spec in runs:
        llm = LLM(path, dtype="float64", decode_mode=mode, buffer_size=16, speculative=spec, max_seq_len=40,
                  max_num_seqs=2)
        outs = llm.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == ref, (mode, spec)
