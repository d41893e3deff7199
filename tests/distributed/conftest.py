"""Shared fixtures of the tensor-parallel tests (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def group():
    """One two-rank CPU group per test module; rank 0 and the worker start with one intra-op
    thread each (tiny models in several processes), rank 0's setting restored after."""
    from replayssm.distributed import TensorParallelGroup

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    g = TensorParallelGroup(2, "cpu", worker_threads=1)
    torch.set_num_threads(n)
    yield g
    g.close()
