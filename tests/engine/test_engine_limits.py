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
    (dict(max_seq_len=5, speculative=SpeculativeConfig("ngram", num_tokens=4)), "max_seq_len 5 leaves no room"),
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
    """max_tokens far past the context: the request stops at max_seq_len with finish
    "length", and no reservation ever asks for more than max_seq_len tokens."""
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
    assert len(out.prompt_token_ids) + len(out.token_ids) <= 40
    assert all(n <= 40 for n in asked)
