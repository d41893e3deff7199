"""Tensor parallelism of the JAX backend (``jax.sharding`` over two host CPU devices, see
conftest): greedy tokens equal to the PyTorch engine (hence to one device) for the three model
types in both forms, with and without n-gram speculation (and a draft model); the parameters and the loop's
caches really split over the mesh; the CLI flag; bad sizes refused."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import torch  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.jax.generate import JaxLLM  # noqa: E402
from replayssm.jax.shard import AXIS, param_specs  # noqa: E402

PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [11, 2, 9, 40, 33, 11, 2, 9, 40, 1, 2, 3, 4], [8]]
MAX = (10, 14, 7)
#: tiny checkpoints whose head / intermediate / vocabulary axes all divide by 2
MODELS = {"mamba2_g3": dict(vocab_size=64),
          "nemotron_h": dict(vocab_size=64, moe_intermediate_size=8, moe_shared_expert_intermediate_size=10),
          "qwen3_next": dict(vocab_size=64, moe_intermediate_size=8, shared_expert_intermediate_size=10)}


@pytest.fixture(scope="module", autouse=True)
def two_devices():
    if jax.device_count() < 2:
        pytest.fail("the sharded tests need two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2 "
                    "must be set before jax starts (tests/jax/conftest.py does)")


def _params():
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX]


def _torch(path, mode):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(path, dtype="float64", decode_mode=mode, buffer_size=8)
        return [o.token_ids for o in llm.generate(PROMPTS, _params())]
    finally:
        torch.set_num_threads(n)


def _split_leaves(specs) -> int:
    return sum(AXIS in tuple(s) for s in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)))


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_greedy_tokens_match_torch_engine(hf_model_dir, name):
    path = hf_model_dir(name, **MODELS[name])
    runs = [("replay", "ngram"), ("recurrent", None)] + ([("replay", "draft")] if name == "mamba2_g3" else [])
    for mode, method in runs:    # draft: the model drafts for itself (sharded draft, snapshot rollback)
        ref = _torch(path, mode)
        spec = SpeculativeConfig(method, num_tokens=3, draft_model=path if method == "draft" else None) if method else None
        llm = JaxLLM(path, dtype="float64", decode_mode=mode, buffer_size=8, speculative=spec, tensor_parallel_size=2)
        out = llm.generate(PROMPTS, _params())
        assert [o.token_ids for o in out] == ref, (mode, method)
        if method == "draft":
            assert min(o.mean_accepted_length for o in out) > 3.0
        # every mixer kind of the model has split parameters, and the embedding is split
        specs = param_specs(llm.spec, llm.params, 2)
        for (sb, _), st in zip(llm.spec.stages, specs["stages"]):
            assert _split_leaves(st["mixer"]) > 0, sb.mixer.kind
        assert tuple(specs["embed"]) == (AXIS, None)
        # the arrays themselves live split on the two devices
        big = llm.params["stages"][0]["mixer"]["out_proj_w"]      # an SSM mixer in all three
        assert len(big.sharding.device_set) == 2
        shards = big.addressable_shards
        assert len(shards) == 2 and shards[0].data.size * 2 == big.size
        # the carry's caches after prefill keep their head split
        prog, carry, _ = llm.start(llm._rows(PROMPTS, _params()))
        split = [k for c in carry["cache"].stages for k, v in c.items() if AXIS in tuple(v.sharding.spec)]
        assert "state" in split or "k" in split, split


def test_sharded_matches_one_device_in_float32_and_cli(hf_model_dir, capsys):
    """float32 sharded vs one device on a Mamba-2 with one norm group (its gated norm folded
    past out_proj under TP: the norm's sum of squares and the partial products reduced
    together; sums split over devices round differently, so tokens are compared, not
    logits), and ``--tensor-parallel-size 2`` on the CLI."""
    from replayssm.cli import main as replayssm

    path = hf_model_dir("mamba2", vocab_size=64, num_heads=6, hidden_size=24)
    one = JaxLLM(path, dtype="float32", decode_mode="replay", buffer_size=8).generate(PROMPTS, _params())
    llm = JaxLLM(path, dtype="float32", decode_mode="replay", buffer_size=8, tensor_parallel_size=2)
    sp = llm.spec.stages[0][0].mixer
    assert dict(sp.opts)["fold_norm"] and sp.group_size == sp.H * sp.d
    assert AXIS in tuple(llm.params["stages"][0]["mixer"]["out_proj_w"].sharding.spec)
    two = llm.generate(PROMPTS, _params())
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    argv = ["generate", "--model", path, "--token-ids", "3,5,7,3,5", "--max-tokens", "6", "--ignore-eos",
            "--dtype", "float64", "--backend", "jax"]
    assert replayssm(argv) == 0
    want = capsys.readouterr().out.split()
    assert replayssm(argv + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out.split() == want and len(want) == 6
    assert replayssm(argv + ["--tensor-parallel-size", "3"]) == 2
    assert "needs 3 devices" in capsys.readouterr().err


def test_bad_tensor_parallel_sizes(hf_model_dir):
    path = hf_model_dir("mamba2_g3", **MODELS["mamba2_g3"])
    for bad, msg in ((0, "positive int"), (True, "positive int"), (1.5, "positive int"), (64, "needs 64 devices")):
        with pytest.raises(ValueError, match=msg):
            JaxLLM(path, tensor_parallel_size=bad)


def test_heads_that_do_not_divide_are_replicated(hf_model_dir):
    """Tiny Mamba-2 with 5 heads on 2 devices: the head leaves stay whole (replicated) and
    the tokens still match the engine's."""
    path = hf_model_dir("mamba2")
    llm = JaxLLM(path, dtype="float64", decode_mode="replay", buffer_size=8, tensor_parallel_size=2)
    specs = param_specs(llm.spec, llm.params, 2)
    assert _split_leaves(specs["stages"]) == 0
    got = llm.generate(PROMPTS, _params())
    assert [o.token_ids for o in got] == _torch(path, "replay")
    assert np.all([len(o.token_ids) for o in got] == np.array(MAX))


def test_sharded_loop_moves_activations_only(hf_model_dir):
    """The compiled TP loop (replay form, n-gram verify of T = 4 tokens) communicates only
    activations: all-reduces of ``[B, T, D]`` partial sums (out_proj's carrying the folded
    norm's sum of squares ``[B, T]``), all-gathers of the vocabulary-split argmax's
    (value, index) pairs; no all-to-all / permute (a cache split against the layer's heads,
    state split on ``d`` say, makes XLA reshard it with those)."""
    import re

    import jax.numpy as jnp

    path = hf_model_dir("mamba2", vocab_size=64, num_heads=6, hidden_size=24)
    llm = JaxLLM(path, dtype="float32", decode_mode="replay", buffer_size=8, tensor_parallel_size=2,
                 speculative=SpeculativeConfig("ngram", num_tokens=3))
    rows = llm._rows(PROMPTS, _params())
    prog, carry, rowp = llm.start(rows)
    hlo = prog.loop.lower(llm.params, llm.dparams, carry, rowp, jnp.int32(5)).compile().as_text()
    B, T, D = len(PROMPTS), 4, llm.spec.hidden_size
    found = re.findall(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)"
                       r"(?:-start)?\(", hlo)
    kinds = {k for _, k in found}
    assert kinds <= {"all-reduce", "all-gather"} and "all-reduce" in kinds, kinds
    folded = False
    for shapes, kind in found:
        dims = [tuple(int(v) for v in d.split(",") if v) for d in re.findall(r"\[([\d,]*)\]", shapes)]
        if kind == "all-gather":
            assert all(d[-1:] == (2,) for d in dims), shapes
        else:
            assert all(int(np.prod(d)) <= B * T * D for d in dims), shapes
            folded |= (B, T) in dims and (B, T, D) in dims
    assert folded, found
