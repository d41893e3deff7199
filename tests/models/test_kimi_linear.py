"""Kimi-Linear (KDA + MLA + MoE) against transformers' own ``kimi_linear``: float64 logits,
greedy generation through the engine in every decode mode and with n-gram / draft / tree
speculation and prefix caching, the checkpoint spellings that load, and the config errors."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import hf_utils as H
from hf_utils import hf_logits

from replayssm import LLM, SpeculativeConfig
from replayssm.models import ConfigError, load_model, parse_config
from replayssm.models.config import WeightError


def _kw(**over):
    kw = dict(vocab_size=67, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
              kv_lora_rank=7, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
              intermediate_size=22, moe_intermediate_size=7, num_experts=6, num_experts_per_token=2,
              num_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.7, linear_head_dim=6,
              linear_num_heads=3, linear_conv_kernel_dim=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"],
              tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    kw.update(over)
    return kw


def tiny_kimi(seed=0, **over):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return H.build_tiny(KimiLinearForCausalLM, KimiLinearConfig(**_kw(**over)), seed)


SPECS = {
    # KDA (dense MLP), MLA (MoE), KDA (MoE); 3 heads of 6 channels, latent 7, rope part 4
    "moe": {},
    # MLA first with a low-rank q (q_a / q_b, its norm), no rope part, 4 KDA heads of 5, a
    # 4-tap conv, every MLP dense, tied embeddings
    "qlora_dense": dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "dense"], q_lora_rank=5, qk_rope_head_dim=0, linear_num_heads=4,
                        linear_head_dim=5, linear_conv_kernel_dim=4, tie_word_embeddings=True),
    # routing variants: no renormalisation, 2 of 3 groups, 3 experts per token
    "routing": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                    mlp_layer_types=["sparse", "sparse"], norm_topk_prob=False, num_experts=9, n_group=3,
                    topk_group=2, num_experts_per_token=3, num_shared_experts=2),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name) -> (hf_model, path, float64 replayssm model)``, built once per module."""
    return H.built_models(tmp_path_factory.mktemp("kimi"), lambda name: tiny_kimi(seed=len(name), **SPECS[name]),
                          load=True)


@pytest.mark.parametrize("name", list(SPECS))
def test_float64_logits_match_transformers(built, name):
    hf, _, ours = built(name)
    ids = torch.randint(0, hf.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(copy.deepcopy(hf), ids)
    got = ours(ids)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    print(f"{name}: max rel err {H.rel_err(got, ref):.2e}")
    assert H.rel_err(got, ref) < 1e-10


def test_float32_logits_near_float64(built):
    _, path, ours = built("moe")
    ids = torch.randint(0, 67, (1, 13), generator=torch.Generator().manual_seed(3))
    assert H.rel_err(load_model(path, dtype="float32")(ids).double(), ours(ids)) < 1e-4


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
N = 10


@pytest.mark.parametrize("name", ["moe", "qlora_dense"])
def test_generation_matches_transformers_in_every_mode(built, name):
    hf, _, ours = built(name)
    ref = [H.hf_greedy(hf, p, N) for p in PROMPTS]
    runs = H.engine_runs(ours, ngram_modes=("recurrent", "replay", "kv"))
    runs += [dict(decode_mode="replay", buffer_size=10,
                  speculative=SpeculativeConfig("tree", draft_model=ours, tree_width=2, tree_depth=2))]
    for kw in runs:
        llm = LLM(ours, dtype="float64", auto_threshold=6, max_seq_len=64, **kw)
        assert H.generate_quiet(llm, PROMPTS, N) == ref, kw


BASE = [(7 * i + 3) % 67 for i in range(30)]
PREFIX_PROMPTS = [BASE, BASE[:9] + [1, 2], BASE[:17] + [5], BASE[:3] + [8, 8], BASE]


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_prefix_caching_keeps_greedy_output(built, mode):
    """Prompts sharing 9, 17, 3 and all 30 tokens with a cached one: the hits resume from the
    prefix store's KDA checkpoints / entries and MLA blocks; output as without the store."""
    _, _, ours = built("moe")
    kw = dict(dtype="float64", decode_mode=mode, max_seq_len=64, kv_block_size=4, auto_threshold=12,
              buffer_size=6)
    plain = LLM(ours, **kw)
    ref = [H.generate_quiet(plain, [p], 6)[0] for p in PREFIX_PROMPTS]
    llm = LLM(ours, enable_prefix_caching=True, prefix_checkpoint_interval=8, **kw)
    got, hits = [], []
    for p in PREFIX_PROMPTS:
        before = llm.stats["prefix_hit_tokens"]
        got.append(H.generate_quiet(llm, [p], 6)[0])
        hits.append(llm.stats["prefix_hit_tokens"] - before)
    assert got == ref
    assert hits == [0, 9, 17, 3, 28]   # (the cached prompt's last, partial block is not stored)


# ---------------------------------------------------------------------------- checkpoints
def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for fn in os.listdir(path):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    return out


def _resave(path, dst, rename):
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    save_file(rename(_tensors(path)), os.path.join(dst, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_transformers_module_names_load(built, tmp_path):
    """transformers' in-memory names (``forget_gate.*``, ``mlp.`` with fused
    ``experts.gate_up_proj`` / ``down_proj``) load to the same model as the saved names."""
    hf, path, ours = built("moe")

    def rename(t):
        out = {}
        for k, v in t.items():
            for leaf in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
                k = k.replace(f"self_attn.{leaf}", f"self_attn.forget_gate.{leaf}")
            k = k.replace(".block_sparse_moe.", ".mlp.")
            if ".experts." not in k:
                out[k] = v
        for i in (1, 2):
            p = f"model.layers.{i}.block_sparse_moe.experts."
            E = hf.config.num_experts
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([t[f"{p}{e}.w1.weight"], t[f"{p}{e}.w3.weight"]], 0) for e in range(E)])
            out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([t[f"{p}{e}.w2.weight"] for e in range(E)])
        return out

    other = load_model(_resave(path, str(tmp_path / "hf_names"), rename), dtype="float64")
    ids = torch.randint(0, 67, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(other(ids), ours(ids))


def test_missing_conv_part_is_named(built, tmp_path):
    _, path, _ = built("moe")
    bad = _resave(path, str(tmp_path / "no_conv"),
                  lambda t: {k: v for k, v in t.items() if k != "model.layers.2.self_attn.k_conv1d.weight"})
    with pytest.raises(WeightError, match="k_conv1d"):
        load_model(bad, dtype="float64")


# ---------------------------------------------------------------------------- config
def _config(built, **edit):
    _, path, _ = built("moe")
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    d.update(edit)
    return d


def test_moonshot_config_spelling(built):
    """Moonshot's config.json form: ``linear_attn_config`` (1-indexed layer lists, head dims,
    conv size) and ``first_k_dense_replace`` give the same config as transformers' save."""
    d = _config(built)
    ref = parse_config(d)
    for k in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        d.pop(k)
    d.update(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 6, "num_heads": 3,
                                 "short_conv_kernel_size": 3},
             first_k_dense_replace=1, mla_use_nope=True, moe_router_activation_func="sigmoid")
    assert parse_config(d) == ref
    assert ref.layer_kinds == ["kda", "attention", "kda"] and [ref.is_moe_layer(i) for i in range(3)] == [
        False, True, True]
    assert ref.num_experts == 6 and ref.num_experts_per_tok == 2 and ref.n_group == 2 and ref.norm_topk_prob


def test_default_layer_pattern():
    c = parse_config({"model_type": "kimi_linear", "num_hidden_layers": 9})
    assert [i for i, k in enumerate(c.layer_kinds) if k == "attention"] == [4, 8]
    assert not c.is_moe_layer(0) and c.is_moe_layer(1)


@pytest.mark.parametrize("edit, msg", [
    (dict(mla_use_nope=False), "'mla_use_nope'"),
    (dict(moe_router_activation_func="softmax"), "'moe_router_activation_func'"),
    (dict(hidden_act="gelu"), "'hidden_act'"),
    (dict(num_key_value_heads=1), "num_key_value_heads 1"),
    (dict(layer_types=["linear_attention", "mamba", "linear_attention"]), "unknown layer types"),
    (dict(layer_types=["linear_attention"]), "'layer_types' must be a list of num_hidden_layers = 3"),
    (dict(mlp_layer_types=["dense", "moe", "dense"]), "'mlp_layer_types'"),
    (dict(num_expert_group=4), "not a multiple of num_expert_group"),
    (dict(topk_group=3), "topk_group 3 > num_expert_group"),
    (dict(num_experts_per_token=4), "num_experts_per_token 4 >"),
    (dict(kv_lora_rank=0), "'kv_lora_rank'"),
    (dict(layer_types=None, linear_attn_config={"full_attn_layers": [0], "kda_layers": [1, 2]}),
     "1-indexed"),
    (dict(layer_types=None, linear_attn_config={"full_attn_layers": [2], "kda_layers": [1]}),
     "names no layer type for layer"),
])
def test_config_errors_name_the_key(built, edit, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_config(_config(built, **edit))


@pytest.mark.parametrize("edit, msg", [
    (dict(linear_num_heads=4), r"linear_num_heads \* linear_head_dim \(4 \* 6\) = 24"),
    (dict(linear_conv_kernel_dim=4), "short_conv_kernel_size"),
    (dict(kv_lora_rank=8), "kv_lora_rank = 8"),
    (dict(v_head_dim=4), r"num_attention_heads \* \(qk_nope_head_dim \+ v_head_dim\)"),
    (dict(num_experts=8), "num_experts = 8"),
])
def test_config_sizes_checked_against_the_tensors(built, tmp_path, edit, msg):
    """A config.json whose sizes disagree with the checkpoint fails before any module is
    built, naming the field and the tensor."""
    _, path, _ = built("moe")
    bad = _resave(path, str(tmp_path / "bad"), lambda t: t)
    d = _config(built, **edit)
    if "num_experts" in edit:
        d["num_expert_group"] = 2
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(d, f)
    with pytest.raises(ConfigError, match=msg):
        load_model(bad, dtype="float64")


def test_jax_refuses_by_name_and_tensor_parallel_names_the_size(built):
    """The JAX backend refuses KDA by name; tensor parallelism (tests/distributed/test_tp_kimi.py)
    refuses a split that does not divide, naming the config field (this model has 3 KDA heads)."""
    from replayssm.distributed.sharding import check_tensor_parallel

    _, _, ours = built("moe")
    with pytest.raises(ValueError, match=r"linear_attn_config.num_heads \(3\)"):
        check_tensor_parallel(ours.config, 2)
    pytest.importorskip("jax")
    from replayssm.jax.params import from_torch_model

    with pytest.raises(ValueError, match="KimiDeltaAttention"):
        from_torch_model(ours)


def test_mla_cache_holds_the_latent_once(built):
    """Each MLA layer's paged cache is one ``[blocks, block_size, 1, R + dr]`` pool under
    both names, counted once in the cache layout."""
    _, _, ours = built("moe")
    cache = ours.make_cache(3, mode="replay", max_seq_len=16, block_size=4)
    store = cache.layers[1]
    assert store["k"] is store["v"] and tuple(store["k"].shape[1:]) == (4, 1, 7 + 4)
    assert ours.cache_layout(mode="replay", max_seq_len=16, block_size=4).attn_block_bytes == 4 * 11 * 8


@pytest.mark.parametrize("mode,blocks", [("replay", None), ("kv", 40)])
def test_cached_steps_swap_and_fork_continue_exactly(built, mode, blocks):
    """Prefill, decode, verify and tree steps against full forwards (1e-9 in float64), then
    the slot swapped to host and back into another slot, and forked, each continuing exactly
    (the MLA pool held once under two names is moved / copied once per name, harmlessly)."""
    from test_cache_fork import _slot_tensors
    from test_cached import Stream

    _, _, model = built("moe")
    cache = model.make_cache(6, mode=mode, buffer_size=6, max_new=3, max_seq_len=64, block_size=4,
                             kv_num_blocks=blocks, attn_num_blocks=blocks, poison=True)
    st = Stream(model, cache, [1, 0, 3], seed=5)
    st.prefill([5, 1, 3])
    if blocks:
        for s in (1, 3):
            cache.reserve(s, 40)
    for _ in range(2):
        st.decode()
        st.verify(3)
        st.tree()
    before = [t.clone() for t in _slot_tensors(cache, 1)]
    cache.swap_out(1, "req")
    cache.swap_in(4, "req")
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(before, _slot_tensors(cache, 4)))
    cache.fork(4, [5])
    st2 = Stream(model, cache, [4, 3, 5], seed=9)
    st2.seqs = {4: list(st.seqs[1]), 3: list(st.seqs[3]), 5: list(st.seqs[1])}
    for _ in range(2):
        if blocks:
            for s in (3, 4, 5):
                cache.reserve(s, len(st2.seqs[s]) + 3)
        st2.decode()
        st2.verify(2)
        st2.tree()
    st2.check_lengths()
    assert max(st.err, st2.err) < 1e-9


def test_published_config_layout():
    """The published 48B-A3B config's form (values as released: 27 layers, attention at
    1-indexed layers 4, 8, .., 24 and 27, extra keys transformers ignores) parses to the
    sizes transformers derives."""
    kda = [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]
    d = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840,
         "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
         "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512,
         "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
         "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
         "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "model_max_length": 1048576, "rope_theta": 10000.0, "rope_scaling": None,
         "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
         "num_nextn_predict_layers": 0,
         "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "kda_layers": kda, "num_heads": 32,
                                "head_dim": 128, "short_conv_kernel_size": 4}}
    c = parse_config(d)
    assert [i + 1 for i, k in enumerate(c.layer_kinds) if k == "attention"] == [4, 8, 12, 16, 20, 24, 27]
    assert c.linear_num_heads == 32 and c.linear_head_dim == 128 and c.linear_conv_kernel_dim == 4
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 27))
    assert c.max_position_embeddings == 1048576 and c.eos_token_id == 163586 and c.q_lora_rank is None


@pytest.mark.parametrize("name", ["moe", "qlora_dense"])
def test_generation_with_the_mla_kernel_matches_transformers(built, name, monkeypatch):
    """The MLA layers' decode / verify / tree steps through the Triton MLA kernel (the CPU
    interpreter here, float64 accumulation) give transformers' greedy tokens in float64 in
    every decode mode and with chain and tree speculation; the kernel ran in every run
    (``qlora_dense``: no shared key part, ``dr = 0``); every other call splits the keys in two."""
    pytest.importorskip("triton")
    from replayssm.kernels import _triton, dispatch
    from replayssm.kernels import mla as KM

    if not _triton.interpreting():
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)")
    calls = []
    kinds = set()

    def kernel(q, cache, block_table, cu, kv_lens, **kw):
        calls.append(1)
        kinds.add("tree" if kw.get("tree_bits") is not None else "chain" if q.shape[0] > kv_lens.shape[0] else "decode")
        # one split or two, alternately (split-K in the model; fewer interpreted programs)
        return KM.mla_attention(q, cache, block_table, cu, kv_lens, num_splits=1 + len(calls) % 2, **kw)

    monkeypatch.setattr(dispatch.ops_for("attention"), "mla_attention", kernel)
    hf, _, ours = built(name)
    ref = [H.hf_greedy(hf, p, N) for p in PROMPTS]
    for kw in H.engine_runs(ours, ngram_modes=("replay", "kv")):
        calls.clear()
        llm = LLM(ours, dtype="float64", auto_threshold=6, max_seq_len=64, kv_block_size=4, **kw)
        assert H.generate_quiet(llm, PROMPTS, N) == ref, kw
        assert calls, f"the MLA kernel never ran: {kw}"
    assert kinds == {"decode", "chain", "tree"}
