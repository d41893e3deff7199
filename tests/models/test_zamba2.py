"""Zamba2 (``zamba2``): Mamba-2 layers with shared transformer blocks (LoRA adapters per
invocation, input ``cat(h, embeddings)``), against transformers' own ``Zamba2ForCausalLM``
(tiny random checkpoints of odd shapes)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hf_utils as H

transformers = pytest.importorskip("transformers")

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.models import ConfigError, WeightError, load_model, parse_config  # noqa: E402
from replayssm.models.zamba2 import Zamba2Config, Zamba2LM  # noqa: E402

KINDS = ["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"]


def tiny_zamba2(seed=0, **over):
    """Odd shapes: hidden 15, 3 attention heads of 10 (2·hidden / heads), Mamba 6 heads of 5 in
    3 groups, state 5, conv 3; three invocations of two shared blocks, adapters of rank 3."""
    kw = dict(vocab_size=61, hidden_size=15, num_hidden_layers=len(KINDS), layers_block_type=KINDS,
              mamba_d_state=5, mamba_d_conv=3, mamba_expand=2, mamba_ngroups=3, n_mamba_heads=6, chunk_size=8,
              num_attention_heads=3, intermediate_size=11, num_mem_blocks=2, use_shared_attention_adapter=True,
              adapter_rank=3, use_mem_rope=True, add_bias_linear=True, rope_parameters={"rope_type": "default",
              "rope_theta": 300.0}, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0,
              bos_token_id=None, initializer_range=0.07)   # 0.07: n-gram drafts get accepted
    kw.update(over)
    return H.build_tiny(transformers.Zamba2ForCausalLM, transformers.Zamba2Config(**kw), seed, prepare=_share_blocks)


def _share_blocks(m):
    """transformers 5.17 builds one block per hybrid layer without tying them: share them
    (invocation j uses block j % num_mem_blocks), as the published checkpoints intend."""
    layers, hyb = m.model.layers, m.config.hybrid_layer_ids
    for j, i in enumerate(hyb):
        if j >= m.config.num_mem_blocks:
            layers[i].shared_transformer = layers[hyb[j % m.config.num_mem_blocks]].shared_transformer


VARIANTS = {
    "two_blocks_adapters": dict(),
    "one_block_gqa_no_rope_tied": dict(num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False,
                                       num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                                       add_bias_linear=False, hidden_act="silu", mamba_ngroups=1),
}


@pytest.fixture(scope="module")
def zamba(tmp_path_factory):
    """``zamba(name) -> (hf_model, path)``, built once per module."""
    return H.built_models(tmp_path_factory.mktemp("zamba2"), lambda name: tiny_zamba2(seed=len(name), **VARIANTS[name]))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_float64_logits_match_transformers(zamba, name):
    hf, path = zamba(name)
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = H.hf_logits(copy.deepcopy(hf), ids)
    model = load_model(path, dtype="float64")
    assert isinstance(model, Zamba2LM)
    got = model(ids)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-10, rel


def test_float32(zamba):
    hf, path = zamba("two_blocks_adapters")
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = copy.deepcopy(hf).float()(ids).logits
    got = load_model(path, dtype="float32")(ids)
    assert got.dtype == torch.float32 and (got - ref).abs().max().item() < 1e-4


def test_shared_weights_are_loaded_once(zamba):
    hf, path = zamba("two_blocks_adapters")
    model = load_model(path, dtype="float64")
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(id(p) for p in model.parameters()))
    assert sum("shared_transformer" in n for n in names) == \
        sum("shared_transformer" in n for n in hf.state_dict() if n.startswith("model.layers.1.")
            or n.startswith("model.layers.3."))
    layers = model.stateful_layers()
    assert [m.layer_id for m in layers] == list(range(len(layers)))
    attn = [m for m in layers if not hasattr(m, "conv_dim")]
    assert len(attn) == 3 and attn[0].q_proj is attn[2].q_proj and attn[0].q_proj is not attn[1].q_proj
    n_hf = sum(p.numel() for p in hf.parameters())        # hf's blocks are shared too (see tiny_zamba2)
    assert sum(p.numel() for p in model.parameters()) == n_hf


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]
N = 12


@pytest.fixture(scope="module")
def greedy(zamba):
    hf, path = zamba("two_blocks_adapters")
    return load_model(path, dtype="float64"), H.greedy_reference(hf, PROMPTS, N)


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_greedy_matches_transformers_generate(greedy, mode):
    model, ref = greedy
    llm = LLM(model, dtype="float64", decode_mode=mode, auto_threshold=6, max_seq_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("mode,spec", [("replay", "ngram"), ("kv", "ngram"), ("auto", "ngram"), ("replay", "draft"),
                                       ("kv", "draft-tree")])
def test_speculation_keeps_greedy_output(greedy, mode, spec):
    model, ref = greedy
    sp = {"draft": SpeculativeConfig("draft", num_tokens=3, draft_model=model),     # the model drafting for itself
          "draft-tree": SpeculativeConfig("tree", draft_model=model, tree_width=2, tree_depth=2)}.get(
        spec, SpeculativeConfig("ngram", num_tokens=3))
    llm = LLM(model, dtype="float64", decode_mode=mode, speculative=sp, auto_threshold=6, max_seq_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == ref
    assert max(o.mean_accepted_length for o in outs) > 1.0


# ---------------------------------------------------------------------------- config errors
def _cfg(**over):
    d = dict(model_type="zamba2", vocab_size=61, hidden_size=15, num_hidden_layers=3,
             layers_block_type=["mamba", "hybrid", "linear_attention"], num_attention_heads=3,
             n_mamba_heads=6, mamba_d_state=5, mamba_ngroups=3)
    d.update(over)
    return {k: v for k, v in d.items() if v is not ...}


def test_config_defaults_follow_transformers():
    c = parse_config(_cfg())
    assert isinstance(c, Zamba2Config) and c.layer_kinds == ["mamba", "hybrid", "mamba"]
    assert c.intermediate_size == 60 and c.head_dim == 10 and c.mamba_headdim == 5 and c.num_key_value_heads == 3
    assert c.hidden_act == "gelu" and c.tie_word_embeddings and c.time_step_min == 0.001 and c.rope_theta == 10000.0
    assert parse_config(_cfg(rope_parameters={"rope_type": "default", "rope_theta": 7.0})).rope_theta == 7.0


@pytest.mark.parametrize("over,key", [
    (dict(layers_block_type=["mamba", "attention", "mamba"]), "layers_block_type"),
    (dict(layers_block_type=["mamba"]), "layers_block_type"),
    (dict(layers_block_type=...), "layers_block_type"),
    (dict(n_mamba_heads=7), "n_mamba_heads"),
    (dict(mamba_ngroups=4), "mamba_ngroups"),
    (dict(num_attention_heads=4), "num_attention_heads"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(num_key_value_heads=1, use_shared_attention_adapter=True), "num_key_value_heads"),
    (dict(hidden_act="gelu_new"), "hidden_act"),
    (dict(use_mem_rope="yes"), "use_mem_rope"),
    (dict(adapter_rank=0), "adapter_rank"),
    (dict(num_mem_blocks=0), "num_mem_blocks"),
    (dict(num_attention_heads=10, use_mem_rope=True), "head_dim"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    (dict(time_step_min=-1.0), "time_step_min"),
])
def test_config_errors_name_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        parse_config(_cfg(**over))


def test_checkpoint_copies_of_a_shared_block_load_once_and_must_be_equal(zamba, tmp_path):
    """A checkpoint holding each invocation's own copy of a shared block (what transformers
    5.17 writes when its blocks are not tied) loads: the copy is checked equal to the block's
    first invocation and read once.  A copy that differs (blocks trained apart) is refused,
    naming both tensors."""
    m = tiny_zamba2(seed=3)
    hyb = m.config.hybrid_layer_ids
    m.model.layers[hyb[2]].shared_transformer = copy.deepcopy(m.model.layers[hyb[2]].shared_transformer)
    d = H.save_quiet(m, str(tmp_path / "copies"))
    ids = torch.randint(0, m.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    ref = H.hf_logits(copy.deepcopy(m), ids)
    got = load_model(d, dtype="float64")(ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-10
    with torch.no_grad():
        m.model.layers[hyb[2]].shared_transformer.pre_ff_layernorm.weight.add_(0.5)
    d2 = H.save_quiet(m, str(tmp_path / "apart"))
    with pytest.raises(WeightError, match=rf"model\.layers\.{hyb[2]}\.shared_transformer.*differs"):
        load_model(d2, dtype="float64")
