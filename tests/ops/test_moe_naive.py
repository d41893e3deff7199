"""The gather-based routed-experts reference against the dense definition (every expert on every
token, weighted by the routing weight or zero)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayssm.ops.moe import naive as M


def dense(x, idx, w, w1, w2, act, gated):
    f = M.activation(act)
    E = w1.shape[0]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in range(E):
        we = torch.where(idx == e, w, torch.zeros_like(w)).sum(-1)
        hx = F.linear(x, w1[e])
        I = w2.shape[2]
        h = f(hx[:, :I]) * hx[:, I:] if gated else f(hx)
        out += F.linear(h, w2[e]) * we[:, None]
    return out


def _case(g, N, D, I, E, k, DO, gated, dtype=torch.float64):
    x = torch.randn(N, D, generator=g, dtype=dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]) if N else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(N, k, generator=g, dtype=dtype)
    w1 = torch.randn(E, (2 if gated else 1) * I, D, generator=g, dtype=dtype) * 0.4
    w2 = torch.randn(E, DO, I, generator=g, dtype=dtype) * 0.4
    return x, idx, w, w1, w2


@pytest.mark.parametrize("N,D,I,E,k,DO,gated,act", [
    (7, 6, 5, 9, 3, 6, True, "silu"),      # few tokens, many experts (some never chosen)
    (40, 5, 3, 4, 2, 7, False, "relu2"),   # many tokens per expert, non-square output (latent)
    (1, 4, 2, 3, 3, 4, False, "gelu"),     # one token choosing every expert
    (0, 4, 2, 3, 2, 4, True, "silu"),      # no tokens
])
def test_experts_match_dense_definition(N, D, I, E, k, DO, gated, act):
    g = torch.Generator().manual_seed(N + E)
    x, idx, w, w1, w2 = _case(g, N, D, I, E, k, DO, gated)
    got = M.experts(x, idx, w, w1, w2, act=act, gated=gated)
    assert got.shape == (N, DO) and got.dtype == torch.float64
    if N:
        assert (got - dense(x, idx, w, w1, w2, act, gated)).abs().max() < 1e-12


def test_float32_accumulates_in_float32_and_returns_input_dtype():
    g = torch.Generator().manual_seed(1)
    x, idx, w, w1, w2 = _case(g, 5, 6, 4, 5, 2, 6, True)
    got = M.experts(x.float(), idx.int(), w.float(), w1.float(), w2.float(), act="silu", gated=True)
    assert got.dtype == torch.float32
    assert (got.double() - dense(x, idx, w, w1, w2, "silu", True)).abs().max() < 1e-5


def test_bad_shapes_raise():
    g = torch.Generator().manual_seed(2)
    x, idx, w, w1, w2 = _case(g, 3, 4, 2, 3, 2, 4, True)
    with pytest.raises(ValueError, match="w must"):
        M.experts(x, idx, w[:, :1], w1, w2)
    with pytest.raises(ValueError, match="w2 must"):
        M.experts(x, idx, w, w1, w2[:, :, :1])
    with pytest.raises(ValueError, match="activation"):
        M.experts(x, idx, w, w1, w2, act="tanh")
    with pytest.raises(ValueError, match="even"):
        M.experts(x, idx, w, w1[:, :3], w2[:, :, :1], gated=True)
