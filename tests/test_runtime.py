"""Device normalisation and the capture-aware check default (``replayssm.runtime``), on CPU.

CUDA is simulated by patching ``torch.cuda.is_available`` / ``current_device``: only the
device *objects* are built, no CUDA tensor is ever allocated.
"""

from __future__ import annotations

import os

import pytest
import torch

from replayssm import runtime
from replayssm.runtime import canonical_device, same_device, want_check


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend CUDA is available with current device 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_cpu_devices_lose_their_index():
    cpu = torch.zeros(1).device
    for d in ("cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)):
        assert canonical_device(d) == cpu
        assert canonical_device(d).index is None
    assert torch.device("cpu:0") != cpu  # the mismatch the normalisation removes
    assert same_device("cpu:0", torch.zeros(1))


def test_cuda_without_index_becomes_current_device(fake_cuda):
    assert canonical_device("cuda") == torch.device("cuda", 1)
    assert canonical_device(torch.device("cuda")) == torch.device("cuda:1")
    assert canonical_device("cuda:0") == torch.device("cuda", 0)      # an explicit index stays
    assert same_device("cuda", "cuda:1") and not same_device("cuda", "cuda:0")
    assert not same_device("cuda", "cpu")


def test_cuda_unavailable_is_left_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert canonical_device("cuda") == torch.device("cuda")           # no crash; allocation errors later
    assert canonical_device("meta") == torch.device("meta")


def test_device_users_normalise(fake_cuda):
    """Every place that stores a user's device keeps the canonical one."""
    from replayssm.cache.paged import PagedIndex
    from replayssm.cache.ring import RingIndex
    from replayssm.engine.model_runner import ModelRunner
    from replayssm.engine.sampler import Sampler

    assert RingIndex(2, 4, "cpu:0").device == torch.device("cpu")
    assert PagedIndex(2, 4, 8, 2, "cpu:0").device == torch.device("cpu")
    assert ModelRunner(None, None, "cuda", 4).device == torch.device("cuda", 1)
    assert Sampler("cpu:0", 0).device == torch.device("cpu")


def test_want_check_off_during_capture(monkeypatch):
    x = torch.zeros(2)
    assert want_check(None, x) is True and want_check(False, x) is False and want_check(True, x) is True
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert want_check(None, x) is False and want_check(True, x) is False
    from replayssm.ops.common import want_check as ops_want_check

    assert ops_want_check(True, x) is False


def test_load_model_cpu0_device_matches_tensors():
    """``load_model(device="cpu:0")``: the model, its cache and its inputs agree on the device
    (before normalisation every call raised "input_ids on cpu, model on cpu:0")."""
    from replayssm.models import load_model

    path = os.path.join(os.path.dirname(__import__("replayssm").__file__), "assets", "tiny-mamba2")
    m = load_model(path, device="cpu:0", dtype="float32")
    assert m.device == torch.device("cpu")
    ids = torch.tensor([[1, 2, 3, 4]])
    full = m(ids)
    cache = m.make_cache(2, buffer_size=4, max_seq_len=16, device="cpu:0")
    slots = torch.tensor([1])
    lp = m.prefill(cache, slots, ids[:, :3], torch.tensor([3]))
    ld = m.decode(cache, slots, ids[:, 3])
    torch.testing.assert_close(lp, full[:, 2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ld, full[:, 3], atol=1e-4, rtol=1e-4)


def test_commit_skips_host_checks_during_capture(monkeypatch):
    """Under capture even ``check=True`` must not sync: the range check is skipped (the
    caller guarantees it) and the null slot is reset by a kernel, not a host scalar."""
    from replayssm.cache.paged import PagedIndex
    from replayssm.cache.ring import RingIndex

    ring = RingIndex(2, 8, "cpu")
    plan = ring.plan_verify(torch.tensor([1, 0]), 2)
    bad = torch.tensor([3, 0])                      # > T: rejected by the host check
    with pytest.raises(ValueError):
        ring.commit(plan, bad, check=True)
    pidx = PagedIndex(2, 4, 8, 2, "cpu")
    pidx.reserve(1, 8)
    pplan = pidx.plan(torch.tensor([1, 0]), 2)
    with pytest.raises(ValueError):
        pidx.commit(pplan, bad, check=True)
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    ring.commit(plan, torch.tensor([2, 1]), check=True)
    pidx.commit(pplan, torch.tensor([2, 1]), check=True)
    assert ring.length.tolist() == [0, 2, 0] and pidx.length.tolist() == [0, 2, 0]  # null slot reset
