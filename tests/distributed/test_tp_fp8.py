"""Tensor-parallel loading of FP8 checkpoints (two CPU ranks over gloo): each rank's shard
slices the block scales with its weights (expert stacks per part, GDN's head reorder on the
local rows), per-tensor scales are replicated, and the sharded model's logits and greedy
output equal the one-device FP8 model's; a split that cuts an FP8 block is refused naming the
weight, before any process starts reading."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.models import load_model  # noqa: E402
from replayssm.models.quantize import quantize_checkpoint  # noqa: E402

pytest.importorskip("replayssm.distributed")
from replayssm.distributed.loading import load_shard  # noqa: E402

IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
# Qwen3-Next sized so that every rank's share is whole (2, 4) blocks: 2 value heads of 4 per
# rank (out_proj columns 8), 28 qkvz rows per key head (chunks 6, 6, 8, 8), 4 ba rows (2, 2),
# experts 8 -> 4 channels
QWEN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=4, num_attention_heads=6,
            num_key_value_heads=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
            intermediate_size=16, mlp_only_layers=[0])
NEMOTRON = dict(hybrid_override_pattern="M*-E", mamba_num_heads=6, n_groups=2, num_attention_heads=6,
                num_key_value_heads=1, intermediate_size=18, moe_intermediate_size=10,
                moe_shared_expert_intermediate_size=6)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes)."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_fp8")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        H.save_tiny(H.tiny_qwen3_next(seed=5, **QWEN), str(root / "qwen"))
        H.save_tiny(H.tiny_nemotron_h(seed=6, **NEMOTRON), str(root / "nem"))
    for name, src, block in (("qwen_block", "qwen", (2, 4)), ("nem_tensor", "nem", None),
                             ("qwen_cut", "qwen", (8, 4)), ("nem_block", "nem", (4, 4))):
        quantize_checkpoint(str(root / src), str(root / name), block)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("name", ["qwen_block", "nem_tensor"])
def test_fp8_tensor_parallel_matches_one_device(dirs, group, name):
    one = load_model(dirs[name], dtype="float64")
    tp = group.load_model(dirs[name], dtype="float64")
    a, b = one(IDS), tp(IDS)
    assert (a - b).abs().max().item() <= 1e-9 * a.abs().max().item()
    prompts = [[1, 2, 3], [9, 9, 9, 9]]
    want = [o.token_ids for o in LLM(one).generate(prompts, SamplingParams(max_tokens=6))]
    with LLM(tp) as llm:
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6))] == want


def test_fp8_shards_slice_scales_with_weights(dirs):
    one = load_model(dirs["qwen_block"], dtype="float64")
    ps = dict(one.named_parameters())
    for rank in (0, 1):
        loc = dict(load_shard(dirs["qwen_block"], rank, 2, dtype="float64").named_parameters())
        w, s = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_scale_inv"
        assert loc[w].dtype == torch.float8_e4m3fn and loc[s].shape == (4, 4, 6)
        rows = torch.cat([torch.arange(rank * 4, rank * 4 + 4), 8 + torch.arange(rank * 4, rank * 4 + 4)])
        assert torch.equal(loc[w].view(torch.uint8), ps[w].view(torch.uint8)[:, rows])
        assert torch.equal(loc[s], ps[s][:, torch.cat([torch.arange(2 * rank, 2 * rank + 2),
                                                        4 + torch.arange(2 * rank, 2 * rank + 2)])])
        o = "model.layers.0.linear_attn.out_proj.weight_scale_inv"
        assert torch.equal(loc[o], ps[o][:, 2 * rank:2 * rank + 2])


@pytest.mark.parametrize("name,match", [("qwen_cut", r"in_proj_qkvz\.weight.*cuts its FP8 blocks of 8"),
                                        ("nem_block", r"mixer\.in_proj\.weight.*cuts its FP8 blocks")])
def test_split_cutting_a_block_refused_by_name(dirs, name, match):
    with pytest.raises(ValueError, match=match):
        load_shard(dirs[name], 0, 2)
