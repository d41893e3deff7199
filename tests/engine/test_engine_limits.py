"""Limits and input validation of the engine API: every error names the field and value,
is raised before any cache is allocated or touched, and leaves the LLM working (its next
output equals a fresh engine's); a bad request in a batch fails alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.config import MAX_VERIFY_TOKENS, EngineConfig
from replayssm.engine.inputs import encode_prompt, prompt_list

from engine_helpers import PROMPTS, reference_greedy

N = 8


@pytest.fixture(scope="module")
def expected(target):
    return [reference_greedy(target, p, N) for p in PROMPTS]


class _Tok:
    """A byte tokenizer (ids = UTF-8 bytes mod 32), enough to exercise the text path."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self._Enc([b % 32 for b in text.encode("utf-8")])

    def decode(self, ids):
        return "".join(chr(65 + i) for i in ids)


# ---------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("prompt, match", [
    ([97.9], r"element 0 is 97.9 \(float\)"),
    ([1, "2"], r"element 1 is '2' \(str\)"),
    ([True, 1], r"element 0 is True \(bool\)"),
    ([1, np.float32(3)], r"element 1 is .*3.0.*numpy.float32"),
    ([1, 2, 32], r"token id 32 at position 2 is out of range: the vocabulary is \[0, 32\)"),
    ([-1], r"token id -1 at position 0"),
    ([], "empty prompt"),
    (torch.tensor([1.0, 2.0]), "dtype torch.float32"),
    (torch.tensor([[1, 2]]), r"1-D token ids, got shape \(1, 2\)"),
    (np.array([1.5]), "dtype float64"),
    (b"abc", "got bytes"),
    ("a\ud800b", r"lone surrogate U\+D800 at character 1"),
    ("def \udcff():", "not valid UTF-8: byte 0xff at character 4"),
    (3.5, "got float"),
])
def test_bad_prompts_are_named(prompt, match):
    with pytest.raises(ValueError, match=match):
        encode_prompt(prompt, _Tok(), 32)


def test_integer_scalars_and_arrays_are_token_ids():
    want = (None, [1, 2, 3])
    assert encode_prompt([np.int64(1), torch.tensor(2), 3], None, 32) == want
    assert encode_prompt(np.array([1, 2, 3], dtype=np.int32), None, 32) == want
    assert encode_prompt(torch.tensor([1, 2, 3]), None, 32) == want
    assert encode_prompt("ab", _Tok(), 32) == ("ab", [97 % 32, 98 % 32])
    assert prompt_list([np.int64(1), 2]) == [[np.int64(1), 2]]
    assert prompt_list([[1], [2]]) == [[1], [2]]
    assert prompt_list("x") == ["x"]


def test_bad_request_in_a_batch_fails_alone_and_the_engine_keeps_working(target, expected):
    llm = LLM(target, max_num_seqs=3, tokenizer=_Tok())
    bad = [[1, 2.5], [True], "x\ud800", [], [1, 99]]
    prompts = [PROMPTS[0]] + bad + [PROMPTS[3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N, ignore_eos=True))
    assert [o.token_ids for o in (outs[0], outs[-1])] == [expected[0], expected[3]]
    for o in outs[1:-1]:
        assert o.finish_reason == "error" and o.error and o.token_ids == [] and o.finished
    assert "element 1 is 2.5" in outs[1].error and "character 1" in outs[3].error
    assert not llm.has_unfinished() and len(llm.scheduler.free_slots) == llm.num_slots
    # the step-wise API refuses the same requests at add_request, queueing nothing
    for p in bad:
        with pytest.raises(ValueError):
            llm.add_request(p, SamplingParams(max_tokens=N))
    assert not llm.has_unfinished()
    # the same object afterwards gives what a fresh engine gives
    again = llm.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True))
    fresh = LLM(target, max_num_seqs=3).generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh] == expected


# ---------------------------------------------------------------------------- settings
@pytest.fixture
def no_cache(target, monkeypatch):
    """Fail if an LLM gets as far as allocating a cache."""
    def refuse(*a, **kw):
        raise AssertionError("make_cache was called")

    monkeypatch.setattr(target, "make_cache", refuse)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device 'tpu' is not a device torch knows"),
    (dict(device="meta"), "device 'meta' holds no data"),
    (dict(device="mps"), "device 'mps' is not supported"),
    (dict(device=None), "device must be a string"),
    (dict(seed="x"), "seed must be an int, got 'x'"),
    (dict(seed=1.5), "seed must be an int, got 1.5"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be a bool"),
    (dict(buffer_size=10, speculative=SpeculativeConfig("ngram", num_tokens=8)),
     r"buffer_size 10 < 2 \* \(draft tokens \+ 1\) = 18"),
    (dict(max_seq_len=1, speculative=SpeculativeConfig("ngram", num_tokens=4)),
     r"max_seq_len 1 leaves no room for a prompt token and a generated token \(needs >= 2\)"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(max_seq_len=2.5), "max_seq_len must be an int, got 2.5"),
    (dict(max_seq_len=10 ** 13, decode_mode="kv"), r"max_seq_len = 10000000000000 with max_num_seqs = 16 needs"),
])
def test_bad_settings_fail_before_any_cache(target, no_cache, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(target, **kwargs)


def test_cuda_without_cuda_is_named(target, no_cache):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="'cuda' requested but CUDA is not available"):
        LLM(target, device="cuda")


def test_cache_estimate_is_what_make_cache_allocates():
    """The pre-allocation check uses the caches' measured layouts: exactly the bytes the
    cache tensors take (so it neither misses a huge cache nor refuses a reasonable one)."""
    from replayssm.engine.cli import DEFAULT_MODEL
    from replayssm.models import load_model

    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("shipped model not present")
    model = load_model(DEFAULT_MODEL)
    for mode in ("recurrent", "replay", "kv", "auto"):
        llm = LLM(model, decode_mode=mode, max_num_seqs=3, max_seq_len=512)
        est = llm.plan.cache_bytes()
        assert est == llm.cache.nbytes(), (mode, llm.cache.nbytes(), est)


# ---------------------------------------------------------------------------- speculation sizes
def test_tree_and_chain_sizes_are_bounded():
    with pytest.raises(ValueError, match=r"tree_width 50 x depth 50 = 2500 draft tokens per step; at most 127"):
        SpeculativeConfig("tree", tree_width=50, num_tokens=50)
    with pytest.raises(ValueError, match=r"num_tokens = 128 draft tokens per step"):
        SpeculativeConfig("ngram", num_tokens=MAX_VERIFY_TOKENS)
    SpeculativeConfig("ngram", num_tokens=MAX_VERIFY_TOKENS - 1)  # the largest that fits


def test_default_buffer_fits_the_speculation():
    """buffer_size left unset: 16, or 2 x the verify window when speculation needs more;
    an explicit size too small is an error naming it."""
    assert EngineConfig().buffer_size == 16
    assert EngineConfig(speculative=SpeculativeConfig("ngram", num_tokens=4)).buffer_size == 16
    tree = SpeculativeConfig("tree", draft_model="draft-dir")         # width 2 x depth 4 = 8 nodes
    assert EngineConfig(speculative=tree).buffer_size == 18
    assert EngineConfig(speculative=SpeculativeConfig("ngram", num_tokens=20)).buffer_size == 42
    with pytest.raises(ValueError, match=r"buffer_size 16 < .* = 18.*leave buffer_size unset to get 18"):
        EngineConfig(buffer_size=16, speculative=tree)


def test_draft_tree_with_default_buffer_runs(target, draft, expected):
    llm = LLM(target, speculative=SpeculativeConfig("tree", draft_model=draft))
    assert llm.config.buffer_size == 18
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=N, ignore_eos=True))[0]
    assert out.token_ids == expected[0]


# ---------------------------------------------------------------------------- max_tokens
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_max_tokens_is_clipped_to_the_context_in_every_mode(target, mode, monkeypatch):
    """max_tokens far past the context: the request stops at exactly max_seq_len tokens with
    finish "length", and no reservation ever asks for more than max_seq_len tokens plus the
    verify window (the cache's own room)."""
    llm = LLM(target, decode_mode=mode, max_seq_len=40, auto_threshold=8,
              speculative=SpeculativeConfig("ngram", num_tokens=3))
    asked = []
    if hasattr(llm.cache, "reserve"):
        real = llm.cache.reserve

        def spy(slot, total_len, **kw):
            asked.append(total_len)
            return real(slot, total_len, **kw)

        monkeypatch.setattr(llm.cache, "reserve", spy)
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10 ** 9, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.error is None
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40
    assert llm.plan.spec.max_seq_len == 40 + 4
    assert all(n <= 40 + 4 for n in asked)


# ---------------------------------------------------------------------------- the context rule
SPECS = [None, SpeculativeConfig("ngram", num_tokens=4), "draft"]


@pytest.mark.parametrize("mode", ["replay", "kv"])
@pytest.mark.parametrize("sp", SPECS, ids=["plain", "ngram", "draft"])
def test_max_seq_len_is_exact_with_or_without_speculation(target, draft, mode, sp):
    """max_seq_len counts prompt + generated tokens and is the same usable length with any
    speculation: a prompt of max_seq_len - 1 tokens gets its one token, one more token is
    refused at add_request with both numbers (and queues nothing)."""
    if sp == "draft":
        sp = SpeculativeConfig("draft", num_tokens=3, draft_model=draft)
    L = 40
    llm = LLM(target, decode_mode=mode, max_seq_len=L, speculative=sp, max_num_seqs=2)
    T = 1 if sp is None else sp.verify_tokens
    assert llm.scheduler.token_limit == llm.config.max_seq_len == llm.plan.max_seq_len == L
    assert llm.plan.spec.max_seq_len == L + T
    assert llm.config.max_seq_len_source == "max_seq_len (given)"
    prompt = [(5 * j + 1) % 32 for j in range(L - 1)]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 1 and out.finish_reason == "length"
    want = reference_greedy(target, prompt, 1)
    assert out.token_ids == want
    with pytest.raises(ValueError, match=rf"prompt of {L} tokens does not fit max_seq_len={L}.* at most {L - 1}"):
        llm.add_request(prompt + [1], SamplingParams(max_tokens=1))
    assert not llm.has_unfinished()
    # in a batch: that prompt alone fails, with the message, and the other runs
    outs = llm.generate([prompt + [1], prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    assert outs[0].finish_reason == "error" and outs[0].token_ids == [] and f"max_seq_len={L}" in outs[0].error
    assert outs[1].token_ids == want


def test_default_context_is_the_models_and_is_lowered_to_fit_the_budget(target):
    """max_seq_len=None: the model's max_position_embeddings (DEFAULT_CONTEXT when it states
    none); lowered to a multiple of the block size when the slots' caches do not fit."""
    from replayssm.engine.cache_plan import DEFAULT_CONTEXT, DEFAULT_MAX_NUM_SEQS

    llm = LLM(target, decode_mode="kv")
    assert llm.config.max_seq_len == llm.scheduler.token_limit == DEFAULT_CONTEXT
    assert "DEFAULT_CONTEXT" in llm.config.max_seq_len_source
    assert llm.num_slots == llm.config.max_num_seqs == DEFAULT_MAX_NUM_SEQS   # CPU, no budget
    assert llm.config.cuda_graphs is False and llm.runner.use_graphs is False

    target.config.max_position_embeddings = 1000
    try:
        llm = LLM(target, decode_mode="kv", max_num_seqs=2)
        assert llm.config.max_seq_len == 1000 and "max_position_embeddings (1000)" in llm.config.max_seq_len_source
        mem, T = llm.plan.memory, llm.plan.memory.verify_tokens
        # a budget for 2 slots and one sequence of ~300 tokens: the context comes down to
        # what fits, in whole blocks (the budget still decides how many run at once)
        budget = 2 * mem.fixed + mem.dynamic(300 + T)
        small = LLM(target, decode_mode="kv", max_num_seqs=2, memory_budget=budget)
        L = small.config.max_seq_len
        assert L % 16 == 0 and 256 <= L <= 300 and small.num_slots == 2
        assert "lowered" in small.config.max_seq_len_source and "memory_budget" in small.config.max_seq_len_source
        assert small.plan.memory.dynamic(L + T) <= budget - 2 * mem.fixed < small.plan.memory.dynamic(L + 16 + T)
        # max_num_seqs=None sizes the slots from the budget at the model's context: each a full one
        auto = LLM(target, decode_mode="kv", memory_budget=3 * mem.need(1000 + T) + 100)
        assert auto.config.max_seq_len == 1000 and auto.num_slots == auto.config.max_num_seqs == 3
        one = LLM(target, decode_mode="kv", memory_budget=mem.need(500 + T))
        assert one.num_slots == 1 and 480 <= one.config.max_seq_len <= 500
        # an explicit max_seq_len is kept (and the budget caps what each request gets)
        kept = LLM(target, decode_mode="kv", max_num_seqs=2, memory_budget=budget, max_seq_len=1000)
        assert kept.config.max_seq_len == 1000
    finally:
        del target.config.max_position_embeddings


def test_default_context_is_lowered_to_the_free_memory(target, monkeypatch):
    """Without a budget on CPU, the caches must fit the available RAM: the context is lowered
    to what does, and an explicit max_seq_len that does not fit is refused."""
    from replayssm.engine import cache_plan

    probe = LLM(target, decode_mode="kv", max_num_seqs=4, max_seq_len=512)
    free = probe.plan.cache_bytes()
    monkeypatch.setattr(cache_plan, "available_memory", lambda device: free)
    llm = LLM(target, decode_mode="kv", max_num_seqs=4)
    assert llm.config.max_seq_len == 512 and llm.plan.cache_bytes() <= free
    assert "free on cpu" in llm.config.max_seq_len_source
    with pytest.raises(ValueError, match=r"max_seq_len = 1024 with max_num_seqs = 4 needs"):
        LLM(target, decode_mode="kv", max_num_seqs=4, max_seq_len=1024)
    monkeypatch.setattr(cache_plan, "available_memory", lambda device: 1000)
    with pytest.raises(ValueError, match=r"caches of 4 slot\(s\) \(max_num_seqs\) do not fit the 1000 B free on cpu"):
        LLM(target, decode_mode="kv", max_num_seqs=4)
