"""Layer-level checks not covered by model parity."""

from __future__ import annotations

import torch

from replayssm.layers.gdn import reorder_ba, reorder_qkvz
from replayssm.layers.mlp import SigmoidMoE, SoftmaxMoE, _dispatch


def _fill(mod, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in mod.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3


def test_moe_gathered_route_equals_dense_route():
    torch.manual_seed(0)
    for moe in (SoftmaxMoE(6, 5, 7, 3, True, 4), SigmoidMoE(6, 5, 8, 2, 2, 1, True, 1.7, 4, 3)):
        moe = moe.to_empty(device="cpu")
        _fill(moe)
        x = torch.randn(2, 6, dtype=torch.float64)   # N * k <= E: gathered route
        y = moe(x)
        if isinstance(moe, SigmoidMoE):
            idx, w = moe.route(x)
            h = moe.fc1_latent_proj(x) if moe.fc1_latent_proj is not None else x
        else:
            p = torch.softmax(moe.gate(x), -1)
            w, idx = torch.topk(p, moe.k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            h = x
        dense = _dispatch(h, idx, w, moe.E, moe._expert)          # no gathered fn: dense route
        gath = _dispatch(h, idx, w, moe.E, moe._expert, moe._gathered)
        assert (dense - gath).abs().max() < 1e-12
        assert torch.isfinite(y).all()


def test_gdn_reorder_matches_hf_layout():
    """Rows of HF's per-key-head interleaved in_proj_qkvz / in_proj_ba, re-ordered."""
    H, HV, K, V = 2, 6, 3, 4
    r = HV // H
    rows = torch.arange(H * (2 * K + 2 * r * V), dtype=torch.float64)[:, None]
    out = reorder_qkvz(rows, H, HV, K, V)[:, 0].long().tolist()
    per = 2 * K + 2 * r * V
    q = [h * per + i for h in range(H) for i in range(K)]
    k = [h * per + K + i for h in range(H) for i in range(K)]
    v = [h * per + 2 * K + i for h in range(H) for i in range(r * V)]
    z = [h * per + 2 * K + r * V + i for h in range(H) for i in range(r * V)]
    assert out == q + k + v + z
    rows = torch.arange(H * 2 * r, dtype=torch.float64)[:, None]
    out = reorder_ba(rows, H, HV)[:, 0].long().tolist()
    assert out == [h * 2 * r + i for h in range(H) for i in range(r)] + \
                  [h * 2 * r + r + i for h in range(H) for i in range(r)]
