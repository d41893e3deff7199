"""Qwen3.5 (dense and MoE) and rope scaling (YaRN, linear) against transformers' own
implementations: float64 logits, greedy generation through the engine in every decode mode
and with n-gram speculation, and the config errors."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import hf_utils as H
from hf_utils import hf_logits

from replayssm import LLM
from replayssm.models import ConfigError, load_model, parse_config

YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 6,
        "partial_rotary_factor": 0.4, "beta_fast": 8.0, "beta_slow": 1.0}


def _text_kw(**over):
    kw = dict(vocab_size=67, hidden_size=24, num_hidden_layers=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=10, intermediate_size=22,
              linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=6,
              linear_value_head_dim=5, linear_conv_kernel_dim=3, tie_word_embeddings=False,
              eos_token_id=None, pad_token_id=None, bos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4,
                               "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    kw.update(over)
    return kw


def tiny_qwen3_5(seed=0, **over):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return H.build_tiny(Qwen3_5ForCausalLM, Qwen3_5TextConfig(**_text_kw(**over)), seed)


def tiny_qwen3_5_moe(seed=0, **over):
    """Qwen3.5-MoE, 5 experts top-2 of odd widths (``over`` may set any text-config field,
    the expert widths included: the tensor-parallel tests give widths that split)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    kw = _text_kw(**{"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 7,
                     "shared_expert_intermediate_size": 9, **over})
    kw.pop("intermediate_size")
    return H.build_tiny(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**kw), seed)


SPECS = {
    "dense": (tiny_qwen3_5, {}),
    "dense_tied": (tiny_qwen3_5, dict(tie_word_embeddings=True, layer_types=["full_attention", "linear_attention"],
                                      num_hidden_layers=2, linear_num_key_heads=3, linear_num_value_heads=3)),
    "moe": (tiny_qwen3_5_moe, {}),
    "yarn": (tiny_qwen3_5, dict(rope_parameters=YARN, max_position_embeddings=24)),
    "next_yarn": (H.tiny_qwen3_next, dict(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.5,
                                                                   partial_rotary_factor=0.5),
                                          max_position_embeddings=24)),
    "next_linear": (H.tiny_qwen3_next, dict(rope_parameters={"rope_type": "linear", "factor": 3.0,
                                                             "rope_theta": 300.0, "partial_rotary_factor": 0.5},
                                            num_hidden_layers=2)),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name) -> (hf_model, path, float64 replayssm model)``, built once per module."""
    return H.built_models(tmp_path_factory.mktemp("qwen3_5"),
                          lambda name: SPECS[name][0](seed=len(name), **SPECS[name][1]), load=True)


@pytest.mark.parametrize("name", list(SPECS))
def test_float64_logits_match_transformers(built, name):
    hf, _, ours = built(name)
    ids = torch.randint(0, hf.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(copy.deepcopy(hf), ids)
    got = ours(ids)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    print(f"{name}: max rel err {H.rel_err(got, ref):.2e}")
    assert H.rel_err(got, ref) < 1e-9


def test_yarn_changes_the_logits(built):
    """Positions past original_max_position_embeddings: YaRN is not the default rope."""
    hf, _, ours = built("yarn")
    ids = torch.randint(0, hf.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(2))
    plain = copy.deepcopy(hf)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.4}
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    plain.model.rotary_emb = Qwen3_5TextRotaryEmbedding(plain.config)
    assert H.rel_err(ours(ids), hf_logits(plain, ids)) > 1e-4
    assert ours.rotary.attention_scaling > 1.0



PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
N = 10


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_generation_matches_transformers_in_every_mode(built, name):
    hf, _, ours = built(name)
    ref = [H.hf_greedy(hf, p, N) for p in PROMPTS]
    for kw in H.engine_runs(ours):
        llm = LLM(ours, dtype="float64", auto_threshold=6, max_seq_len=64, **kw)
        assert H.generate_quiet(llm, PROMPTS, N) == ref, kw


def _mm_config(text: dict, mt="qwen3_5", **top) -> dict:
    return {"model_type": mt, "text_config": dict(text), "vision_config": {"depth": 1}, **top}


def test_multimodal_config_reads_text_config(built):
    hf, path, _ = built("moe")
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    c = parse_config(_mm_config(text, "qwen3_5_moe", tie_word_embeddings=True))
    assert c.multimodal and c.model_type == "qwen3_5_moe" and c.tie_word_embeddings
    assert c.num_experts == 5 and c.norm_topk_prob and all(c.is_moe_layer(i) for i in range(3))
    assert c.rotary_dim == 4
    d = parse_config(_mm_config(dict(text, model_type="qwen3_5_text", num_experts=None, intermediate_size=22)))
    assert d.num_experts == 0 and not d.is_moe_layer(0)


def test_language_model_prefix_aliases():
    from replayssm.models.qwen3_5 import Qwen3_5LM

    al = Qwen3_5LM.key_aliases()
    assert al.get("model.layers.0.linear_attn.in_proj_qkv.weight", []) == [
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert al.get("lm_head.weight", []) == []


@pytest.mark.parametrize("edit, msg", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "longrope", "factor": 2.0}), "rope_type 'longrope'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}, max_position_embeddings=None),
     "original_max_position_embeddings"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8}),
     "rope_parameters.factor"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1}), "low_freq_factor"),
    (dict(num_experts=None, model_type="qwen3_5_moe_text"), "'num_experts'"),
    (dict(linear_num_key_heads=None), "'linear_num_key_heads'"),
])
def test_config_errors_name_the_key(built, edit, msg):
    _, path, _ = built("dense")
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    d.update(edit)
    with pytest.raises(ConfigError, match=msg):
        parse_config(d)


def test_multimodal_config_needs_text_config():
    with pytest.raises(ConfigError, match="'text_config'"):
        parse_config({"model_type": "qwen3_5", "vision_config": {}})


def test_multimodal_checkpoint_loads_its_language_model(built, tmp_path):
    """A checkpoint in the published layout (``model_type`` qwen3_5_moe, ``text_config``, the
    text tensors under ``model.language_model.``, a vision tower under ``model.visual.``)
    loads its language model: the same logits as the text-only checkpoint."""
    from safetensors.torch import load_file, save_file

    hf, path, ours = built("moe")
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    tensors = {}
    for fn in os.listdir(path):
        if fn.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, fn)))
    nested = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
              for k, v in tensors.items()}
    nested["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)   # read by nobody
    save_file(nested, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(_mm_config(text, "qwen3_5_moe", tie_word_embeddings=text.get("tie_word_embeddings", False)), f)
    mm = load_model(str(tmp_path), dtype="float64")
    ids = torch.randint(0, hf.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    assert torch.equal(mm(ids), ours(ids))
