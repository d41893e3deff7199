"""Checks and checkpoints shared by the tensor-parallel family tests (CPU, gloo)."""

from __future__ import annotations

import warnings

import torch


def save_tiny_specs(root, specs: dict, seed: int) -> dict:
    """``{name: directory}``: each ``specs[name] = (builder, overrides)`` tiny transformers
    model (seed ``seed + i``) saved in Hugging Face layout under ``root / name``."""
    import hf_utils as H   # tests/models, put on sys.path by the test modules

    out = {}
    for i, (name, (fn, over)) in enumerate(specs.items()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = H.save_tiny(fn(seed=seed + i, **over), str(root / name))
    return out


def assert_forward_matches(ref, tp, atol: float) -> None:
    """The sharded model's full forward over a ``[2, 9]`` batch of random ids equals the
    one-rank model's (logits ``[2, 9, V]``, ``rtol=0``)."""
    V = ref.config.vocab_size
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    a, b = ref(ids), tp(ids)
    assert b.shape == a.shape == (2, 9, V)
    torch.testing.assert_close(b, a, rtol=0, atol=atol)
