"""`replayssm generate` and `replayssm bench e2e --smoke`."""

import json
import os

import pytest

from replayssm import cli as top
from replayssm.engine import cli


def test_missing_shipped_model_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "DEFAULT_MODEL", tmp_path / "no-such-model")
    assert cli.main(["hello"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "--model" in err


def test_bad_arguments(tmp_path, capsys):
    assert cli.main(["--model", str(tmp_path), "hi"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "PROMPT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["hi", "--mode", "fast"])
    # flags that one would silently drop are refused together
    assert cli.main(["hi", "--token-ids", "1,2"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["hi", "--draft-model", str(tmp_path)]) == 2
    assert "--speculative draft or tree only" in capsys.readouterr().err


def test_router_reaches_generate(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "DEFAULT_MODEL", tmp_path / "absent")
    assert top.main(["generate", "hello"]) == 2
    assert "absent" in capsys.readouterr().err


def test_bench_e2e_smoke(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from replayssm.bench import e2e

    assert e2e.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "e2e.json").read_text())
    assert {r["mode"] for r in res["throughput"]} == {"recurrent", "replay"}
    assert {r["mode"] for r in res["speculative"]} == {"recurrent", "replay"}
    assert all(r["mean_accepted_length"] >= 1 for r in res["speculative"])
    conc = {r["label"]: r for r in res["concurrency"]}
    assert conc["replay+spec"]["max_sequences"] > conc["snapshot+spec"]["max_sequences"]
    for r in res["concurrency"]:
        if "observed_peak_batch" in r:
            assert r["observed_peak_batch"] == r["max_sequences"]
    for f in ("e2e_throughput.png", "e2e_speculative.png", "e2e_concurrency.png"):
        assert (tmp_path / f).stat().st_size > 1000
    assert "tok/s" in capsys.readouterr().out


def test_bench_e2e_prefill_workload_smoke(tmp_path, capsys):
    """TTFT rows for every (length, batch); the mixed run finishes every request in full with
    chunked prefill on and off (tiny budget: 16 tokens a step, so prompts of 40 take 3 chunks)."""
    from replayssm.bench import e2e

    assert e2e.main(["--smoke", "--workload", "prefill", "--no-plots", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "prefill.json").read_text())
    assert [(r["prompt_len"], r["batch"]) for r in res["ttft"]] == [(24, 1), (24, 3), (40, 1), (40, 3)]
    assert all(0 < r["ttft_min_ms"] <= r["ttft_mean_ms"] <= r["ttft_max_ms"] for r in res["ttft"])
    assert [r["prefill"] for r in res["mixed"]] == ["chunked", "whole"]
    assert all(r["tokens"] == 3 * 12 + 2 * 16 for r in res["mixed"])
    assert res["mixed"][0]["max_num_batched_tokens"] == 16 and res["mixed"][1]["max_num_batched_tokens"] >= 2 * 40
    assert "TTFT" in capsys.readouterr().out


@pytest.mark.skipif(not (cli.DEFAULT_MODEL / "config.json").is_file(), reason="shipped model not present")
@pytest.mark.parametrize("extra", [[], ["--speculative", "draft"], ["--speculative", "tree", "--mode", "auto"],
                                   ["--speculative", "ngram", "--mode", "kv"], ["--async-scheduling"]])
def test_generate_with_shipped_model(capsys, extra):
    if "draft" in extra or "tree" in extra:
        if not (cli.DEFAULT_DRAFT / "config.json").is_file():
            pytest.skip("shipped draft model not present")
    assert cli.main(["def add(a, b):", "--max-tokens", "12", *extra]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("def add(a, b):")
    assert "tokens/s" in cap.err and "mean accepted length" in cap.err


@pytest.mark.skipif(not (cli.DEFAULT_MODEL / "config.json").is_file(), reason="shipped model not present")
def test_shipped_model_greedy_is_the_same_in_every_configuration():
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    outs = set()
    draft = str(cli.DEFAULT_DRAFT) if (cli.DEFAULT_DRAFT / "config.json").is_file() else None
    configs = [("replay", None), ("recurrent", None), ("auto", None), ("replay", SpeculativeConfig("ngram", 3)),
               ("async", None)]
    if draft:
        configs += [("replay", SpeculativeConfig("draft", 3, draft_model=draft)),
                    ("recurrent", SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=2))]
    for mode, sp in configs:
        asy = mode == "async"   # replay with async scheduling
        llm = LLM(str(cli.DEFAULT_MODEL), dtype="float64", decode_mode="replay" if asy else mode, speculative=sp,
                  max_seq_len=128, auto_threshold=24, async_scheduling=asy)
        o = llm.generate(["def fibonacci(n):\n    "], SamplingParams(max_tokens=24))[0]
        outs.add(tuple(o.token_ids))
    assert len(outs) == 1


def test_bench_random_model_has_a_clear_greedy_margin(tmp_path):
    """The bench's random model predicts its next token by a wide logit margin (its lm_head
    permutes the embeddings), so a precomputed greedy continuation survives rounding
    differences between decode and verify paths (the oracle drafter relies on it)."""
    import torch

    models = pytest.importorskip("replayssm.models")
    from replayssm.bench.e2e import _random_model_dir

    m = models.load_model(_random_model_dir("tiny", str(tmp_path)), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(0))
    logits = m(ids)
    top = logits.topk(2, -1).values
    margin = (top[..., 0] - top[..., 1]) / logits.std(-1)
    assert float(margin.min()) > 0.5  # bf16 rounding moves logits by ~1e-2 std


def test_a_benchmarks_bad_setting_is_a_message(tmp_path, capsys):
    """``replayssm bench ...`` with a value only the benchmark can check: exit 2 and one line."""
    assert top.main(["bench", "prefill", "--families", "bogus", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "replayssm bench prefill: error: --families: unknown ['bogus']" in err and "Traceback" not in err


@pytest.mark.skipif(not (cli.DEFAULT_MODEL / "config.json").is_file(), reason="shipped model not present")
@pytest.mark.parametrize("extra", [[], ["--speculative", "ngram", "--num-tokens", "4"]])
def test_generate_and_llm_agree_on_the_context(capsys, extra):
    """--max-seq-len counts prompt + generated tokens with or without speculation, exactly as
    LLM(max_seq_len=...) does: a prompt of max_seq_len - 1 tokens gets one token, one more is refused."""
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    L = 48
    ids = ",".join(str(5 + j % 50) for j in range(L - 1))
    assert cli.main(["--token-ids", ids, "--max-seq-len", str(L), "--max-tokens", "8", "--ignore-eos", *extra]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 1 and "clipped to 1" in cap.err and "finish=length" in cap.err
    assert cli.main(["--token-ids", ids + ",7", "--max-seq-len", str(L), *extra]) == 2
    err = capsys.readouterr().err
    assert f"the prompt has {L} tokens" in err and f"context limit of {L} tokens" in err
    sp = SpeculativeConfig("ngram", num_tokens=4) if extra else None
    llm = LLM(str(cli.DEFAULT_MODEL), max_seq_len=L, speculative=sp, max_num_seqs=1)
    prompt = [5 + j % 50 for j in range(L - 1)]
    out = llm.generate([prompt, prompt + [7]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 1 and out[1].finish_reason == "error" and f"max_seq_len={L}" in out[1].error


def test_torch_threads_flag_and_default(monkeypatch, tmp_path, capsys):
    import torch

    n = cli.default_torch_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0, 0.0, 0.0))   # a saturated machine: one thread
    assert cli.default_torch_threads() == 1
    assert "--torch-threads" in cli.build_parser().format_help()
    seen = []
    monkeypatch.setattr(cli, "_generate", lambda args: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    assert cli.main(["hi", "--torch-threads", "3"]) == 0 and seen == [3]
    assert cli.main(["hi"]) == 0 and seen[-1] == 1                       # the default, under that load
    assert torch.get_num_threads() == before                            # restored for an in-process caller
