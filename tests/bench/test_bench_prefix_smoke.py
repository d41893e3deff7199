"""`replayssm bench e2e --smoke --workload shared-prefix,chat --prefix-memory`: prefix caching
off vs on on a tiny model (CPU), and memory per cached token, ours vs state-per-block."""

import json

import pytest


def test_bench_prefix_smoke(tmp_path, capsys):
    from replayssm.bench.e2e import main

    pytest.importorskip("matplotlib")
    rc = main(["--smoke", "--workload", "shared-prefix,chat", "--prefix-memory", "--memory-presets",
               "2.7b,nemotron-h-4b", "--out", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "prefix_chat_ttft.png").stat().st_size > 1000     # chat TTFT per turn, off vs on
    res = json.loads((tmp_path / "prefix.json").read_text())
    runs = {(r["workload"], r["cache"]): r for r in res["runs"]}
    assert set(runs) == {("shared-prefix", "off"), ("shared-prefix", "on"), ("chat", "off"), ("chat", "prompts"),
                         ("chat", "on")}
    for (w, c), r in runs.items():
        on = c != "off"
        assert r["requests"] > 0 and r["output_tokens"] == r["requests"] * 8
        assert 0 < r["ttft_mean_ms"] and r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["output_tokens_per_s"] > 0
        assert (r["hit_rate"] > 0) == on
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["hit_tokens"]
        if on:
            assert r["bytes_per_cached_token"] > 0 and r["store_bytes"] > 0
    # smoke sizes: a 40-token system prompt + 6-token questions, blocks of 16: the first
    # request caches the system prompt's 2 whole blocks, the 3 others resume at token 32
    sp = runs[("shared-prefix", "on")]
    assert sp["requests"] == 3 and sp["hit_tokens"] == 3 * 32 and sp["prompt_tokens"] == 3 * 46
    assert sp["hit_rate"] == pytest.approx(96 / (4 * 46))    # the cold first request is looked up too
    # chat: with replies cached a turn prefills only its new message (the last answer token
    # too: it was never fed), with prompts only also the previous answer and prompt tail
    chat = {c: runs[("chat", c)]["prefilled_per_turn"] for c in ("off", "prompts", "on")}
    conv, turn_len = res["config"]["conversations"], res["config"]["turn_len"]
    assert chat["on"][1:] == [conv * (turn_len + 1)] * (len(chat["on"]) - 1)
    assert all(a < b < c for a, b, c in zip(chat["on"][1:], chat["prompts"][1:], chat["off"][1:]))
    # greedy outputs with caching on are those with caching off (fp32 on CPU)
    assert res["summary"]["shared-prefix_same_output_frac"] == 1.0 and res["summary"]["chat_same_output_frac"] == 1.0
    mem = json.loads((tmp_path / "prefix_memory.json").read_text())
    assert [m["preset"] for m in mem] == ["2.7b", "nemotron-h-4b"]
    for m in mem:
        assert abs(m["ours_analytic"] - m["ours_measured"]) < 1e-6 * m["ours_measured"]
        for v in m["state_per_block"].values():
            assert abs(v["analytic"] - v["measured"]) < 1e-6 * v["measured"]
        assert m["state_per_block"]["16"]["measured"] > m["ours_measured"]   # a state per 16 tokens costs more
    out = capsys.readouterr().out
    assert "memory per cached token" in out and "shared-prefix" in out and "chat" in out
