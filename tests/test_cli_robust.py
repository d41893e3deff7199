"""Command-line robustness: limits before allocation, clear errors instead of tracebacks,
the router's defaults, and a long KV-only prompt on the shipped model staying fast."""

from __future__ import annotations

import time

import pytest

from replayssm import cli as top
from replayssm.bench import traffic
from replayssm.engine import cli

SHIPPED = (cli.DEFAULT_MODEL / "config.json").is_file()
needs_model = pytest.mark.skipif(not SHIPPED, reason="shipped model not present")


@pytest.fixture
def no_llm(monkeypatch):
    """Record the LLM the command would build, then stop (nothing is allocated)."""
    seen = {}

    class Stop(cli.LLM):
        def __init__(self, model, **kw):
            seen.update(kw)
            raise ValueError("stopped by the test before building the engine")

    monkeypatch.setattr(cli, "LLM", Stop)
    return seen


# ---------------------------------------------------------------------------- limits
@needs_model
@pytest.mark.parametrize("mode", ["kv", "auto", "replay"])
def test_huge_max_tokens_leaves_the_context_to_the_engine(no_llm, mode):
    """A request larger than any context builds the engine at ``max_seq_len=None``: the
    model's context, lowered to what memory holds (the engine's one rule)."""
    assert cli.main(["def f():", "--max-tokens", "1000000000", "--mode", mode]) == 2
    assert no_llm["max_seq_len"] is None


@needs_model
def test_max_seq_len_option_sets_the_limit(no_llm, capsys):
    assert cli.main(["def f():", "--max-tokens", "50", "--max-seq-len", "100"]) == 2
    assert no_llm["max_seq_len"] == 64          # the request sized: prompt + max tokens, to 64s
    assert cli.main(["def f():", "--max-tokens", "500", "--max-seq-len", "100"]) == 2
    assert no_llm["max_seq_len"] == 100
    assert cli.main(["x" * 200, "--max-seq-len", "100"]) == 2
    assert "does not fit the context limit of 100 tokens" in capsys.readouterr().err


@needs_model
def test_max_tokens_clipped_to_the_engines_context(capsys):
    """The limit counts prompt + generated tokens (9 + 91 = 100), the note says where it
    came from."""
    assert cli.main(["def f():", "--max-tokens", "500", "--max-seq-len", "100"]) == 0
    err = capsys.readouterr().err
    assert "--max-tokens 500 clipped to 91: the context limit is 100 tokens" in err
    assert "91 tokens in" in err


@needs_model
def test_oversized_tree_fails_fast(capsys):
    t0 = time.perf_counter()
    assert cli.main(["def f():", "--speculative", "tree", "--tree-width", "50", "--num-tokens", "50"]) == 2
    assert time.perf_counter() - t0 < 5
    assert "tree_width 50 x depth 50 = 2500 draft tokens per step; at most 127" in capsys.readouterr().err


# ---------------------------------------------------------------------------- clear errors
@pytest.mark.parametrize("argv, match", [
    (["def \udcff():"], "PROMPT is not valid UTF-8: byte 0xff at character 4"),
    (["x\ud800"], "PROMPT is not valid Unicode: lone surrogate U+D800 at character 1"),
    (["x", "--device", "tpu"], "device 'tpu' is not a device torch knows"),
    (["x", "--device", "meta"], "device 'meta' holds no data"),
])
def test_bad_input_is_a_clear_error(no_llm, capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("replayssm generate: error: ") and match in err and "Traceback" not in err


@needs_model
@pytest.mark.parametrize("argv, match", [
    (["--token-ids", "1,2,300"], "--token-ids token id 300 at position 2 is out of range"),
    (["--token-ids", "1,2.5"], "--token-ids must be comma-separated integers, got '1,2.5'"),
])
def test_bad_token_ids_are_clear_errors(no_llm, capsys, argv, match):
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["x", "--max-tokens", "0"], "argument --max-tokens: must be a positive int, got 0"),
    (["x", "--buffer-size", "-1"], "argument --buffer-size: must be a positive int, got -1"),
    (["x", "--seed", "s"], "argument --seed: invalid int value"),
])
def test_bad_numbers_are_usage_errors(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--d", "-5", "--n", "4"], "argument --d: must be a positive int, got -5"),
    (["--buffer-size", "0"], "argument --buffer-size: must be a positive int, got 0"),
    (["--key-share", "x"], "argument --key-share: invalid int value: 'x'"),
])
def test_traffic_bad_numbers_are_usage_errors(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        traffic.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


@needs_model
def test_cuda_graphs_on_cpu_warns(no_llm, capsys):
    cli.main(["def f():", "--cuda-graphs", "--max-tokens", "2"])
    assert "warning: --cuda-graphs needs a CUDA device; ignored on cpu" in capsys.readouterr().err
    assert no_llm["cuda_graphs"] is False


# ---------------------------------------------------------------------------- router
def test_bench_help_lists_the_benchmarks(capsys):
    assert top.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("  ")]
    assert {ln.split()[0] for ln in lines} >= {"kernels", "e2e"}
    assert all(len(ln.split()) > 1 for ln in lines)          # one line of help each
    assert top.main(["bench"]) == 2
    assert top.main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_a_prompt_alone_runs_generate(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "DEFAULT_MODEL", tmp_path / "absent")
    assert top.main(["def f():"]) == 2                       # reached generate (no model there)
    assert "absent" in capsys.readouterr().err
    assert top.main(["--mode", "kv", "x"]) == 2
    assert "absent" in capsys.readouterr().err
    assert top.main(["generat", "x"]) == 2                   # a typo of a command is named
    assert "did you mean 'generate'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- long prompts
@needs_model
def test_long_kv_prompt_on_the_shipped_model_is_fast_and_shows_prefill_progress(capsys):
    """1500 tokens through the KV-only form at the layer level (the dense-mask form needed
    ~27 GB for this), with the prefill progress bar on stderr."""
    prompt = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(80))[:1500]
    t0 = time.perf_counter()
    assert cli.main([prompt, "--mode", "kv", "--max-tokens", "4"]) == 0
    elapsed = time.perf_counter() - t0
    cap = capsys.readouterr()
    assert cap.out.startswith(prompt) and len(cap.out) > len(prompt)
    assert "prefill 1501 tokens" in cap.err and "finish=length" in cap.err  # + the BOS token
    assert elapsed < 90, f"{elapsed:.1f} s"
