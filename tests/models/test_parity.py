"""Logits parity with transformers' own implementations (float64 within 1e-8)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_utils as H
from hf_utils import SPECS

ALL = [n for n in SPECS if n != "mamba2_g3"]  # n_groups > 1: see test_mamba2_grouped_norm


@pytest.mark.parametrize("name", ALL)
def test_float64_logits_match_transformers(name, tiny, ours):
    hf, _ = tiny(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=g)
    ref = H.hf_logits(copy.deepcopy(hf), ids)
    got = ours(name)(ids)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-8


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_float32_logits_close_to_transformers(name, tiny, ours):
    hf, _ = tiny(name)
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(name, "float32")(ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-4


def test_mamba2_grouped_norm(tiny, ours, monkeypatch):
    """n_groups > 1: transformers' torch ``MambaRMSNormGated`` normalises the whole
    intermediate vector, mamba_ssm (the checkpoints' origin) normalises each of the
    n_groups groups.  We follow mamba_ssm: equal to transformers with a grouped norm patched
    in, and measurably different from the unpatched transformers path."""
    from transformers.models.mamba2 import modeling_mamba2 as mm

    hf, _ = tiny("mamba2_g3")
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    got = ours("mamba2_g3")(ids)
    plain = H.hf_logits(copy.deepcopy(hf), ids)
    G = hf.config.n_groups

    def grouped(self, hidden_states, gate=None):
        dt = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * torch.nn.functional.silu(gate.to(torch.float32))
        shp = h.shape
        h = h.view(*shp[:-1], G, shp[-1] // G)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.view(shp).to(dt)

    monkeypatch.setattr(mm.MambaRMSNormGated, "forward", grouped)
    ref = H.hf_logits(copy.deepcopy(hf), ids)
    assert (got - ref).abs().max().item() < 1e-8
    assert (got - plain).abs().max().item() > 1e-6


def test_bfloat16_and_float16_load_and_run(tiny, ours):
    hf, _ = tiny("qwen3_next")
    ids = torch.randint(0, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    ref = ours("qwen3_next", "float64")(ids)
    for dt in ("bfloat16", "float16"):
        m = ours("qwen3_next", dt)
        assert m.embed_weight().dtype == getattr(torch, dt)
        got = m(ids)
        assert torch.isfinite(got).all()
        assert (got.double() - ref).abs().max().item() < 0.1


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next_dense"])
def test_greedy_generate_matches_transformers(name, tiny, ours):
    hf, _ = tiny(name)
    model = ours(name)
    prompt = torch.randint(0, hf.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    n_new = 8
    hf64 = copy.deepcopy(hf).to(torch.float64)
    with torch.no_grad(), H.Float32AsFloat64():
        out = hf64.generate(prompt, max_new_tokens=n_new, do_sample=False, pad_token_id=0,
                            eos_token_id=None, use_cache=True)
    ref = out[0, prompt.shape[1]:].tolist()
    cache = model.make_cache(2, mode="replay", buffer_size=3, max_seq_len=32)
    slots = torch.tensor([1])
    lg = model.prefill(cache, slots, prompt, torch.tensor([prompt.shape[1]]))
    toks = []
    for _ in range(n_new):
        t = lg.argmax(-1)
        toks.append(int(t))
        lg = model.decode(cache, slots, t)
    assert toks == ref
