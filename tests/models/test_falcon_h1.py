"""Falcon-H1 (``falcon_h1``): parallel Mamba-2 + attention layers with muP multipliers, against
transformers' own ``FalconH1ForCausalLM`` (tiny random checkpoints of odd shapes)."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings

import pytest
import torch

import hf_utils as H

transformers = pytest.importorskip("transformers")

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.models import ConfigError, WeightError, load_model, parse_config  # noqa: E402
from replayssm.models.falcon_h1 import FalconH1Config, FalconH1LM  # noqa: E402

#: every multiplier non-trivial (and distinct), so a misplaced one shows in the logits
MULTS = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, attention_in_multiplier=0.8,
             attention_out_multiplier=1.3, key_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
             ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 0.7], mlp_multipliers=[1.1, 0.75])


def tiny_falcon_h1(seed=0, **over):
    """Odd shapes: attention head_dim 6 != hidden / heads (10), GQA 3:1; Mamba width 24 !=
    expand * hidden, 6 heads of 4, 2 groups, state 5, conv 3; every optional bias on."""
    kw = dict(vocab_size=61, hidden_size=30, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
              head_dim=6, intermediate_size=22, mamba_d_ssm=24, mamba_n_heads=6, mamba_d_head="auto",
              mamba_d_state=5, mamba_n_groups=2, mamba_d_conv=3, mamba_chunk_size=8, mamba_rms_norm=True,
              mamba_norm_before_gate=True, projectors_bias=True, mamba_proj_bias=True, attention_bias=True,
              mlp_bias=True, rope_theta=500.0, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0,
              bos_token_id=None, initializer_range=0.1, **MULTS)   # 0.1: greedy output varies
    kw.update(over)
    return H.build_tiny(transformers.FalconH1ForCausalLM, transformers.FalconH1Config(**kw), seed)


VARIANTS = {
    "norm_then_gate_g2": dict(),
    "gate_then_norm_g2": dict(mamba_norm_before_gate=False, time_step_limit=(0.05, 0.9)),
    "no_norm_tied": dict(mamba_rms_norm=False, tie_word_embeddings=True, projectors_bias=False,
                         mamba_proj_bias=False, attention_bias=False, mlp_bias=False, mamba_conv_bias=False),
    "norm_g1_3layers": dict(mamba_n_groups=1, num_hidden_layers=3, num_key_value_heads=3),
}


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    """``falcon(name) -> (hf_model, path)``, built once per module."""
    return H.built_models(tmp_path_factory.mktemp("falcon_h1"),
                          lambda name: tiny_falcon_h1(seed=len(name), **VARIANTS[name]))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_float64_logits_match_transformers(falcon, name):
    hf, path = falcon(name)
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = H.hf_logits(copy.deepcopy(hf), ids)
    model = load_model(path, dtype="float64")
    assert isinstance(model, FalconH1LM)
    got = model(ids)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-9, rel


def test_multipliers_matter(falcon, tmp_path):
    """The same weights with every multiplier at 1: transformers' logits move, and ours follow."""
    hf, path = falcon("norm_then_gate_g2")
    plain = copy.deepcopy(hf)
    for k, v in MULTS.items():
        setattr(plain.config, k, [1.0] * len(v) if isinstance(v, list) else 1.0)
    plain = H._eager(transformers.FalconH1ForCausalLM, plain.config)
    plain.load_state_dict(hf.state_dict())
    d = H.save_quiet(plain.eval(), str(tmp_path / "plain"))
    ids = torch.randint(1, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    ref, ref_mult = H.hf_logits(copy.deepcopy(plain), ids), H.hf_logits(copy.deepcopy(hf), ids)
    assert (ref - ref_mult).abs().max().item() > 1e-2
    assert (load_model(d, dtype="float64")(ids) - ref).abs().max().item() < 1e-9


def test_float32_and_bfloat16(falcon):
    hf, path = falcon("norm_then_gate_g2")
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.float()(ids).logits
    got = load_model(path, dtype="float32")(ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-4
    bf = load_model(path, dtype="bfloat16")(ids)
    assert torch.isfinite(bf).all() and (bf.double() - ref.double()).abs().max().item() < 0.1


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]
N = 12


@pytest.fixture(scope="module")
def greedy(falcon):
    hf, path = falcon("norm_then_gate_g2")
    return load_model(path, dtype="float64"), H.greedy_reference(hf, PROMPTS, N)


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_greedy_matches_transformers_generate(greedy, mode):
    model, ref = greedy
    llm = LLM(model, dtype="float64", decode_mode=mode, auto_threshold=6, max_seq_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("mode,spec", [("replay", "ngram"), ("kv", "ngram"), ("auto", "ngram"),
                                       ("replay", "ngram-tree"), ("recurrent", "ngram-chunked"),
                                       ("replay", "draft"), ("kv", "draft-tree")])
def test_speculation_and_chunked_prefill_keep_greedy_output(greedy, mode, spec):
    model, ref = greedy
    sp = {"ngram-tree": SpeculativeConfig("tree", num_tokens=3, tree_width=2),
          "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=model),     # the model drafting for itself
          "draft-tree": SpeculativeConfig("tree", draft_model=model, tree_width=2, tree_depth=2)}.get(
        spec, SpeculativeConfig("ngram", num_tokens=3))
    kw = dict(max_num_batched_tokens=5) if spec.endswith("chunked") else {}
    llm = LLM(model, dtype="float64", decode_mode=mode, speculative=sp, auto_threshold=6, max_seq_len=64, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == ref
    assert max(o.mean_accepted_length for o in outs) > 1.0     # drafts were accepted


def test_two_stateful_layers_per_decoder_layer(greedy):
    model, _ = greedy
    layers = model.stateful_layers()
    assert len(layers) == 2 * model.config.num_hidden_layers
    assert [m.layer_id for m in layers] == list(range(len(layers)))
    cache = model.make_cache(3, mode="replay", buffer_size=3, max_seq_len=32)
    assert sorted(cache.layers) == list(range(len(layers)))


# ---------------------------------------------------------------------------- config errors
def _cfg(**over):
    d = dict(model_type="falcon_h1", vocab_size=61, hidden_size=30, num_hidden_layers=2, num_attention_heads=3,
             num_key_value_heads=1, head_dim=6, intermediate_size=22, mamba_d_ssm=24, mamba_n_heads=6,
             mamba_d_state=5, mamba_n_groups=2)
    d.update(over)
    return {k: v for k, v in d.items() if v is not ...}


def test_config_defaults_follow_transformers():
    c = parse_config(_cfg())
    assert isinstance(c, FalconH1Config) and c.mamba_d_head == 4 and c.mamba_d_conv == 4
    assert c.ssm_multipliers == (1.0,) * 5 and c.mlp_multipliers == (1.0, 1.0) and not c.mamba_rms_norm
    assert parse_config(_cfg(head_dim=...)).head_dim == 10           # hidden_size // heads
    assert parse_config(_cfg(mamba_d_ssm=..., mamba_n_heads=8)).mamba_d_ssm == 1024   # absent: 1024
    c = parse_config(_cfg(mamba_d_ssm=None, mamba_expand=2))                         # null: expand * D
    assert c.mamba_d_ssm == 60 and c.mamba_d_head == 10
    assert parse_config(_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e11})).rope_theta == 1e11
    assert parse_config(_cfg(time_step_limit=[0.0, {"__float__": "Infinity"}])).time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize("over,key", [
    (dict(mamba_n_heads=...), "mamba_n_heads"),
    (dict(mamba_d_state=...), "mamba_d_state"),
    (dict(intermediate_size=...), "intermediate_size"),
    (dict(mamba_n_heads=5), "mamba_n_heads"),
    (dict(mamba_d_head=5), "mamba_d_head"),
    (dict(mamba_n_groups=4), "mamba_n_groups"),
    (dict(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
    (dict(mlp_multipliers=[1.0, "x"]), "mlp_multipliers"),
    (dict(key_multiplier={"__float__": "NaN"}), "key_multiplier"),
    (dict(embedding_multiplier="big"), "embedding_multiplier"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(head_dim=5), "head_dim"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    (dict(mamba_rms_norm="false"), "mamba_rms_norm"),
    (dict(time_step_limit=[1.0]), "time_step_limit"),
])
def test_config_errors_name_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        parse_config(_cfg(**over))


def test_checkpoint_errors_name_the_tensor(falcon, tmp_path):
    hf, path = falcon("norm_then_gate_g2")
    d = str(tmp_path / "bad")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["mamba_d_state"] = 7          # conv / in_proj widths no longer match
    os.makedirs(d)
    os.symlink(os.path.join(path, "model.safetensors"), os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises((WeightError, ConfigError), match=r"model\.layers\.0\.mamba\.(conv1d|in_proj)"):
        load_model(d, dtype="float64")
    cfg["mamba_d_state"] = 5
    cfg["mamba_rms_norm"] = False     # the checkpoint's mamba.norm.weight is then unexpected
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.mamba\.norm\.weight"):
        load_model(d, dtype="float64")
