"""Bytes per decode step: what XLA's compiled program moves against the least a step must move.

Compiles one decode step (``model.decode``, cache donated, as the generation loop runs it)
for abstract arguments (``jax.ShapeDtypeStruct``: nothing is allocated, so a 2.7B model
compiles on a laptop) and reports

* ``ideal``: every weight once (the embedding only through its row; the head once) plus,
  per row, recurrent: the state and the conv windows read and written; replay: the checkpoint
  ``S0`` read, the ring read at its mean fill ``(L-1)/2``, one entry written, the conv
  windows read and written (:func:`ideal_sizes`, the model ``scripts/gpu_jax.py`` uses);
* ``hlo``: bytes moved by the optimized program, loops counted
  (:func:`replayssm.jax.hlo_bytes.hlo_bytes`);
* ``xla``: ``compiled.cost_analysis()["bytes accessed"]`` (XLA counts a loop body once: a
  64-layer scan as one layer);
* the largest instructions, to find what moves more than it should.

::

    python -m replayssm.jax.costs --preset 2.7b --batch-sizes 1,64 --modes replay,recurrent
    python -m replayssm.jax.costs --preset 2.7b --layer-loop group --group 8    # or unroll

Each row also gives the step's compile seconds (``compile_s``).

On a CPU-only machine the numbers are the CPU backend's (its fusion and layout choices differ
from a GPU's; the CPU also upcasts bf16 dot operands to fp32 outside loops, so the default
``--dtype float32`` keeps that artefact out).  On a GPU the same call compiles for the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

from . import model as M
from . import ops
from .hlo_bytes import hlo_bytes

__all__ = ["abstract_model", "ideal_sizes", "step_costs", "unstack_abstract", "group_abstract", "loop_params"]


def abstract_model(preset: str = "2.7b", dtype: str = "float32", layers: int | None = None):
    """``(spec, params)`` of the random-weight Mamba-2 ``preset`` of ``replayssm bench e2e``
    (``layers`` of them: default the preset's), params as ``jax.ShapeDtypeStruct`` (built from
    a one-layer, small-vocabulary model)."""
    import torch

    from ..bench.e2e import mamba2_preset_config
    from ..models.registry import model_class, parse_config
    from .params import from_torch_model

    cfg = mamba2_preset_config(preset)
    c = parse_config(dict(cfg, num_hidden_layers=1, vocab_size=64))
    spec, params = from_torch_model(model_class(c)(c, torch.float32, torch.device("cpu")), dtype)
    Ly, V = layers or cfg["num_hidden_layers"], cfg["vocab_size"]

    def grow(path, a):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        shape = list(a.shape)
        if keys[0] == "stages":
            shape[0] = Ly
        elif keys[0] in ("embed", "head"):
            shape[0] = V
        return jax.ShapeDtypeStruct(tuple(shape), a.dtype)

    params = jax.tree_util.tree_map_with_path(grow, params)
    spec = dataclasses.replace(spec, vocab_size=V, stages=tuple((sb, Ly) for sb, _ in spec.stages))
    return spec, params


def unstack_abstract(params):
    """Abstract ``params`` with every stage as a list of per-layer leaves (as
    :func:`replayssm.jax.model.unstack_params` gives)."""
    stages = []
    for p in params["stages"]:
        n = jax.tree_util.tree_leaves(p)[0].shape[0]
        stages.append([jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), p)
                       for _ in range(n)])
    return {**params, "stages": stages}


def group_abstract(params, k: int):
    """Abstract ``params`` grouped ``k`` layers at a time (as
    :func:`replayssm.jax.model.group_params` gives)."""
    return jax.eval_shape(lambda p: M.group_params(p, k), params)


def loop_params(params, layer_loop: str, group: int = 4):
    """``params`` (stacked, arrays or abstract) laid out for a layer loop: ``"scan"`` as they
    are, ``"unroll"`` per layer, ``"group"`` in groups of ``group`` layers."""
    if layer_loop == "scan":
        return params
    if layer_loop == "unroll":
        return jax.eval_shape(M.unstack_params, params)
    if layer_loop == "group":
        return group_abstract(params, group)
    raise ValueError(f"layer_loop must be 'scan', 'unroll' or 'group', got {layer_loop!r}")


def _nbytes(a) -> int:
    return int(a.size) * jnp.dtype(a.dtype).itemsize


def ideal_sizes(spec, params, L: int) -> dict:
    """Per-step byte counts (module docstring): ``weights`` and per-row ``recurrent_row``,
    ``replay_row`` (mean ring fill; the flush's state write amortised over ``L`` steps),
    ``replay_row_noflush`` (the same without it), ``state_row``."""
    leaves = jax.tree_util.tree_leaves(params)
    emb = _nbytes(params["embed"])
    wbytes = sum(_nbytes(a) for a in leaves) - emb + (0 if "head" in params else emb)
    wdt = jnp.dtype(params["embed"].dtype).itemsize
    cdt = jnp.dtype(ops.compute_dtype(params["embed"].dtype)).itemsize
    st = win = ring = 0
    for sb, cnt in spec.stages:
        m = sb.mixer
        if m.kind == "mamba":
            st += cnt * m.H * m.d * m.n * cdt
            win += cnt * (m.W - 1) * m.conv_dim * wdt
            ring += cnt * ((m.H * m.d + m.G * m.n) * wdt + m.H * cdt)      # rx, rB, rdt per entry
    rep = st + ring * ((L - 1) / 2 + 1) + 2 * win
    return {"weights": wbytes, "recurrent_row": 2 * st + 2 * win, "replay_row": rep + st / L,
            "replay_row_noflush": rep, "state_row": st}


def step_costs(spec, params, mode: str, B: int, L: int = 16, flush: bool | None = None, top: int = 8,
               compiler_options: dict | None = None) -> dict:
    """Compile one decode step for abstract ``params`` (``ShapeDtypeStruct`` leaves or arrays)
    and a donated cache of ``B`` rows (per-layer arrays when ``params`` are per layer, as the
    unrolled loop carries them); ``flush`` (replay) defaults to the loop's common step,
    the one compiled without checkpoint writes.  Grouped ``params``
    (:func:`group_abstract`) keep the stacked cache.  ``compiler_options``: XLA options of
    the compile (default: none).  Returns bytes (``ideal``, ``hlo``, ``xla``), ``flops``,
    ``compile_s`` and the ``top`` instructions by bytes."""
    flush = (mode == "recurrent") if flush is None else flush
    params = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    per_layer = isinstance(params["stages"][0], list)   # unrolled layers carry per-layer caches
    cache = jax.eval_shape(lambda: (M.split_cache if per_layer else (lambda c: c))(M.init_cache(spec, B, mode, L, 64)))
    ids = jax.ShapeDtypeStruct((B,), jnp.int32)
    step = jax.jit(lambda p, c, i: M.decode(spec, p, c, i, flush=flush), donate_argnums=(1,),
                   compiler_options=compiler_options or None)
    t0 = time.perf_counter()
    comp = step.lower(params, cache, ids).compile()
    compile_s = time.perf_counter() - t0
    ca = comp.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    hb = hlo_bytes(comp.as_text())
    stacked = params if not isinstance(params["stages"][0], list) else \
        {**params, "stages": [jax.tree_util.tree_map(lambda *a: a[0], *p) for p in params["stages"]]}
    sz = ideal_sizes(spec, stacked, L)
    if isinstance(params["stages"][0], list):   # per-layer leaves: count every layer's weights
        sz["weights"] = sum(_nbytes(a) for a in jax.tree_util.tree_leaves(params)) - _nbytes(params["embed"]) \
            + (0 if "head" in params else _nbytes(params["embed"]))
    row = sz["recurrent_row"] if mode == "recurrent" else (sz["replay_row"] if flush else sz["replay_row_noflush"])
    ideal = sz["weights"] + B * row
    return {"mode": mode, "batch": B, "flush": flush, "ideal": ideal, "hlo": hb.total, "compile_s": compile_s,
            "xla": float(ca.get("bytes accessed", 0.0)), "flops": float(ca.get("flops", 0.0)),
            "hlo_over_ideal": hb.total / ideal,
            "top": [{"bytes": r[0], "times": r[1], "op": r[2], "shape": r[3], "where": r[4]} for r in hb.top(top)],
            "copies": sum(r[0] for r in hb.copies)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m replayssm.jax.costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="2.7b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--modes", default="replay,recurrent")
    p.add_argument("--buffer-size", type=int, default=16)
    p.add_argument("--readout", choices=ops.STEP_READOUTS, default=None)
    p.add_argument("--unstack", action="store_true", help="per-layer weights (layers unrolled): --layer-loop unroll")
    p.add_argument("--layer-loop", choices=("scan", "unroll", "group"), default="scan")
    p.add_argument("--group", type=int, default=4, help="layers per group (--layer-loop group)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    if a.readout:
        ops.set_step_readout(a.readout)
    spec, params = abstract_model(a.preset, a.dtype, a.layers)
    params = loop_params(params, "unroll" if a.unstack else a.layer_loop, a.group)
    rows = []
    print(f"{'mode':<10}{'B':>4}{'ideal GB':>10}{'hlo GB':>9}{'hlo/ideal':>10}{'xla GB':>9}{'copies MB':>10}{'compile s':>10}")
    for B in [int(b) for b in a.batch_sizes.split(",")]:
        for mode in a.modes.split(","):
            r = step_costs(spec, params, mode, B, a.buffer_size, top=a.top)
            rows.append(r)
            print(f"{mode:<10}{B:>4}{r['ideal'] / 1e9:>10.3f}{r['hlo'] / 1e9:>9.3f}{r['hlo_over_ideal']:>10.2f}"
                  f"{r['xla'] / 1e9:>9.3f}{r['copies'] / 1e6:>10.1f}{r['compile_s']:>10.1f}")
            for t in r["top"]:
                print(f"    {t['bytes'] / 1e6:10.1f} MB x{t['times']:<3} {t['op']:<10} {t['shape']:<28} {t['where'][:90]}",
                      file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
