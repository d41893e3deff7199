"""``scripts/state_dtype_drift.py`` runs end to end (a few tokens) and reports what the docs
quote: per model / form / state dtype, logits drift and greedy agreement."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from replayssm.engine.cli import DEFAULT_MODEL

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "state_dtype_drift.py"


@pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="shipped model not present")
def test_drift_script_smoke(tmp_path, one_thread):
    spec = importlib.util.spec_from_file_location("state_dtype_drift", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "drift.json"
    assert mod.main(["--tokens", "6", "--batch", "2", "--models", "shipped", "--modes", "replay,recurrent",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["state_dtype"]) for r in rows] == [("replay", "bfloat16"), ("replay", "float16"),
                                                              ("recurrent", "bfloat16"), ("recurrent", "float16")]
    for r in rows:
        # 16-bit states change the logits a little, never by much over 6 tokens
        assert 0 < r["max_abs"] and r["max_rel"] < 1e-2 and r["max_abs"] >= r["mean_abs"]
        assert 0 <= r["greedy_agreement"] <= 1 and r["tokens"] == 6
