"""No kernel launch puts more than 65535 programs on CUDA grid axis 1 or 2.

Row counts past that limit are ordinary: a Qwen3-Next-class prefill of 64 prompts × 32
tokens × 32 value heads gives 65536 (token × head) rows to the gated RMSNorm.  The norm is
launched for real past the limit (on the interpreter, or the GPU) and checked against the
PyTorch form.  For every other kernel the test calls its wrapper with more than 65535 rows
(tiny heads) and records each launch's grid instead of running it (a real launch of that
many programs takes minutes on the interpreter); the flat grids' indexing is covered by the
small-shape tests in ``test_kernels.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.cache.buffers import GDNBuffers, Mamba2Buffers  # noqa: E402
from replayssm.cache.conv import ConvWindow  # noqa: E402
from replayssm.cache.paged import PagedPlan  # noqa: E402
from replayssm.cache.ring import RingIndex  # noqa: E402
from replayssm.kernels import _triton, conv, gdn, mamba2, norm  # noqa: E402
from replayssm.layers.norms import GatedRMSNorm  # noqa: E402

DEVICE = kernel_device()
ROWS = _triton.GRID_YZ_MAX + 3


def _record(monkeypatch, run: bool) -> list:
    """Record each ``kernel[grid](...)`` launch (kernel name, grid); launch it too if ``run``."""
    seen = []
    cls = type(mamba2._m2_recurrent_kernel)
    original = cls.__getitem__

    def getitem(self, grid):
        def launch(*args, **kwargs):
            seen.append((getattr(self, "__name__", repr(self)), tuple(grid)))
            if run:
                return original(self, grid)(*args, **kwargs)
        return launch

    monkeypatch.setattr(cls, "__getitem__", getitem)
    return seen


def test_gated_rmsnorm_past_the_grid_limit(monkeypatch):
    """64 prompts × 32 tokens × 32 value heads of the GDN output norm (gate last), for real."""
    seen = _record(monkeypatch, run=True)
    g = torch.Generator().manual_seed(0)
    V = 4
    mod = GatedRMSNorm(V, 1e-6, gate_first=False)
    mod.weight.data = (1 + 0.3 * torch.randn(V, generator=g)).to(DEVICE)
    x = torch.randn(64, 32, 32, V, generator=g).to(DEVICE)
    z = torch.randn(64, 32, 32, V, generator=g).to(DEVICE)
    assert x.numel() // V > _triton.GRID_YZ_MAX
    y = norm.gated_rmsnorm(x, z, mod.weight, mod.eps, V, gate_first=False)
    torch.testing.assert_close(y, mod.reference(x, z), atol=1e-5, rtol=1e-5)
    _check(seen, ["_gated_rmsnorm_kernel"])


@pytest.fixture
def launches(monkeypatch):
    """Launches recorded, not run."""
    return _record(monkeypatch, run=False)


def _check(seen, names):
    launched = {name for name, _ in seen}
    assert set(names) <= launched, f"not launched: {set(names) - launched}"
    for name, grid in seen:
        assert len(grid) <= 3 and grid[0] <= _triton.GRID_X_MAX, (name, grid)
        assert all(g <= _triton.GRID_YZ_MAX for g in grid[1:]), f"{name}: grid {grid} past the axis-1/2 limit"


def _ring(T, h):
    ring = RingIndex(ROWS, 4, "cpu")
    ring.length[1:] = h
    return ring, torch.arange(1, ROWS + 1)


def _paged(T):
    bt = torch.zeros(ROWS, 2, dtype=torch.long)
    return PagedPlan(torch.arange(1, ROWS + 1), torch.zeros(ROWS, dtype=torch.long), bt, T, 4)


def test_mamba2_launches_past_the_grid_limit(launches):
    H, d, n, G, T = 2, 2, 2, 1, 2
    buf = Mamba2Buffers.allocate(ROWS, 4, H, d, n, G)
    x, dt, B, C = torch.randn(ROWS, H, d), torch.rand(ROWS, H), torch.randn(ROWS, G, n), torch.randn(ROWS, G, n)
    A = -torch.ones(H)
    ring, slots = _ring(1, 3)
    for pre in (False, True):
        mamba2.replay_decode(buf, ring.plan_decode(slots), x, dt, A, B, C, pre_scores=pre)
        mamba2.replay_decode(buf, ring.plan_decode(slots), x, dt, A, B, C, pre_scores=pre, fold_form="fma",
                             block_d=1)
        mamba2.replay_decode(buf, ring.plan_decode(slots), x, dt, A, B, C, pre_scores=pre, fold_form="hold",
                             prefetch=True)
        mamba2.replay_decode(buf, ring.plan_decode(slots), x, dt, A, B, C, pre_scores=pre, fold_form="unroll",
                             block_d=1, prefetch=True)
    mamba2.recurrent_update(buf.state, x, dt, A, B, C, slot=slots)
    xT, dtT, BT_, CT = (t[:, None].expand(-1, T, *t.shape[1:]).contiguous() for t in (x, dt, B, C))
    ring, slots = _ring(T, 0)
    mamba2.replay_verify(buf, ring.plan_verify(slots, T), xT, dtT, A, BT_, CT, fused_fold=False)
    mamba2.tree_verify(buf, ring.plan_verify(slots, T, "tree"), torch.tensor([-1, 0]), xT, dtT, A, BT_, CT)
    mamba2.snapshot_verify(buf.state, slots, xT, dtT, A, BT_, CT)
    kv = SimpleNamespace(x=torch.zeros(8, H, d), B=torch.zeros(8, G, n), dt=torch.zeros(8, H))
    mamba2.kv_verify(kv, _paged(T), xT, dtT, A, BT_, CT)
    _check(launches, ["_m2_replay_decode_kernel", "_m2_scores_kernel", "_m2_fold_kernel", "_m2_recurrent_kernel",
                      "_m2_verify_dot_kernel", "_m2_snapshot_kernel", "_append3_kernel"])


def test_gdn_launches_past_the_grid_limit(launches):
    H, HV, K, V, T = 1, 2, 2, 2, 2
    buf = GDNBuffers.allocate(ROWS, 4, H, HV, K, V)
    q, k, v = torch.randn(ROWS, H, K), torch.randn(ROWS, H, K), torch.randn(ROWS, HV, V)
    g, beta = -torch.rand(ROWS, HV), torch.rand(ROWS, HV)
    ring, slots = _ring(1, 3)
    for mode in gdn.FLUSH_MODES:
        for pre in (False, True):
            gdn.replay_decode(buf, ring.plan_decode(slots), q, k, v, g, beta, flush_mode=mode, pre_scores=pre)
            if mode != "split":
                gdn.replay_decode(buf, ring.plan_decode(slots), q, k, v, g, beta, flush_mode=mode, pre_scores=pre,
                                  fold_form="fma", block_v=1)
                gdn.replay_decode(buf, ring.plan_decode(slots), q, k, v, g, beta, flush_mode=mode, pre_scores=pre,
                                  fold_form="hold", prefetch=True)
                gdn.replay_decode(buf, ring.plan_decode(slots), q, k, v, g, beta, flush_mode=mode, pre_scores=pre,
                                  fold_form="unroll", block_v=1, prefetch=True)
    gdn.replay_decode(buf, ring.plan_decode(slots), q, k, v, g, beta, route="state")
    gdn.recurrent_update(buf.state, q, k, v, g, beta, slot=slots)
    qT, kT, vT, gT, bT = (t[:, None].expand(-1, T, *t.shape[1:]).contiguous() for t in (q, k, v, g, beta))
    ring, slots = _ring(T, 0)
    for impl in gdn.VERIFY_IMPLS:
        gdn.replay_verify(buf, ring.plan_verify(slots, T), qT, kT, vT, gT, bT, impl=impl, fused_fold=False)
        gdn.tree_verify(buf, ring.plan_verify(slots, T, "tree"), torch.tensor([-1, 0]), qT, kT, vT, gT, bT,
                        impl=impl)
        kv = SimpleNamespace(u=torch.zeros(8, HV, V), k=torch.zeros(8, H, K), g=torch.zeros(8, HV))
        gdn.kv_verify(kv, _paged(T), qT, kT, vT, gT, bT, impl=impl)
    gdn.snapshot_verify(buf.state, slots, qT, kT, vT, gT, bT)
    _check(launches, ["_gdn_replay_decode_kernel", "_gdn_scores_kernel", "_gdn_fold_kernel", "_gdn_recurrent_kernel",
                      "_gdn_verify_rows_kernel", "_gdn_verify_dot_kernel", "_append3_kernel"])


def test_conv_launches_past_the_grid_limit(launches):
    C, W, T = 3, 4, 2
    win = ConvWindow.allocate(ROWS, C, W)
    slots = torch.arange(1, ROWS + 1)
    w = torch.randn(C, W)
    conv.conv_decode(win, slots, torch.randn(ROWS, C), w)
    conv.conv_verify(win, slots, torch.randn(ROWS, T, C), w)
    conv.conv_commit(win, slots, torch.randn(ROWS, T, C), torch.ones(ROWS, dtype=torch.long))
    _check(launches, ["_conv_decode_kernel", "_conv_verify_kernel", "_conv_commit_kernel"])
