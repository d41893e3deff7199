"""The JAX backend against the PyTorch engine: greedy tokens identical on the shipped model
and on tiny random HF checkpoints of every supported type (float64 and float32; replay and
recurrent; n-gram and draft speculation), logits of the full forward within a named
tolerance, sampling / stopping behaviour, bad settings, the CLI, and a jaxpr check that the
compiled decode loop never calls back to the host."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import replayssm  # noqa: E402
from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.jax.generate import JaxLLM  # noqa: E402

ASSETS = os.path.join(os.path.dirname(replayssm.__file__), "assets")
TARGET, DRAFT = os.path.join(ASSETS, "tiny-mamba2"), os.path.join(ASSETS, "tiny-mamba2-draft")
LOGITS_TOL = {"float64": dict(rtol=1e-9, atol=1e-9), "float32": dict(rtol=2e-4, atol=2e-4)}

PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [11, 2, 9, 40, 33, 11, 2, 9, 40, 1, 2, 3, 4], [8]]
_REFS: dict = {}


def _params(max_tokens=(14, 20, 9)):
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]


def _torch_ref(path, dtype, prompts=PROMPTS, params=None):
    key = (path, dtype, str(prompts), str(params))
    if key not in _REFS:
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _REFS[key] = [o.token_ids for o in LLM(path, dtype=dtype).generate(prompts, params or _params())]
        finally:
            torch.set_num_threads(n)
    return _REFS[key]


def _spec(method, draft=None, k=3):
    if method is None:
        return None
    return SpeculativeConfig(method, num_tokens=k, draft_model=draft if method == "draft" else None)


@pytest.mark.skipif(not os.path.isfile(os.path.join(DRAFT, "config.json")), reason="shipped models not present")
def test_shipped_model_with_shipped_draft_matches_torch():
    prompts = ["def fibonacci(n):", "import os\nclass Foo:", "x = 1"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = _torch_ref(TARGET, "float32", prompts, [params] * 3)
    llm = JaxLLM(TARGET, dtype="float32", decode_mode="replay", buffer_size=8,
                 speculative=SpeculativeConfig("draft", draft_model=DRAFT, num_tokens=3))
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == ref
    assert min(o.mean_accepted_length for o in out) > 1.5, [o.mean_accepted_length for o in out]
    assert out[0].text.strip()


@pytest.mark.parametrize("name,dtype,mode,method", [
    ("mamba2", "float64", "replay", None),
    ("mamba2_g3", "float64", "recurrent", "ngram"),
    ("nemotron_h", "float64", "replay", "ngram"),
    ("nemotron_h", "float64", "recurrent", None),
    ("nemotron_h", "float64", "replay", "draft"),
    ("qwen3_next", "float64", "replay", "ngram"),
    ("qwen3_next", "float64", "recurrent", "ngram"),
    ("qwen3_next_dense", "float32", "replay", None),
    ("nemotron_h_dense", "float32", "replay", "ngram"),
])
def test_greedy_tokens_match_torch_engine(hf_model_dir, name, dtype, mode, method):
    """Rows of one batch differ in prompt length and max_tokens; ``draft`` uses the model as its
    own draft (every draft accepted: the snapshot rollback of attention/GDN/MoE drafts)."""
    path = hf_model_dir(name)
    ref = _torch_ref(path, dtype)
    llm = JaxLLM(path, dtype=dtype, decode_mode=mode, buffer_size=8, speculative=_spec(method, path))
    out = llm.generate(PROMPTS, _params())
    assert [o.token_ids for o in out] == ref
    assert [len(o.token_ids) for o in out] == [14, 20, 9]
    if method == "draft":
        assert min(o.mean_accepted_length for o in out) > 3.0


@pytest.mark.parametrize("name,mode,method", [("mamba2_g3", "replay", "ngram"), ("nemotron_h", "recurrent", None),
                                              ("qwen3_next", "replay", None)])
def test_unrolled_layers_match_torch_engine(hf_model_dir, name, mode, method):
    """``layer_loop="unroll"`` (per-layer weights, layers unrolled in decode / verify, prefill
    stacked back into a scan; per-layer cache arrays in the loop): the engine's greedy tokens,
    and the same logits and cache as the scan after a prefill and four decode steps (through a
    flush), with stacked and with per-layer caches (states, windows, ring, K/V: every array)."""
    from replayssm.jax import model as M

    path = hf_model_dir(name)
    ref = _torch_ref(path, "float64")
    llm = JaxLLM(path, dtype="float64", decode_mode=mode, buffer_size=8, speculative=_spec(method), layer_loop="unroll")
    assert isinstance(llm.params["stages"][0], list)
    assert [o.token_ids for o in llm.generate(PROMPTS, _params())] == ref
    scan = JaxLLM(path, dtype="float64", decode_mode=mode, buffer_size=4, layer_loop="scan")
    ids = jnp.asarray([[3, 5, 7, 3, 5], [1, 2, 9, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 3], jnp.int32)
    caches = []
    for p, split in ((scan.params, False), (llm.params, False), (llm.params, True)):
        c = M.init_cache(scan.spec, 2, mode, 4, 32, fill=float("nan"))
        lg, c = M.prefill(scan.spec, p, c, ids, lengths)
        if split:   # per-layer cache arrays (as the unrolled loop carries them)
            c = M.split_cache(c)
            assert isinstance(c.stages[0]["state"], list)
        outs = [lg]
        for t in (4, 6, 8, 1):     # through a flush of the 4-entry ring
            lg, c = M.decode(scan.spec, p, c, jnp.asarray([t, t + 1], jnp.int32))
            outs.append(lg)
        if split:
            c = c.replace(stages=[{k: jnp.stack(v) for k, v in st.items()} for st in c.stages])
        caches.append((outs, c))
    (o1, c1) = caches[0]
    for o2, c2 in caches[1:]:
        for a, b in zip(o1, o2):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-12)
        for a, b in zip(jax.tree_util.tree_leaves(c1), jax.tree_util.tree_leaves(c2)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,dtype", [("mamba2_opts", "float64"), ("nemotron_h_opts", "float64"),
                                        ("qwen3_next_opts", "float64"), ("mamba2", "float32")])
def test_forward_logits_match_torch(hf_model_dir, name, dtype):
    from replayssm.jax.model import forward
    from replayssm.jax.params import load_params
    from replayssm.models import load_model

    path = hf_model_dir(name)
    ids = np.array([[3, 5, 7, 3, 5, 7, 3, 5, 9, 12, 1], [4, 4, 1, 2, 60, 33, 2, 1, 0, 8, 8]])
    spec, params = load_params(path, dtype)
    got = np.asarray(jax.jit(lambda p, x: forward(spec, p, x))(params, jnp.asarray(ids)))
    with torch.no_grad():
        want = load_model(path, dtype=dtype)(torch.tensor(ids)).numpy()
    np.testing.assert_allclose(got, want, **LOGITS_TOL[dtype])


def test_sampling_rows_and_stops(hf_model_dir):
    """One sampled batch: a greedy row and a top-k=1 row give the greedy tokens; a stop id
    ends a row (kept); a temperature/top-p row samples valid tokens.  A seeded request alone
    is reproducible, and gives the same tokens inside a batch of others (each row draws
    from its own key); two unseeded sampled rows draw differently."""
    path = hf_model_dir("mamba2")
    ref = _torch_ref(path, "float64")
    stop = ref[1][4]
    sampled = SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, top_k=20, ignore_eos=True)
    params = [SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.7, top_k=1, ignore_eos=True, stop_token_ids=[stop]), sampled]
    llm = JaxLLM(path, dtype="float64", decode_mode="replay", buffer_size=8, speculative=_spec("ngram"))
    a = llm.generate(PROMPTS, params)
    assert a[0].token_ids == ref[0]
    cut = ref[1].index(stop) + 1
    assert a[1].token_ids == ref[1][:cut] and a[1].finish_reason == "stop"
    assert len(a[2].token_ids) == 9 and a[2].finish_reason == "length" and all(0 <= t < 61 for t in a[2].token_ids)
    seeded = dataclasses.replace(sampled, seed=123)
    one, two = llm.generate(PROMPTS[2], seeded), llm.generate(PROMPTS[2], seeded)
    assert one[0].token_ids == two[0].token_ids and len(one[0].token_ids) == 9
    batch = llm.generate(PROMPTS, params[:2] + [seeded])
    assert batch[2].token_ids == one[0].token_ids
    assert [o.token_ids for o in batch[:2]] == [a[0].token_ids, a[1].token_ids]
    free = dataclasses.replace(sampled, max_tokens=30)
    x, y = llm.generate([PROMPTS[2], PROMPTS[2]], [free, free])
    assert x.token_ids != y.token_ids


def test_unsupported_settings_are_refused_by_name(hf_model_dir):
    """The PyTorch engine's prompt checks apply; max_tokens is clipped to the context as there
    (parameters the loop does not take: test_jax_sampling.py)."""
    path = hf_model_dir("mamba2")
    llm = JaxLLM(path, dtype="float32", max_seq_len=64)
    for bad in ([1, 2.7, 3], [True, 2]):
        with pytest.raises(ValueError, match="token ids must be ints"):
            llm.generate([bad], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="chunk_steps"):
        next(llm.stream(PROMPTS[0], SamplingParams(max_tokens=4), chunk_steps=0))
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1000, ignore_eos=True))[0]
    assert len(out.token_ids) == 64 - len(PROMPTS[0]) - 1 and out.finish_reason == "length"
    # prompts read as the PyTorch engine reads them: one id sequence (list, tuple, 1-D array) or a list of them
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    want = llm.generate([PROMPTS[0]], short)[0].token_ids
    for one in (tuple(PROMPTS[0]), np.asarray(PROMPTS[0]), [np.asarray(PROMPTS[0])]):
        got = llm.generate(one, short)
        assert len(got) == 1 and got[0].token_ids == want
    with pytest.raises(ValueError, match="leaves no room in max_seq_len 64"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=4))


def _primitives(jaxpr, out):
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, out)
    return out


def test_decode_loop_has_no_host_callback(hf_model_dir):
    """The whole decode phase (draft, verify, accept, commit, sampling) is one while loop
    (holding the inner loop of no-flush steps) with no callback primitive anywhere inside."""
    path = hf_model_dir("nemotron_h")
    llm = JaxLLM(path, dtype="float64", decode_mode="replay", buffer_size=8, speculative=_spec("draft", path))
    rows = llm._rows(PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9))
    prog, cfg = llm._program(rows)
    ids, lengths, rowp, key = llm._inputs(rows, cfg)
    carry = jax.eval_shape(prog._start, llm.params, llm.dparams, ids, lengths, rowp, key)
    jaxpr = jax.make_jaxpr(prog._loop)(llm.params, llm.dparams, carry, rowp, jnp.int32(5)).jaxpr
    top = [e.primitive.name for e in jaxpr.eqns]
    assert top.count("while") == 1
    inner = _primitives(jaxpr, [])
    names = set(inner)
    assert inner.count("while") == 2 and {"scan", "sort", "scatter"} <= names   # no-flush loop, draft steps, top-p
    assert not names & {"pure_callback", "io_callback", "debug_callback", "callback", "outside_call"}


def test_bad_settings_raise(hf_model_dir):
    path = hf_model_dir("mamba2")
    with pytest.raises(ValueError, match="decode_mode"):
        JaxLLM(path, decode_mode="paged")
    with pytest.raises(ValueError, match="chains"):
        JaxLLM(path, speculative=SpeculativeConfig("tree"))
    with pytest.raises(ValueError, match="buffer_size 8 < 2"):
        JaxLLM(path, buffer_size=8, speculative=_spec("ngram", k=4))
    with pytest.raises(ValueError, match="float64"):
        jax.config.update("jax_enable_x64", False)
        try:
            JaxLLM(path, dtype="float64")
        finally:
            jax.config.update("jax_enable_x64", True)
    with pytest.raises(ValueError, match="layer_loop"):
        JaxLLM(path, layer_loop="unrolled")
    llm = JaxLLM(path, dtype="float64")
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 99]])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text prompt")


def test_cli_backend_jax_streams_the_torch_tokens(hf_model_dir, capsys):
    from replayssm.cli import main as replayssm

    def main(args):
        return replayssm(["generate"] + args)

    path = hf_model_dir("mamba2")
    argv = ["--model", path, "--token-ids", "3,5,7,3,5", "--max-tokens", "12", "--ignore-eos",
            "--dtype", "float64", "--speculative", "ngram", "--num-tokens", "2"]
    assert main(argv) == 0
    want = capsys.readouterr().out.split()
    assert main(argv + ["--backend", "jax"]) == 0
    cap = capsys.readouterr()
    assert cap.out.split() == want and len(want) == 12
    assert "backend=jax" in cap.err
    assert main(argv + ["--backend", "jax", "--mode", "kv"]) == 0
    assert capsys.readouterr().out.split() == want


@pytest.mark.parametrize("name,mode,method", [("nemotron_h", "replay", None), ("mamba2", "replay", "ngram"),
                                              ("mamba2_g3", "recurrent", None), ("qwen3_next", "replay", None),
                                              ("mamba2", "kv", "ngram"), ("mamba2", "auto", "ngram")])
def test_compiled_loop_updates_the_cache_in_place(hf_model_dir, name, mode, method):
    """XLA copies an array it cannot update in place; a copy of a state, ring or K/V array
    inside the decode loop would move the whole cache every step.  None is copied: states
    (recurrent step; replay flush in stacked stages) are rewritten slice by slice in the
    layer, ring / K/V entries scattered after the layer scan; and no stacked state or ring
    array is copied transposed either (the batch-axis scatter of the flushed states did that).
    Conv windows (``W-1`` inputs per channel) are not checked."""
    import re

    path = hf_model_dir(name)
    llm = JaxLLM(path, dtype="float32", decode_mode=mode, buffer_size=8, speculative=_spec(method), layer_loop="scan")
    rows = llm._rows(PROMPTS * 6, SamplingParams(max_tokens=8))      # 18 rows: the cache dominates
    prog, cfg = llm._program(rows)
    ids, lengths, rowp, key = llm._inputs(rows, cfg)
    carry = jax.eval_shape(prog._start, llm.params, llm.dparams, ids, lengths, rowp, key)
    comp = jax.jit(prog._loop, donate_argnums=(2,)).lower(llm.params, llm.dparams, carry, rowp, jnp.int32(5)).compile()
    hlo = comp.as_text()

    def dims(shape):   # a shape up to order and unit axes (a transposed copy has the same)
        return tuple(sorted(int(v) for v in shape if int(v) != 1))

    exact, stacked = set(), set()     # every cache array (or its one layer); stacked state / ring arrays
    for c in carry["cache"].stages:
        for name_, a in c.items():
            if not name_.startswith("win_"):
                exact.add(tuple(a.shape))
                if a.shape[0] == 1:
                    exact.add(tuple(a.shape[1:]))
                elif name_ not in ("k", "v"):
                    stacked.add(dims(a.shape))
    assert len(exact) >= (4 if mode == "replay" else 1) and (bool(stacked) or not name.startswith("mamba2"))
    moved = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} (?:copy|transpose)\(", hlo)
    assert not {dims(s.split(",")) for s in moved} & stacked, sorted({dims(s.split(",")) for s in moved} & stacked)
    copied = {tuple(int(v) for v in s.split(",") if v) for s in re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} copy\(", hlo)}
    assert not copied & exact, sorted(copied & exact)

