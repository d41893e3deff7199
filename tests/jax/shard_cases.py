"""Tensor parallelism of the JAX backend (``jax.sharding`` over two host CPU devices, see
conftest): greedy tokens equal to the PyTorch engine (hence to one device) for the three model
types in both forms, with and without n-gram speculation (and a draft model), in the default
grouped layer loop and in the scan; grouped stages whose layer count the group size does not
divide, and the unrolled loop, against one device; the parameters (every layout) and the
loop's caches really split over the mesh; the CLI flag; bad sizes refused."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import torch  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.jax import model as M  # noqa: E402
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


def _stacks(stage) -> list:
    """The layer dicts of one stage in any layout (stacked, grouped tuple, per-layer list)."""
    return list(stage) if isinstance(stage, (tuple, list)) else [stage]


def _check_split_params(spec, params, stacked: int = 1):
    """Every stack of every stage has split mixer leaves, each array is split exactly where
    its spec from :func:`param_specs` (the layout's) says, ``out_proj`` is halved on its
    columns on the two devices, and the embedding is split."""
    specs = param_specs(spec, params, 2)
    for (sb, _), st, pst in zip(spec.stages, specs["stages"], params["stages"]):
        assert type(st) is type(pst), (type(st), type(pst))
        for sp, p in zip(_stacks(st), _stacks(pst)):
            assert _split_leaves(sp["mixer"]) > 0, sb.mixer.kind
            for k, a in p["mixer"].items():
                want = tuple(sp["mixer"][k])
                assert tuple(a.sharding.spec) + (None,) * (len(want) - len(a.sharding.spec)) == want, (k, a.sharding)
    for p in _stacks(params["stages"][0]):   # an SSM mixer's out_proj: columns split
        big = p["mixer"]["out_proj_w"]
        assert tuple(big.sharding.spec)[stacked + 1] == AXIS and len(big.sharding.device_set) == 2
        shards = big.addressable_shards
        assert len(shards) == 2 and shards[0].data.size * 2 == big.size
    assert tuple(specs["embed"]) == (AXIS, None)


def _split_caches(llm, rows) -> list:
    """Names of the loop carry's cache arrays (after prefill) split over the mesh."""
    _, carry, _ = llm.start(rows)
    return [k for c in carry["cache"].stages for k, v in c.items()
            if all(AXIS in tuple(a.sharding.spec) for a in (v if isinstance(v, list) else [v]))]


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_greedy_tokens_match_torch_engine(hf_model_dir, name):
    """The default (grouped) layer loop in every run; the scan in the replay one."""
    path = hf_model_dir(name, **MODELS[name])
    runs = [("replay", "ngram"), ("recurrent", None)] + ([("replay", "draft")] if name == "mamba2_g3" else [])
    for mode, method in runs:    # draft: the model drafts for itself (sharded draft, snapshot rollback)
        ref = _torch(path, mode)
        spec = SpeculativeConfig(method, num_tokens=3, draft_model=path if method == "draft" else None) if method else None
        loops = (None, "scan") if method == "ngram" else (None,)
        for loop in loops:
            llm = JaxLLM(path, dtype="float64", decode_mode=mode, buffer_size=8, speculative=spec,
                         tensor_parallel_size=2, layer_loop=loop)
            assert llm.layer_loop == (loop or "group")
            assert isinstance(llm.params["stages"][0], tuple if loop is None else dict)
            out = llm.generate(PROMPTS, _params())
            assert [o.token_ids for o in out] == ref, (mode, method, llm.layer_loop)
            if method == "draft":
                assert min(o.mean_accepted_length for o in out) > 3.0
                _check_split_params(llm.dspec, llm.dparams)
            # every mixer kind of the model has split parameters (each stack of a grouped
            # stage), the embedding is split, the arrays themselves live split on the devices
            _check_split_params(llm.spec, llm.params)
            # the carry's caches after prefill keep their head split
            split = _split_caches(llm, llm._rows(PROMPTS, _params()))
            assert "state" in split or "k" in split, split


@pytest.mark.parametrize("name,extra,group,mode,method", [
    # 6 layers, groups of at most 4: the largest divisor, 3 (two groups; verify steps too)
    ("mamba2_g3", {"num_hidden_layers": 6}, 4, "replay", "ngram"),
    ("mamba2_g3", {"num_hidden_layers": 6}, 4, "recurrent", None),
    # a hybrid with a 4-layer Mamba-2 stage, groups of at most 3: 2
    ("nemotron_h", {"hybrid_override_pattern": "MMMM*-E"}, 3, "replay", None),
])
def test_grouped_stages_the_group_size_does_not_divide(hf_model_dir, name, extra, group, mode, method):
    """Sharded grouped tokens equal one device's and the engine's; each of the ``g`` stacks
    of a stage (leaves ``[cnt / g, ...]``) splits on the stacked leaves' axes; the unrolled
    loop (per-layer weights and caches) under the mesh too (recurrent)."""
    path = hf_model_dir(name, **{**MODELS[name], **extra})
    spec = SpeculativeConfig(method, num_tokens=3) if method else None
    kw = {"dtype": "float64", "decode_mode": mode, "buffer_size": 8, "speculative": spec, "layer_loop": "group",
          "layer_group": group}
    one = [o.token_ids for o in JaxLLM(path, **kw).generate(PROMPTS, _params())]
    assert one == _torch(path, mode)
    llm = JaxLLM(path, tensor_parallel_size=2, **kw)
    cnt = llm.spec.stages[0][1]
    g = 3 if name == "mamba2_g3" else 2
    assert cnt % group and len(llm.params["stages"][0]) == g
    assert llm.params["stages"][0][0]["mixer"]["in_x_w"].shape[0] == cnt // g
    assert [o.token_ids for o in llm.generate(PROMPTS, _params())] == one
    _check_split_params(llm.spec, llm.params)
    # each stack's specs are those of the stage stacked back into one [cnt, ...] stack
    stacked = param_specs(llm.spec, {**llm.params, "stages": [M._ungroup(p) for p in llm.params["stages"]]}, 2)
    for st, grouped in zip(stacked["stages"], param_specs(llm.spec, llm.params, 2)["stages"]):
        assert len(grouped) >= 1 and all(q == st for q in grouped)
    assert "state" in _split_caches(llm, llm._rows(PROMPTS, _params()))
    if mode == "recurrent":   # unrolled layers under the mesh: per-layer weights and caches split
        llm = JaxLLM(path, tensor_parallel_size=2, **{**kw, "layer_loop": "unroll"})
        assert isinstance(llm.params["stages"][0], list) and len(llm.params["stages"][0]) == cnt
        assert [o.token_ids for o in llm.generate(PROMPTS, _params())] == one
        _check_split_params(llm.spec, llm.params, stacked=0)
        assert "state" in _split_caches(llm, llm._rows(PROMPTS, _params()))


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
    assert all(AXIS in tuple(p["mixer"]["out_proj_w"].sharding.spec) for p in _stacks(llm.params["stages"][0]))
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
