"""Cached parameter-derived tensors (``layers.derived``) and the one-op gate path against the
per-call path (``REPLAYSSM_FUSED_GATES=0``), on tiny mixers."""

from __future__ import annotations

import pytest
import torch

from replayssm.layers.context import StepContext
from replayssm.layers.gdn import GatedDeltaNet
from replayssm.layers.kda import KimiDeltaAttention
from replayssm.layers.mamba2 import Mamba2Mixer


def _fill(m, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g))
    return m


def _mamba2(limit=(0.0, float("inf"))):
    return _fill(Mamba2Mixer(24, num_heads=5, head_dim=4, state_size=6, n_groups=1, conv_kernel=4, norm_group_size=20,
                             eps=1e-5, time_step_limit=limit, chunk_size=4), 1)


def _gdn():
    return _fill(GatedDeltaNet(24, num_k_heads=2, num_v_heads=6, head_k_dim=4, head_v_dim=3, conv_kernel=4, eps=1e-6,
                               chunk_size=4), 2)


def _kda():
    return _fill(KimiDeltaAttention(24, num_heads=3, head_dim=4, conv_kernel=4, eps=1e-6, chunk_size=4), 3)


def _run(m, h, fused: bool, monkeypatch):
    monkeypatch.setenv("REPLAYSSM_FUSED_GATES", "1" if fused else "0")
    Bt, T, _ = h.shape
    return m(h, StepContext("full", T, torch.arange(T).expand(Bt, T)))


@pytest.mark.parametrize("make,exact", [(_mamba2, True), (lambda: _mamba2((0.05, 0.4)), True), (_gdn, True),
                                        (_kda, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_gates_match_per_call_path(make, exact, dtype, monkeypatch):
    m = make().to(dtype)
    h = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(4), dtype=dtype)
    new, old = _run(m, h, True, monkeypatch), _run(m, h, False, monkeypatch)
    if exact:   # the same operators on the CPU (the cached parameters are the casts they replace)
        assert torch.equal(new, old)
    else:       # KDA's old path wrote softplus as log(1 + e^v), the gate op uses log1p
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(new, old, rtol=tol, atol=tol)


def test_derived_tensors_are_cached_and_follow_the_parameters(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_FUSED_GATES", "1")
    m = _mamba2()
    A = m._A(torch.float32)
    assert m._A(torch.float32) is A                                   # one tensor, stable address
    torch.testing.assert_close(A, -torch.exp(m.A_log.detach()))
    with torch.no_grad():                                             # a weight load after construction
        m.A_log.copy_(torch.full_like(m.A_log, 0.5))
    A2 = m._A(torch.float32)
    assert A2 is not A and torch.equal(A2, torch.full_like(A2, -float(torch.exp(torch.tensor(0.5)))))
    A64 = m._A(torch.float64)                                         # one entry per dtype
    assert A64.dtype == torch.float64 and m._A(torch.float32) is A2
    m.to(torch.float64)                                               # .to() swaps the parameters' storage
    D = m._cast("D", torch.float32)
    assert D.dtype == torch.float32 and torch.equal(D, m.D.detach().float())
    with torch.no_grad():
        m.D.mul_(2)
    assert torch.equal(m._cast("D", torch.float32), m.D.detach().float())
    assert m._cast("D", torch.float64) is m.D                         # no copy in the parameter's dtype

    k = _kda()
    w = k._conv_weight()[0]
    assert k._conv_weight()[0] is w
    with torch.no_grad():
        k.v_conv1d.weight.add_(1)
    w2 = k._conv_weight()[0]
    assert torch.equal(w2, torch.cat([k.q_conv1d.weight, k.k_conv1d.weight, k.v_conv1d.weight]).reshape(w.shape))


def test_switch_off_caches_nothing(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_FUSED_GATES", "0")
    m = _gdn()
    _run(m, torch.randn(1, 3, 24), False, monkeypatch)
    assert not m.__dict__.get("_derived_cache")


def test_inference_tensors_are_not_kept(monkeypatch):
    """A parameter without a version counter (made under inference mode) is recomputed each
    call rather than cached (an in-place change could not be seen)."""
    monkeypatch.setenv("REPLAYSSM_FUSED_GATES", "1")
    m = _mamba2()
    with torch.inference_mode():
        m.A_log = torch.nn.Parameter(torch.rand(5), requires_grad=False)
    assert m._A(torch.float32) is not m._A(torch.float32)
    torch.testing.assert_close(m._A(torch.float32), -torch.exp(m.A_log))
