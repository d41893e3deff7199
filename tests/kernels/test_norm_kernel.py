"""The fused RMS norm kernels (gated; plain / zero-centred with the residual add) against the
layers' PyTorch forms."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels.norm import gated_rmsnorm, gated_sumsq, rmsnorm  # noqa: E402
from replayssm.layers.norms import GatedRMSNorm, RMSNorm  # noqa: E402

DEVICE = kernel_device()


@pytest.mark.parametrize("N,group,gate_first,dtype", [
    (24, 24, True, torch.float32), (24, 8, True, torch.float32), (20, 20, False, torch.float32),
    (96, 32, True, torch.bfloat16), (40, 40, False, torch.bfloat16), (33, 11, True, torch.float32)])
def test_gated_rmsnorm_kernel_matches_reference(N, group, gate_first, dtype):
    g = torch.Generator().manual_seed(N + group)
    norm = GatedRMSNorm(N, 1e-5, group_size=group, gate_first=gate_first)
    norm.weight.data = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    x = torch.randn(3, 2, N, generator=g).to(dtype).to(DEVICE)
    zfull = torch.randn(3, 2, N + 7, generator=g).to(dtype).to(DEVICE)
    z = zfull[..., 3:3 + N]  # strided rows, as the slice of the in_proj output
    y_ref = norm.reference(x, z)
    y = gated_rmsnorm(x, z, norm.weight, norm.eps, group, gate_first)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)


def test_gated_rmsnorm_kernel_rejects_bad_groups():
    x = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="group size"):
        gated_rmsnorm(x, x, torch.ones(10, device=DEVICE), 1e-5, 3, True)


@pytest.mark.parametrize("N,zero_centered,dtype,sum_dtype", [
    (24, False, torch.float32, None), (33, True, torch.float32, None), (96, False, torch.bfloat16, None),
    (80, True, torch.bfloat16, None), (96, False, torch.bfloat16, torch.float32),
    (3136 // 16, True, torch.bfloat16, torch.float32)])
def test_rmsnorm_kernel_matches_reference(N, zero_centered, dtype, sum_dtype):
    """``y = norm(h)`` and ``(y, s) = (norm(s), h + r)`` against the PyTorch form, in the
    activation dtype or with an fp32 residual stream (``residual_in_fp32``); strided rows."""
    g = torch.Generator().manual_seed(N)
    norm = RMSNorm(N, 1e-5, zero_centered=zero_centered)
    norm.weight.data = ((0.3 if zero_centered else 1.0) + 0.3 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    hdt = sum_dtype or dtype
    hfull = (3 * torch.randn(5, 3, N + 5, generator=g)).to(hdt).to(DEVICE)
    h = hfull[..., 2:2 + N]   # strided rows
    r = torch.randn(5, 3, N, generator=g).to(dtype).to(DEVICE)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    y, s = rmsnorm(h.to(dtype), norm.weight, norm.eps, zero_centered)
    y_ref = norm.reference(h.to(dtype))
    assert s is None and y.dtype == y_ref.dtype == dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    # the residual add fused in front
    y, s = rmsnorm(h, norm.weight, norm.eps, zero_centered, residual=r, sum_dtype=hdt)
    s_ref = h + r
    y_ref = norm.reference(s_ref.to(dtype))
    assert s.dtype == s_ref.dtype == hdt and y.dtype == dtype
    # exact in fp32; within one bf16 unit otherwise (the CPU interpreter rounds to bf16 its own way)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0 if hdt == torch.float32 else 2 ** -7)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)


def test_rmsnorm_kernel_rejects_bad_shapes():
    x = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="norm weight"):
        rmsnorm(x, torch.ones(9, device=DEVICE), 1e-5, False)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, torch.ones(10, device=DEVICE), 1e-5, False, residual=torch.zeros(2, 9, device=DEVICE))


@pytest.mark.parametrize("N,ranks,dtype", [(24, 2, torch.float32), (30, 3, torch.float32), (64, 2, torch.bfloat16)])
def test_split_gated_rmsnorm_over_ranks_matches_the_whole_norm(N, ranks, dtype):
    """A norm group spread over ``ranks``: each rank's ``gated_sumsq`` of its channels, summed
    (the all-reduce), then ``gated_rmsnorm(..., sumsq=, total=N)`` on each rank's channels,
    concatenated, equals the one-group norm of the whole row (rows 5: odd; strided z)."""
    g = torch.Generator().manual_seed(N)
    norm = GatedRMSNorm(N, 1e-5, group_size=N, gate_first=True)
    norm.weight.data = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    x = torch.randn(5, N, generator=g).to(dtype).to(DEVICE)
    z = torch.randn(5, N + 3, generator=g).to(dtype).to(DEVICE)[:, 1:1 + N]
    y_ref = norm.reference(x, z)
    w = N // ranks
    parts = [(x[:, r * w:(r + 1) * w], z[:, r * w:(r + 1) * w]) for r in range(ranks)]
    sums = [gated_sumsq(a, b) for a, b in parts]
    assert sums[0].shape == (5,) and sums[0].dtype == torch.float32
    want = (x.double() * torch.nn.functional.silu(z.double())).pow(2).sum(-1)
    torch.testing.assert_close(sum(sums).double(), want, rtol=1e-5, atol=1e-5)
    total = sum(sums)
    y = torch.cat([gated_rmsnorm(a, b, norm.weight[r * w:(r + 1) * w], norm.eps, w, True, sumsq=total, total=N)
                   for r, (a, b) in enumerate(parts)], -1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    with pytest.raises(ValueError, match="sum of squares"):
        gated_rmsnorm(x, z, norm.weight, norm.eps, N, True, sumsq=total.double(), total=N)


@pytest.mark.parametrize("R,N,dtype", [(5, 24, torch.float32), (3, 40, torch.bfloat16), (1, 7, torch.float32)])
def test_gated_sumsq_with_weight_defers_the_row_scale(R, N, dtype, nan_empty):
    """``gated_sumsq(x, z, weight, out=)``: ``u = w · x · silu(z)`` and the fp32 sums written
    into ``out``; ``u`` times the row scale ``rsqrt(sums / N + eps)`` is the gated norm."""
    g = torch.Generator().manual_seed(R * N)
    w = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    x = torch.randn(R, N, generator=g).to(dtype).to(DEVICE)
    z = torch.randn(R, N + 3, generator=g).to(dtype).to(DEVICE)[:, 2:2 + N]
    out = torch.full((R + 2,), -1.0, device=DEVICE)
    u, ss = gated_sumsq(x, z, w, out=out[1:1 + R])
    assert out[0] == -1 and out[-1] == -1 and ss.data_ptr() == out[1:].data_ptr()
    xs = x.double() * torch.nn.functional.silu(z.double())
    lo = dtype == torch.bfloat16
    torch.testing.assert_close(ss.double().cpu(), xs.pow(2).sum(-1).cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u.double().cpu(), (xs * w.double()).cpu(), **(dict(atol=2e-2, rtol=2e-2) if lo
                                                                             else dict(atol=1e-5, rtol=1e-5)))
    norm = GatedRMSNorm(N, 1e-5, group_size=N, gate_first=True)
    norm.weight.data = w
    y = u.double() * torch.rsqrt(ss.double() / N + 1e-5)[:, None]
    torch.testing.assert_close(y.cpu(), norm.reference(x, z).double().cpu(), **(dict(atol=4e-2, rtol=4e-2) if lo
                                                                               else dict(atol=1e-5, rtol=1e-5)))
    with pytest.raises(ValueError, match="out must"):
        gated_sumsq(x, z, w, out=torch.empty(R, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        gated_sumsq(x, z, w[:-1])
