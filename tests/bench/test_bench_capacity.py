"""``bench serve --preemption-modes``: admission policies compared at equal memory through
the real server (``replayssm/bench/capacity.py``)."""

import dataclasses
import json
import math

import pytest

from replayssm.bench.capacity import (BudgetPlan, concurrency, engine_config, gauge_values, lost, meta_model,
                                      plan_budget, size_budget)
from replayssm.bench.serve import Result, build_parser, main


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from replayssm.bench.e2e import _random_model_dir

    return _random_model_dir("nemotron-h-tiny", str(tmp_path_factory.mktemp("capacity")))


def _args(*extra):
    return build_parser().parse_args(["--max-seq-len", "256", *extra])


# ---- the memory plan against the engine's own ------------------------------------------------------
@pytest.mark.parametrize("mode,spec,slots,seqs,worst", [("replay", False, 5, 2, 112), ("kv", False, 3, 3, 50),
                                                        ("replay", True, 4, 1, 77)])
def test_sized_budget_is_what_the_engine_plans(hybrid_dir, mode, spec, slots, seqs, worst):
    """--budget-seqs: the engine built with the budget has the slots asked for and block pools
    of exactly ``seqs`` worst-case reservations; worst-case reservation then admits ``seqs``
    long requests and no more, and off-fit's slot count is the most whose worst cases fit."""
    from replayssm import LLM, SamplingParams

    args = _args("--num-tokens", "3", "--kv-block-size", "8")
    model = meta_model(hybrid_dir, "float32")
    ec = engine_config(args, mode, spec, slots, None)
    bp = size_budget(model, ec, worst, seqs)
    assert bp.slots == slots and bp.pool == seqs * bp.worst_bytes and bp.worst_case_seqs == seqs
    kw = dict(dtype="float32", decode_mode=mode, max_seq_len=256, kv_block_size=8, memory_budget=bp.budget,
              speculative=ec.speculative)
    llm = LLM(hybrid_dir, max_num_seqs=slots, preemption_mode="off", **kw)
    assert llm.num_slots == slots and llm.blocks.pool_bytes == bp.pool
    assert llm.plan.memory.fixed == bp.fixed and llm.plan.memory.per_token == bp.per_token
    P = 10
    for i in range(slots):   # prompt P + max_tokens = worst: each reserves the worst case
        llm.add_request([(3 * i + j) % 200 for j in range(P)], SamplingParams(max_tokens=worst - P))
    llm.step()
    assert len(llm.scheduler.running) == seqs
    llm.close()
    fit = bp.fit_slots()
    room = bp.budget   # no prefix store
    assert fit * (bp.fixed + bp.worst_bytes) <= room < (fit + 1) * (bp.fixed + bp.worst_bytes)
    fitted = plan_budget(model, dataclasses.replace(ec, max_num_seqs=fit, memory_budget=bp.budget), worst)
    assert fitted.slots == fit and fitted.worst_case_seqs == fit


def test_budget_sizing_refuses_what_it_cannot_plan(hybrid_dir):
    from pathlib import Path

    tiny_mamba = str(Path(__file__).resolve().parents[2] / "replayssm" / "assets" / "tiny-mamba2")
    args = _args()
    with pytest.raises(ValueError, match="do not grow"):   # no attention, replay: nothing grows per token
        size_budget(meta_model(tiny_mamba, "float32"), engine_config(args, "replay", False, 4, None), 64, 2)
    with pytest.raises(ValueError, match=">= 1"):
        size_budget(meta_model(hybrid_dir, "float32"), engine_config(args, "replay", False, 4, None), 64, 0)
    with pytest.raises(ValueError, match="drafter cache"):
        engine_config(_args("--spec-method", "draft"), "replay", True, 4, None)
    with pytest.raises(ValueError, match="max-seq-len"):
        plan_budget(meta_model(hybrid_dir, "float32"),
                    engine_config(build_parser().parse_args([]), "replay", False, 4, 1 << 30), 64)


def test_fit_slots_by_hand():
    # 10 000 bytes: slots of 1 000 fixed, worst case 1 500 -> 4 slots (4 x 2 500); pool of 8 slots: 2 000
    bp = BudgetPlan(budget=10_000, slots=8, fixed=1_000, per_token=10, block_size=10, pool=2_000, blocks=20,
                    worst_tokens=140, worst_bytes=1_500)
    assert bp.worst_case_seqs == 1 and bp.fit_slots() == 4
    assert BudgetPlan(100, 1, 90, 1, 1, 10, 10, 9, 1_000).fit_slots() == 1     # at least one slot


# ---- sampling and completeness ---------------------------------------------------------------------
def test_concurrency_holds_each_sample_until_the_next():
    samples = [(0.0, 0, 5), (1.0, 2, 3), (3.0, 4, 0)]
    c = concurrency(samples, 4.0)       # 0 for 1 s, 2 for 2 s, 4 for 1 s
    assert c["mean_running"] == pytest.approx(2.0) and c["peak_running"] == 4 and c["peak_waiting"] == 5
    assert c["num_samples"] == 3
    assert concurrency([(0.5, 3, 0)], 0.2)["mean_running"] == 3       # one sample past the end
    assert math.isnan(concurrency([], 1.0)["mean_running"])


def test_gauge_values_sum_label_sets_and_skip_comments():
    text = ("# HELP replayssm:num_requests_running Sequences\n# TYPE replayssm:num_requests_running gauge\n"
            'replayssm:num_requests_running{model_name="m"} 3.0\n'
            'replayssm:num_requests_running{model_name="n"} 2.0\n'
            'replayssm:num_requests_running_other{model_name="m"} 50.0\n'
            "replayssm:num_requests_waiting 7.0\n")
    assert gauge_values(text, ("replayssm:num_requests_running", "replayssm:num_requests_waiting")) == [5.0, 7.0]
    assert gauge_values("", ("replayssm:num_requests_running",)) == [0.0]


def test_a_request_is_lost_without_its_stop_or_full_output():
    def r(ok, reason, n):
        return Result(ok=ok, finish_reason=reason, output_tokens=n)

    assert not lost(r(True, "stop", 3), 64)
    assert not lost(r(True, "length", 64), 64)
    assert lost(r(True, "length", 40), 64)          # cut short (a token cap)
    assert lost(r(True, "abort", 64), 64)
    assert lost(r(False, "", 0), 64)


# ---- flags --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["swap,bogus", "swap,swap", ","])
def test_preemption_modes_refuse_bad_lists(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preemption-modes", bad])


@pytest.mark.parametrize("argv", [["--url", "http://127.0.0.1:1", "--preemption-modes", "swap,off"],
                                  ["--budget-seqs", "2", "--memory-budget", "1000000"],
                                  ["--preemption-modes", "swap,off-fit"],
                                  ["--budget-seqs", "2", "--dataset", "x.jsonl"]])
def test_capacity_flags_that_do_not_go_together(tmp_path, argv, capsys):
    assert main(["--smoke", "--out", str(tmp_path), *argv]) == 2
    assert "error" in capsys.readouterr().err


# ---- through the real server ---------------------------------------------------------------------------
def test_swap_holds_more_sequences_than_worst_case_reservation_through_the_server(tmp_path):
    """Both modes at one budget (2 worst-case requests beside 8 slots): every request ends
    with its stop, swap runs more sequences at once than off, and greedy outputs are identical."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    n = 10
    rc = main(["--preset", "nemotron-h-tiny", "--device", "cpu", "--torch-threads", "1", "--configs", "replay",
               "--preemption-modes", "swap,off", "--budget-seqs", "2", "--max-num-seqs", "8", "--prompt-len", "16",
               "--output-len", "48", "--stop-at", "4,12", "--num-prompts", str(n), "--request-rates", "inf",
               "--warmup", "0", "--metrics-interval", "0.05", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "serve.json").read_text())
    (swap,), (off,) = res["runs"]["replay/swap"], res["runs"]["replay/off"]
    plans = res["memory_plans"]
    for name, row in (("replay/swap", swap), ("replay/off", off)):
        assert row["completed"] == row["sent"] == n and row["failed"] == 0 and row["lost"] == 0
        assert row["finish_reasons"] == {"stop": n}                 # each at its drawn stop (or before)
        assert row["slots"] == plans[name]["slots"] == 8              # from /metrics: what was planned
        assert row["kv_blocks"] == plans[name]["blocks"]
        assert row["num_samples"] >= 3 and row["preemptions"] is not None
    assert plans["replay/off"]["worst_case_seqs"] == 2 and off["peak_running"] <= 2
    assert swap["peak_running"] > off["peak_running"]
    assert swap["outputs_sha256"] == off["outputs_sha256"]
    (cmp,) = res["capacity"]
    assert cmp["baseline"] == "off" and cmp["differing_outputs"] == 0
    assert cmp["peak_concurrency_ratio"] > 1 and cmp["mean_concurrency_ratio"] > 1
    assert (tmp_path / "running.png").stat().st_size > 0
    assert res["running_samples"]["replay/swap"]["inf"]
