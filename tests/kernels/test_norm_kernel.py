"""The fused gated RMSNorm kernel against the layer's PyTorch form."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels.norm import gated_rmsnorm  # noqa: E402
from replayssm.layers.norms import GatedRMSNorm  # noqa: E402

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
