"""Continuous batching under a memory budget."""

import pytest

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.cache_plan import memory_model

from engine_helpers import PROMPTS, reference_greedy

N = 12


@pytest.fixture(scope="module")
def expected(target):
    return [reference_greedy(target, p, N) for p in PROMPTS]


def test_over_budget_prompt_rejected_while_others_finish(target, expected):
    probe = LLM(target, decode_mode="kv", max_seq_len=2048)
    budget = probe.plan.memory.need(120)  # room for one sequence of ~120 tokens
    llm = LLM(target, decode_mode="kv", memory_budget=budget, max_seq_len=2048)
    long_prompt = [3] * 400
    outs = llm.generate([PROMPTS[0], long_prompt, PROMPTS[1]], SamplingParams(max_tokens=N))
    assert outs[1].finish_reason == "rejected" and outs[1].token_ids == []
    assert "prompt of 400 tokens" in outs[1].error and "memory budget" in outs[1].error
    assert outs[0].token_ids == expected[0] and outs[2].token_ids == expected[1]
    assert outs[0].error is None
    assert llm.scheduler.reserved == 0 and not llm.has_unfinished()


def test_prompt_longer_than_max_seq_len_rejected(target, expected):
    llm = LLM(target, max_seq_len=64)
    outs = llm.generate([PROMPTS[2], [1] * 80], SamplingParams(max_tokens=N))
    assert outs[0].token_ids == expected[2]
    assert outs[1].finish_reason == "error" and outs[1].token_ids == [] and "max_seq_len=64" in outs[1].error


def test_queue_when_budget_full(target, draft):
    prompts = [[(7 * i + j) % 32 for j in range(10)] for i in range(5)]
    exp = [reference_greedy(target, p, N) for p in prompts]
    for sp in (None, SpeculativeConfig("draft", num_tokens=2, draft_model=draft)):
        probe = LLM(target, decode_mode="kv", speculative=sp)
        per_seq = probe.plan.memory.need(10 + N + probe.plan.memory.verify_tokens)
        budget = 2 * per_seq + 1
        llm = LLM(target, decode_mode="kv", speculative=sp, memory_budget=budget, max_num_seqs=8)
        seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in prompts]
        while llm.has_unfinished():
            llm.step()
            assert llm.scheduler.reserved <= budget
        assert [llm.output(s).token_ids for s in seqs] == exp
        assert llm.scheduler.peak_running == 2
        assert llm.scheduler.reserved == 0


def test_capped_generation_when_only_the_prompt_fits(target, expected):
    probe = LLM(target, decode_mode="kv", max_seq_len=2048)
    n_prompt = len(PROMPTS[4])
    budget = probe.plan.memory.need(n_prompt + 1 + probe.plan.memory.verify_tokens + 5)
    llm = LLM(target, decode_mode="kv", memory_budget=budget, max_seq_len=2048)
    out = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=N))[0]
    assert out.finish_reason == "length" and 1 <= len(out.token_ids) < N
    assert out.token_ids == expected[4][: len(out.token_ids)]


def test_slots_limit_concurrency(target, expected):
    llm = LLM(target, max_num_seqs=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert llm.scheduler.peak_running == 2


def test_replay_fits_more_speculating_sequences_than_snapshots(target):
    sp = SpeculativeConfig("ngram", num_tokens=4)
    one = memory_model(target.cache_layout(mode="replay", buffer_size=16, max_new=5), "replay", 5, target.config.vocab_size).need(64)
    budget = 40 * one
    replay = LLM(target, decode_mode="replay", speculative=sp, memory_budget=budget, max_num_seqs=1000)
    snap = LLM(target, decode_mode="recurrent", speculative=sp, memory_budget=budget, max_num_seqs=1000)
    assert replay.num_slots >= 2.5 * snap.num_slots


def test_auto_mode_switches_at_threshold(target, expected):
    llm = LLM(target, decode_mode="auto", auto_threshold=10)
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS]
    modes = {}
    while llm.has_unfinished():
        llm.step()
        for s in seqs:
            if s.slot is not None and not s.is_finished:
                modes.setdefault(s.request_id, []).append((s.num_cached, s.mode))
    for s, e in zip(seqs, expected):
        assert llm.output(s).token_ids == e
        hist = modes.get(s.request_id, [])
        for n, m in hist:
            assert m == ("kv" if n < 10 else "replay"), hist
    # the default threshold comes from the traffic model (about n or d tokens)
    assert 16 <= LLM(target, decode_mode="auto").plan.auto_threshold <= 256


def test_kv_pool_running_dry_ends_requests_with_an_error(target, expected):
    """A safety net below the budget: a KV block pool that is too small (here shrunk by
    hand) ends the requests that cannot grow, with an error, and the others continue."""
    llm = LLM(target, decode_mode="kv", max_seq_len=256, kv_block_size=4)
    llm.cache._static_kv = False
    llm.cache.kv_num_blocks = 9
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=N))
    errs = [o for o in outs if o.finish_reason == "error"]
    assert errs and all("pool exhausted" in o.error for o in errs)
    for o, e in zip(outs, expected):
        assert o.token_ids == e[: len(o.token_ids)]
    assert any(o.finish_reason == "length" for o in outs) or len(errs) == 3
    assert not llm.has_unfinished() and llm.scheduler.reserved == 0


def test_sequence_token_views_equal_all_ids():
    """``token_at`` / ``last_ids`` (the per-step views the drafters use) equal indexing
    ``all_ids``, which copies the whole context."""
    import random

    from replayssm import SamplingParams
    from replayssm.engine.sequence import Sequence

    rng = random.Random(0)
    for _ in range(200):
        s = Sequence([rng.randrange(9) for _ in range(rng.randint(1, 6))], SamplingParams(max_tokens=30))
        s.output_ids.extend(rng.randrange(9) for _ in range(rng.randint(0, 6)))
        a = s.all_ids
        assert [s.token_at(i) for i in range(len(a))] == a
        assert all(s.last_ids(k) == a[-k:] for k in range(1, len(a) + 1))


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_a_step_releases_its_finished_slots_in_one_call(target, expected, mode):
    """Requests finishing in the same step give their slots back in one ``cache.release``
    (one message to the workers under TP); requests finishing apart, one call per step; an
    abort outside a step releases at once.  Every slot comes back, later requests reuse them,
    outputs are the greedy reference's."""
    llm = LLM(target, decode_mode=mode, max_seq_len=64, max_num_seqs=4)
    calls = []
    orig = llm.cache.release
    llm.cache.release = lambda slots: (calls.append(sorted(int(s) for s in slots)), orig(slots))[1]
    p = SamplingParams(max_tokens=N, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], p)                            # four finish together
    assert [o.token_ids for o in outs] == expected[:4]
    assert calls == [[1, 2, 3, 4]] and sorted(llm.blocks.free_slots) == [1, 2, 3, 4]
    calls.clear()
    lens = [N, N - 3, N - 3, N - 7]
    outs = llm.generate(PROMPTS[:4], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    assert [o.token_ids for o in outs] == [e[:n] for e, n in zip(expected, lens)]
    assert len(calls) == 3 and sorted(s for c in calls for s in c) == [1, 2, 3, 4]
    assert [len(c) for c in calls] == [1, 2, 1]                    # N-7, then the two N-3, then N
    calls.clear()
    seq = llm.add_request(PROMPTS[4], p)
    llm.step()
    assert llm.abort(seq.request_id)
    assert len(calls) == 1 and len(calls[0]) == 1 and not llm.has_unfinished()
    assert sorted(llm.blocks.free_slots) == [1, 2, 3, 4]
