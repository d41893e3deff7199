"""The step-wise API a server drives: add_request / step / abort, outputs as they come."""

import pytest

from replayssm import LLM, SamplingParams, SpeculativeConfig

from engine_helpers import PROMPTS, reference_greedy

N = 12


@pytest.fixture(scope="module")
def expected(target):
    return [reference_greedy(target, p, N) for p in PROMPTS]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_step_outputs_stream_every_token_once(target, expected, spec):
    sp = SpeculativeConfig("ngram", num_tokens=3) if spec else None
    llm = LLM(target, speculative=sp, max_num_seqs=3)
    ids = [llm.add_request(p, SamplingParams(max_tokens=N), request_id=f"r{i}").request_id
           for i, p in enumerate(PROMPTS)]
    seen = {i: [] for i in ids}
    done = set()
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id not in done, "no output after a request finished"
            new = out.token_ids[len(seen[out.request_id]):]
            assert out.token_ids[: len(seen[out.request_id])] == seen[out.request_id]  # cumulative
            assert new or out.finished
            seen[out.request_id] = list(out.token_ids)
            if out.finished:
                done.add(out.request_id)
    assert done == set(ids)
    assert [seen[i] for i in ids] == expected


def test_abort_waiting_and_running_frees_slots(target, expected):
    llm = LLM(target, max_num_seqs=2)
    a = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=N), request_id="a")
    b = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=N), request_id="b")
    c = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=N), request_id="c")   # waits
    llm.step()
    assert llm.abort("c") and c.finish_reason == "abort"       # still queued
    assert llm.abort("a") and a.finish_reason == "abort"       # running: slot back at once
    assert not llm.abort("a") and not llm.abort("nope")
    assert len(llm.scheduler.free_slots) == llm.num_slots - 1
    while llm.has_unfinished():
        llm.step()
    assert llm.output(b).token_ids == expected[1]
    assert len(llm.scheduler.free_slots) == llm.num_slots
    # the engine serves new requests normally afterwards
    d = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=N), request_id="a")  # id free again
    while llm.has_unfinished():
        llm.step()
    assert llm.output(d).token_ids == expected[0]


def test_duplicate_request_id_rejected_before_queueing(target):
    llm = LLM(target)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2), request_id=7)
    with pytest.raises(ValueError, match="request_id 7"):
        llm.add_request(PROMPTS[1], SamplingParams(max_tokens=2), request_id=7)
    assert len(llm.scheduler.waiting) == 1


def test_auto_ids_skip_ids_the_caller_chose(target):
    """An int id a caller picks ahead of the automatic counter is never handed out again."""
    from replayssm.engine import sequence

    llm = LLM(target)
    ahead = next(sequence._ids) + 1
    a = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2), request_id=ahead)
    b = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=2))
    assert b.request_id != ahead and a.request_id == ahead
    assert llm.abort(ahead) and a.finish_reason == "abort" and b.finish_reason is None


def test_params_changed_after_queueing_cannot_reach_the_step(target, expected):
    """add_request keeps its own validated copy: the caller's later edits to the object it
    passed change nothing, and a bad one passed in is refused before anything is queued."""
    llm = LLM(target, max_num_seqs=4)
    good = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS[:3]]
    sp = SamplingParams(max_tokens=N)
    bad = llm.add_request(PROMPTS[0], sp)
    sp.logprobs, sp.temperature, sp.max_tokens = 1000, "hot", None      # after queueing
    while llm.has_unfinished():
        llm.step()
    assert [llm.output(g).token_ids for g in good] == expected[:3]
    assert llm.output(bad).token_ids == expected[0]
    with pytest.raises(ValueError, match="SamplingParams.max_tokens"):
        llm.add_request(PROMPTS[0], sp)                                  # edited, then passed
    assert not llm.has_unfinished()


def test_falsy_non_params_are_refused_not_defaulted(target):
    llm = LLM(target)
    for bad in (0, "", []):
        with pytest.raises(ValueError, match="SamplingParams"):
            llm.add_request(PROMPTS[0], bad)
        with pytest.raises(ValueError, match="SamplingParams"):
            llm.generate([PROMPTS[0]], bad if bad != [] else [0])
    assert not llm.has_unfinished()


@pytest.mark.parametrize("mode,spec,prefix", [("replay", None, False), ("replay", "ngram", True),
                                              ("recurrent", None, True), ("auto", None, False)])
def test_warm_up_leaves_an_idle_clean_engine(mode, spec, prefix):
    """``warm_up`` (what ``replayssm serve`` runs before listening on a GPU) holds no slot, no
    cached prefix and no counter afterwards, and the requests that follow are exact."""
    import os

    import replayssm

    shipped = os.path.join(os.path.dirname(replayssm.__file__), "assets", "tiny-mamba2")
    model = pytest.importorskip("replayssm.models").load_model(shipped)
    expected = [reference_greedy(model, p, N) for p in PROMPTS]
    sp = SpeculativeConfig("ngram", num_tokens=3) if spec else None
    llm = LLM(model, decode_mode=mode, speculative=sp, max_num_seqs=3, max_seq_len=96,
              max_num_batched_tokens=48, enable_prefix_caching=prefix, auto_threshold=8,
              prefix_checkpoint_interval=16 if prefix else None)
    loads = []
    if prefix:                                             # the resume kernels are warmed up too
        real = llm.cache.load_prefixes
        llm.cache.load_prefixes = lambda reqs: loads.extend(reqs) or real(reqs)
    assert llm.warm_up() > 0
    if prefix:
        assert [(r[1], r[4][0]) for r in loads] == [(47, 32)]   # hit at 47 tokens, checkpoint at 32
    assert not llm.has_unfinished()
    assert len(llm.scheduler.free_slots) == llm.num_slots
    assert all(v == 0 for v in llm.stats.values() if isinstance(v, (int, float)))
    if prefix:
        snap = llm.prefix_stats()
        assert snap["prefix_evictions"] == 0 and len(llm.prefix_cache.index) == 0
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    with pytest.raises(ValueError, match="max_prompt_len"):
        llm.warm_up(max_prompt_len=95)


def test_warm_up_refuses_a_busy_engine(target):
    llm = LLM(target, max_num_seqs=2)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=N))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.warm_up()
