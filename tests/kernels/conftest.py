"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def nan_empty(monkeypatch):
    """Every ``torch.empty`` inside the test returns NaN-filled memory (outputs a kernel
    must write in full)."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture(autouse=True)
def fresh_dispatch():
    """Each test resolves the dispatch tables anew (from its own ``REPLAYSSM_KERNELS`` and
    kernel modules, patched or not) and leaves no resolved choice behind."""
    from replayssm.kernels import dispatch

    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture
def kernels_env(monkeypatch):
    """``set_backend(name)``: ``REPLAYSSM_KERNELS=name`` (None: unset) from then on; dispatch
    reads the environment once per resolution, so the tables are reset too."""
    from replayssm.kernels import dispatch

    def set_backend(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv("REPLAYSSM_KERNELS", raising=False)
        else:
            monkeypatch.setenv("REPLAYSSM_KERNELS", name)
        dispatch.reset()

    return set_backend
