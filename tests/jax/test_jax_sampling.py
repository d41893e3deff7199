"""The JAX backend's sampling parameters against the PyTorch engine: penalties, logit_bias,
min_tokens (inside the compiled loop, decode and n-gram verify), logprobs, min_p, n > 1,
stop strings (on the host between chunks), and the parameters it refuses by name."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import torch  # noqa: E402

import replayssm  # noqa: E402
from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.jax.generate import JaxLLM  # noqa: E402

PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [11, 2, 9, 40, 33, 11, 2, 9, 40, 1, 2, 3, 4], [8]]
TINY = os.path.join(os.path.dirname(replayssm.__file__), "assets", "tiny-mamba2")


def _torch(path, dtype, prompts, params, **kw):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return LLM(path, dtype=dtype, buffer_size=8, **kw).generate(prompts, params)
    finally:
        torch.set_num_threads(n)


def _penalised():
    return [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.7, logprobs=3),
            SamplingParams(max_tokens=15, ignore_eos=True, frequency_penalty=0.9, presence_penalty=0.4,
                           logit_bias={7: 2.5, 9: -3.0}),
            SamplingParams(max_tokens=9, min_tokens=6, stop_token_ids=[5, 7, 9], repetition_penalty=1.2)]


@pytest.mark.parametrize("name,mode,method", [("mamba2", "replay", "ngram"), ("qwen3_next", "recurrent", None)])
def test_penalties_bias_min_tokens_logprobs_match_torch(hf_model_dir, name, mode, method):
    """Greedy tokens after penalties / logit_bias / min_tokens equal the engine's (the n-gram
    verify counts the chain's drafts as the engine's tree verify does), and logprobs (the raw
    model distribution) match it in float64."""
    path = hf_model_dir(name)
    spec = SpeculativeConfig("ngram", num_tokens=3) if method else None
    want = _torch(path, "float64", PROMPTS, _penalised(), decode_mode=mode, speculative=spec)
    llm = JaxLLM(path, dtype="float64", decode_mode=mode, buffer_size=8, speculative=spec)
    got = llm.generate(PROMPTS, _penalised())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert len(got[2].token_ids) >= 6                       # min_tokens held the stop ids back
    assert got[1].logprobs is None and want[0].logprobs is not None
    g, w = got[0].logprobs, want[0].logprobs
    assert len(g) == len(w) == 12
    np.testing.assert_allclose([x[0] for x in g], [x[0] for x in w], rtol=1e-9, atol=1e-9)
    assert [[t for t, _ in x[1]] for x in g] == [[t for t, _ in x[1]] for x in w]
    np.testing.assert_allclose([[v for _, v in x[1]] for x in g], [[v for _, v in x[1]] for x in w], rtol=1e-9, atol=1e-9)


def test_min_p_n_samples_and_seeds(hf_model_dir):
    """min_p = 1 keeps only the most likely token (the greedy tokens, sampled); n samples come
    back as ``samples`` with their index, seeded samples differ from each other and repeat
    across calls."""
    path = hf_model_dir("mamba2")
    greedy = _torch(path, "float64", PROMPTS[:1], SamplingParams(max_tokens=10, ignore_eos=True))
    llm = JaxLLM(path, dtype="float64", decode_mode="replay", buffer_size=8)
    ps = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, min_p=1.0),
          SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, n=3, seed=7)]
    a = llm.generate(PROMPTS[:2], ps)
    assert a[0].token_ids == greedy[0].token_ids and a[0].samples == []
    assert len(a) == 2 and [s.index for s in a[1].samples] == [0, 1, 2]
    assert a[1].token_ids == a[1].samples[0].token_ids and a[1].request_id == 1
    assert len({tuple(s.token_ids) for s in a[1].samples}) == 3
    b = llm.generate(PROMPTS[:2], ps)
    assert [s.token_ids for s in b[1].samples] == [s.token_ids for s in a[1].samples]


@pytest.mark.skipif(not os.path.isfile(os.path.join(TINY, "tokenizer.json")), reason="shipped model not present")
def test_stop_strings_match_torch():
    """Text stops on the host between loop chunks: the same tokens, text and finish reason as
    the engine (greedy, n-gram drafts: tokens accepted past the stop are dropped), and in
    stream."""
    prompts = ["def fibonacci(n):", "import os\nclass Foo:"]
    ps = [SamplingParams(max_tokens=30, stop=["\n\n", "return"]), SamplingParams(max_tokens=30, stop=["(self"])]
    want = _torch(TINY, "float32", prompts, ps)
    llm = JaxLLM(TINY, dtype="float32", buffer_size=8, speculative=SpeculativeConfig("ngram", num_tokens=3))
    assert any(o.finish_reason == "stop" for o in want)
    got = llm.generate(prompts, ps, chunk_steps=3)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason) for o in want]
    streamed = [t for c in llm.stream(prompts[0], ps[0], chunk_steps=2) for t in c]
    assert streamed == want[0].token_ids and llm.last_output.text == want[0].text


def test_refused_parameters_are_named(hf_model_dir):
    path = hf_model_dir("mamba2")
    llm = JaxLLM(path, dtype="float64")
    for kw, name in ((dict(structured_outputs={"regex": "a+"}), "structured_outputs"),
                     (dict(bad_words=["x"]), "bad_words"), (dict(stop=["x"]), "needs a tokenizer")):
        with pytest.raises(ValueError, match=name):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, **kw))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, logit_bias={999: 1.0}))
    with pytest.raises(ValueError, match="n == 1"):
        next(llm.stream(PROMPTS[0], SamplingParams(max_tokens=4, n=2, temperature=1.0)))
    draft = JaxLLM(path, dtype="float64", buffer_size=8, speculative=SpeculativeConfig("draft", draft_model=path, num_tokens=3))
    for kw in (dict(repetition_penalty=1.5), dict(logit_bias={3: 1.0}), dict(min_tokens=2)):
        with pytest.raises(ValueError, match="draft-model speculation"):
            draft.generate(PROMPTS[0], SamplingParams(max_tokens=4, **kw))
