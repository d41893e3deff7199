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
