"""Hybrid bench presets: the files load, the shapes are the advertised ones, and the greedy next
token wins by a clear logit margin (what the oracle drafter relies on in bf16)."""

from __future__ import annotations

import pytest
import torch

from replayssm.bench.hybrid_presets import HYBRID_PRESETS, parameter_count, random_hybrid_dir


@pytest.mark.parametrize("preset", ["nemotron-h-tiny", "qwen3-next-tiny"])
def test_tiny_hybrid_preset_loads_with_a_clear_greedy_margin(preset, tmp_path):
    from replayssm.models import load_model

    m = load_model(random_hybrid_dir(preset, str(tmp_path), gen_device="cpu"), device="cpu", dtype=torch.float32)
    kinds = set(m.config.layer_kinds)
    assert kinds == ({"mamba", "attention", "mlp", "moe"} if preset.startswith("nemotron") else {"gdn", "attention"})
    ids = torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(0))
    logits = m(ids)
    top = logits.topk(2, -1).values
    margin = (top[..., 0] - top[..., 1]) / logits.std(-1)
    assert float(margin.min()) > 0.5


def test_4b_presets_have_the_advertised_size():
    assert abs(parameter_count("nemotron-h-4b") / 1e9 - 3.97) < 0.01   # NVIDIA-Nemotron-3-Nano-4B
    assert 3.5 < parameter_count("qwen3-next-4b") / 1e9 < 4.2
    cfg = HYBRID_PRESETS["nemotron-h-4b"][0]
    assert cfg["hybrid_override_pattern"].count("*") == 4 and len(cfg["hybrid_override_pattern"]) == 42
