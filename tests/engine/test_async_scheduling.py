"""Async scheduling (engine.overlap): decode step n+1 is launched, fed on the device from step
n's greedy tokens, before step n's tokens are read.  Every test runs the same requests with
``async_scheduling`` off and on and compares token streams and finish reasons exactly, and
checks that the overlapped path really ran (lagged steps counted, the runner's
``decode_rows`` called) or, for configurations that must not overlap, that it did not."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402
from engine_helpers import CharTok, simulate_decode_graphs  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.engine.config import EngineConfig  # noqa: E402
from replayssm.engine.overlap import InFlight, ends_with_pending  # noqa: E402
from replayssm.engine.sequence import Sequence  # noqa: E402
from replayssm.models import load_model  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9], [30, 31, 3], [11, 12]]
MAXLEN = 64


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = H.save_tiny(H.tiny_mamba2(seed=0), str(tmp_path_factory.mktemp("async") / "m2"))
    return load_model(d, dtype="float64")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Nemotron-H: Mamba-2, paged attention KV, MLP and MoE layers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = H.save_tiny(H.tiny_nemotron_h(seed=0), str(tmp_path_factory.mktemp("async") / "nh"))
    return load_model(d, dtype="float64")


def _run(model, prompts, params, eos=None, **kw):
    """``([(token ids, finish reason)], stats, runner calls)`` of one generate call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, max_seq_len=kw.pop("max_seq_len", MAXLEN), **kw)
        if eos is not None:
            llm.outputs.eos_token_id = eos
        outs = llm.generate(prompts, params)
    assert not llm.has_unfinished() and llm._inflight is None
    assert len(llm.blocks.free_slots) == llm.num_slots and llm.blocks.reserved == 0
    res = []
    for o in outs:
        res.append((o.token_ids, o.finish_reason, o.text))
        res += [(s.token_ids, s.finish_reason, s.text) for s in o.samples[1:]]
    return res, dict(llm.stats), dict(llm.runner.num_calls)


def _both(model, prompts, params, same_steps=True, **kw):
    """Sync and async runs: the outputs must be identical; returns the async run's stats and
    calls.  ``same_steps``: as many steps (False where a waiting request is admitted one step
    later, after the step in flight is collected)."""
    want, st_sync, _ = _run(model, prompts, params, **kw)
    got, st, calls = _run(model, prompts, params, async_scheduling=True, **kw)
    assert got == want
    assert st["generated"] == st_sync["generated"]
    assert st["steps"] == st_sync["steps"] if same_steps else st["steps"] >= st_sync["steps"]
    return want, st, calls


def _overlapped(st, calls):
    assert st["async_steps"] > 0 and calls["rows_decode"] == st["async_steps"] + st["async_wasted_steps"]


@pytest.mark.parametrize("mode", ["replay", "recurrent"])
def test_mixed_max_tokens(mamba2, mode):
    ps = [SamplingParams(max_tokens=k) for k in (12, 5, 9, 1, 20)]
    want, st, calls = _both(mamba2, PROMPTS, ps, decode_mode=mode)
    assert [len(t) for t, _, _ in want] == [12, 5, 9, 1, 20]
    _overlapped(st, calls)
    assert st["async_dropped_rows"] == 0   # every end known before its token: no wasted row
    # the first decode step reads host tokens, each one after it the device's (one per step)
    assert calls["greedy_decode"] == st["steps"] - 1 and calls["decode"] == 0


def _eos_candidate(rows):
    """A token that first appears at different positions in several rows (so EOS really ends
    requests at different steps of one batch)."""
    first = {}
    for r, (toks, _, _) in enumerate(rows):
        for i, t in enumerate(toks):
            first.setdefault(t, {}).setdefault(r, i)

    def ends(t):   # where each row would end with EOS t
        return [first[t].get(r, len(toks)) for r, (toks, _, _) in enumerate(rows)]

    best = max(first, key=lambda t: (len(set(first[t].values())) >= 3, sum(ends(t))))
    assert len(set(first[best].values())) >= 3, first
    return best


@pytest.mark.parametrize("mode", ["replay", "recurrent"])
def test_eos_mid_batch(mamba2, mode):
    ps = SamplingParams(max_tokens=20)
    base, _, _ = _run(mamba2, PROMPTS, ps, decode_mode=mode)
    eos = _eos_candidate(base)
    want, st, calls = _both(mamba2, PROMPTS, ps, eos=eos, decode_mode=mode)
    stops = [len(t) for t, r, _ in want if r == "stop"]
    assert len(set(stops)) >= 3 and all(t[-1] == eos for t, r, _ in want if r == "stop")
    _overlapped(st, calls)
    assert st["async_dropped_rows"] > 0    # rows launched for sequences their EOS ended: dropped



def test_stop_strings(mamba2):
    tok = CharTok()
    base, _, _ = _run(mamba2, PROMPTS, SamplingParams(max_tokens=16), tokenizer=tok)
    stops = [base[0][2][4:6], base[2][2][6:8]]
    ps = SamplingParams(max_tokens=16, stop=stops)
    want, st, calls = _both(mamba2, PROMPTS, ps, tokenizer=tok)
    assert sum(r == "stop" for _, r, _ in want) >= 2
    _overlapped(st, calls)


@pytest.mark.parametrize("slots", [8, 3])
def test_n_greedy_samples(mamba2, slots):
    """``n > 1`` greedy samples (identical); with 3 slots the later requests wait for their
    samples' slots while the others decode overlapped."""
    ps = [SamplingParams(max_tokens=10, n=3), SamplingParams(max_tokens=7), SamplingParams(max_tokens=13, n=2)]
    want, st, calls = _both(mamba2, PROMPTS[:3], ps, same_steps=slots == 8, max_num_seqs=slots)
    assert len(want) == 6 and want[0][0] == want[1][0] == want[2][0]
    _overlapped(st, calls)


def _stepwise(model, script, **kw):
    """Drive the engine by hand: ``script`` maps a step number to actions before it
    (``("add", rid, prompt, max_tokens)`` or ``("abort", rid)``); returns every request's
    (tokens, finish reason), the step outputs seen and the engine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, max_seq_len=MAXLEN, max_num_seqs=3, **kw)
    seqs, seen, k, aborted_in_flight = {}, [], 0, None
    while k <= max(script) or llm.has_unfinished():
        for act in script.get(k, []):
            if act[0] == "add":
                seqs[act[1]] = llm.add_request(act[2], SamplingParams(max_tokens=act[3]), request_id=act[1])
            else:
                aborted_in_flight = llm._inflight is not None and seqs[act[1]] in llm._inflight.seqs
                assert llm.abort(act[1])
        seen.append(sorted((o.request_id, len(o.token_ids), o.finish_reason) for o in llm.step()))
        k += 1
    assert len(llm.blocks.free_slots) == llm.num_slots and llm._inflight is None
    llm.aborted_in_flight = aborted_in_flight
    return {r: (s.output_ids, s.finish_reason) for r, s in seqs.items()}, seen, llm


def test_requests_added_and_aborted_mid_flight(mamba2):
    """Requests arrive while a step is in flight (more than the slots: some wait for a slot
    that a finishing request frees), one is aborted with a row in flight; outputs and finish
    reasons are those of the synchronous engine.  (A request added while a step is in
    flight is admitted one ``step()`` later: that call collects the step in flight.)"""
    script = {0: [("add", "a", PROMPTS[0], 14), ("add", "b", PROMPTS[1], 6)],
              3: [("add", "c", PROMPTS[2], 9)],
              5: [("add", "d", PROMPTS[3], 8), ("add", "e", PROMPTS[4], 5)],
              9: [("abort", "a")]}
    want, seen_sync, _ = _stepwise(mamba2, script)
    got, seen, llm = _stepwise(mamba2, script, async_scheduling=True)
    assert got == want
    assert seen[:3] == seen_sync[:3]   # the same tokens per step() until the first arrival mid-flight
    assert want["a"][1] == "abort" and 0 < len(want["a"][0]) < 14
    assert llm.aborted_in_flight   # its row was on the device when it was aborted: dropped
    assert llm.stats["async_steps"] > 0 and llm.stats["async_dropped_rows"] >= 1


@pytest.mark.parametrize("mode", ["replay", "recurrent"])
def test_hybrid_paged_attention_past_the_ring(hybrid, mode):
    """Nemotron-H (attention KV in paged blocks of 4 tokens) with a ring of 4: generations
    of 30 tokens wrap the ring several times and cross many blocks, EOS ends some early."""
    kw = dict(decode_mode=mode, buffer_size=4, kv_block_size=4)
    ps = [SamplingParams(max_tokens=k) for k in (30, 17, 25, 3, 30)]
    base, _, _ = _run(hybrid, PROMPTS, ps, **kw)
    eos = _eos_candidate(base)
    want, st, calls = _both(hybrid, PROMPTS, ps, eos=eos, **kw)
    assert max(len(t) for t, _, _ in want) > 8
    _overlapped(st, calls)
    _, st, calls = _both(hybrid, PROMPTS, ps, **kw)
    _overlapped(st, calls)


def test_hybrid_memory_budget_drains_instead_of_preempting(hybrid):
    """A budget too small for every sequence's growth: steps that cannot grow without
    preempting drain and run synchronously (the scheduler preempts there); same outputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = LLM(hybrid, max_seq_len=MAXLEN, kv_block_size=4, max_num_seqs=4)
    m = probe.blocks.memory
    budget = 4 * m.fixed + m.dynamic(60)   # about 60 tokens of blocks for four sequences
    ps = SamplingParams(max_tokens=24)
    want, st, calls = _both(hybrid, PROMPTS, ps, same_steps=False, kv_block_size=4, max_num_seqs=4,
                            memory_budget=budget)
    assert st["preemptions"] > 0
    _overlapped(st, calls)


def test_prefix_cache_of_prompts_only_overlaps(mamba2):
    ps = SamplingParams(max_tokens=10)
    prompts = [PROMPTS[0] * 3, PROMPTS[0] * 3 + [5], PROMPTS[2]]
    kw = dict(enable_prefix_caching=True, kv_block_size=4, prefix_cache_blocks=16)
    _, st, calls = _both(mamba2, prompts, ps, prefix_cache_replies=False, **kw)
    _overlapped(st, calls)
    _, st, calls = _both(mamba2, prompts, ps, **kw)   # replies cached at finish: no overlap
    assert st["async_steps"] == 0 and calls["rows_decode"] == 0


@pytest.mark.parametrize("case", ["temperature", "penalty", "logprobs", "ngram", "kv", "auto", "mixed"])
def test_ineligible_configs_run_synchronously(mamba2, case):
    greedy = SamplingParams(max_tokens=12)
    kw, ps = {}, greedy
    if case == "temperature":
        ps = [SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(len(PROMPTS))]
    elif case == "penalty":
        ps = SamplingParams(max_tokens=12, repetition_penalty=1.3)
    elif case == "logprobs":
        ps = SamplingParams(max_tokens=12, logprobs=2)
    elif case == "ngram":
        kw = dict(speculative=SpeculativeConfig("ngram", num_tokens=3))
    elif case in ("kv", "auto"):
        kw = dict(decode_mode=case, auto_threshold=6)
    else:   # one sampled request in a greedy batch: the whole batch decodes synchronously
        ps = [greedy] * (len(PROMPTS) - 1) + [SamplingParams(max_tokens=12, temperature=0.7, seed=1)]
    _, st, calls = _both(mamba2, PROMPTS, ps, **kw)
    assert st["async_steps"] == 0 and calls["rows_decode"] == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_plain_steps_above_disable_by_batch_size_overlap(mamba2, method):
    """With speculation off above ``disable_by_batch_size``, a drafter that catches up lazily
    from the token ids (n-gram, draft model) lets those plain steps overlap; once few enough
    rows remain, speculation resumes synchronously.  Outputs equal the synchronous engine's."""
    spec = SpeculativeConfig(method, num_tokens=3, disable_by_batch_size=2,
                             draft_model=mamba2 if method == "draft" else None)
    ps = [SamplingParams(max_tokens=k) for k in (14, 6, 10, 4, 16)]
    _, st, calls = _both(mamba2, PROMPTS, ps, speculative=spec)
    _overlapped(st, calls)
    assert st["spec_T3_steps"] > 0 and st["spec_T0_steps"] >= st["async_steps"]   # both kinds of step ran


def test_drafters_that_work_before_a_plain_step_never_overlap(mamba2):
    """``overlaps_drafter``: no drafter, or a lazy one on a step speculation is off for; the
    MTP head (work before every plain step) never."""
    from replayssm.engine.spec.base import Drafter
    from replayssm.engine.spec.mtp import MTPDrafter

    assert Drafter.lazy_catch_up and not MTPDrafter.lazy_catch_up
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(mamba2, max_seq_len=MAXLEN, async_scheduling=True,
                  speculative=SpeculativeConfig("ngram", num_tokens=3, disable_by_batch_size=2))
    ex = llm.executor
    assert ex.overlaps_drafter(3) and not ex.overlaps_drafter(2)     # above the limit only
    ex.drafter.lazy_catch_up = False
    assert not ex.overlaps_drafter(3)
    ex.drafter = None
    assert ex.overlaps_drafter(1)


def test_mixed_batch_overlaps_once_the_sampled_request_ends(mamba2):
    """Sampled and greedy requests together: synchronous while the sampled one runs, then
    the greedy ones overlap."""
    ps = [SamplingParams(max_tokens=16)] * 4 + [SamplingParams(max_tokens=4, temperature=0.7, seed=1)]
    _, st, calls = _both(mamba2, PROMPTS, ps)
    _overlapped(st, calls)
    assert st["async_steps"] <= 16 - 4


def test_graph_static_buffers(mamba2):
    """With the decode graphs simulated on CPU (static inputs and outputs, each replay
    overwriting the output the previous step returned) the overlapped steps still feed on
    the right tokens: the gather and the host copy come before the next replay."""
    want, _, _ = _run(mamba2, PROMPTS, [SamplingParams(max_tokens=k) for k in (12, 5, 9, 1, 20)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(mamba2, max_seq_len=MAXLEN, async_scheduling=True, max_num_seqs=8)
    keys = simulate_decode_graphs(llm.runner)
    llm.runner.pad_batches = True
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=k) for k in (12, 5, 9, 1, 20)])
    assert [(o.token_ids, o.finish_reason, o.text) for o in outs] == want
    assert {k.kind for k in keys} == {"gdecode"} and len({k.batch for k in keys}) >= 3   # buckets change
    assert llm.stats["async_steps"] > 0


def test_decode_rows_is_validated(mamba2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(mamba2, max_seq_len=MAXLEN, async_scheduling=True)
    r = llm.runner
    assert r.greedy_decode
    with pytest.raises(ValueError, match="greedy decode step just before"):
        r.decode_rows([1], [0])
    r.cache.reserve(1, 8)
    r.cache.reserve(2, 8)
    r.prefill([1, 2], [[3, 4], [5]])
    with pytest.raises(ValueError, match="greedy decode step just before"):   # a prefill came last
        r.decode_rows([1], [0])
    first = r.decode([1, 2], torch.tensor([4, 5]), greedy=True)
    seq_len = r.cache.seq_len.clone()
    for rows, slots, msg in (([0, 2], [1, 2], "rows must be in"), ([-1], [1], "rows must be in"),
                             ([0], [1, 2], "one each"), ([], [], "one each")):
        with pytest.raises(ValueError, match=msg):
            r.decode_rows(slots, rows)
    assert torch.equal(r.cache.seq_len, seq_len)   # nothing ran
    # slot 2 alone, fed from row 1 of the previous step: as a host-fed greedy decode of that token
    got = r.decode_rows([2], [1])
    ref = LLM(mamba2, max_seq_len=MAXLEN, async_scheduling=True).runner   # the same calls, host-fed
    ref.cache.reserve(1, 8)
    ref.cache.reserve(2, 8)
    ref.prefill([1, 2], [[3, 4], [5]])
    assert torch.equal(ref.decode([1, 2], torch.tensor([4, 5]), greedy=True), first)
    assert torch.equal(got, ref.decode([2], torch.tensor([int(first[1])]), greedy=True))
    for a, b in zip(r.cache.tensors(), ref.cache.tensors()):
        assert torch.equal(a, b)


def test_ends_with_pending():
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=3))
    s.output_ids = [4]
    assert not ends_with_pending(s, token_limit=10)
    s.output_ids = [4, 5]
    assert ends_with_pending(s, token_limit=10)        # the pending token is the third
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=50))
    s.output_ids = [4, 5]
    assert ends_with_pending(s, token_limit=6) and not ends_with_pending(s, token_limit=7)
    s.token_cap = 6
    assert ends_with_pending(s, token_limit=100)


def test_inflight_copy_survives_the_output_being_overwritten():
    out = torch.tensor([3, 1, 4])
    seqs = [Sequence([1], SamplingParams()) for _ in range(3)]
    fl = InFlight.launched(seqs, out)
    out.fill_(0)   # the next replay writes the static output
    assert fl.wait() == [3, 1, 4] and fl.rows_of([seqs[0], seqs[2]]) == [0, 2]


def test_config_is_validated():
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling="yes")
    assert EngineConfig(async_scheduling=True).async_scheduling is True
    assert EngineConfig().async_scheduling is None   # resolved by the engine: on for CUDA devices


def test_default_is_off_on_the_cpu(mamba2):
    """``None`` (the default) resolves to off on the CPU, where the host runs the model itself."""
    llm = LLM(mamba2, max_seq_len=MAXLEN)
    assert llm.config.async_scheduling is False and "async_steps" not in llm.stats


def test_a_failed_step_ends_the_requests_in_flight(mamba2):
    """A launch that raises with a step in flight: ``recover()`` ends that step's requests
    with an error and frees their slots (their caches are a token ahead of their outputs);
    the engine then serves new requests exactly."""
    want, _, _ = _run(mamba2, PROMPTS[:2], SamplingParams(max_tokens=6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(mamba2, max_seq_len=MAXLEN, async_scheduling=True)
    seqs = [llm.add_request(p, SamplingParams(max_tokens=20)) for p in PROMPTS]
    real, calls = llm.runner.decode_rows, []

    def failing(slots, rows):
        calls.append(len(slots))
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real(slots, rows)

    llm.runner.decode_rows = failing
    with pytest.raises(RuntimeError, match="device fault"):
        while llm.has_unfinished():
            llm.step()
    assert llm._inflight is not None
    llm.recover()
    assert not llm.has_unfinished() and len(llm.blocks.free_slots) == llm.num_slots and llm.blocks.reserved == 0
    assert all(s.finish_reason == "error" and "in flight" in s.error for s in seqs)
    llm.runner.decode_rows = real
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6))
    assert [(o.token_ids, o.finish_reason, o.text) for o in outs] == want and llm.stats["async_steps"] > 0


def test_stream_leaves_nothing_in_flight(mamba2):
    """``LLM.stream`` yields the synchronous engine's tokens; a request ended by EOS leaves
    no step in flight behind it (its dropped row is collected)."""
    outs = []
    for asy in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(mamba2, max_seq_len=MAXLEN, async_scheduling=asy)
        toks = [t for c in llm.stream(PROMPTS[0], SamplingParams(max_tokens=12)) for t in c]
        llm.outputs.eos_token_id = toks[7]
        chunks = list(llm.stream(PROMPTS[0], SamplingParams(max_tokens=12)))
        assert not llm.has_unfinished() and llm.last_output.finish_reason == "stop"
        outs.append((toks, chunks, llm.stats.get("async_dropped_rows")))
    assert outs[0][:2] == outs[1][:2] and outs[1][2] == 1
