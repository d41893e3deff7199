"""Layer-level checks not covered by model parity."""

from __future__ import annotations

import torch

from replayssm.layers.gdn import reorder_ba, reorder_qkvz
from replayssm.layers.mlp import SigmoidMoE, SoftmaxMoE


def _fill(mod, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in mod.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3


def _dense_moe(moe, x, idx, w, gated):
    """Every expert on every token, weighted by its routing weight (zero when not chosen)."""
    w1 = moe.experts.gate_up_proj if gated else moe.experts.up_proj
    w2 = moe.experts.down_proj
    I = w2.shape[2]
    out = 0
    for e in range(w1.shape[0]):
        we = torch.where(idx == e, w, torch.zeros_like(w)).sum(-1)
        hx = torch.nn.functional.linear(x, w1[e])
        h = torch.nn.functional.silu(hx[:, :I]) * hx[:, I:] if gated else torch.relu(hx) ** 2
        out = out + torch.nn.functional.linear(h, w2[e]) * we[:, None]
    return out


def test_moe_blocks_equal_dense_definition():
    torch.manual_seed(0)
    for moe in (SoftmaxMoE(6, 5, 7, 3, True, 4), SigmoidMoE(6, 5, 8, 2, 2, 1, True, 1.7, 4, 3)):
        moe = moe.to_empty(device="cpu")
        _fill(moe)
        x = torch.randn(9, 6, dtype=torch.float64)
        y = moe(x)
        idx, w = moe.route(x)
        if isinstance(moe, SigmoidMoE):
            h = moe.fc1_latent_proj(x)
            ref = moe.fc2_latent_proj(_dense_moe(moe, h, idx, w, False)) + moe.shared_experts(x)
        else:
            ref = _dense_moe(moe, x, idx, w, True) + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
        assert (y - ref).abs().max() < 1e-12


def test_routing_ties_break_as_transformers():
    """Duplicated router rows give exactly tied scores; our routers pick the same experts as
    transformers' (same topk calls, same tie order)."""
    from transformers import NemotronHConfig, Qwen3NextConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 6, generator=g)
    x[3] = x[4]                                                     # tied tokens too
    moe = SoftmaxMoE(6, 5, 8, 3, True, 0).to_empty(device="cpu")
    _fill(moe)
    moe.gate.weight.data[5] = moe.gate.weight.data[1]
    moe.gate.weight.data[6] = moe.gate.weight.data[2]
    moe.gate.weight.data[7] = moe.gate.weight.data[1]
    hf = Qwen3NextTopKRouter(Qwen3NextConfig(hidden_size=6, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True))
    hf.weight.data.copy_(moe.gate.weight.data.float())
    moe.float()
    idx, w = moe.route(x)
    _, hw, hidx = hf(x)
    assert torch.equal(idx, hidx) and torch.equal(w, hw)
    assert (idx == 1).any() and (idx == 5).any()                     # a tie was actually broken

    smoe = SigmoidMoE(6, 5, 8, 2, 4, 2, True, 1.7, 4, None).to_empty(device="cpu")
    _fill(smoe)
    smoe.gate.weight.data[3] = smoe.gate.weight.data[0]             # groups {0,1} and {2,3} tie
    smoe.gate.weight.data[2] = smoe.gate.weight.data[1]
    smoe.gate.weight.data[6] = smoe.gate.weight.data[0]
    smoe.gate.e_score_correction_bias.data.zero_()
    smoe.float()
    cfg = NemotronHConfig(hidden_size=6, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=1.7)
    hfs = NemotronHTopkRouter(cfg)
    hfs.weight.data.copy_(smoe.gate.weight.data)
    idx, w = smoe.route(x)
    _, hw, hidx = hfs(x)
    assert torch.equal(idx, hidx) and torch.equal(w, hw)


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
