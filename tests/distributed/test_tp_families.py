"""Tensor parallelism for the newer families on CPU: two processes over gloo.

Qwen3.5 (dense and MoE: separate GDN projections, gated attention, experts with a shared
expert), Granite-4.0-H (Mamba-2 with one group: a norm spanning ranks; attention; experts
``input_linear`` / ``output_linear`` and a shared MLP; every multiplier), Bamba (one KV head:
replicated) and Falcon-H1 (Mamba-2 and attention in parallel, muP multipliers, two norm
layouts and both group layouts), and the Qwen3-Next-80B-A3B structure at tiny size (the TP
preset of ``scripts/gpu_tp_big.py``).  Each: TP=2 full-forward logits equal TP=1 in float64,
greedy generation equal in replay and KV modes, prefix caching keeps greedy output; sizes
that do not split are named before any process starts (Kimi-Linear: test_tp_kimi.py).
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
from tp_checks import assert_forward_matches, save_tiny_specs  # noqa: E402
from tp_prefix import cached_runs, prefix_prompts  # noqa: E402

pytest.importorskip("transformers")

from test_falcon_h1 import tiny_falcon_h1  # noqa: E402
from test_granite_bamba import _build as granite_or_bamba  # noqa: E402
from test_qwen3_5 import tiny_qwen3_5, tiny_qwen3_5_moe  # noqa: E402
from test_zamba2 import tiny_zamba2  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.models import load_model  # noqa: E402
from replayssm.models.registry import parse_config, read_config  # noqa: E402

dist_mod = pytest.importorskip("replayssm.distributed")
from replayssm.distributed import check_tensor_parallel  # noqa: E402




N_NEW = 8
MAXLEN = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]

SPECS = {
    # dense: GDN 2 key / 6 value heads (3 per rank), attention 4 heads, 1 KV head (replicated)
    "qwen3_5": (tiny_qwen3_5, dict(num_key_value_heads=1)),
    # MoE: experts of 8 channels, shared expert of 6, KV heads split, vocabulary 67 (padded shard)
    "qwen3_5_moe": (tiny_qwen3_5_moe, dict(moe_intermediate_size=8, shared_expert_intermediate_size=6)),
    # Mamba-2 (6 heads, one group: cross-rank gated norm) + attention + experts + shared MLP, multipliers
    "granite": (lambda seed, **o: granite_or_bamba("granite", seed, **o),
                dict(intermediate_size=8, shared_intermediate_size=10, mamba_proj_bias=True)),
    "bamba": (lambda seed, **o: granite_or_bamba("bamba", seed, **o),
              dict(intermediate_size=12, mamba_n_heads=6, hidden_size=24, num_key_value_heads=1, attention_bias=True,
                   tie_word_embeddings=True)),
    # norm then gate over 2 groups (one per rank), every bias, every multiplier
    "falcon_h1": (tiny_falcon_h1, dict(num_attention_heads=4)),
    # norm then gate over the whole width: the norm spans both ranks
    "falcon_h1_g1": (tiny_falcon_h1, dict(num_attention_heads=4, mamba_n_groups=1)),
    # gate then norm, one group (the Mamba-2 sharded norm); no norm at all
    "falcon_h1_gate": (tiny_falcon_h1, dict(num_attention_heads=4, mamba_n_groups=1, mamba_norm_before_gate=False)),
    "falcon_h1_plain": (tiny_falcon_h1, dict(num_attention_heads=4, mamba_rms_norm=False, tie_word_embeddings=True)),
    # two shared blocks invoked three times, LoRA adapters, RoPE, biases; 4 heads of 8 (2·16/4),
    # Mamba-2 8 heads in 2 groups (one per rank)
    "zamba2": (tiny_zamba2, dict(hidden_size=16, num_attention_heads=4, n_mamba_heads=8, mamba_ngroups=2,
                                 intermediate_size=12)),
    # one shared block, GQA (2 KV heads: split), no adapters, one Mamba group (cross-rank norm), tied
    "zamba2_gqa": (tiny_zamba2, dict(hidden_size=16, num_mem_blocks=1, use_shared_attention_adapter=False,
                                     use_mem_rope=False, num_attention_heads=4, num_key_value_heads=2,
                                     n_mamba_heads=8, mamba_ngroups=1, intermediate_size=12, tie_word_embeddings=True,
                                     hidden_act="silu")),
    # the Qwen3-Next-80B-A3B structure (hf_utils.QWEN3_NEXT_80B_TINY): 4 query heads and one
    # KV head a rank, 2 GDN key / 6 value heads, 6 channels of each of 7 experts, shared 10
    "qwen3_next_80b": (H.tiny_qwen3_next, H.QWEN3_NEXT_80B_TINY),
}
GENERATE = ["qwen3_next_80b", "qwen3_5", "qwen3_5_moe", "granite", "bamba", "falcon_h1", "falcon_h1_g1", "zamba2", "zamba2_gqa"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return save_tiny_specs(tmp_path_factory.mktemp("tp_families"), SPECS, seed=21)


@pytest.fixture(scope="module")
def models(paths, group):
    """``models(name) -> (TP=1 model, TP=2 model)``, float64 (cached)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = (load_model(paths[name], dtype="float64"), group.load_model(paths[name], dtype="float64"))
        return cache[name]

    return get


def _generate(model, prompts=PROMPTS, max_tokens=N_NEW, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=MAXLEN, **kw) as llm:
            out = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]
            return out, llm.stats


# ---------------------------------------------------------------------------------------
# before any process
# ---------------------------------------------------------------------------------------
def test_sizes_that_do_not_split_are_named(paths):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\)"):
        LLM(paths["qwen3_5_moe"], tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"mamba_n_heads \(6\)"):
        LLM(paths["granite"], tensor_parallel_size=4)
    assert multiprocessing.active_children() == before
    q = read_config(paths["qwen3_5_moe"])
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(7\)"):
        check_tensor_parallel(dataclasses.replace(q, moe_intermediate_size=7), 2)
    g = read_config(paths["granite"])
    with pytest.raises(ValueError, match=r"shared_intermediate_size \(9\)"):
        check_tensor_parallel(dataclasses.replace(g, shared_intermediate_size=9), 2)
    with pytest.raises(ValueError, match=r"intermediate_size \(7\): .* channels of every expert"):
        check_tensor_parallel(dataclasses.replace(g, intermediate_size=7), 2)
    check_tensor_parallel(dataclasses.replace(g, num_local_experts=0, intermediate_size=7), 2)  # no experts
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        check_tensor_parallel(dataclasses.replace(g, num_attention_heads=6, num_key_value_heads=3), 2)
    b = read_config(paths["bamba"])
    with pytest.raises(ValueError, match=r"intermediate_size \(11\)"):
        check_tensor_parallel(dataclasses.replace(b, intermediate_size=11), 2)
    f = read_config(paths["falcon_h1"])
    with pytest.raises(ValueError, match=r"mamba_n_groups \(2\)"):
        check_tensor_parallel(f, 3)     # 6 heads split in 3, but 2 groups and 3 ranks do not nest
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\)"):
        check_tensor_parallel(dataclasses.replace(f, num_attention_heads=3), 2)
    z = read_config(paths["zamba2"])
    with pytest.raises(ValueError, match=r"mamba_ngroups \(3\)"):
        check_tensor_parallel(dataclasses.replace(z, mamba_ngroups=3, n_mamba_heads=6), 2)
    with pytest.raises(ValueError, match=r"intermediate_size \(11\)"):
        check_tensor_parallel(dataclasses.replace(z, intermediate_size=11), 2)
    other = type("Cfg", (), {"model_type": "llama"})()
    with pytest.raises(ValueError, match="model_type 'llama' .*no sharding rules"):
        check_tensor_parallel(other, 2)
    check_tensor_parallel(other, 1)   # one rank: nothing to split


def test_local_configs():
    from replayssm.distributed import local_config

    f = parse_config(dict(model_type="falcon_h1", vocab_size=11, hidden_size=8, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=4, intermediate_size=6,
                          mamba_d_ssm=16, mamba_n_heads=4, mamba_d_state=3, mamba_n_groups=1))
    lf = local_config(f, 2)
    assert (lf.mamba_n_heads, lf.mamba_d_ssm, lf.mamba_d_head, lf.mamba_n_groups) == (2, 8, 4, 1)
    assert (lf.num_attention_heads, lf.num_key_value_heads, lf.head_dim, lf.intermediate_size) == (2, 1, 4, 3)
    z = parse_config(dict(model_type="zamba2", vocab_size=11, hidden_size=8, num_hidden_layers=2,
                          layers_block_type=["mamba", "hybrid"], num_attention_heads=4, n_mamba_heads=4))
    lz = local_config(z, 2)
    assert (lz.num_attention_heads, lz.head_dim, z.head_dim, lz.n_mamba_heads, lz.mamba_headdim) == (2, 4, 4, 2, 4)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "granite", "bamba", "falcon_h1_g1", "zamba2"])
def test_rank_shards_are_slices_of_the_full_model(paths, arch):
    """Rank 1's loaded tensors (no process: the loader alone) are the full model's rows or
    columns its rule names (after the load transforms: the multipliers scale each row alike),
    row-parallel biases are zeros, the rest equals the full model's."""
    from replayssm.distributed.loading import load_shard
    from replayssm.distributed.sharding import ROOT_ONLY, Shard, shard_rules

    full = load_model(paths[arch], dtype="float64")
    local = load_shard(paths[arch], rank=1, size=2, dtype="float64")
    rules = shard_rules(full, 2, 1)
    fp, lp = dict(full.named_parameters()), dict(local.named_parameters())
    assert set(fp) == set(lp) and all(n in fp for n in rules)
    assert sum(isinstance(r, Shard) for r in rules.values()) > 8
    for n, p in lp.items():
        rule = rules.get(n)
        if isinstance(rule, Shard):
            want = torch.cat([fp[n].narrow(rule.dim, a, b - a) for a, b in rule.ranges], rule.dim)
            got = p.narrow(rule.dim, 0, want.shape[rule.dim])
            assert torch.equal(got, want), n
            assert not p.narrow(rule.dim, want.shape[rule.dim], p.shape[rule.dim] - want.shape[rule.dim]).any(), n
        elif rule == ROOT_ONLY:
            assert not p.any(), n
        else:
            assert torch.equal(p, fp[n]), n


# ---------------------------------------------------------------------------------------
# two processes
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(SPECS))
def test_full_forward_matches(models, arch):
    assert_forward_matches(*models(arch), atol=1e-12)


@pytest.mark.parametrize("mode", ["replay", "kv"])
@pytest.mark.parametrize("arch", GENERATE)
def test_greedy_matches_one_rank(models, arch, mode):
    ref, tp = models(arch)
    want, _ = _generate(ref, decode_mode="recurrent")
    got, _ = _generate(tp, decode_mode=mode)
    assert got == want
    assert len({tuple(g) for g in got}) > 1     # the continuations differ: the test can fail


@pytest.mark.parametrize("arch", GENERATE)
def test_prefix_caching_matches_one_rank(models, arch):
    """Rank 0's prefix index, every rank's share of the checkpoints and blocks: resumed
    requests give one rank's output, with the same prefix hits."""
    ref, tp = models(arch)
    prompts = prefix_prompts(ref.config.vocab_size)
    (got, hits), (want_cached, ref_hits) = cached_runs((tp, ref), prompts, MAXLEN)
    want, _ = _generate(ref, prompts, max_tokens=5)
    assert got == want == want_cached
    assert hits == ref_hits > 0
