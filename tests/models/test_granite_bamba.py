"""IBM Granite-4.0-H (``granitemoehybrid``) and Bamba (``bamba``) against transformers' own
classes: float64 logits, greedy generation through ``LLM`` in every decode mode and with
n-gram speculation, and config errors that name the key."""

from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch

import hf_utils as H
from replayssm.models import ConfigError, load_model
from replayssm.models.registry import parse_config

GRANITE = dict(vocab_size=61, hidden_size=24, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=7, shared_intermediate_size=9, num_local_experts=5, num_experts_per_tok=2,
               layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=6, mamba_d_head=8,
               mamba_n_groups=1, mamba_d_state=6, mamba_d_conv=3, mamba_chunk_size=8,
               position_embedding_type="rope", embedding_multiplier=3.5, logits_scaling=2.5,
               residual_multiplier=0.45, attention_multiplier=0.3, rms_norm_eps=1e-5,
               tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
BAMBA = dict(vocab_size=61, hidden_size=20, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=6, intermediate_size=11, attn_layer_indices=[1], mamba_n_heads=5, mamba_d_head=8,
             mamba_n_groups=1, mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=8, tie_word_embeddings=False,
             eos_token_id=None, pad_token_id=0, bos_token_id=None)
BAMBA["head_dim"] = 8   # rotary on half of it: 4 channels

SPECS = {
    # MoE (5 experts, top-2) + shared expert, RoPE, every multiplier
    "granite": ("granite", {}),
    # no RoPE (head_dim 5), biases on attention and the Mamba projections, tied embeddings, attention first
    "granite_norope": ("granite", dict(position_embedding_type=None, hidden_size=20, mamba_n_heads=5, attention_bias=True, mamba_proj_bias=True,
                                       tie_word_embeddings=True, layer_types=["attention", "mamba", "mamba"],
                                       num_experts_per_tok=3)),
    # dense: no routed experts, the shared MLP alone
    "granite_dense": ("granite", dict(num_local_experts=0, layer_types=["mamba", "attention"])),
    "bamba": ("bamba", {}),
    "bamba_opts": ("bamba", dict(attn_layer_indices=[0, 2], mlp_bias=True, attention_bias=True,
                                 mamba_conv_bias=False, tie_word_embeddings=True, num_key_value_heads=1)),
}


def _build(kind, seed, **over):
    import transformers

    if kind == "granite":
        kw = {**GRANITE, **over}
        kw["num_hidden_layers"] = len(kw["layer_types"])
        cfg = transformers.GraniteMoeHybridConfig(**kw)
        cls = transformers.GraniteMoeHybridForCausalLM
    else:
        cfg = transformers.BambaConfig(**{**BAMBA, **over})
        cls = transformers.BambaForCausalLM
    m = H.build_tiny(cls, cfg, seed)
    if kind == "bamba":
        with torch.no_grad():   # larger weights than HF's init: greedy continuations that move
            for n, w in m.named_parameters():
                if n.endswith(("embed_tokens.weight", "in_proj.weight", "gate_proj.weight", "up_proj.weight")):
                    w.mul_(25.0 if n.endswith("embed_tokens.weight") else 5.0)
    return m


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name) -> (hf_model, path, float64 replayssm model)``, built once per module."""
    return H.built_models(tmp_path_factory.mktemp("granite_bamba"),
                          lambda name: _build(SPECS[name][0], len(name), **SPECS[name][1]), load=True)


@pytest.mark.parametrize("name", list(SPECS))
def test_float64_logits_match_transformers(name, built):
    hf, _, ours = built(name)
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = H.hf_logits(copy.deepcopy(hf), ids)
    got = ours(ids)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert H.rel_err(got, ref) < 1e-10


def test_float32_logits_close(built):
    hf, path, _ = built("granite")
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    got = load_model(path, dtype="float32")(ids)
    assert got.dtype == torch.float32 and H.rel_err(got.double(), ref.double()) < 1e-5


def test_multipliers_matter(built):
    """The multipliers are not no-ops: dropping one changes the logits."""
    _, path, ours = built("granite")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = ours(ids)
    for attr in ("embedding_multiplier", "logits_scaling"):
        m = load_model(path, dtype="float64")
        setattr(m, attr, 1.0)
        assert H.rel_err(m(ids), ref) > 1e-3



PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
N = 10


@pytest.mark.parametrize("name", ["granite", "granite_norope", "bamba"])
def test_greedy_generation_matches_transformers_every_mode(name, built):
    from replayssm import LLM

    hf, _, ours = built(name)
    ref = [H.hf_greedy(hf, p, N) for p in PROMPTS]
    for kw in H.engine_runs(ours):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(ours, dtype="float64", auto_threshold=6, max_seq_len=64, **kw)
        assert H.generate_quiet(llm, PROMPTS, N) == ref, kw


def _cfg(kind, **over):
    base = json.loads(json.dumps({**(GRANITE if kind == "granite" else BAMBA),
                                  "model_type": "granitemoehybrid" if kind == "granite" else "bamba"}))
    if kind == "granite":
        base["layer_types"] = ["linear_attention", "full_attention"]
    base.update(over)
    return {k: v for k, v in base.items() if v is not ...}


@pytest.mark.parametrize("kind,over,key", [
    ("granite", dict(vocab_size=...), "vocab_size"),
    ("granite", dict(layer_types=["mamba", "conv"]), "layer_types"),
    ("granite", dict(num_hidden_layers=3), "num_hidden_layers"),
    ("granite", dict(position_embedding_type="alibi"), "position_embedding_type"),
    ("granite", dict(logits_scaling=0), "logits_scaling"),
    ("granite", dict(residual_multiplier="x"), "residual_multiplier"),
    ("granite", dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ("granite", dict(intermediate_size=...), "intermediate_size"),
    ("granite", dict(mamba_d_head=7), "mamba_d_head"),
    ("granite", dict(mamba_n_groups=4), "mamba_n_groups"),
    ("granite", dict(hidden_size=20, mamba_n_heads=5), "head_dim"),
    ("granite", dict(hidden_act="tanh"), "hidden_act"),
    ("granite", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    ("granite", dict(time_step_limit=[1.0, 0.5]), "time_step_limit"),
    ("granite", dict(tie_word_embeddings="no"), "tie_word_embeddings"),
    ("bamba", dict(attn_layer_indices=[5]), "attn_layer_indices"),
    ("bamba", dict(num_hidden_layers=...), "num_hidden_layers"),
    ("bamba", dict(num_key_value_heads=3), "num_key_value_heads"),
    ("bamba", dict(head_dim=6), "partial_rotary_factor"),
    ("bamba", dict(mamba_n_heads=7, mamba_d_head="auto"), "mamba_n_heads"),
])
def test_config_errors_name_the_key(kind, over, key):
    with pytest.raises(ConfigError, match=key):
        parse_config(_cfg(kind, **over), "cfg.json")


def test_config_defaults_and_aliases():
    c = parse_config(_cfg("granite", layer_types=None, layers_block_type=["mamba", "attention"],
                          mamba_d_head="auto", head_dim=None))
    assert c.layer_kinds == ["mamba", "attention"] and c.mamba_d_head == 8 and c.head_dim == 6
    b = parse_config(_cfg("bamba", rope_theta=5e5, rope_parameters=None))
    assert b.rope_theta == 5e5 and b.partial_rotary_factor == 0.5 and b.layer_kinds == ["mamba", "attention", "mamba"]


def test_missing_expert_tensor_is_named(built, tmp_path):
    from safetensors.torch import load_file, save_file

    from replayssm.models import WeightError

    _, path, _ = built("granite_dense")
    d = tmp_path / "g"
    d.mkdir()
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd.pop("model.layers.0.shared_mlp.output_linear.weight")
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(WeightError, match="shared_mlp.output_linear"):
        load_model(str(d), dtype="float64")
