"""Bytes per compiled step (``replayssm.jax.hlo_bytes`` / ``replayssm.jax.costs``): loops
counted by their trip count, slices and in-place updates counted by what they move, the ideal
byte model, and bad input."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from replayssm.jax import costs  # noqa: E402
from replayssm.jax.hlo_bytes import hlo_bytes, shape_bytes  # noqa: E402


def test_shape_bytes():
    assert shape_bytes("f32[2,3]{1,0}") == 24
    assert shape_bytes("(f32[2,3], bf16[4], pred[])") == 24 + 8 + 1
    assert shape_bytes("s32[]") == 4


def _scan_text(n: int, d: int = 96) -> str:
    def f(w, x):
        return lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    w = jax.ShapeDtypeStruct((n, d, d), jnp.float32)
    x = jax.ShapeDtypeStruct((3, d), jnp.float32)
    return jax.jit(f).lower(w, x).compile().as_text()


def test_loops_are_counted_by_their_trip_count():
    """XLA's own count reads a scan as one layer; ours grows with the layers, by at least one
    read of each layer's weights, and each layer costs the same."""
    d = 96
    b3, b5, b9 = (hlo_bytes(_scan_text(n, d)).total for n in (3, 5, 9))
    per_layer = (b9 - b5) / 4
    assert per_layer == pytest.approx((b5 - b3) / 2)
    assert per_layer >= d * d * 4
    assert b3 >= 3 * d * d * 4
    rows = hlo_bytes(_scan_text(5, d)).rows
    assert any(r[1] == 5 for r in rows)          # instructions inside the loop: 5 times


def test_in_place_update_counts_the_update_only():
    def f(big, small, i):
        return lax.dynamic_update_index_in_dim(big, small, i, 0)

    big = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    small = jax.ShapeDtypeStruct((1024,), jnp.float32)
    text = jax.jit(f, donate_argnums=(0,)).lower(big, small, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
    total = hlo_bytes(text).total
    assert 2 * 1024 * 4 <= total < 64 * 1024 * 4       # not the whole array


def test_bad_hlo_text_raises():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_bytes("not an HLO module")


def test_step_costs_and_ideal_bytes_on_the_tiny_preset():
    """The tiny preset (2 layers, H=8, d=16, n=16, W=4, conv 2·128+2·2·16 channels): the ideal
    byte model by hand, and both layer loops compile and move at least the ideal."""
    spec, params = costs.abstract_model("tiny", "float32")
    sz = costs.ideal_sizes(spec, params, 4)
    st = 2 * 8 * 16 * 16 * 4
    win = 2 * 3 * (128 + 2 * 2 * 16) * 4
    ring = 2 * ((128 + 2 * 16) * 4 + 8 * 4)
    assert sz["state_row"] == st
    assert sz["recurrent_row"] == 2 * st + 2 * win
    assert sz["replay_row_noflush"] == pytest.approx(st + ring * (1.5 + 1) + 2 * win)
    weights = sum(a.size * 4 for a in jax.tree_util.tree_leaves(params)) - params["embed"].size * 4
    assert sz["weights"] == weights
    for p in (params, costs.unstack_abstract(params)):
        for mode in ("replay", "recurrent"):
            r = costs.step_costs(spec, p, mode, 3, 4, top=2)
            assert r["ideal"] == weights + 3 * sz["recurrent_row" if mode == "recurrent" else "replay_row_noflush"]
            assert r["hlo"] >= r["ideal"] * 0.9 and r["flops"] > 0 and len(r["top"]) == 2


def test_unrolled_layer_loop_reads_weights_in_place(hf_model_dir):
    """The unrolled loop (``layer_loop="unroll"``) moves near the ideal bytes per decode step;
    a regression to weights copied out of a stack each step (what the scan, the default, does
    on this backend: ~2.8x) is caught.  Tiny preset widened to 4 layers, B = 1, both forms
    (replay: the loop's common step, no checkpoint write)."""
    from replayssm.jax.generate import JaxLLM

    assert JaxLLM(hf_model_dir("mamba2")).layer_loop == "group"       # the default (short compiles)
    spec, params = costs.abstract_model("tiny", "float32", layers=4)
    unrolled = costs.loop_params(params, "unroll")
    assert isinstance(unrolled["stages"][0], list) and len(unrolled["stages"][0]) == 4
    for mode in ("replay", "recurrent"):
        r = costs.step_costs(spec, unrolled, mode, 1, 4, top=1)
        assert 0.9 < r["hlo_over_ideal"] < 1.6, (mode, r["hlo_over_ideal"], r["top"])
    scan = costs.step_costs(spec, params, "recurrent", 1, 4, top=1)
    assert scan["hlo_over_ideal"] > 2.0, scan["hlo_over_ideal"]      # the counter sees the copies
    with pytest.raises(ValueError, match="layer_loop"):
        costs.loop_params(params, "unrolled")
