"""Qwen3.5's MTP head (Qwen3-Next's layout: ``mtp.fc``, two zero-centred input norms, one
gated-attention decoder layer, ``mtp.norm``): its step against transformers' own modules in
float64, and MTP speculation keeping greedy output, for the dense and MoE text models and the
multimodal (``model.language_model.``) layout."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import mtp_checkpoint as M  # noqa: E402
from engine_helpers import reference_greedy  # noqa: E402
from test_qwen3_5 import tiny_qwen3_5, tiny_qwen3_5_moe  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.models import load_model  # noqa: E402

N = 12
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9] * 11]
BUILDERS = {"dense": tiny_qwen3_5, "moe": tiny_qwen3_5_moe}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """``name -> (hf model, dir, reference data, our float64 model with its head)``."""
    root = tmp_path_factory.mktemp("qwen3_5_mtp")
    out = {}
    for name, fn in BUILDERS.items():
        hf = fn(seed=4)
        d = str(root / name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.save_pretrained(d)
        ref = M.add_mtp(d, seed=5)
        out[name] = (hf, d, ref, load_model(d, dtype="float64", mtp=True))
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
def test_mtp_step_matches_transformers_modules(heads, name):
    hf, _, ref, ours = heads[name]
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    h = M.hf_hidden(hf, ids)
    want = M.reference_g(ref, hf.get_input_embeddings().weight, ids[:, 1:], h[:, :-1])
    got = ours.mtp(ids[:, 1:], h[:, :-1])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert (ours.mtp(ids[:, 1:], h[:, 1:]) - want).abs().max() > 1e-3   # the hidden half matters


@pytest.fixture(scope="module")
def predictable(heads, tmp_path_factory):
    """``name -> (our float64 model with a head that mostly guesses right, its greedy
    continuations of PROMPTS)``, made once per model."""
    import shutil

    out = {}
    for name, (_, d, _, _) in heads.items():
        p = str(tmp_path_factory.mktemp("pred") / name)
        shutil.copytree(d, p)
        M.make_predictable(p, seed=1, mtp_noise=1.5)
        m = load_model(p, dtype="float64", mtp=True)
        out[name] = (m, [reference_greedy(m, q, N) for q in PROMPTS])
    return out


@pytest.mark.parametrize("mode,tree", [("replay", None), ("replay", "topk"), ("kv", None), ("recurrent", "topk")])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_mtp_speculation_keeps_greedy_output(predictable, name, mode, tree):
    m, expected = predictable[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(m, dtype="float64", decode_mode=mode, max_seq_len=64, auto_threshold=8,
                  speculative=SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2, spec_policy="fixed"))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert max(o.mean_accepted_length for o in outs) > 1.5     # drafts were accepted


def test_multimodal_layout_loads_the_head(heads, tmp_path):
    """A ``qwen3_5_moe`` checkpoint (text model under ``model.language_model.``, ``mtp.*`` at
    the top) gives the same head as the text-only checkpoint."""
    from safetensors.torch import load_file, save_file

    _, d, _, ours = heads["moe"]
    cfg = json.load(open(os.path.join(d, "config.json")))
    mm = {"model_type": "qwen3_5_moe", "text_config": dict(cfg, model_type="qwen3_5_moe_text"),
          "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    os.makedirs(tmp_path / "mm")
    json.dump(mm, open(tmp_path / "mm" / "config.json", "w"))
    for fn in os.listdir(d):
        if fn.endswith(".safetensors"):
            sd = load_file(os.path.join(d, fn))
            sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                  for k, v in sd.items()}
            save_file(sd, str(tmp_path / "mm" / fn))
    theirs = load_model(str(tmp_path / "mm"), dtype="float64", mtp=True)
    for (k, a), (_, b) in zip(sorted(ours.mtp.state_dict().items()), sorted(theirs.mtp.state_dict().items())):
        assert torch.equal(a, b), k
