"""Tiny random transformers checkpoints shared by the model tests (built once per session)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import hf_utils as H  # noqa: E402

# name -> (builder, overrides).  Odd sizes everywhere; see hf_utils for the base configs.
SPECS = {
    # Mamba-2, one group (transformers' torch norm == mamba_ssm's grouped norm), 3 layers
    "mamba2": (H.tiny_mamba2, dict(num_hidden_layers=3)),
    # Mamba-2, 5 heads in... 3 groups impossible (5 % 3); use 6 heads / 3 groups, tied embeddings
    "mamba2_g3": (H.tiny_mamba2, dict(num_heads=6, head_dim=5, hidden_size=15, n_groups=3,
                                     tie_word_embeddings=True)),
    # Nemotron-H: Mamba (3 groups) + attention (GQA) + relu2 MLP + grouped sigmoid MoE
    "nemotron_h": (H.tiny_nemotron_h, dict(hybrid_override_pattern="M*-EM")),
    # Nemotron-H without MoE, attention first, one group, latent-free
    "nemotron_h_dense": (H.tiny_nemotron_h, dict(hybrid_override_pattern="*M-M", n_groups=1,
                                                 tie_word_embeddings=True)),
    # Qwen3-Next: GDN with GVA (2 key heads, 4 value heads), gated attention, MoE + shared expert
    "qwen3_next": (H.tiny_qwen3_next, dict()),
    # Qwen3-Next: dense MLP layers (mlp_only_layers), attention in the middle, 1:3 GVA, tied
    "qwen3_next_dense": (H.tiny_qwen3_next, dict(num_hidden_layers=4, full_attention_interval=3,
                                                 linear_num_key_heads=1, linear_num_value_heads=3,
                                                 mlp_only_layers=[0, 2], decoder_sparse_step=1,
                                                 partial_rotary_factor=0.5, tie_word_embeddings=True)),
    # variants exercising optional weights / clamps (parity only)
    "mamba2_opts": (H.tiny_mamba2, dict(use_bias=True, use_conv_bias=False, residual_in_fp32=True,
                                        time_step_limit=(0.02, 0.06), num_hidden_layers=1)),
    "nemotron_h_opts": (H.tiny_nemotron_h, dict(hybrid_override_pattern="ME*", use_bias=True, mlp_bias=True,
                                                moe_latent_size=5, time_step_min=0.05, norm_topk_prob=False,
                                                n_group=1, use_conv_bias=False)),
    "qwen3_next_opts": (H.tiny_qwen3_next, dict(num_hidden_layers=2, attention_bias=True,
                                                norm_topk_prob=False, num_experts_per_tok=3)),
}


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
def _one_thread():
    """Tiny matmuls: one intra-op thread is ~1000x faster than two on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
