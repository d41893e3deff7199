"""Layer loops of the JAX backend: the grouped loop (``layer_loop="group"``: a scan over groups
of layers, each group unrolled) against the PyTorch engine's greedy tokens and against the
scan's logits and caches; the grouped parameter layout; the compiler options and bad input."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.jax import model as M  # noqa: E402
from replayssm.jax.compiler import DEFAULT_COMPILER_OPTIONS, SCAN_COMPILER_OPTIONS, compiler_options  # noqa: E402
from replayssm.jax.generate import JaxLLM  # noqa: E402

PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [11, 2, 9, 40, 33, 11, 2, 9, 40, 1, 2, 3, 4], [8]]
PARAMS = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 20, 9)]


def _torch_tokens(path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [o.token_ids for o in LLM(path, dtype="float64").generate(PROMPTS, PARAMS)]
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("name,extra,mode,method", [
    ("mamba2", {"num_hidden_layers": 6}, "replay", "ngram"),     # 6 layers: 3 groups of 2 (verify too)
    ("nemotron_h", {}, "recurrent", None),                      # hybrid: stages of one layer
    ("qwen3_next", {}, "replay", None),                          # GDN + attention + MoE
])
def test_grouped_layers_match_torch_engine(hf_model_dir, name, extra, mode, method):
    path = hf_model_dir(name, **extra)
    spec = SpeculativeConfig(method, num_tokens=3) if method else None
    llm = JaxLLM(path, dtype="float64", decode_mode=mode, buffer_size=8, speculative=spec, layer_loop="group",
                 layer_group=2)
    stage = llm.params["stages"][0]
    assert isinstance(stage, tuple)
    if name == "mamba2":   # the 6-layer stage: two stacks of three layers each
        assert len(stage) == 2 and stage[0]["norm"].shape[0] == 3
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == _torch_tokens(path)


def test_grouped_steps_equal_the_scan_logits_and_every_cache_array(hf_model_dir):
    """Prefill, four decode steps through a flush of the 4-entry ring, and a verify + commit:
    the grouped loop's logits and every cache array (states, windows, ring) equal the scan's
    (float64; groups of 2 and of 3 of a 6-layer stage)."""
    path = hf_model_dir("mamba2", num_hidden_layers=6)
    scan = JaxLLM(path, dtype="float64", decode_mode="replay", buffer_size=4, layer_loop="scan")
    ids = jnp.asarray([[3, 5, 7, 3, 5], [1, 2, 9, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 3], jnp.int32)

    @jax.jit
    def run(p):
        c = M.init_cache(scan.spec, 2, "replay", 4, 32, fill=float("nan"))
        lg, c = M.prefill(scan.spec, p, c, ids, lengths)
        outs = [lg]
        for t in (4, 6, 8, 1):
            lg, c = M.decode(scan.spec, p, c, jnp.asarray([t, t + 1], jnp.int32))
            outs.append(lg)
        lg, c, pend = M.verify(scan.spec, p, c, jnp.asarray([[2, 3], [4, 5]], jnp.int32))
        c = M.commit(scan.spec, c, pend, jnp.asarray([2, 1], jnp.int32))
        return outs + [lg], c

    o1, c1 = run(scan.params)
    for k in (2, 3):
        o2, c2 = run(M.group_params(scan.params, k))
        for a, b in zip(o1, o2):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-12)
        l1, l2 = jax.tree_util.tree_leaves(c1), jax.tree_util.tree_leaves(c2)
        assert len(l1) == len(l2) >= 9
        for a, b in zip(l1, l2):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-12)


def test_group_layout_and_bad_input():
    assert [M.group_size(n, k) for n, k in ((64, 8), (6, 4), (5, 4), (3, 8), (1, 1))] == [8, 3, 1, 3, 1]
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="group size"):
            M.group_size(8, bad)
    w = jnp.arange(6 * 2 * 3, dtype=jnp.float64).reshape(6, 2, 3)
    params = {"embed": jnp.zeros((4, 3)), "stages": [{"norm": jnp.arange(6.0), "mixer": {"w": w}}]}
    g = M.group_params(params, 4)        # 6 layers, at most 4 a group: groups of 3
    st = g["stages"][0]
    assert isinstance(st, tuple) and len(st) == 3
    np.testing.assert_array_equal(np.asarray(st[1]["norm"]), [1.0, 4.0])     # layers 1 and 4
    np.testing.assert_array_equal(np.asarray(st[2]["mixer"]["w"]), np.asarray(w)[2::3])
    back = M._ungroup(st)
    np.testing.assert_array_equal(np.asarray(back["mixer"]["w"]), np.asarray(w))
    per = M.unstack_params(g)["stages"][0]   # grouped -> per-layer keeps the layer order
    assert len(per) == 6 and all(float(per[i]["norm"]) == i for i in range(6))
    with pytest.raises(ValueError, match="stacked stages"):
        M.group_params(g, 2)
    with pytest.raises(ValueError, match="stacked stages"):
        M.group_params(M.unstack_params(params), 2)


def test_compiler_options_defaults_user_flags_and_overrides(hf_model_dir):
    assert compiler_options(xla_flags="") == DEFAULT_COMPILER_OPTIONS
    assert DEFAULT_COMPILER_OPTIONS == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
                                        "xla_gpu_dot_merger_threshold_mb": 0}
    # an option the user's XLA_FLAGS sets is left to the flag
    got = compiler_options(xla_flags="--xla_gpu_autotune_level=4 --xla_dump_to=/x")
    assert got == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
    got = compiler_options({"xla_gpu_enable_triton_gemm": None, "xla_gpu_enable_dynamic_slice_fusion": True}, "")
    assert got == {"xla_gpu_autotune_level": 0, "xla_gpu_enable_dynamic_slice_fusion": True,
                   "xla_gpu_dot_merger_threshold_mb": 0}
    for bad, match in (("fast", "dict"), ({"autotune": 1}, "xla_"), ({"xla_x": [1]}, "bool, number")):
        with pytest.raises(ValueError, match=match):
            compiler_options(bad, "")
    path = hf_model_dir("mamba2")
    with pytest.raises(ValueError, match="compiler option"):
        JaxLLM(path, compiler_options={"gpu": 1})
    with pytest.raises(ValueError, match="layer_loop"):
        JaxLLM(path, layer_loop="groups")
    with pytest.raises(ValueError, match="group size"):
        JaxLLM(path, layer_loop="group", layer_group=0)
    # the unrolled and grouped (the default) loops take the defaults; the scan compiles with
    # XLA's own GEMM choices, as its GPU figures were measured, and the dot merger off
    assert compiler_options(xla_flags="", defaults=False) == SCAN_COMPILER_OPTIONS
    assert SCAN_COMPILER_OPTIONS == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert JaxLLM(path).layer_loop == "group" and JaxLLM(path).compiler_options == compiler_options()
    assert JaxLLM(path, layer_loop="scan").compiler_options == SCAN_COMPILER_OPTIONS
    assert JaxLLM(path, layer_loop="unroll").compiler_options == compiler_options()
    # the options compile on this backend (the xla_gpu_* names are ignored off GPUs)
    llm = JaxLLM(path, dtype="float64", decode_mode="recurrent", layer_loop="scan",
                 compiler_options={"xla_gpu_autotune_level": 1})
    assert llm.compiler_options["xla_gpu_autotune_level"] == 1
    assert [len(o.token_ids) for o in llm.generate(PROMPTS[:1], PARAMS[:1])] == [14]
