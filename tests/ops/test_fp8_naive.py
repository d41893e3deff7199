"""FP8 e4m3 reference quantization (``replayssm.ops.fp8.naive``): block / per-tensor /
per-token-group scales on odd shapes with partial edge blocks, zero blocks, the stacked
experts layout, and bad arguments."""

from __future__ import annotations

import pytest
import torch

from replayssm.ops.fp8 import naive as Q


def _blocks_amax(w, bo, bi):
    out, d_in = w.shape
    return torch.stack([torch.stack([w[r:r + bo, c:c + bi].abs().max() for c in range(0, d_in, bi)])
                        for r in range(0, out, bo)])


def test_block_round_trip_on_odd_shape():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(13, 29, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 29, dtype=torch.float64)
    w[4:8, 8:16] = 0.0                                            # an all-zero block
    q, s = Q.quantize_block(w, (4, 8))
    assert q.dtype == Q.FP8 and s.dtype == torch.float32 and s.shape == (4, 4)
    amax = _blocks_amax(w, 4, 8)
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).float()
    assert torch.equal(s, want) and s[1, 1] == 1.0 and (q.float()[4:8, 8:16] == 0).all()
    d = Q.dequantize_block(q, s, (4, 8), torch.float64)
    up = Q.expand_scale(s.double(), 13, 29, (4, 8))
    assert up.shape == (13, 29) and up[12, 28] == s[3, 3]
    # e4m3 rounding: at most half a step (2^-4 relative) for normals, 2^-10·s for subnormals
    err = (d - w).abs()
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, up * 2.0 ** -10) * (1 + 1e-12)).all()
    assert torch.equal(Q.quantize_block(d, (4, 8))[0].view(torch.uint8), q.view(torch.uint8))   # idempotent


def test_tensor_and_group_scales():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, 5, generator=g)
    q, s = Q.quantize_tensor(w)
    assert s.shape == () and s == (w.double().abs().max() / 448).float()
    assert (q.float().abs().max() == 448.0)
    assert ((Q.dequantize_tensor(q, s, torch.float64) - w.double()).abs() <= w.double().abs() * 2 ** -4 + 1e-6).all()
    assert Q.quantize_tensor(torch.zeros(3, 3))[1] == 1.0
    x = torch.randn(3, 2, 37, generator=g)
    x[0, 1, 32:] = 0.0                                            # a zero (partial) group
    qx, sx = Q.quantize_groups(x, 16)
    assert qx.shape == x.shape and sx.shape == (3, 2, 3) and sx[0, 1, 2] == 1.0
    assert torch.allclose(sx[1, 0, 0].double(), x[1, 0, :16].double().abs().max() / 448)
    back = Q.dequantize_groups(qx, sx, 16)
    assert ((back - x.double()).abs() <= x.double().abs() * 2 ** -4 + 1e-6).all()


@pytest.mark.parametrize("block", [(4, 8), None])
def test_experts_layout_per_part(block):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 14, 11, generator=g)                       # [gate (7) | up (7)] per expert
    q, s = Q.quantize_experts(w, block, parts=2)
    assert s.shape == Q.expert_scale_shape(3, 14, 11, block, 2) == ((3, 4, 2) if block else (3, 2))
    for e in range(3):
        for p in range(2):
            part = w[e, 7 * p:7 * p + 7]
            qp, sp = Q.quantize_block(part, block) if block else Q.quantize_tensor(part)
            assert torch.equal(q[e, 7 * p:7 * p + 7].view(torch.uint8), qp.view(torch.uint8))
            assert torch.equal(s[e, 2 * p:2 * p + 2] if block else s[e, p], sp)
    d = Q.dequantize_experts(q, s, block, 2, torch.float64)
    assert ((d - w.double()).abs() <= w.double().abs() * 2 ** -4 + 1e-3).all()
    with pytest.raises(ValueError, match="expert scales have shape"):
        Q.dequantize_experts(q, s[:, :1], block, 2)


def test_linear_reference_and_bad_arguments():
    g = torch.Generator().manual_seed(3)
    w, x, b = torch.randn(6, 10, generator=g), torch.randn(4, 10, generator=g), torch.randn(6, generator=g)
    q, s = Q.quantize_block(w, (4, 4))
    y = Q.linear(x.double(), q, s, b.double(), block=(4, 4))
    assert torch.equal(y, x.double() @ Q.dequantize_block(q, s, (4, 4), torch.float64).T + b.double())
    assert Q.linear(x, q, s, block=(4, 4)).dtype == torch.float32
    for bad in ((0, 4), (4,), (4, 4.0), "128", (True, 4)):
        with pytest.raises(ValueError, match="block must be"):
            Q.check_block(bad)
    with pytest.raises(ValueError, match="scale has shape"):
        Q.linear(x, q, s[:1], block=(4, 4))
    with pytest.raises(ValueError, match="features"):
        Q.linear(x[:, :9], q, s, block=(4, 4))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Q.linear(x, w, s, block=(4, 4))
    with pytest.raises(ValueError, match="float"):
        Q.quantize_block(torch.ones(2, 2, dtype=torch.int32), (1, 1))
