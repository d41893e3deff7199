"""`replayssm bench serve --smoke`: starts a server, drives Poisson load, writes JSON + PNG."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_bench_serve_smoke(tmp_path, capsys):
    from replayssm.bench.serve import main

    rc = main(["--smoke", "--configs", "replay+spec", "--request-rates", "16,inf", "--num-prompts", "6",
               "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "serve.json").read_text())
    rows = res["runs"]["replay+spec"]
    assert [r["rate"] for r in rows] == [16.0, "inf"]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["output_tokens"] == 6 * 8
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["p50_tpot_ms"] > 0
        assert r["mean_accepted_length"] > 1.5       # walk prompts: prompt lookup finds the continuation
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "replay+spec" in capsys.readouterr().out
