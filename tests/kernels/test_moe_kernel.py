"""Fused routed-experts kernels (interpreter on CPU, compiled on a GPU) against the gather-based
reference: few tokens over many experts (decode), many tokens per expert (several row tiles),
gated SwiGLU and plain relu² experts, strided inputs, and the MoE layers end to end."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels import moe as KM  # noqa: E402
from replayssm.layers.mlp import SigmoidMoE, SoftmaxMoE  # noqa: E402
from replayssm.ops.moe import naive as M  # noqa: E402

DEVICE = kernel_device()
TOL = {torch.float32: 2e-5, torch.float16: 2e-2}


def _case(g, N, D, I, E, k, DO, gated, dtype):
    x = torch.randn(N, D + 3, generator=g)[:, 2:2 + D]                  # strided token rows
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    w1 = torch.randn(E, (2 if gated else 1) * I, D, generator=g) * 0.3
    w2 = torch.randn(E, DO, I, generator=g) * 0.3
    dev = lambda t: t.to(dtype).to(DEVICE)
    return dev(x), idx.to(DEVICE), w.to(DEVICE), dev(w1), dev(w2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,D,I,E,k,DO,gated,act,bm", [
    (3, 20, 9, 37, 4, 20, True, "silu", None),     # decode-like: 12 pairs over 37 experts
    (45, 17, 6, 3, 2, 11, False, "relu2", 16),     # 30 rows per expert: two row tiles each
    (9, 33, 40, 5, 5, 33, True, "silu", 32),       # every token picks every expert; I > one tile
    (6, 16, 5, 8, 1, 7, False, "relu", None),      # top-1
])
def test_fused_experts_match_reference(N, D, I, E, k, DO, gated, act, bm, dtype):
    g = torch.Generator().manual_seed(N * E + k)
    x, idx, w, w1, w2 = _case(g, N, D, I, E, k, DO, gated, dtype)
    ref = M.experts(x.double(), idx, w.double(), w1.double(), w2.double(), act=act, gated=gated)
    got = KM.experts(x, idx, w, w1, w2, act=act, gated=gated, block_m=bm)
    assert got.dtype == dtype and got.shape == (N, DO)
    assert (got.double() - ref).abs().max().item() < TOL[dtype] * max(1.0, ref.abs().max().item())


def test_fused_experts_unsupported_activation_raises():
    g = torch.Generator().manual_seed(0)
    x, idx, w, w1, w2 = _case(g, 2, 16, 4, 3, 2, 16, True, torch.float32)
    with pytest.raises(ValueError, match="fused experts"):
        KM.experts(x, idx, w, w1, w2, act="gelu")


def _fill(mod, seed):
    g = torch.Generator().manual_seed(seed)
    for p in mod.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3


def test_moe_layers_kernel_path_equals_reference(kernels_env):
    """The layers' fused path (``REPLAYSSM_KERNELS=triton``) gives the reference path's output
    from the same routing, including tied router scores."""
    for i, moe in enumerate((SoftmaxMoE(24, 10, 7, 3, True, 4), SigmoidMoE(24, 10, 8, 2, 2, 1, True, 1.7, 4, 16))):
        moe = moe.to_empty(device="cpu")
        _fill(moe, i)
        moe.gate.weight.data[5] = moe.gate.weight.data[1]                # exact ties in the router
        moe.to(DEVICE)
        x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        kernels_env("naive")
        ref = moe(x)
        kernels_env("triton")
        got = moe(x)
        assert (got - ref).abs().max().item() < 1e-5
