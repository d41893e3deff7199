"""The in-place relu² kernel against ``torch.square(F.relu(x))``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels.activation import BLOCK, relu2_  # noqa: E402

DEVICE = kernel_device()


@pytest.mark.parametrize("shape,dtype", [((3, 5, 7), torch.float32), ((2, BLOCK + 3), torch.float32),
                                         ((4, 96), torch.bfloat16), ((0, 8), torch.float32)])
def test_relu2_matches_torch(shape, dtype):
    x = (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    ref = torch.square(F.relu(x))
    y = relu2_(x)
    assert y is x
    # exact in fp32; one bf16 unit otherwise (the CPU interpreter rounds to bf16 its own way)
    torch.testing.assert_close(y, ref, atol=0, rtol=0 if dtype == torch.float32 else 2 ** -7)


def test_relu2_rejects_strided():
    with pytest.raises(ValueError, match="contiguous"):
        relu2_(torch.zeros(4, 6, device=DEVICE)[:, ::2])
