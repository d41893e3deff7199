"""JAX backend tests: skipped when jax is not importable.  64-bit JAX is on for the whole
(JAX) session so float64 models work; float32 models stay float32 (every array the backend
makes has an explicit dtype).  XLA's CPU backend is told to spend little time optimising:
compile time dominates these tests and the numbers do not change."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
try:
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # the test modules skip themselves
    jax = None

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """``hf_model_dir(name) -> path`` of a tiny random transformers checkpoint
    (``tests/models/hf_utils.SPECS``), built once per session."""
    import torch

    import hf_utils as H

    root = tmp_path_factory.mktemp("jax_tiny_models")
    cache = {}

    def get(name):
        if name not in cache:
            fn, over = H.SPECS[name]
            over = dict(over)
            prf = over.pop("partial_rotary_factor", None)
            if prf is not None:
                over["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": prf}
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                m = fn(seed=len(name), **over)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cache[name] = H.save_tiny(m, str(root / name))
            finally:
                torch.set_num_threads(n)
        return cache[name]

    return get
