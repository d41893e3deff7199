import pytest

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.config import EngineConfig


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop=[""]), "stop"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature=10 ** 400), "temperature is too large"),
    (dict(top_k=10 ** 400), "top_k must be <="),
    (dict(repetition_penalty=1e-300), "repetition_penalty must be in"),
    (dict(stop=5), "stop must be a list"),
    (dict(stop_token_ids={1: 2}), "stop_token_ids must be a list"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="medusa"), "method"),
    (dict(num_tokens=0), "num_tokens"),
    (dict(num_tokens=-2), "num_tokens"),
    (dict(method="draft"), "draft_model"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(method="tree", tree="wide"), "tree"),
    (dict(method="tree", tree=[(0, 0)], draft_model="d"), "parent"),
    (dict(method="tree", tree=[(1,)], draft_model="d"), "sibling"),
    (dict(method="tree", tree=[(0,), (0,)], draft_model="d"), "duplicate"),
    (dict(method="tree", tree=[(0,), (-1,)], draft_model="d"), "negative"),
    (dict(method="tree", tree=["0", "00"], draft_model="d"), "path '0'"),
    (dict(method="tree", tree=[(0.9,), (1.7,)], draft_model="d"), "ranks must be ints"),
    (dict(method="tree", tree=[(False,), (True,)], draft_model="d"), "ranks must be ints"),
    (dict(method="tree", tree=[(0,), (1,)]), "needs draft_model"),
    (dict(method="ngram", tree=[(0,)]), "tree"),
    (dict(method="tree", tree_width=0), "tree_width"),
])
def test_bad_speculative_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def test_buffer_too_small_for_speculation():
    with pytest.raises(ValueError, match=r"buffer_size 8 < 2 \* \(draft tokens \+ 1\) = 10"):
        EngineConfig(buffer_size=8, speculative=SpeculativeConfig("ngram", num_tokens=4))
    EngineConfig(buffer_size=10, speculative=SpeculativeConfig("ngram", num_tokens=4))  # exactly enough
    # static tree: nodes + 1 verify inputs
    with pytest.raises(ValueError, match="buffer_size"):
        EngineConfig(buffer_size=8, speculative=SpeculativeConfig("tree", tree=[(0,), (1,), (0, 0), (0, 1)],
                                                                  draft_model="draft-dir"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(decode_mode="fast"), "decode_mode"),
    (dict(buffer_size=0), "buffer_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(memory_budget=-5), "memory_budget"),
    (dict(dtype="int8"), "dtype"),
    (dict(speculative="ngram"), "speculative"),
    (dict(auto_threshold=0), "auto_threshold"),
])
def test_bad_llm_args(target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(target, **kwargs)


def test_bad_prompts(target):
    """add_request raises and queues nothing; in generate a bad prompt fails alone (its
    output carries the error), and bad arguments of the call itself raise."""
    llm = LLM(target)
    for prompt, match in (([], "empty prompt"), ([1, 2, 999], "out of range"), ("hello", "tokenizer")):
        with pytest.raises(ValueError, match=match):
            llm.add_request(prompt)
        out = llm.generate([prompt, [1, 2]], SamplingParams(max_tokens=2))
        assert out[0].finish_reason == "error" and match in out[0].error and out[0].token_ids == []
        assert out[1].finish_reason == "length" and len(out[1].token_ids) == 2
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    assert not llm.has_unfinished()  # nothing was queued by the failed calls


def test_missing_model_dir():
    with pytest.raises(ValueError, match="not found"):
        LLM("/nonexistent/model/dir")


def test_budget_smaller_than_one_sequence(target):
    with pytest.raises(ValueError, match="memory_budget"):
        LLM(target, memory_budget=10)


def test_lazy_package_import():
    import subprocess
    import sys

    code = ("import sys, replayssm; assert 'torch' not in sys.modules; "
            "from replayssm import LLM, SamplingParams, SpeculativeConfig; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_sampling_params_edge_values_that_mean_something():
    """Below 1e-5 a temperature is greedy (dividing fp32 logits by less overflows them);
    ``None`` stop lists mean none, as OpenAI-style callers send them."""
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-40).temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy
    sp = SamplingParams(stop=None, stop_token_ids=None)
    assert sp.stop == () and sp.stop_token_ids == ()


def test_tiny_temperature_is_greedy_output(target):
    llm = LLM(target)
    prompt = [256, 100, 101, 102]
    want = llm.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    assert llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1e-40, seed=1))[0].token_ids == want


def test_engine_arguments_checked_or_clamped(target):
    with pytest.raises(ValueError, match="tokenizer must have encode"):
        LLM(target, tokenizer=5)
    llm = LLM(target, speculative={"method": "ngram", "num_tokens": 2})      # a dict, as EngineConfig takes
    assert llm.config.speculative.method == "ngram"
    small = LLM(target, decode_mode="auto", max_seq_len=64, max_num_seqs=2)
    huge = LLM(target, decode_mode="auto", max_seq_len=64, max_num_seqs=2, auto_threshold=100_000)
    assert huge.plan.auto_threshold == 64
    assert huge.plan.memory.need(64) <= 2 * small.plan.memory.need(64)


def test_options_that_would_be_ignored_are_refused(target):
    for kw, match in ((dict(gpu_memory_utilization=-3), "gpu_memory_utilization"),
                      (dict(gpu_memory_utilization="x"), "gpu_memory_utilization"),
                      (dict(pad_batches="yes"), "pad_batches"),
                      (dict(prefix_cache_blocks=8), "enable_prefix_caching")):
        with pytest.raises(ValueError, match=match):
            LLM(target, **kw)
    with pytest.raises(ValueError, match="draft_model is not used"):
        SpeculativeConfig("ngram", draft_model=target)


def test_a_tokenizer_larger_than_the_vocabulary_is_named_at_load(target):
    """Every text request would fail later: the mismatch is a warning when the engine is built."""
    from tokenizers import Tokenizer, models

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    with pytest.warns(UserWarning, match="more than the model's vocab_size"):
        LLM(target, tokenizer=big)


def test_fast_defaults_and_the_internal_spec(target):
    """max_seq_len / max_num_seqs / cuda_graphs default to None (resolved by the engine); the
    cache spec holds the verify window on top of max_seq_len."""
    from replayssm.engine.config import EngineConfig

    ec = EngineConfig()
    assert ec.max_seq_len is None and ec.max_num_seqs is None and ec.cuda_graphs is None
    with pytest.raises(ValueError, match="max_seq_len is not resolved yet"):
        ec.cache_spec()
    sp = EngineConfig(max_seq_len=100, speculative=SpeculativeConfig("ngram", num_tokens=4))
    assert sp.cache_spec().max_seq_len == 105 and EngineConfig(max_seq_len=100).cache_spec().max_seq_len == 101
    with pytest.warns(UserWarning, match="cuda_graphs=True ignored"):   # an explicit bool is kept
        llm = LLM(target, cuda_graphs=True, max_seq_len=64)
    assert llm.config.cuda_graphs is True and not llm.runner.use_graphs
    assert LLM(target, max_seq_len=64).config.cuda_graphs is False       # None: off on CPU
