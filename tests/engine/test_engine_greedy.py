"""Greedy output is identical across decode modes and drafters, and equals plain decoding."""

import pytest

from replayssm import LLM, SamplingParams, SpeculativeConfig

from engine_helpers import PROMPTS, CharTok, reference_greedy

N = 24


@pytest.fixture(scope="module")
def expected(target):
    return [reference_greedy(target, p, N) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_modes_match_plain_decoding(target, expected, mode):
    llm = LLM(target, decode_mode=mode, auto_threshold=6)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    if mode == "auto":  # every request passed the threshold and was switched to a state
        assert sorted(llm.cache.switched) == sorted(set(llm.cache.switched))
        assert len(llm.cache.switched) == len(PROMPTS)


def _specs(draft):
    return {
        "ngram": SpeculativeConfig("ngram", num_tokens=4),
        "ngram-n1": SpeculativeConfig("ngram", num_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1),
        "ngram-tree": SpeculativeConfig("tree", num_tokens=3, tree_width=2),
        "draft": SpeculativeConfig("draft", num_tokens=4, draft_model=draft),
        "draft-k1": SpeculativeConfig("draft", num_tokens=1, draft_model=draft),
        "tree-beam": SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=3),
        "tree-beam-d1": SpeculativeConfig("tree", draft_model=draft, tree_width=3, tree_depth=1),
        "tree-static": SpeculativeConfig("tree", draft_model=draft,
                                         tree=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
    }


SPEC_NAMES = ["ngram", "ngram-n1", "ngram-tree", "draft", "draft-k1", "tree-beam", "tree-beam-d1", "tree-static"]


@pytest.mark.parametrize("name", SPEC_NAMES)
@pytest.mark.parametrize("mode", ["replay", "recurrent", "auto"])
def test_speculation_never_changes_greedy_output(target, draft, expected, name, mode):
    sp = _specs(draft)[name]
    llm = LLM(target, decode_mode=mode, speculative=sp, buffer_size=16, auto_threshold=10)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        assert o.mean_accepted_length >= 1.0
        assert o.num_accepted <= o.num_drafted
        assert sum(o.accepted_lengths) >= N - 1  # every token after the first came from a step
    if name.startswith("draft") or name.startswith("tree-"):
        # a draft close to the target gets several tokens accepted per step
        assert max(o.mean_accepted_length for o in outs) > 1.5


def test_kv_mode_with_speculation(target, draft, expected):
    llm = LLM(target, decode_mode="kv", speculative=SpeculativeConfig("draft", num_tokens=3, draft_model=draft))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected


def test_float32_engine_matches(target, expected):
    llm = LLM(target, dtype="float32")
    assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N))] == expected


def test_padded_batches_match(target, draft, expected):
    """The null-slot padding path the CUDA graphs use, exercised on CPU."""
    for sp in (None, _specs(draft)["tree-beam"]):
        llm = LLM(target, speculative=sp, pad_batches=True, max_num_seqs=8)
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N))] == expected
        assert any(c[1] > len(PROMPTS) for c in llm.cache.calls if c[0] in ("decode", "tree"))


def test_padded_ngram_chains_match(target, expected):
    """With CUDA graphs, n-gram chains are padded to num_tokens drafts (invalid nodes): one
    verify shape per batch bucket.  Padding is never accepted and keeps greedy output."""
    for mode in ("replay", "recurrent"):
        llm = LLM(target, decode_mode=mode, speculative=SpeculativeConfig("ngram", num_tokens=4))
        llm.drafter.pad = True
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
        assert [o.token_ids for o in outs] == expected
        verify_T = {c[2] for c in llm.cache.calls if c[0] == "verify"}
        assert verify_T == {5}, verify_T
        assert all(o.num_accepted <= o.num_drafted for o in outs)


def test_requests_join_mid_flight(target, draft, expected):
    """Requests of different lengths join and leave between steps."""
    for sp in (None, SpeculativeConfig("draft", num_tokens=3, draft_model=draft)):
        llm = LLM(target, speculative=sp, max_num_seqs=3)
        lens = [5, 24, 9, 17, 3]
        seqs = [llm.add_request(PROMPTS[0], SamplingParams(max_tokens=lens[0]))]
        llm.step()
        llm.step()
        seqs.append(llm.add_request(PROMPTS[1], SamplingParams(max_tokens=lens[1])))
        llm.step()
        seqs += [llm.add_request(PROMPTS[i], SamplingParams(max_tokens=lens[i])) for i in (2, 3, 4)]
        batch_sizes = set()
        while llm.has_unfinished():
            llm.step()
            batch_sizes.add(len(llm.scheduler.running))
            assert len(llm.scheduler.running) <= 3
        outs = [llm.output(s) for s in seqs]
        for i, o in enumerate(outs):
            assert o.token_ids == expected[i][: lens[i]], i
        assert llm.scheduler.peak_running == 3
        assert len(llm.scheduler.free_slots) == llm.num_slots  # every slot came back


def test_eos_and_stop_tokens(target, expected):
    e = expected[1]
    eos = e[5]
    llm = LLM(target)
    llm.outputs.eos_token_id = eos
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=N))[0]
    assert out.token_ids == e[: e.index(eos) + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=N, ignore_eos=True))[0]
    assert out.token_ids == e
    llm.outputs.eos_token_id = None
    stop = e[8]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=N, stop_token_ids=[stop]))[0]
    assert out.token_ids == e[: e.index(stop) + 1] and out.finish_reason == "stop"


def test_stop_inside_accepted_drafts(target, draft, expected):
    """A stop token accepted in the middle of a draft chain cuts the output there."""
    e = expected[3]
    stop = e[6]
    llm = LLM(target, speculative=SpeculativeConfig("draft", num_tokens=4, draft_model=draft))
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=N, stop_token_ids=[stop]))[0]
    assert out.token_ids == e[: e.index(stop) + 1]
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=7))[0]
    assert out.token_ids == e[:7]



def test_string_prompts_and_stop_strings(target, expected):
    tok = CharTok()
    llm = LLM(target, tokenizer=tok)
    prompt = tok.decode(PROMPTS[0])
    out = llm.generate([prompt], SamplingParams(max_tokens=N))[0]
    assert out.token_ids == expected[0] and out.text == tok.decode(expected[0]) and out.prompt == prompt
    text = out.text
    stop = text[5:7]
    out2 = llm.generate([prompt], SamplingParams(max_tokens=N, stop=[stop]))[0]
    assert out2.finish_reason == "stop" and out2.text == text[: text.index(stop)]


def test_stream(target, expected):
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_tokens=3))
    chunks = list(llm.stream(PROMPTS[3], SamplingParams(max_tokens=N)))
    assert [t for c in chunks for t in c] == expected[3]
    assert llm.last_output.token_ids == expected[3]


@pytest.mark.parametrize("name", ["ngram", "ngram-tree", "draft", "tree-beam"])
@pytest.mark.parametrize("mode", ["replay", "recurrent"])
def test_speculation_off_above_a_batch_size_keeps_greedy_output(target, draft, expected, name, mode):
    """``disable_by_batch_size=2``: the first steps (5 running) decode plainly, the last ones
    (requests of different lengths finish, 2 or 1 left) speculate; the drafters catch up on
    the plain steps' tokens and the output is unchanged."""
    import dataclasses

    sp = dataclasses.replace(_specs(draft)[name], disable_by_batch_size=2)
    lens = [N, N - 3, N - 7, 9, 5]
    llm = LLM(target, decode_mode=mode, speculative=sp, buffer_size=16, max_num_seqs=5)
    seqs = [llm.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, lens)]
    while llm.has_unfinished():
        llm.step()
    assert [s.output_ids for s in seqs] == [e[:n] for e, n in zip(expected, lens)]
    assert all(s.num_verify_steps < s.num_steps for s in seqs)   # plain steps while 5 ran
    assert seqs[0].num_verify_steps > 0                            # it speculated once alone


def test_disable_by_batch_size_is_validated():
    for bad in (0, -3, 2.5, "8"):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            SpeculativeConfig("ngram", disable_by_batch_size=bad)
