"""Paged attention reference ops against a dense, loop-per-query fp64 softmax."""

from __future__ import annotations

import pytest
import torch

from paged_cases import dense_reference, make_case, random_tree_bits

from replayssm.ops.attention import naive as A

CASES = [
    # kv_lens, q_lens, H, Hkv, Dh, BS : varlen with zero-length rows, contexts ending mid-block
    ([5, 3, 9, 1, 6], [2, 0, 9, 1, 3], 6, 2, 5, 4),
    # decode, GQA 4:1, one block each and a context of exactly two blocks
    ([7, 8, 1, 13], [1, 1, 1, 1], 4, 1, 3, 4),
    # chain verify T=3 after existing context, no GQA
    ([11, 4, 3], [3, 3, 3], 3, 3, 7, 3),
    # prefill continuation: 5 new tokens after 12 committed; a fresh prompt of 6; an empty row
    ([17, 6, 2], [5, 6, 0], 4, 2, 4, 5),
]


@pytest.mark.parametrize("kv_lens,q_lens,H,Hkv,Dh,BS", CASES)
def test_paged_attention_matches_dense_softmax(kv_lens, q_lens, H, Hkv, Dh, BS):
    g = torch.Generator().manual_seed(sum(kv_lens) * 7 + H)
    case = make_case(g, kv_lens, q_lens, H, Hkv, Dh, BS)
    ref = dense_reference(case, scale=0.37)
    got = A.paged_attention(**case, scale=0.37)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    assert (got - ref).abs().max() < 1e-12


@pytest.mark.parametrize("R", [1, 3])
def test_tree_mask_matches_dense_softmax(R):
    g = torch.Generator().manual_seed(11 + R)
    N, T, Hkv = 3, 5, 2
    bits = random_tree_bits(g, N, T)
    case = make_case(g, [9, 5, 12], [T] * N, R * Hkv, Hkv, 6, 4, tree_bits=bits)
    ref = dense_reference(case, scale=0.5)
    got = A.paged_attention(**case, scale=0.5)
    assert (got - ref).abs().max() < 1e-12
    # a chain's bitmasks are the causal mask
    chain = torch.tensor([[(1 << (i + 1)) - 1 for i in range(T)]] * N, dtype=torch.int32)
    causal = A.paged_attention(**{**case, "tree_bits": None}, scale=0.5)
    assert (A.paged_attention(**{**case, "tree_bits": chain}, scale=0.5) - causal).abs().max() < 1e-15


def test_out_argument_and_float32():
    g = torch.Generator().manual_seed(3)
    case = make_case(g, [6, 2], [2, 1], 4, 2, 8, 4, dtype=torch.float32)
    out = torch.full_like(case["q"], float("nan"))
    got = A.paged_attention(**case, scale=0.3, out=out)
    assert got is out and out.dtype == torch.float32
    ref = dense_reference(case, scale=0.3)
    assert (out.double() - ref).abs().max() < 1e-5


def test_write_kv_skips_negative_slots_and_new_slots_follow_block_table():
    g = torch.Generator().manual_seed(5)
    NB, BS, Hkv, Dh = 6, 4, 2, 3
    kc = torch.randn(NB, BS, Hkv, Dh, generator=g)
    vc = torch.randn(NB, BS, Hkv, Dh, generator=g)
    kc0, vc0 = kc.clone(), vc.clone()
    bt = torch.tensor([[4, 2, 0], [5, 1, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    lens = torch.tensor([6, 9], dtype=torch.int32)         # row 0 writes positions 3..5, row 1 7..8
    valid = torch.tensor([True, True, False, True, True])
    slots = A.new_slots(bt, cu, lens, BS, 5, valid)
    assert slots.tolist() == [4 * 4 + 3, 2 * 4 + 0, -1, 1 * 4 + 3, 3 * 4 + 0]
    k = torch.randn(5, Hkv, Dh, generator=g)
    v = torch.randn(5, Hkv, Dh, generator=g)
    A.write_kv(kc, vc, k, v, slots)
    flat_k, flat_v = kc.view(-1, Hkv, Dh), vc.view(-1, Hkv, Dh)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    touched = torch.zeros(NB * BS, dtype=torch.bool)
    touched[slots[slots >= 0]] = True
    assert torch.equal(kc.view(-1, Hkv, Dh)[~touched], kc0.view(-1, Hkv, Dh)[~touched])
    assert torch.equal(vc.view(-1, Hkv, Dh)[~touched], vc0.view(-1, Hkv, Dh)[~touched])
    seq, pos = A.token_positions(cu, lens, 5)
    assert seq.tolist() == [0, 0, 0, 1, 1] and pos.tolist() == [3, 4, 5, 7, 8]


def test_bad_input_raises_before_writing():
    g = torch.Generator().manual_seed(9)
    case = make_case(g, [5, 3], [2, 1], 4, 2, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        A.paged_attention(**{**case, "cu_seqlens_q": torch.tensor([0, 2, 2], dtype=torch.int32)}, scale=1.0)
    with pytest.raises(ValueError, match="kv_lens"):
        A.paged_attention(**{**case, "kv_lens": torch.tensor([1, 3], dtype=torch.int32)}, scale=1.0)
    with pytest.raises(ValueError, match="blocks"):
        A.paged_attention(**{**case, "kv_lens": torch.tensor([50, 3], dtype=torch.int32)}, scale=1.0)
    with pytest.raises(ValueError, match="heads"):
        A.paged_attention(**{**case, "q": case["q"][:, :3]}, scale=1.0)
    with pytest.raises(ValueError, match="tree_bits"):
        A.paged_attention(**{**case, "tree_bits": torch.zeros(2, 2, dtype=torch.int32)}, scale=1.0)
    kc = case["k_cache"].clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        A.write_kv(kc, case["v_cache"].clone(), torch.ones(2, 2, 4, dtype=torch.float64),
                   torch.ones(2, 2, 4, dtype=torch.float64), torch.tensor([3, 10_000]))
    assert torch.equal(kc.isnan(), case["k_cache"].isnan())
