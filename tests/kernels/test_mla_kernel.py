"""The absorbed-MLA kernel (interpreter on CPU, compiled on a GPU) against its float64
reference op and a dense per-query softmax: decode, chain verify and tree steps over shuffled
non-contiguous blocks with NaN in every unused block and block tail, odd latent ranks with and
without the shared key part, head groups, split-K, tile variants; outputs pre-filled with NaN
(and NaN scratch) so every row must be written; bad input raises before anything runs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ops"))
from paged_cases import dense_reference, make_case, random_tree_bits  # noqa: E402

from replayssm.kernels import dispatch  # noqa: E402
from replayssm.kernels import mla as KM  # noqa: E402
from replayssm.ops.attention import mla as M  # noqa: E402

DEVICE = kernel_device()
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SCALE = 0.37


def mla_case(seed, kv_lens, q_lens, H, rank, dr, BS, dtype, tree=False):
    """A latent pool ``[NB, BS, 1, rank + dr]`` (paged_cases layout: shuffled blocks, NaN
    elsewhere) and its dense fp64 reference output ``[Nt, H, rank]``."""
    g = torch.Generator().manual_seed(seed)
    bits = random_tree_bits(g, len(kv_lens), q_lens[0]) if tree else None
    c = make_case(g, kv_lens, q_lens, H, 1, rank + dr, BS, dtype=dtype, device=DEVICE, tree_bits=bits)
    c["v_cache"] = c["k_cache"]
    dense = dense_reference(c, SCALE)[..., :rank]
    args = dict(q=c["q"], cache=c["k_cache"], block_table=c["block_table"], cu_seqlens_q=c["cu_seqlens_q"],
                kv_lens=c["kv_lens"], tree_bits=c["tree_bits"])
    return args, dense


CASES = [
    # kv_lens, q_lens, H, rank, dr, BS, splits, tree
    ([5, 3, 9, 1, 6], [1, 1, 1, 1, 1], 3, 7, 4, 4, 1, False),     # decode, odd rank, context < a block
    ([37, 8, 1, 70], [1, 1, 1, 1], 5, 7, 4, 8, 3, False),         # decode, split-K
    ([29, 17], [1, 1], 40, 9, 3, 3, 2, False),                   # 40 heads in one 64-row program
    ([11, 4, 3], [3, 3, 3], 3, 6, 0, 3, 2, False),               # chain verify, no shared key part
    ([30, 7, 12], [4, 0, 2], 2, 20, 5, 4, 1, False),             # varlen rows, an empty row
    ([14, 6, 23], [6, 6, 6], 3, 7, 4, 4, 2, True),               # tree verify
    ([19, 9], [5, 5], 4, 16, 16, 4, 16, True),                   # tree, more splits than key blocks
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("kv_lens,q_lens,H,rank,dr,BS,S,tree", CASES)
def test_kernel_matches_reference(kv_lens, q_lens, H, rank, dr, BS, S, tree, dtype, nan_empty):
    args, dense = mla_case(sum(kv_lens) + H, kv_lens, q_lens, H, rank, dr, BS, dtype, tree)
    ref = M.mla_attention(**{k: (v.double() if v is not None and v.is_floating_point() else v)
                             for k, v in args.items()}, rank=rank, scale=SCALE)
    assert (ref.cpu() - dense).abs().max().item() < 1e-12          # the reference against the dense loop
    out = torch.full((dense.shape[0], H, rank), float("nan"), dtype=dtype, device=DEVICE)
    got = KM.mla_attention(**args, rank=rank, scale=SCALE, num_splits=S, out=out)
    assert got is out and got.dtype == dtype
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max().item() < TOL[dtype]
    # the cache is only read
    assert torch.equal(args["cache"].nan_to_num(7.0), mla_case(sum(kv_lens) + H, kv_lens, q_lens, H, rank, dr,
                                                               BS, dtype, tree)[0]["cache"].nan_to_num(7.0))


@pytest.mark.parametrize("block_m,block_n,warps", [(16, 16, 4), (32, 32, 8), (64, 16, 4)])
def test_tile_sizes_give_the_same_result(block_m, block_n, warps):
    """Any rows-per-program (tokens × heads) and keys-per-step tiling gives the same numbers."""
    args, dense = mla_case(3, [21, 13, 9], [3, 3, 3], 6, 10, 3, 4, torch.float64)
    got = KM.mla_attention(**args, rank=10, scale=SCALE, block_m=block_m, block_n=block_n, num_warps=warps,
                           num_splits=2)
    assert (got.cpu() - dense).abs().max().item() < 1e-12


@pytest.mark.parametrize("q_lens,tree", [([1, 1, 1], False), ([3, 3, 3], False), ([3, 3, 3], True)])
def test_head_groups(q_lens, tree):
    """20 heads in 16-row programs: two head groups per token, the second one part empty."""
    args, dense = mla_case(7, [21, 13, 9], q_lens, 20, 12, 4, 4, torch.float64, tree)
    assert KM.mla_tiles(len(args["q"]), 3, 20, 12, block_m=16)[:3] == (16, 16, 1)
    got = KM.mla_attention(**args, rank=12, scale=SCALE, block_m=16, num_splits=2)
    assert (got.cpu() - dense).abs().max().item() < 1e-12


def test_tiles_from_shapes():
    """Kimi-Linear's shapes (32 heads, rank 512): decode keeps all heads of a sequence in one
    32-row program; verify fills 32 rows with one token's heads; small ranks pack tokens."""
    assert KM.mla_tiles(64, 64, 32, 512)[:3] == (32, 32, 1)
    assert KM.mla_tiles(256, 64, 32, 512)[:3] == (32, 32, 1)
    assert KM.mla_tiles(256, 64, 128, 512)[:3] == (32, 32, 1)          # 128 heads: 4 groups
    assert KM.mla_tiles(12, 3, 3, 7)[:3] == (64, 3, 21)
    assert KM.mla_tiles(3, 3, 3, 7)[:3] == (16, 3, 5)


def test_dispatch_routes_mla_attention(monkeypatch):
    args, _ = mla_case(4, [6, 3], [1, 1], 4, 8, 2, 4, torch.float32)
    ref = M.mla_attention(**args, rank=8, scale=0.5)
    calls = []
    monkeypatch.setattr(KM, "mla_attention", lambda *a, **k: calls.append(1) or ref)
    dispatch.KernelOps("attention", backend="triton").mla_attention(**args, rank=8, scale=0.5, num_splits=2)
    assert calls == [1]
    got = dispatch.KernelOps("attention", backend="naive").mla_attention(**args, rank=8, scale=0.5, num_splits=2)
    assert calls == [1] and torch.equal(got, ref)


def _bad(args):
    c = args["cache"]
    return [
        (dict(cache=c.expand(-1, -1, 2, -1).contiguous()), "latent pool"),
        (dict(cache=c[..., :-1].contiguous()), "head dim"),
        (dict(cache=c[..., :-1]), "contiguous"),
        (dict(q=args["q"].half()[..., :-1]), "head dim"),
        (dict(rank=0), "rank must be"),
        (dict(rank=c.shape[-1] + 1), "rank must be"),
        (dict(rank=2.0), "rank must be"),
        (dict(out=torch.empty(2, 4, 9, device=DEVICE)), "out must be"),
        (dict(kv_lens=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)), "kv_lens"),
        (dict(block_table=args["block_table"][:, :1]), "block_table holds"),
    ]


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_bad_input_raises_before_writing(impl):
    args, _ = mla_case(5, [6, 7], [1, 1], 4, 8, 2, 4, torch.float32)
    f = M.mla_attention if impl == "reference" else KM.mla_attention
    for edit, msg in _bad(args):
        kw = dict(args, rank=8, scale=0.5, out=torch.full((2, 4, 8), 3.0, device=DEVICE))
        kw.update(edit)
        with pytest.raises(ValueError, match=msg):
            f(**kw)
        if "out" not in edit:
            assert (kw["out"] == 3.0).all()
