"""Paged attention kernels (interpreter on CPU, compiled on a GPU) against the reference ops and
a dense fp64 softmax: varlen batches with empty rows, contexts ending mid-block, shuffled block
tables, NaN in every unused block, tree masks, GQA ratios, prefill continuation, split-KV."""

from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ops"))
from paged_cases import dense_reference, make_case, random_tree_bits  # noqa: E402

from replayssm.kernels import attention as KA  # noqa: E402
from replayssm.kernels import dispatch  # noqa: E402
from replayssm.ops.attention import naive as A  # noqa: E402

DEVICE = kernel_device()
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

CASES = [
    # kv_lens, q_lens, H, Hkv, Dh, BS, splits
    ([5, 3, 9, 1, 6], [2, 0, 9, 1, 3], 6, 2, 5, 4, 1),        # varlen, empty row, odd Dh, GQA 3
    ([5, 3, 9, 1, 6], [2, 0, 9, 1, 3], 6, 2, 5, 4, 3),        # same, split-KV
    ([37, 8, 1, 70], [1, 1, 1, 1], 8, 2, 16, 8, 4),           # decode, GQA 4, long rows, splits
    ([11, 4, 3], [3, 3, 3], 3, 3, 7, 3, 2),                   # chain verify, MHA
    ([40, 6, 2], [25, 6, 0], 4, 1, 8, 5, 1),                  # prefill continuation, MQA, many tiles
    ([9], [0], 2, 1, 4, 4, 1),                                # nothing to attend
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_lens,q_lens,H,Hkv,Dh,BS,S", CASES)
def test_paged_attention_kernel(kv_lens, q_lens, H, Hkv, Dh, BS, S, dtype):
    g = torch.Generator().manual_seed(sum(kv_lens) + 13 * S + H)
    case = make_case(g, kv_lens, q_lens, H, Hkv, Dh, BS, dtype=dtype, device=DEVICE)
    ref = A.paged_attention(**{k: (v.double() if v is not None and v.is_floating_point() else v)
                               for k, v in case.items()}, scale=0.41)
    out = torch.full_like(case["q"], float("nan"))
    got = KA.paged_attention(**case, scale=0.41, num_splits=S, out=out)
    assert got is out and got.dtype == dtype and got.shape == case["q"].shape
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max().item() < TOL[dtype]
    if dtype == torch.float32 and sum(q_lens):  # and the reference against the dense softmax
        assert (ref.cpu() - dense_reference(case, 0.41)).abs().max().item() < 1e-12


@pytest.mark.parametrize("R,S", [(1, 1), (5, 2)])
def test_tree_kernel(R, S):
    g = torch.Generator().manual_seed(R * 10 + S)
    N, T, Hkv = 3, 6, 2
    bits = random_tree_bits(g, N, T)
    case = make_case(g, [14, 6, 23], [T] * N, R * Hkv, Hkv, 12, 4, dtype=torch.float32, device=DEVICE,
                     tree_bits=bits)
    ref = dense_reference(case, 0.3)
    got = KA.paged_attention(**case, scale=0.3, num_splits=S)
    assert (got.double().cpu() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("block_m", [16, 32])
def test_tile_sizes_give_the_same_result(block_m):
    """Different query tilings (tokens per tile) and key steps give the same numbers."""
    g = torch.Generator().manual_seed(block_m)
    case = make_case(g, [30, 17, 5], [12, 17, 2], 6, 3, 16, 4, dtype=torch.float32, device=DEVICE)
    ref = A.paged_attention(**case, scale=0.25)
    got = KA.paged_attention(**case, scale=0.25, block_m=block_m, block_n=16)
    assert (got - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_kernel(dtype):
    g = torch.Generator().manual_seed(2)
    NB, BS, Hkv, Dh, Nt = 7, 4, 3, 5, 9
    kc = torch.randn(NB, BS, Hkv, Dh, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(NB, BS, Hkv, Dh, generator=g).to(dtype).to(DEVICE)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.tensor([3, -1, 27, 0, 5, -4, 11, 12, 20], device=DEVICE)
    full = torch.randn(Nt, Hkv + 1, Dh, generator=g).to(DEVICE)
    k, v = full[:, 1:], torch.randn(Nt, Hkv, Dh, generator=g).to(DEVICE)   # k: strided token rows
    A.write_kv(kr, vr, k, v, slots)
    KA.write_kv(kc, vc, k, v, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_dispatch_routes_by_device_and_dtype(monkeypatch):
    g = torch.Generator().manual_seed(4)
    case = make_case(g, [6, 3], [2, 1], 4, 2, 8, 4, dtype=torch.float32, device=DEVICE)
    ref = A.paged_attention(**case, scale=0.5)
    calls = []
    monkeypatch.setattr(KA, "paged_attention", lambda *a, **k: calls.append(1) or ref)
    dispatch.KernelOps("attention", backend="triton").paged_attention(**case, scale=0.5, num_splits=2)
    assert calls == [1]
    got = dispatch.KernelOps("attention", backend="naive").paged_attention(**case, scale=0.5, num_splits=2)   # kernel keyword dropped
    assert calls == [1] and torch.equal(got, ref)


def test_default_splits_depend_on_shapes_only():
    dev = torch.device("cpu")
    assert 1 <= KA.default_splits(programs=16 * 8, device=dev) <= 16
    assert KA.default_splits(programs=10_000, device=dev) == 1
    assert KA.default_splits(programs=1, device=dev) == 16
