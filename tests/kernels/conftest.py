"""Fixtures of the kernel tests."""

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
