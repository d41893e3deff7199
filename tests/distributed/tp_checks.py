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


def assert_bf16_states_on_every_rank(ref, tp, mode: str) -> None:
    """A 16-bit state spec is every rank's: through a prefill of two rows and three decode
    steps (in ``kv`` mode the rows first switch to a state), the split model's logits equal
    the one-rank model's with the same bf16 states and differ from float64 states'."""
    from replayssm.cache.spec import CacheSpec

    spec = CacheSpec(mode=mode, max_seq_len=32, block_size=4, max_new=2, ssm_state_dtype="bfloat16")
    c1, c2, c3 = ref.make_cache(3, spec), tp.make_cache(3, spec), ref.make_cache(3, spec, ssm_state_dtype="auto")
    assert c2.spec.ssm_state_dtype == "bfloat16" and c2.state_dtype == torch.bfloat16
    runs = ((ref, c1), (tp, c2), (ref, c3))
    slots, ids, lens = torch.tensor([1, 2]), torch.tensor([[3, 4, 5, 9], [6, 1, 0, 0]]), torch.tensor([4, 2])
    outs = [[m.prefill(c, slots, ids, lens)] for m, c in runs]
    if mode == "kv":
        for _, c in runs:
            c.switch_to_state([1, 2])      # KV-only -> a bf16 state on every rank
    for t in ([7, 8], [2, 3], [4, 4]):
        for o, (m, c) in zip(outs, runs):
            o.append(m.decode(c, slots, torch.tensor(t)))
    one, split, f64 = (torch.stack(o) for o in outs)
    torch.testing.assert_close(split, one, rtol=0, atol=1e-10)
    assert (one - f64).abs().max() > 1e-9
