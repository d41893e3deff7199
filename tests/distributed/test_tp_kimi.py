"""Tensor parallelism for Kimi-Linear on CPU (two processes over gloo, float64).

KDA split by heads (2 of 4 heads of 5 channels a rank), MLA split by heads with the latent
``[c | k_rot]`` replicated (every rank caches the whole latent of each token), the MoE's
experts and shared experts along their intermediate channels, the router replicated.  TP=2
logits equal TP=1's; greedy generation equals one rank's in every decode mode and with
n-gram (chain and tree: MLA's tree commit on every rank) and draft-model speculation;
prefix caching resumes with the same hits and output; sizes that do not split are named
before any process starts.  (TP=4: ``test_tp4.py``.)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402
from tp_checks import assert_forward_matches  # noqa: E402

pytest.importorskip("transformers")

from test_kimi_linear import tiny_kimi  # noqa: E402

from replayssm import LLM, SpeculativeConfig  # noqa: E402
from replayssm.models import load_model  # noqa: E402
from replayssm.models.registry import read_config  # noqa: E402

dist_mod = pytest.importorskip("replayssm.distributed")
from replayssm.distributed import check_tensor_parallel, local_config  # noqa: E402

MAXLEN = 64
N_NEW = 8
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]

#: 4 KDA heads of 5, 4 MLA heads (nope 5, rope 3, value 3) over a latent of 7, experts of
#: 6 channels (3 a rank) with 2 shared experts, dense MLP of 22 (11 a rank), vocabulary 67
#: (shards of 34 and 33, the second padded)
BASE = dict(num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=5, qk_rope_head_dim=3, v_head_dim=3,
            linear_num_heads=4, linear_head_dim=5, moe_intermediate_size=6, num_shared_experts=2)
SPECS = {
    # KDA (dense MLP), MLA (MoE), KDA (MoE)
    "moe": BASE,
    # MLA first with a low-rank q (q_a / q_b and its norm: replicated / split), no rope part,
    # a 4-tap conv, dense MLPs, tied embeddings
    "qlora": dict(BASE, num_hidden_layers=2, layer_types=["full_attention", "linear_attention"],
                  mlp_layer_types=["dense", "dense"], q_lora_rank=5, qk_rope_head_dim=0, linear_conv_kernel_dim=4,
                  tie_word_embeddings=True),
}
#: with MLA's biases (q_a / kv_a replicated, o_proj's on rank 0 only): forward and shards only
#: (the tiny model's random biases make its greedy continuations constant)
SPECS["qlora_bias"] = dict(SPECS["qlora"], attention_bias=True)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_kimi")
    out = {}
    for i, (name, over) in enumerate(SPECS.items()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = H.save_tiny(tiny_kimi(seed=31 + i, **over), str(root / name))
    return out


@pytest.fixture(scope="module")
def models(paths, group):
    """``models(name) -> (TP=1 model, TP=2 model)``, float64 (cached)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = (load_model(paths[name], dtype="float64"), group.load_model(paths[name], dtype="float64"))
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------
# before any process
# ---------------------------------------------------------------------------------------
def test_sizes_that_do_not_split_are_named(paths):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"linear_attn_config.num_heads \(4\)"):
        LLM(paths["moe"], tensor_parallel_size=3)
    assert multiprocessing.active_children() == before
    c = read_config(paths["moe"])
    check_tensor_parallel(c, 2)
    for field, value, what in (("linear_num_heads", 3, r"linear_attn_config.num_heads \(3\): .*KDA heads"),
                               ("num_attention_heads", 6, r"num_attention_heads \(6\): .*MLA heads"),
                               ("moe_intermediate_size", 5, r"moe_intermediate_size \(5\): .*every expert"),
                               ("intermediate_size", 21, r"intermediate_size \(21\): .*MLP channels")):
        with pytest.raises(ValueError, match=what):
            check_tensor_parallel(dataclasses.replace(c, **{field: value}), 4 if value == 6 else 2)
    # a kind the model lacks is not checked: no dense MLP, no MLA layer
    check_tensor_parallel(dataclasses.replace(c, mlp_layer_types=("sparse",) * 3, intermediate_size=21), 2)
    check_tensor_parallel(dataclasses.replace(c, layer_types=("linear_attention",) * 3, num_attention_heads=3), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int"):
        check_tensor_parallel(c, 0)


def test_local_config():
    from replayssm.models import parse_config

    c = parse_config(dict(model_type="kimi_linear", vocab_size=11, hidden_size=8, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=7, intermediate_size=6,
                          moe_intermediate_size=4, num_shared_experts=3, num_experts=4, num_experts_per_token=2,
                          linear_attn_config=dict(num_heads=6, head_dim=5, full_attn_layers=[2], kda_layers=[1])))
    lc = local_config(c, 2)
    assert (lc.linear_num_heads, lc.linear_head_dim, lc.num_attention_heads) == (3, 5, 2)
    assert (lc.kv_lora_rank, lc.qk_rope_head_dim, lc.qk_nope_head_dim, lc.v_head_dim) == (7, 64, 128, 128)
    assert (lc.intermediate_size, lc.moe_intermediate_size, lc.num_shared_experts, lc.num_experts) == (3, 2, 3, 4)


@pytest.mark.parametrize("arch", list(SPECS))
def test_rank_shards_are_slices_of_the_full_model(paths, arch):
    """Rank 1's loaded tensors (the loader alone) are the full model's rows or columns its rule
    names, row-parallel biases zeros, the rest (latent path, router, norms) the full model's."""
    from replayssm.distributed.loading import load_shard
    from replayssm.distributed.sharding import ROOT_ONLY, Shard, shard_rules

    full = load_model(paths[arch], dtype="float64")
    local = load_shard(paths[arch], rank=1, size=2, dtype="float64")
    rules = shard_rules(full, 2, 1)
    fp, lp = dict(full.named_parameters()), dict(local.named_parameters())
    assert set(fp) == set(lp) and all(n in fp for n in rules)
    split = {n.split(".", 3)[-1] for n, r in rules.items() if isinstance(r, Shard)}
    want = {"self_attn.q_proj.weight", "self_attn.k_conv1d.weight", "self_attn.f_b_proj.weight", "self_attn.dt_bias",
            "self_attn.A_log", "self_attn.b_proj.weight", "self_attn.g_b_proj.weight", "self_attn.o_proj.weight",
            "self_attn.kv_b_proj.weight", "mlp.down_proj.weight"}
    want |= {"self_attn.q_b_proj.weight"} if arch.startswith("qlora") else {"mlp.experts.gate_up_proj",
                                                                    "mlp.shared_experts.up_proj.weight"}
    assert want <= split, want - split
    for n in fp:
        if any(k in n for k in ("kv_a_proj", "kv_a_layernorm", "q_a_proj", "q_a_layernorm", "f_a_proj", "g_a_proj",
                                "o_norm", "gate.weight", "e_score_correction_bias")):
            assert n not in rules, n
    for n, p in lp.items():
        rule = rules.get(n)
        if isinstance(rule, Shard):
            w = torch.cat([fp[n].narrow(rule.dim, a, b - a) for a, b in rule.ranges], rule.dim)
            assert torch.equal(p.narrow(rule.dim, 0, w.shape[rule.dim]), w), n
            assert not p.narrow(rule.dim, w.shape[rule.dim], p.shape[rule.dim] - w.shape[rule.dim]).any(), n
        elif rule == ROOT_ONLY:
            assert not p.any(), n
        else:
            assert torch.equal(p, fp[n]), n
    if arch == "qlora_bias":
        assert any(r == ROOT_ONLY and n.endswith("self_attn.o_proj.bias") for n, r in rules.items())


# ---------------------------------------------------------------------------------------
# two processes
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(SPECS))
def test_full_forward_matches(models, arch):
    assert_forward_matches(*models(arch), atol=1e-10)


def test_rank_cache_holds_the_whole_latent(models):
    """Each rank's MLA layer runs its 2 of 4 heads over the full latent: the paged pool holds
    ``R + dr`` channels a token (as one rank's), the KDA states half the heads."""
    ref, tp = models("moe")
    mla, kda = tp.local.blocks[1].self_attn, tp.local.blocks[0].self_attn
    assert (mla.H, mla.Hkv, mla.Dh, mla.kv_b_proj.weight.shape) == (2, 1, 7 + 3, (2 * (5 + 3), 7))
    assert (kda.H, kda.K, kda.q_proj.weight.shape[0]) == (2, 5, 10)
    with torch.device("meta"):
        pool = mla.allocate(3, 4, torch.float64, "meta")
    assert pool["k"] is pool["v"] and tuple(pool["k"].shape) == (3, 4, 1, 10)
    a, b = ref.cache_layout(max_seq_len=MAXLEN), tp.cache_layout(max_seq_len=MAXLEN)
    assert b.attn_block_bytes == a.attn_block_bytes > 0     # the MLA blocks: the replicated latent
    assert 2 * b.state_bytes == a.state_bytes > 0           # KDA states: half the heads
    assert 2 * b.entry_bytes == a.entry_bytes > 0           # and half of each ring entry


def test_mla_op_runs_the_rank_heads_over_the_whole_latent(models, monkeypatch):
    """Rank 0's decode steps call ``mla_attention`` with its 2 query heads of ``R + dr`` and
    the latent pool ``[blocks, block_size, 1, R + dr]``; the output is the latent ``[.., 2, R]``."""
    from replayssm.kernels.dispatch import ops_for

    _, tp = models("moe")
    ops = ops_for("attention")
    real, seen = ops.mla_attention, []

    def spy(q, pool, *args, **kw):
        out = real(q, pool, *args, **kw)
        seen.append((tuple(q.shape[1:]), tuple(pool.shape[2:]), kw["rank"], tuple(out.shape[1:])))
        return out

    monkeypatch.setattr(ops, "mla_attention", spy)
    _run(tp, PROMPTS[:1], 3, decode_mode="kv")
    assert seen and set(seen) == {((2, 10), (1, 10), 7, (2, 7))}


def _run(model, prompts=PROMPTS, n=N_NEW, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=MAXLEN, auto_threshold=6, **kw) as llm:
            return H.generate_quiet(llm, prompts, n)


@pytest.mark.parametrize("arch", ["moe", "qlora"])
def test_greedy_matches_one_rank_in_every_mode(models, arch):
    ref, tp = models(arch)
    want = _run(ref, decode_mode="recurrent")
    assert len({tuple(w) for w in want}) > 1     # the continuations differ: the test can fail
    runs = [dict(decode_mode=m) for m in ("recurrent", "replay", "kv", "auto")]
    runs += [dict(decode_mode=m, speculative=SpeculativeConfig("ngram", num_tokens=3)) for m in ("replay", "kv")]
    runs += [dict(decode_mode="kv", speculative=SpeculativeConfig("tree", num_tokens=3, tree_width=2)),
             dict(decode_mode="replay", speculative=SpeculativeConfig("draft", num_tokens=3, draft_model=ref))]
    for kw in runs if arch == "moe" else runs[1:3]:
        assert _run(tp, **kw) == want, kw


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_prefix_caching_matches_one_rank(models, mode):
    """Rank 0's prefix index, every rank's share of KDA checkpoints and whole MLA latent
    blocks: resumed requests give one rank's output, with the same prefix hits."""
    ref, tp = models("moe")
    V = ref.config.vocab_size
    base = [(7 * i + 3) % V for i in range(30)]
    prompts = [base, base[:9] + [1, 2], base[:17] + [3], base[:22] + [4, 5], base]
    kw = dict(decode_mode=mode, kv_block_size=4, buffer_size=6, enable_prefix_caching=True,
              prefix_checkpoint_interval=8)
    runs = []
    for m in (tp, ref):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LLM(m, max_seq_len=MAXLEN, **kw) as llm:
                got = [H.generate_quiet(llm, [p], 5)[0] for p in prompts]
                runs.append((got, llm.stats["prefix_hit_tokens"]))
    (got, hits), (want_cached, ref_hits) = runs
    assert got == want_cached == _run(ref, prompts, 5, decode_mode="recurrent")
    assert hits == ref_hits > 0
