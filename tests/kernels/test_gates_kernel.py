"""The one-launch gate op (``kernels.gates``) against its reference and a float64 recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels.gates import MAX_BC, gates  # noqa: E402
from replayssm.ops.gates import naive  # noqa: E402

DEVICE = kernel_device()


def _f64(x, bias, A, group, limit, beta_in):
    """The gate math in float64 from the same inputs (the exactness reference)."""
    s = F.softplus(x.double() + bias.double())
    if limit[0] > 0 or limit[1] != float("inf"):
        s = s.clamp(*limit)
    if A is not None:
        s = s * A.double().reshape(-1).repeat_interleave(group)
    return s, None if beta_in is None else torch.sigmoid(beta_in.double())


CASES = [  # (lead dims, C, group, with A, limit, with beta)
    ((3, 5), 7, 1, False, (0.0, float("inf")), False),     # Mamba-2 Δ, odd heads
    ((2, 3), 6, 1, False, (0.05, 1.5), False),             # time_step_limit on
    ((1, 1), 5, 1, False, (0.0, 0.7), False),               # only the upper limit
    ((4, 1), 9, 1, True, (0.0, float("inf")), True),       # GDN (g, β), decode rows
    ((2, 2), 12, 4, True, (0.0, float("inf")), True),      # KDA: A per head of 4 channels
    ((3,), MAX_BC + 40, 8, True, (0.0, float("inf")), True),  # several column programs, 2-D x
    ((0, 3), 5, 1, True, (0.0, float("inf")), True),       # no rows
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_gates_match_reference(case, dtype):
    lead, C, group, with_a, limit, with_beta = case
    g = torch.Generator().manual_seed(C)
    HB = C // group
    # the gate columns are a strided slice of a wider projection row, as in the layers
    proj = (6 * torch.randn(*lead, C + HB + 5, generator=g)).to(dtype).to(DEVICE)
    x = proj[..., 3: 3 + C]
    beta_in = proj[..., 3 + C: 3 + C + HB] if with_beta else None
    bias = (2 * torch.randn(C, generator=g)).to(DEVICE)
    bias[0] = 30.0                                      # the softplus linear branch (v > 20)
    if C > 1:
        bias[1] = -40.0                                 # e^v below fp32's epsilon: log1p matters
    A = -torch.rand(HB, generator=g).to(DEVICE) if with_a else None
    got_g, got_b = gates(x, bias, A, group=group, time_step_limit=limit, beta_in=beta_in)
    ref_g, ref_b = naive.gates(x, bias, A, group=group, time_step_limit=limit, beta_in=beta_in)
    want_g, want_b = _f64(x, bias, A, group, limit, beta_in)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert got_g.dtype == ref_g.dtype == cdt and got_g.shape == x.shape and got_g.is_contiguous()
    tol = dict(rtol=1e-12, atol=0) if cdt == torch.float64 else dict(rtol=4e-6, atol=0)
    torch.testing.assert_close(got_g.double().cpu(), want_g.cpu(), **tol)
    torch.testing.assert_close(ref_g.double().cpu(), want_g.cpu(), **tol)
    if with_beta:
        assert got_b.dtype == ref_b.dtype == dtype and got_b.shape == beta_in.shape
        btol = dict(rtol=1e-12, atol=0) if dtype == torch.float64 else \
            dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
        torch.testing.assert_close(got_b.double().cpu(), want_b.cpu(), **btol)
        torch.testing.assert_close(ref_b.double().cpu(), want_b.cpu(), **btol)
    else:
        assert got_b is None and ref_b is None


def test_gates_3d_time_major_strides():
    """A ``[Bt, T, C]`` slice whose batch stride is not ``T ×`` its time stride (a
    transposed view) still reads every row where it is."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 3, 11, generator=g).to(DEVICE)       # [T, Bt, width]
    x = base.transpose(0, 1)[..., 2:9]                          # [Bt=3, T=4, C=7]
    bias = torch.randn(7, generator=g).to(DEVICE)
    got, _ = gates(x, bias, time_step_limit=(0.1, 2.0))
    want, _ = _f64(x, bias, None, 1, (0.1, 2.0), None)
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=4e-6, atol=0)


@pytest.mark.parametrize("f", [gates, naive.gates])
def test_gates_reject_bad_input(f):
    x = torch.zeros(2, 3, 6, device=DEVICE)
    with pytest.raises(ValueError, match="bias"):
        f(x, torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="group"):
        f(x, torch.zeros(6, device=DEVICE), torch.zeros(1, device=DEVICE), group=4)
    with pytest.raises(ValueError, match="A has"):
        f(x, torch.zeros(6, device=DEVICE), torch.zeros(4, device=DEVICE), group=2)
    with pytest.raises(ValueError, match="time_step_limit"):
        f(x, torch.zeros(6, device=DEVICE), time_step_limit=(2.0, 1.0))
    with pytest.raises(ValueError, match="beta_in"):
        f(x, torch.zeros(6, device=DEVICE), beta_in=torch.zeros(2, 4, 3, device=DEVICE))
    with pytest.raises(ValueError, match="floating"):
        f(torch.zeros(2, 6, dtype=torch.int32, device=DEVICE), torch.zeros(6, device=DEVICE))
