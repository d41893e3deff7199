"""Hybrid bench presets: the files load, the shapes are the advertised ones, and the greedy next
token wins by a clear logit margin (what the oracle drafter relies on in bf16)."""

from __future__ import annotations

import pytest
import torch

from replayssm.bench.hybrid_presets import HYBRID_PRESETS, parameter_count, random_hybrid_dir


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models; ``tests/conftest.py``)."""


KINDS = {"nemotron-h-tiny": {"mamba", "attention", "mlp", "moe"}, "qwen3-next-tiny": {"gdn", "attention"},
         "qwen3.5-tiny": {"gdn", "attention"}, "granite-4.0-h-tiny-smoke": {"mamba", "attention"}}


@pytest.mark.parametrize("preset", list(KINDS))
def test_tiny_hybrid_preset_loads_with_a_clear_greedy_margin(preset, tmp_path):
    from replayssm.models import load_model

    m = load_model(random_hybrid_dir(preset, str(tmp_path), gen_device="cpu"), device="cpu", dtype=torch.float32)
    assert m.config.model_type == HYBRID_PRESETS[preset][0]["model_type"]
    assert set(m.config.layer_kinds) == KINDS[preset]
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
    # Qwen3.5-4B: the text model (no vision tower), untied head: 4.84 B
    assert abs(parameter_count("qwen3.5-4b") / 1e9 - 4.84) < 0.01
    q = HYBRID_PRESETS["qwen3.5-4b"][0]["layer_types"]
    assert len(q) == 32 and [i for i, t in enumerate(q) if t == "full_attention"] == list(range(3, 32, 4))
    # Granite-4.0-H-Tiny: "7B total" on its model card
    assert abs(parameter_count("granite-4.0-h-tiny") / 1e9 - 6.94) < 0.01
    g = HYBRID_PRESETS["granite-4.0-h-tiny"][0]["layer_types"]
    assert len(g) == 40 and [i for i, t in enumerate(g) if t == "attention"] == [5, 15, 25, 35]


@pytest.mark.parametrize("preset,tiny", [("qwen3.5-4b", "qwen3.5-tiny"), ("granite-4.0-h-tiny", "granite-4.0-h-tiny-smoke")])
def test_bench_e2e_smoke_runs_the_tiny_twin(preset, tiny, tmp_path, monkeypatch):
    """``bench e2e --preset <4B preset> --smoke`` runs its tiny twin on the CPU: every decode and
    speculation row, oracle drafts accepted in full (accept 1.0), the ratios in the summary."""
    import json

    from replayssm.bench import common, e2e

    monkeypatch.setenv(common.RANDOM_MODEL_CACHE, str(tmp_path / "models"))
    assert e2e.main(["--preset", preset, "--smoke", "--skip-concurrency", "--no-plots", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "e2e.json").read_text())
    assert res["config"]["preset"] == tiny and tiny in res["config"]["model_desc"]
    assert {(r["mode"], r["batch"]) for r in res["throughput"]} == {(m, b) for m in ("recurrent", "replay") for b in (1, 4)}
    assert {r["mode"] for r in res["speculative"]} == {"recurrent", "replay"}
    assert all(r["mean_accepted_length"] == 4.0 for r in res["speculative"])   # num_tokens 4, all accepted
    assert all(r["generated"] == r["batch"] * 8 for r in res["throughput"] + res["speculative"])
    assert {"replay_vs_recurrent_B4", "replay_spec_vs_standard_B4"} <= set(res["summary"])


def test_family_presets_script_smoke(tmp_path, monkeypatch, capsys):
    """``scripts/gpu_family_presets.py`` on the tiny twins (CPU): every row measured, the
    speculative and replay outputs checked against their baselines, the JSON written."""
    import importlib.util
    import json
    from pathlib import Path

    from replayssm.bench import common

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_family_presets.py"
    spec = importlib.util.spec_from_file_location("gpu_family_presets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv(common.RANDOM_MODEL_CACHE, str(tmp_path / "models"))
    assert mod.main(["--presets", "qwen3.5-tiny,granite-4.0-h-tiny-smoke", "--device", "cpu", "--batches", "3",
                     "--spec-batch", "4", "--max-tokens", "6", "--policies", "adaptive,fixed"]) == 0
    res = json.loads((tmp_path / "family_presets.json").read_text())
    assert [p["preset"] for p in res["presets"]] == ["qwen3.5-tiny", "granite-4.0-h-tiny-smoke"]
    for p in res["presets"]:
        assert set(p["runs"]) == {"recurrent", "replay", "spec-adaptive", "spec-fixed"}
        assert set(p["runs"]["replay"]) == {"3", "4"} and set(p["runs"]["spec-fixed"]) == {"4"}
        assert all(r["mismatch"] == 0 and r["decode_tokens_per_s"] > 0 for rows in p["runs"].values()
                   for r in rows.values())
        assert p["runs"]["spec-fixed"]["4"]["mean_accepted_length"] > 1.0
        assert set(p["ratios"]) == {"replay_vs_recurrent_B3", "replay_vs_recurrent_B4", "spec_adaptive_vs_standard_B4",
                                    "spec_fixed_vs_standard_B4"}
    assert res["failed_checks"] == [] and "checks: all passed" in capsys.readouterr().out
