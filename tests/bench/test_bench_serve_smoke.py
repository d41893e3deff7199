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
        assert r["engine_steps"] >= 8 / 5 and 0 <= r["slow_steps"] <= r["engine_steps"]   # from the step histogram
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "replay+spec" in capsys.readouterr().out


def test_step_counts_read_the_step_histogram():
    from replayssm.bench.serve import SLOW_STEP_S, step_counts

    name = "replayssm:engine_step_seconds"
    before = {f"{name}_count": 10.0, f"{name}_bucket{{le={SLOW_STEP_S}}}": 9.0}
    after = {f"{name}_count": 30.0, f"{name}_bucket{{le={SLOW_STEP_S}}}": 26.0}
    assert step_counts(before, after) == (20, 3)


@pytest.mark.parametrize("preset,model_type", [("nemotron-h-tiny", "nemotron_h"), ("qwen3-next-tiny", "qwen3_next")])
def test_hybrid_preset_loads_and_its_greedy_step_is_a_token_map(tmp_path, preset, model_type):
    """The random hybrid checkpoint bench serve writes loads, and its greedy next token depends
    on the current token only (what the benchmark's walk prompts rely on)."""
    import torch

    from replayssm.bench.e2e import _random_model_dir
    from replayssm.models import load_model

    model = load_model(_random_model_dir(preset, str(tmp_path)))
    assert model.config.model_type == model_type
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 256, (8, 12), generator=g)
    ctx[:, -1] = ctx[0, -1]                       # different contexts, the same last token
    nxt = model(ctx)[:, -1].argmax(-1)
    assert (nxt == nxt[0]).all()


def test_early_stop_requests_stop_at_the_drawn_walk_position():
    """--stop-at: each request keeps its max_tokens but carries the walk's token at the
    drawn position as its stop token; positions past the known continuation are refused."""
    from replayssm.bench.serve import early_stop_request

    walk = list(range(100, 140))          # a walk of 40 distinct tokens
    prompt, out_len, stop = early_stop_request(walk, a=10, k=3, stop_pos=5, out_len=64)
    assert prompt == walk[:10] + walk[:3] and out_len == 64
    assert stop == [walk[3 + 5 - 1]]      # the continuation is walk[3:]: its 5th token
    with pytest.raises(ValueError, match="past the walk"):
        early_stop_request(walk, a=10, k=3, stop_pos=38, out_len=64)


@pytest.mark.parametrize("bad", ["0,4", "5,4", "x", "1,2,3"])
def test_stop_at_refuses_bad_ranges(bad):
    from replayssm.bench.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--stop-at", bad])


def test_bench_serve_early_stop_smoke(tmp_path):
    """The early-stop workload end to end: every request asks for the smoke run's 8 tokens
    and stops within [2, 6] (greedy walks of the random model)."""
    from replayssm.bench.serve import main

    rc = main(["--smoke", "--configs", "replay", "--request-rates", "inf", "--num-prompts", "6",
               "--output-len", "16", "--stop-at", "2,6", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "serve.json").read_text())
    (row,) = res["runs"]["replay"]
    assert row["completed"] == 6 and row["failed"] == 0
    assert 6 <= row["output_tokens"] <= 6 * 6       # each stopped at its drawn position or before
    assert main(["--smoke", "--prompt-kind", "random", "--stop-at", "2,6", "--out", str(tmp_path)]) == 2
    assert main(["--smoke", "--output-len", "4", "--stop-at", "2,6", "--out", str(tmp_path)]) == 2
