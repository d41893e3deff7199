"""The async engine loop in-process: requests join between steps, a failing step ends only
the requests in flight, aborts free slots, and the loop keeps serving."""

from __future__ import annotations

import asyncio

import pytest
import torch

from replayssm import LLM, SamplingParams
from recompute_model import tiny_pair
from server_helpers import DRAFT, MODEL
from replayssm.server.engine_loop import AsyncEngine, EngineError, QueueFull, ShuttingDown, StepEngine


class Flaky:
    """An LLM whose ``fail_at``-th step raises after its verify ran (a half-done step)."""

    def __init__(self, llm, fail_at):
        self.llm, self.fail_at, self.calls = llm, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def step(self):
        self.calls += 1
        if self.calls == self.fail_at:
            self.llm.step()
            self.llm.cache.pending = object()      # as if a verify never got its commit
            raise RuntimeError("boom")
        return self.llm.step()


async def _run(loop, prompt, n=8):
    stream = loop.submit([(loop.new_id("r"), prompt, SamplingParams(max_tokens=n))])
    last = None
    async for out in stream:
        last = out
    return last


def test_llm_is_a_step_engine():
    target, _ = tiny_pair(vocab_size=32)
    assert isinstance(LLM(target), StepEngine)


def test_failed_step_ends_its_requests_and_the_loop_goes_on():
    torch.set_num_threads(1)
    target, _ = tiny_pair(vocab_size=32)
    want = LLM(target).generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0].token_ids
    eng = Flaky(LLM(target, max_num_seqs=4), fail_at=2)
    loop = AsyncEngine(eng, max_running=4, max_queue=2)

    async def main():
        loop.start()
        try:
            res = await asyncio.gather(_run(loop, [1, 2, 3]), _run(loop, [5, 6]), return_exceptions=True)
            assert all(isinstance(r, EngineError) and "boom" in str(r) for r in res), res
            assert loop.in_flight == 0 and loop.step_failures == 1
            out = await _run(loop, [1, 2, 3])                      # served normally afterwards
            assert out.token_ids == want
            with pytest.raises(QueueFull, match="capacity"):
                loop.submit([(loop.new_id("r"), [1], SamplingParams(max_tokens=4, n=7))])
            # an abort between steps frees the slot
            s = loop.submit([(loop.new_id("r"), [1, 2], SamplingParams(max_tokens=500, ignore_eos=True))])
            await s.__anext__()
            loop.abort(s)
            with pytest.raises(StopAsyncIteration):
                while True:
                    await s.__anext__()
            for _ in range(100):
                if len(eng.llm.scheduler.free_slots) == 4 and loop.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert len(eng.llm.scheduler.free_slots) == 4 and loop.in_flight == 0
        finally:
            loop.shutdown()

    asyncio.run(main())


def test_serve_flags_reach_the_speculative_config():
    """``replayssm serve --speculative ngram --speculative-disable-by-batch-size 8`` builds that
    engine (and ``--warm-up`` parses); bad values are the config's clear errors."""
    from replayssm.server.cli import build_engine, build_parser

    model = str(MODEL)
    args = build_parser().parse_args([model, "--speculative", "ngram", "--speculative-disable-by-batch-size", "8",
                                      "--warm-up", "off", "--device", "cpu", "--max-num-seqs", "2"])
    llm = build_engine(model, args)
    assert llm.config.speculative.disable_by_batch_size == 8 and args.warm_up == "off"
    assert not llm.config.async_scheduling
    args = build_parser().parse_args([model, "--async-scheduling", "--device", "cpu", "--max-num-seqs", "2"])
    assert build_engine(model, args).config.async_scheduling
    bad = build_parser().parse_args([model, "--speculative", "ngram", "--speculative-disable-by-batch-size", "0"])
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        build_engine(model, bad)


def test_serve_flag_values_and_conflicts_are_named(tmp_path):
    """Bad ports, byte counts and thread counts are argparse errors (exit 2, the flag named),
    not tracebacks; a draft beside --speculative-config is refused, not ignored; a taken port
    is reported before the model loads."""
    import socket
    import subprocess
    import sys

    from replayssm.server.cli import build_engine, build_parser

    model = str(MODEL)
    for flags in (["--port", "-1"], ["--port", "70000"], ["--memory-budget", "inf"], ["--memory-budget", "nan"],
                  ["--memory-budget", "0.5"], ["--torch-threads", "0"], ["--torch-threads", "-1"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([model, *flags])
        assert e.value.code == 2
    assert build_parser().parse_args([model, "--memory-budget", "8e9"]).memory_budget == 8_000_000_000
    args = build_parser().parse_args([model, "--speculative-config", '{"method": "ngram"}', "--draft-model", model])
    with pytest.raises(ValueError, match="--draft-model is ignored with --speculative-config"):
        build_engine(model, args)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "replayssm", "serve", model, "--port", str(port), "--host",
                            "127.0.0.1"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "cannot bind" in r.stderr
    finally:
        taken.close()


def test_slow_steps_are_logged_with_where_their_time_went(caplog):
    """A step longer than ``slow_step_s`` is a warning naming its prefill / decode split and
    the engine's occupancy (here every step counts as slow)."""
    import logging

    torch.set_num_threads(1)
    target, _ = tiny_pair(vocab_size=32)
    loop = AsyncEngine(LLM(target, max_num_seqs=2), max_running=2, max_queue=2, slow_step_s=0.0)

    async def main():
        loop.start()
        try:
            await _run(loop, [1, 2, 3], n=3)
        finally:
            loop.shutdown()

    with caplog.at_level(logging.WARNING, logger="replayssm.server"):
        asyncio.run(main())
    msgs = [r.getMessage() for r in caplog.records if r.name == "replayssm.server"]
    assert msgs and all("slow engine step" in m and "prefill" in m and "decode" in m and "running" in m
                        for m in msgs), msgs


def test_vllm_flags_are_understood():
    """vLLM's ``--speculative-config`` JSON and ``--max-model-len`` work as they do there; what
    we do not support is refused by name, before any engine is built."""
    from replayssm.server.cli import build_engine, build_parser
    from replayssm.server.engine_args import speculative_from_json

    sp = speculative_from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,'
                               ' "disable_by_batch_size": 8}')
    assert (sp.method, sp.num_tokens, sp.prompt_lookup_max, sp.disable_by_batch_size) == ("ngram", 3, 4, 8)
    sp = speculative_from_json(f'{{"model": "{DRAFT}", "num_speculative_tokens": 2}}')
    assert sp.method == "draft" and sp.num_tokens == 2
    assert speculative_from_json('{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}').method == "mtp"
    assert speculative_from_json('{"method": "ngram"}').spec_policy == "adaptive"
    assert speculative_from_json('{"method": "ngram", "spec_policy": "fixed"}').spec_policy == "fixed"
    with pytest.raises(ValueError, match="spec_policy"):
        speculative_from_json('{"method": "ngram", "spec_policy": "sometimes"}')
    for bad, msg in (('{"method": "eagle3", "model": "x"}', "not supported"), ('[1]', "JSON object"),
                     ('{"method": "ngram", "acceptance": 1}', "unsupported keys"), ("{nope", "not valid JSON"),
                     ('{"num_speculative_tokens": 2}', "needs a 'method'"),
                     ('{"method": "ngram", "model": "x"}', "takes no 'model'")):
        with pytest.raises(ValueError, match=msg):
            speculative_from_json(bad)
    model = str(MODEL)
    args = build_parser().parse_args([model, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                                      "--max-model-len", "300", "--device", "cpu", "--max-num-seqs", "2"])
    llm = build_engine(model, args)
    assert llm.config.speculative.num_tokens == 2 and llm.config.max_seq_len == 300
    both = build_parser().parse_args([model, "--speculative", "ngram", "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="not both"):
        build_engine(model, both)


def test_drain_lets_short_requests_finish_and_aborts_the_rest_with_a_final_output():
    """``drain``: a short request finishes on its own; long ones (two samples of one, one that
    took the short one's slot, one still waiting for a slot) each get a final ``abort`` output
    with the tokens they had;
    submits are refused meanwhile and after; every slot is free at the end."""
    pytest.importorskip("prometheus_client")
    from replayssm.server.metrics import ServerMetrics

    torch.set_num_threads(1)
    target, _ = tiny_pair(vocab_size=32)
    llm = LLM(target, max_num_seqs=3)
    metrics = ServerMetrics("t")
    loop = AsyncEngine(llm, max_running=3, max_queue=4, metrics=metrics)
    long = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def collect(stream):
        last = {}
        async for out in stream:
            last[(out.request_id, out.index)] = out
        return last

    async def main():
        loop.start()
        try:
            short = loop.submit([("short", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))])
            pair = loop.submit([("pair", [3, 4], SamplingParams(max_tokens=long.max_tokens, ignore_eos=True, n=2))])
            solo = loop.submit([("solo", [6, 7], long)])              # 3 slots: short + pair's two
            waiting = loop.submit([("waiting", [5], long)])
            tasks = [asyncio.ensure_future(collect(s)) for s in (short, pair, solo, waiting)]
            await asyncio.sleep(0.2)
            left = await loop.drain(timeout=0.3)
            with pytest.raises(ShuttingDown, match="shutting down"):
                loop.submit([("late", [1], SamplingParams(max_tokens=2))])
            got_short, got_pair, got_solo, got_waiting = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            assert left == 4
            assert [o.finish_reason for o in got_short.values()] == ["length"]
            assert sorted(got_pair) == [("pair", 0), ("pair", 1)]
            assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < long.max_tokens
                       for o in [*got_pair.values(), *got_solo.values()])
            (w,) = got_waiting.values()
            assert w.finish_reason == "abort" and w.token_ids == [] and w.prompt_token_ids == [5]
            assert loop.in_flight == 0 and len(llm.scheduler.free_slots) == 3 and not llm.has_unfinished()
            get = metrics.registry.get_sample_value
            assert get("replayssm:request_success_total", {"model_name": "t", "finished_reason": "abort"}) == 4
            assert get("replayssm:request_queue_time_seconds_count", {"model_name": "t"}) == 3   # not "waiting"
        finally:
            loop.shutdown()

    asyncio.run(main())


def test_one_event_loop_wake_up_per_step_and_outputs_in_order():
    """Six requests decoding together: every step's outputs reach the event loop in one
    ``call_soon_threadsafe`` (not one per output: each is a self-pipe write that hands the GIL
    to the event loop's thread mid-delivery), each stream gets every output in order, and the
    tokens are the offline engine's."""
    torch.set_num_threads(1)
    target, _ = tiny_pair(vocab_size=32)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 3], [2, 2, 2]]
    want = [o.token_ids for o in LLM(target).generate(prompts, SamplingParams(max_tokens=7, ignore_eos=True))]
    loop = AsyncEngine(LLM(target, max_num_seqs=8), max_running=8, max_queue=0)

    async def main():
        ev = asyncio.get_running_loop()
        wakes = []
        real = ev.call_soon_threadsafe
        ev.call_soon_threadsafe = lambda *a, **k: (wakes.append(a[0]), real(*a, **k))[1]
        loop.start()
        try:
            streams = [loop.submit([(loop.new_id("r"), p, SamplingParams(max_tokens=7, ignore_eos=True))])
                       for p in prompts]
            seen = []
            for s in streams:
                lens = []
                async for out in s:
                    lens.append(len(out.token_ids))
                seen.append((lens, out.token_ids))
        finally:
            loop.shutdown()
            ev.call_soon_threadsafe = real
        assert [ids for _, ids in seen] == want
        assert all(lens == sorted(lens) and lens[-1] == 7 for lens, _ in seen)
        outputs = sum(len(lens) for lens, _ in seen) + len(prompts)   # outputs + each stream's end
        assert loop.steps <= len(wakes) <= loop.steps + 2 < outputs
    asyncio.run(main())
