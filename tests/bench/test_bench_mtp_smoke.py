"""``replayssm bench mtp --smoke``: every drafter's path runs on the CPU (a tiny random Mamba-2
with a random MTP head in its checkpoint layout) and the table's rows are consistent."""

from __future__ import annotations

import json

from replayssm.bench import common, mtp


def test_bench_mtp_smoke(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "models"   # the random models come from the cache; the head goes into a copy
    monkeypatch.setenv(common.RANDOM_MODEL_CACHE, str(cache))
    rc = mtp.main(["--smoke", "--preset", "tiny", "--batch-sizes", "2", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "mtp_bench.json").read_text())["rows"]
    assert [r["drafter"] for r in rows] == ["none", "ngram", "draft", "mtp"]
    spec = [r for r in rows if r["drafter"] != "none"]
    # the oracle's tokens are verified whatever drafts: the same acceptance for every drafter
    assert len({round(r["mean_accepted_length"], 6) for r in spec}) == 1
    assert spec[0]["mean_accepted_length"] > 1.0
    assert all(r["draft_steps"] > 0 and r["draft_ms_per_step"] > 0 for r in spec)
    assert all(r["draft_steps"] <= r["steps"] for r in spec)     # warm-up steps are not timed
    # the policy and its choices: speculative steps are those the drafter was timed in
    assert all(r["spec_policy"] == "adaptive" for r in spec)
    assert all(sum(n for T, n in r["draft_lengths"].items() if int(T)) == r["draft_steps"] for r in spec)
    assert rows[0]["mean_accepted_length"] == 1.0
    assert "mtp" in capsys.readouterr().out
    cached = sorted(p.name for p in cache.iterdir())
    assert cached and all(not (cache / d / "mtp.safetensors").exists() for d in cached)
