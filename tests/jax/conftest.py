"""JAX backend tests: skipped when jax is not importable.  64-bit JAX is on for the whole
(JAX) session so float64 models work; float32 models stay float32 (every array the backend
makes has an explicit dtype).  XLA's CPU backend is told to spend little time optimising:
compile time dominates these tests and the numbers do not change.  Two host CPU devices
(``--xla_force_host_platform_device_count=2``) serve the sharded tests."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    # two host CPU devices for the sharded tests (read when jax's CPU backend starts: before any test)
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
try:
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # the test modules skip themselves
    jax = None

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """``hf_model_dir(name, **overrides) -> path`` of a tiny random transformers checkpoint
    (``tests/models/hf_utils.SPECS``, config fields overridden), built once per session."""
    import torch

    import hf_utils as H

    root = tmp_path_factory.mktemp("jax_tiny_models")
    cache = {}

    def get(name, **extra):
        key = name + "".join(f"-{k}={v}" for k, v in sorted(extra.items()))
        if key not in cache:
            fn, over = H.SPECS[name]
            over = {**over, **extra}
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
                    cache[key] = H.save_tiny(m, str(root / key))
            finally:
                torch.set_num_threads(n)
        return cache[key]

    return get
