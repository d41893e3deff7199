"""Tiny random transformers checkpoints shared by the model tests (built once per session)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import hf_utils as H  # noqa: E402

SPECS = H.SPECS


def _build(name, tmp_root):
    fn, over = SPECS[name]
    over = dict(over)
    prf = over.pop("partial_rotary_factor", None)
    if prf is not None:
        over["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf}
    m = fn(seed=len(name), **over)
    path = os.path.join(tmp_root, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        H.save_tiny(m, path)
    return m, path


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny(tiny_root):
    """``tiny(name) -> (hf_model, path)``, built lazily and cached for the session."""
    cache = {}

    def get(name):
        if name not in cache:
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[name] = _build(name, tiny_root)
            finally:
                torch.set_num_threads(n)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def ours(tiny):
    """``ours(name, dtype="float64") -> replayssm model`` (cached)."""
    from replayssm.models import load_model

    cache = {}

    def get(name, dtype="float64"):
        key = (name, dtype)
        if key not in cache:
            cache[key] = load_model(tiny(name)[1], dtype=dtype)
        return cache[key]

    return get


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny matmuls; ``tests/conftest.py``)."""
