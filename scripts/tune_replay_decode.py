"""Replay-decode launch forms against the current defaults and the peers, at B = 1 / 8 / 64 / 256
(GPU; one run decides the rows of ``DECODE_TABLE`` in ``kernels/mamba2.py`` and ``kernels/gdn.py``).

Layers: Mamba-2 2.7B (80 heads × head_dim 64 × d_state 128, 8 groups) and GDN Qwen3-Next
(32 value heads, 16 key heads, K = V = 128), bf16 activations, fp32 checkpoint states (bf16 too
with ``--state-dtypes float32,bfloat16``), ring L = 16.  Per (family, state dtype, batch):

* the peer's one recurrent step (``mamba_ssm.selective_state_update`` /
  ``fla.fused_recurrent_gated_delta_rule``, state read + written; absent peers are named), and
  for Mamba-2 the same step with its states in a slot pool read through ``state_batch_indices``
  (``peer-indexed``: how vLLM and SGLang call it, the indirection our kernels always take);
* ``default``: the wrappers' current choice (``DECODE_TABLE`` as committed);
* every candidate form of :data:`FORMS` (tile width, warps, scores kernel, ``fold_form``
  "dot" / "fma" / "hold", ``prefetch``, GDN flush mode), at every batch.

Each form is timed at a non-flush fill (h = 7: the mean cost of h = 0..14), the all-flush step
(h = 15) and a staggered fill (row r at h = r mod 16: 1/16 of the rows flush, the running
batch's case); ``cycle = (15 × non-flush + flush) / 16`` is the flush-cycle average that
``bench kernels`` reports.  ``%copy``: the cycle's bytes (state read once, written on flush,
ring entries read, inputs, outputs, the new entry) over its time, against a 1 GiB ``copy_``
timed in the same run; ``xpeer``: the peer's step time over the cycle; ``progs``: the decode
kernel's programs at that batch (the peers at B = 1: 1280 for mamba_ssm, 512 for fla).
Times: back-to-back calls replayed from a CUDA graph (per call, median
of 7 replays).  Before timing, every form runs two decode steps (rows flushing, ring entries
wrapping) on 8 rows and is compared with the float64 reference op (outputs, every state and ring
entry) and with the default form.

    PYTHONPATH=. python scripts/tune_replay_decode.py [--peers DIR] [--batches 1,8,64,256]
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/tune_replay_decode.py --device cpu --smoke --batches 1,64

Prints one line per form and a summary (fastest form per family / state dtype / batch, as
``DECODE_TABLE`` rows); writes ``tune_replay_decode.json`` to ``$OUT`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from replayssm.bench.kernels import Timer, copy_bandwidth, load_peers
from replayssm.cache.buffers import GDNBuffers, Mamba2Buffers
from replayssm.cache.ring import RingIndex
from replayssm.kernels import gdn as kg
from replayssm.kernels import mamba2 as km
from replayssm.ops.gdn import naive as ng
from replayssm.ops.mamba2 import naive as nm

SHAPES = {"mamba2": dict(H=80, d=64, n=128, G=8), "gdn": dict(HK=16, HV=32, K=128, V=128)}
SMOKE = {"mamba2": dict(H=4, d=8, n=16, G=2), "gdn": dict(HK=2, HV=4, K=16, V=16)}
F64 = torch.float64
#: activation / ring dtype: bf16 on the GPU; fp32 under the CPU interpreter (whose bf16 ``tl.dot``
#: is wrong, docs/KERNEL_NOTES.md)
ACT = {"dtype": torch.bfloat16}


def _m2(bd, nw, pre, fold, early=False):
    return dict(block_d=bd, num_warps=nw, pre_scores=pre, fold_form=fold, prefetch=early)


def _gdn(bv, nw, pre, fold, mode="fused", early=False, fw=4):
    return dict(block_v=bv, num_warps=nw, pre_scores=pre, fold_form=fold, flush_mode=mode, prefetch=early,
                fold_warps=fw)


#: candidate forms per family, each timed at every batch ("default", the wrappers' choice, too).
#: ``-e``: ``prefetch`` (the plan words and the flush flag in one round of loads, before the
#: state); ``hold``: the flush rows' fold as one ``tl.dot`` over the tile the readout holds;
#: ``unroll``: rank-1 updates of the held tile, unrolled over the ring positions (narrow tiles;
#: at B = 1 ``v8w4-unroll-e`` has fla's 512 programs, ``d4w1-unroll-e`` mamba_ssm's 1280).
#: Chosen so that none spills on a local sm_90 compile (``scripts/tune_registers.py``'s
#: machinery, Triton 3.9; the device's 3.6 may differ).
#: The defaults: Mamba-2 32-wide, 4 warps, one launch below 2048 tiles (B <= 12 at 80 heads), else
#: 2 warps with the scores kernel; GDN 32-wide, 4 warps, fused below 2048 tiles (B <= 16), else
#: 64-wide, 2 warps, scores kernel, flush rows apart.  The peers at B = 1: 1280 programs of 4 × 128
#: (mamba_ssm, 80 heads) and 512 of 128 × 8 (fla); the defaults 160 and 128.
FORMS = {
    "mamba2": {
        # small batches: the default tile + prefetch, then more programs (16-, 8-, 4-wide)
        "d32w4-e": _m2(32, 4, False, "dot", True),
        "d16w2-hold-e": _m2(16, 2, False, "hold", True),
        "d16w2-hold": _m2(16, 2, False, "hold"),
        "d16w4-hold-e": _m2(16, 4, False, "hold", True),
        "d8w2-unroll-e": _m2(8, 2, False, "unroll", True),
        "d4w1-unroll-e": _m2(4, 1, False, "unroll", True),
        "d8w1-fma-e": _m2(8, 1, False, "fma", True),
        # large batches: the default tile (scores kernel) + prefetch, the held fold, wider tiles
        "d32w2-sc-e": _m2(32, 2, True, "dot", True),
        "d32w2-sc-fma-e": _m2(32, 2, True, "fma", True),
        "d32w2-sc-fma": _m2(32, 2, True, "fma"),
        "d32w4-sc-hold-e": _m2(32, 4, True, "hold", True),
        "d64w8-sc-hold-e": _m2(64, 8, True, "hold", True),
    },
    "gdn": {
        # small batches
        "v32w4-e": _gdn(32, 4, False, "dot", early=True),
        "v16w2-hold-e": _gdn(16, 2, False, "hold", early=True),
        "v16w2-hold": _gdn(16, 2, False, "hold"),
        "v16w4-hold-e": _gdn(16, 4, False, "hold", early=True),
        "v8w4-unroll-e": _gdn(8, 4, False, "unroll", early=True),
        "v8w2-fma-e": _gdn(8, 2, False, "fma", early=True),
        # large batches: the apart default + prefetch (hot kernel: flag, plan, state, 3 rounds -> 2;
        # persistent kernel: contiguous tile ranges), other hot tiles, the persistent kernel on 8
        # warps / with the held fold
        "v64w2-apart-e": _gdn(64, 2, True, "dot", "apart", True),
        "v64w2-apart-e-fw8": _gdn(64, 2, True, "dot", "apart", True, fw=8),
        "v64w2-apart-hold-e": _gdn(64, 2, True, "hold", "apart", True, fw=8),
        "v32w2-apart-e": _gdn(32, 2, True, "dot", "apart", True),
        "v64w4-apart-e": _gdn(64, 4, True, "dot", "apart", True),
        "v128w4-apart-fma-e": _gdn(128, 4, True, "fma", "apart", True),  # 64 KiB hot tiles (fold: no spills)
        # gated: the flush rows' decode + fold over the whole grid instead of the persistent kernel
        # (every step launches that grid: 2 programs per SM on 4 warps, 1 on 8)
        "v32w2-gated-hold-e": _gdn(32, 2, True, "hold", "gated", True, fw=4),
        "v32w4-fused-hold-e": _gdn(32, 4, True, "hold", "fused", True),
        "v64w8-fused-hold-e": _gdn(64, 8, True, "hold", "fused", True),
    },
}


def forms_for(fam: str, sdt: torch.dtype, B: int, smoke: bool, only: str | None = None) -> dict:
    """``default`` and every form of ``fam`` (all batches: the table picks per batch); smoke: three;
    ``only``: a comma list of form names (the others skipped)."""
    forms = dict(FORMS[fam])
    if smoke:
        forms = {k: v for k, v in forms.items() if k in ("d16w2-hold-e", "d4w1-unroll-e", "d32w4-sc-hold-e",
                                                          "v16w2-hold-e", "v32w2-apart-e", "v32w2-gated-hold-e")}
    if only:
        keep = set(only.split(","))
        forms = {k: v for k, v in forms.items() if k in keep}
    return {"default": {}, **forms}


def _sname(sdt) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(sdt, str(sdt))


# ============================================================================ setup
def setup(fam, s, Bt, L, sdt, dev):
    """Buffers for ``Bt`` rows (slot 0 unused) with random checkpoints and ring entries."""
    dtype = ACT["dtype"]
    if fam == "mamba2":
        buf = Mamba2Buffers.allocate(Bt, L, s["H"], s["d"], s["n"], s["G"], dtype=dtype, state_dtype=sdt, device=dev)
        buf.state.normal_()
        buf.x.normal_()
        buf.B.normal_()
        buf.dt.uniform_(0.01, 0.2)
    else:
        buf = GDNBuffers.allocate(Bt, L, s["HK"], s["HV"], s["K"], s["V"], dtype=dtype, state_dtype=sdt, device=dev)
        buf.state.normal_().mul_(0.05)
        buf.u.normal_()
        buf.k.copy_(torch.nn.functional.normalize(torch.randn(buf.k.shape, device=dev), dim=-1).to(dtype))
        buf.g.uniform_(-0.3, -0.01)
    return buf


def inputs(fam, s, Bt, dev):
    dtype = ACT["dtype"]
    if fam == "mamba2":
        return dict(x=torch.randn(Bt, s["H"], s["d"], device=dev).to(dtype),
                    dt=torch.rand(Bt, s["H"], device=dev) * 0.2 + 0.01,
                    A=-(torch.rand(s["H"], device=dev) + 0.5),
                    B=torch.randn(Bt, s["G"], s["n"], device=dev).to(dtype),
                    C=torch.randn(Bt, s["G"], s["n"], device=dev).to(dtype),
                    D=torch.randn(s["H"], device=dev))
    return dict(q=torch.randn(Bt, s["HK"], s["K"], device=dev).to(dtype),
                k=torch.randn(Bt, s["HK"], s["K"], device=dev).to(dtype),
                v=torch.randn(Bt, s["HV"], s["V"], device=dev).to(dtype),
                g=-torch.rand(Bt, s["HV"], device=dev) * 0.3,
                beta=torch.rand(Bt, s["HV"], device=dev))


def set_fill(ring, slots, h=None, seed=0):
    """Every row at fill ``h`` (None: row r at r mod L); random ring starts (entries wrap)."""
    g = torch.Generator().manual_seed(seed)
    Bt, L = slots.shape[0], ring.capacity
    hs = torch.arange(Bt) % L if h is None else torch.full((Bt,), h, dtype=torch.long)
    ring.length[slots] = hs.to(slots.device)
    ring.start[slots] = torch.randint(0, L, (Bt,), generator=g).to(slots.device)
    return hs


def step_bytes(fam, s, hs, L, sb, vb=2) -> float:
    """Bytes a decode step must move for rows at fills ``hs``: the state read (written too on a
    flush row), the ``h`` committed entries, inputs, output, the new entry."""
    if fam == "mamba2":
        H, d, n, G = s["H"], s["d"], s["n"], s["G"]
        state, entry = H * d * n * sb, H * d * vb + G * n * vb + H * 4
        io = H * d * vb + 2 * G * n * vb + H * 4 + H * d * vb
    else:
        HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]
        state, entry = HV * K * V * sb, HV * V * vb + HK * K * vb + HV * 4
        io = 2 * HK * K * vb + HV * V * vb + 2 * HV * 4 + HV * V * vb
    return float(sum(state + int(h) * entry + io + entry + (state if int(h) == L - 1 else 0) for h in hs))


def peer_bytes(fam, s, Bt, sb, vb=2) -> float:
    """A recurrent step: the state read and written, inputs and output (no ring)."""
    if fam == "mamba2":
        H, d, n, G = s["H"], s["d"], s["n"], s["G"]
        state, io = H * d * n * sb, H * d * vb + 2 * G * n * vb + H * 4 + H * d * vb
    else:
        HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]
        state, io = HV * K * V * sb, 2 * HK * K * vb + HV * V * vb + 2 * HV * 4 + HV * V * vb
    return float(Bt * (2 * state + io))


# ============================================================================ timing
def graph_us(fn, dev, reps: int = 7, min_us: float = 1000.0) -> float:
    """Microseconds per call of ``fn``: back-to-back calls captured in a CUDA graph (enough
    for ``min_us`` per replay, 3..400), the median of ``reps`` replays; eager (CUDA events) if
    capture fails.  On CPU: the median of 3 wall-clock calls."""
    if dev != "cuda":
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(ts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        fn()
    e1.record()
    torch.cuda.synchronize()
    est = max(1e-3, e0.elapsed_time(e1) * 1e3 / 5)
    n = int(max(3, min(400, min_us / est)))
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        run = g.replay
    except Exception:  # a peer that does not capture: eager back-to-back calls
        torch.cuda.synchronize()

        def run():
            for _ in range(n):
                fn()
    ts = []
    for _ in range(reps):
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(ts)


# ============================================================================ checks
def _rel(want, got) -> float:
    want, got = want.to(F64), got.to(F64)
    if torch.isnan(got).any():
        return float("nan")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _as64(buf):
    return type(buf)(**{f.name: getattr(buf, f.name).to(F64) for f in dataclasses.fields(buf)})


def _clone(buf):
    return type(buf)(**{f.name: getattr(buf, f.name).clone() for f in dataclasses.fields(buf)})


def check_form(fam, s, form, sdt, dev, L, default_result=None):
    """Two decode steps on 8 rows (two flushing on the first step, their entries wrapping past
    the ring end; one row pads on slot 0) against the float64 reference op: worst relative
    errors of the outputs, states and ring entries; and the result for the comparison with
    the default form."""
    mod, naive = (km, nm) if fam == "mamba2" else (kg, ng)
    Bt = 8
    torch.manual_seed(0)
    buf = setup(fam, s, Bt + 1, L, sdt, dev)
    ref = _as64(buf)
    ring = RingIndex(Bt + 1, L, buf.state.device)
    slots = torch.arange(1, Bt + 1, device=buf.state.device)
    slots[2] = 0
    set_fill(ring, slots, None, seed=1)
    ring.length[slots] = torch.tensor([L - 1, 0, 0, L // 3, L - 1, L // 2, L - 2, 1], device=slots.device)
    ring.start[slots[0]] = L - 3
    ring.start[slots[4]] = L - 2
    real = slots != 0
    err = dict(y=0.0, state=0.0, ring=0.0)
    ys = []
    for step in range(2):
        torch.manual_seed(10 + step)
        inp = inputs(fam, s, Bt, dev)
        plan = ring.plan_decode(slots)
        a = naive.replay_decode(ref, plan, **{k: v.to(F64) if v.is_floating_point() else v for k, v in inp.items()},
                                check=False)
        b = mod.replay_decode(buf, plan, **inp, **form)
        ys.append(b)
        err["y"] = max(err["y"], _rel(a[real], b[real]))
        err["state"] = max(err["state"], _rel(ref.state[1:], buf.state[1:]))
        for f in dataclasses.fields(buf):
            if f.name != "state":
                err["ring"] = max(err["ring"], _rel(getattr(ref, f.name)[1:], getattr(buf, f.name)[1:]))
        ref.state.copy_(buf.state.to(F64))  # the next step reads the state as stored
        ring.commit(plan)
    result = (torch.cat([y.float().flatten() for y in ys]), buf.state.float())
    if default_result is not None:
        err["vs_default_y"] = _rel(default_result[0], result[0])
        err["vs_default_state"] = _rel(default_result[1], result[1])
    # against float64: bf16 activations, outputs and ring values (GDN's u, k) rounded to bf16; against the
    # default form (same roundings): fp32-level for fp32 states, a rounding apart for bf16 ones
    err["ok"] = bool(err["y"] < 1e-2 and err["state"] < 1e-2 and err["ring"] < 1e-2)
    if default_result is not None:
        tol = 1e-4 if sdt.itemsize == 4 else 1e-2
        err["ok"] = err["ok"] and bool(err["vs_default_y"] < 1e-2 and err["vs_default_state"] < tol)
    return err, result


# ============================================================================ peers
def peer_fn(fam, s, peers, Bt, sdt, dev, indexed: bool = False):
    """``(label, fn)`` of the peer's decode step, or ``(why not, None)``.  ``indexed``: the
    state read through a slot index per row (``state_batch_indices``, how vLLM and SGLang call
    ``selective_state_update``; Mamba-2 only: fla's recurrent step takes no slot indices)."""
    name = "mamba_ssm" if fam == "mamba2" else "fla"
    if name not in peers:
        return (peers.get(name + "_error") or f"{name} not importable"), None
    f = peers[name]
    inp = inputs(fam, s, Bt, dev)
    if indexed and fam != "mamba2":
        return "fla's recurrent step has no slot indices", None
    if fam == "mamba2":
        H, d, n = s["H"], s["d"], s["n"]
        st = torch.randn(Bt, H, d, n, device=dev).to(sdt)
        A3 = inp["A"][:, None, None].expand(H, d, n)
        dt3 = inp["dt"][:, :, None].expand(Bt, H, d)
        bias = torch.zeros(H, device=dev)[:, None].expand(H, d)
        D2 = inp["D"][:, None].expand(H, d)
        if indexed:   # as serving engines call it: states in a slot pool, one slot index per row
            pool = torch.randn(2 * Bt + 1, H, d, n, device=dev).to(sdt)
            idx = torch.randperm(2 * Bt + 1, device=dev)[:Bt].to(torch.int32)
            return "mamba_ssm.selective_state_update(state_batch_indices)", lambda: f(
                pool, inp["x"], dt3, A3, inp["B"], inp["C"], D=D2, dt_bias=bias, dt_softplus=False,
                state_batch_indices=idx)
        return "mamba_ssm.selective_state_update", lambda: f(st, inp["x"], dt3, A3, inp["B"], inp["C"], D=D2,
                                                              dt_bias=bias, dt_softplus=False)
    st = (torch.randn(Bt, s["HV"], s["K"], s["V"], device=dev) * 0.05).to(sdt)
    q, k, v = inp["q"][:, None], inp["k"][:, None], inp["v"][:, None]
    g, beta = inp["g"][:, None], inp["beta"][:, None]
    return "fla.fused_recurrent_gated_delta_rule", lambda: f(q, k, v, g=g, beta=beta, initial_state=st,
                                                              output_final_state=True, use_qk_l2norm_in_kernel=True)


def programs(fam, s, B, form, sdt) -> int:
    """Programs of ``form``'s decode kernel at batch ``B`` (its tile width as the wrapper picks it)."""
    if fam == "mamba2":
        auto = km.decode_defaults(B, s["H"], s["d"], form.get("block_d"), sdt.itemsize)
        cfg = dict(auto, **form)
        return -(-s["d"] // km.decode_block(s["d"], cfg["block_d"], cfg["fold_form"])) * s["H"] * B
    cfg = dict(kg.decode_defaults(B, s["HV"], s["V"], sdt.itemsize), **form)
    fold = cfg["fold_form"] if cfg["flush_mode"] != "split" else "dot"
    return -(-s["V"] // km.decode_block(s["V"], cfg["block_v"], fold)) * s["HV"] * B


def time_section(res, fam, s, sdt, B, L, dev, peers, bw, chk, args) -> None:
    """Time the peer and every checked form of ``fam`` at batch ``B`` (rows into ``res``)."""
    sname = _sname(sdt)
    mod = km if fam == "mamba2" else kg
    label, pf = peer_fn(fam, s, peers, B, sdt, dev) if dev == "cuda" else ("cpu run", None)
    peer_us = graph_us(pf, dev) if pf is not None else float("nan")
    sb = sdt.itemsize
    if pf is not None:
        pb = peer_bytes(fam, s, B, sb)
        print(f"{fam:6} {sname:5} {B:>4} {'peer':18} {peer_us:8.1f} {'':>8} {'':>8} {peer_us:8.1f} "
              f"{100 * pb / (peer_us * 1e-6) / bw:6.1f}   ({label})", flush=True)
    else:
        print(f"{fam:6} {sname:5} {B:>4} {'peer':18} absent: {label}", flush=True)
    res["rows"].append(dict(family=fam, state=sname, B=B, form="peer", peer=label, us=peer_us))
    ilabel, ipf = peer_fn(fam, s, peers, B, sdt, dev, indexed=True) if dev == "cuda" else ("cpu run", None)
    ipeer_us = graph_us(ipf, dev) if ipf is not None else float("nan")
    if ipf is not None:
        print(f"{fam:6} {sname:5} {B:>4} {'peer-indexed':18} {ipeer_us:8.1f} {'':>8} {'':>8} {ipeer_us:8.1f} "
              f"{100 * peer_bytes(fam, s, B, sb) / (ipeer_us * 1e-6) / bw:6.1f}   ({ilabel})", flush=True)
        res["rows"].append(dict(family=fam, state=sname, B=B, form="peer-indexed", peer=ilabel, us=ipeer_us))
    buf = setup(fam, s, B, L, sdt, dev)
    ring = RingIndex(B, L, buf.state.device)
    slots = torch.arange(1, B + 1, device=buf.state.device)
    inp = inputs(fam, s, B, dev)
    plans = {}
    for key, h in (("mid", (L - 2) // 2), ("flush", L - 1), ("stagger", None)):
        hs = set_fill(ring, slots, h, seed=2)
        plans[key] = (ring.plan_decode(slots), step_bytes(fam, s, hs.tolist(), L, sb))
    cyc_bytes = step_bytes(fam, s, list(range(L)), L, sb) * B / L
    def_cycle = def_stag = None
    for name, form in forms_for(fam, sdt, B, args.smoke, args.forms).items():
        if not chk.get(name, {}).get("ok"):
            print(f"{fam:6} {sname:5} {B:>4} {name:18} not timed: failed its check", flush=True)
            continue
        try:
            t = {key: graph_us(lambda p=p, b=buf: mod.replay_decode(b, p, **inp, **form), dev)
                 for key, (p, _) in plans.items()}
        except Exception as exc:
            print(f"{fam:6} {sname:5} {B:>4} {name:18} failed: {repr(exc)[:160]}", flush=True)
            res["rows"].append(dict(family=fam, state=sname, B=B, form=name, error=repr(exc)[:300]))
            continue
        cycle = ((L - 1) * t["mid"] + t["flush"]) / L
        if name == "default":
            def_cycle, def_stag = cycle, t["stagger"]
        nan = float("nan")
        pct = 100 * cyc_bytes / (cycle * 1e-6) / bw
        row = dict(family=fam, state=sname, B=B, form=name, config=form, programs=programs(fam, s, B, form, sdt),
                   mid_us=t["mid"],
                   flush_us=t["flush"], stagger_us=t["stagger"], cycle_us=cycle, cycle_pct_copy=pct,
                   stagger_pct_copy=100 * plans["stagger"][1] / (t["stagger"] * 1e-6) / bw,
                   x_peer=peer_us / cycle, x_peer_indexed=ipeer_us / cycle, x_default=(def_cycle or nan) / cycle,
                   x_default_stagger=(def_stag or nan) / t["stagger"])
        res["rows"].append(row)
        print(f"{fam:6} {sname:5} {B:>4} {name:18} {t['mid']:8.1f} {t['flush']:8.1f} "
              f"{t['stagger']:8.1f} "
              f"{cycle:8.1f} {pct:6.1f} {peer_us / cycle:6.2f} {row['x_default']:6.2f} {row['programs']:>7}",
              flush=True)
    del buf, ring
    if dev == "cuda":
        torch.cuda.empty_cache()


# ============================================================================ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--fams", default="mamba2,gdn")
    ap.add_argument("--state-dtypes", default="float32", help="comma list (float32,bfloat16: about twice the run)")
    ap.add_argument("--peers", default=None,
                    help="folder holding mamba_ssm/ and fla/ (default $REPLAYSSM_PEERS or .peers)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--forms", default=None, help="comma list of form names to time (default: all of FORMS)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, two forms per class (CPU interpreter)")
    ap.add_argument("--budget-s", type=float, default=225.0, help="skip the remaining sections past this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    t_start = time.time()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no GPU: run with --device cpu under TRITON_INTERPRET=1 for a smoke run")
        return 2
    shapes = SMOKE if args.smoke else SHAPES
    ACT["dtype"] = torch.bfloat16 if dev == "cuda" else torch.float32
    L = 4 if args.smoke else args.L
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        batches = batches[:2]
    sdts = [getattr(torch, n) for n in args.state_dtypes.split(",")]
    fams = args.fams.split(",")
    peers = load_peers(args.peers) if dev == "cuda" else {}
    bw = copy_bandwidth(dev, Timer(dev, quick=True), (1 << 22) if dev != "cuda" else None)
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", date=time.strftime("%Y-%m-%d %H:%M"),
               torch=torch.__version__, copy_TBps=bw / 1e12, L=L, shapes=shapes,
               peers={k: (v if isinstance(v, str) else "ok") for k, v in peers.items()}, checks={}, rows=[],
               skipped=[])
    print(f"{res['device']}  copy {bw / 1e12:.3f} TB/s (1 GiB copy_, read + write)  peers: "
          f"{ {k: v for k, v in res['peers'].items()} or 'none importable'}", flush=True)
    mid = f"h={(L - 2) // 2}"
    head = (f"{'family':6} {'state':5} {'B':>4} {'form':18} {mid:>8} {'flush':>8} {'stagger':>8} {'cycle':>8} "
            f"{'%copy':>6} {'xpeer':>6} {'xdef':>6} {'progs':>7}")
    # ---- phase 1 (most of the compiles): every form of every section against the float64 reference
    checks = {}
    for sdt in sdts:
        sname = _sname(sdt)
        for fam in fams:
            chk, base = {}, None
            names = forms_for(fam, sdt, 0, args.smoke, args.forms)
            for name in names:
                try:
                    err, result = check_form(fam, shapes[fam], names[name], sdt, dev, L, base)
                except Exception as exc:  # a form the compiler rejects
                    err = dict(ok=False, error=repr(exc)[:300])
                    result = None
                if name == "default":
                    base = result
                chk[name] = err
            checks[(fam, sname)] = res["checks"][f"{fam}/{sname}"] = chk
            bad = [n for n, e in chk.items() if not e.get("ok")]
            worst = max((e.get("vs_default_state", 0.0) for e in chk.values() if e.get("ok")), default=0.0)
            print(f"# {fam} {sname}: {len(chk)} forms checked vs float64 reference; failing: {bad or 'none'}; "
                  f"max state rel diff vs default {worst:.1e}  ({time.time() - t_start:.0f} s)", flush=True)
            for n in bad:
                print(f"#   {n}: {chk[n].get('error') or {k: v for k, v in chk[n].items() if k != 'ok'}}"[:300])
    _write(res, args.out)
    print(head)
    # ---- phase 2: timing, the targets' batches (B = 1 and the largest) first, within the budget
    order = sorted(batches, key=lambda b: (b not in (min(batches), max(batches)), batches.index(b)))
    for B in order:
        for sdt in sdts:
            sname = _sname(sdt)
            for fam in fams:
                if time.time() - t_start > args.budget_s:
                    res["skipped"].append(f"{fam}/{sname}/B={B}")
                    print(f"# skipped {fam} {sname} B={B}: past the {args.budget_s:.0f} s budget", flush=True)
                    continue
                try:
                    time_section(res, fam, shapes[fam], sdt, B, L, dev, peers, bw, checks[(fam, sname)], args)
                except Exception as exc:  # one section failing must not lose the others
                    res.setdefault("errors", []).append(f"{fam}/{sname}/B={B}: {exc!r}"[:500])
                    print(f"# {fam} {sname} B={B}: section failed: {exc!r}"[:300], flush=True)
                _write(res, args.out)
    # ---- summary: the fastest checked form per (family, state, B), by cycle and by staggered fill
    print("\n== fastest form per family / state dtype / batch (cycle average; staggered in brackets)")
    table = {}
    for fam in fams:
        for sdt in sdts:
            sname = _sname(sdt)
            for B in batches:
                rows = [r for r in res["rows"] if r["family"] == fam and r["state"] == sname and r["B"] == B
                        and "cycle_us" in r]
                if not rows:
                    continue
                d = next((r for r in rows if r["form"] == "default"), None)
                best = min(rows, key=lambda r: r["cycle_us"])
                bst = min(rows, key=lambda r: r["stagger_us"])
                peer = next((r["us"] for r in res["rows"] if r["family"] == fam and r["state"] == sname
                             and r["B"] == B and r["form"] == "peer"), float("nan"))
                ipeer = next((r["us"] for r in res["rows"] if r["family"] == fam and r["state"] == sname
                              and r["B"] == B and r["form"] == "peer-indexed"), float("nan"))
                if d is not None:
                    print(f"{fam:6} {sname:5} B={B:<4} default {'':15} {d['cycle_us']:8.1f} us "
                          f"{d['cycle_pct_copy']:5.1f}% copy  {'':11}  x{peer / d['cycle_us']:.2f} peer"
                          + (f"  x{ipeer / d['cycle_us']:.2f} indexed peer" if ipeer == ipeer else ""))
                print(f"{fam:6} {sname:5} B={B:<4} best {best['form']:18} {best['cycle_us']:8.1f} us "
                      f"{best['cycle_pct_copy']:5.1f}% copy  x{best['x_default']:.2f} default  "
                      f"x{peer / best['cycle_us']:.2f} peer   [staggered: {bst['form']} "
                      f"x{(d['stagger_us'] if d else float('nan')) / bst['stagger_us']:.2f} default]")
                # a form replaces the default where its cycle is > 3% faster and its staggered
                # step (the running batch's case) is no more than 2% slower
                win = (d is not None and best["form"] != "default" and best["cycle_us"] < 0.97 * d["cycle_us"]
                       and best["stagger_us"] <= 1.02 * d["stagger_us"])
                last = B == max(batches)
                table.setdefault(fam, []).append((1 << 30 if last else B, sdt.itemsize, best["config"] if win else {}))
    if torch.float32 in sdts and torch.bfloat16 in sdts:
        print("\n== bf16 states ÷ fp32 states (cycle speed-up of the replay-decode step; default forms, best forms)")
        for fam in fams:
            for B in batches:
                got = {}
                for sname in ("fp32", "bf16"):
                    rows = [r for r in res["rows"] if r["family"] == fam and r["state"] == sname and r["B"] == B
                            and "cycle_us" in r]
                    d = next((r["cycle_us"] for r in rows if r["form"] == "default"), float("nan"))
                    got[sname] = (d, min((r["cycle_us"] for r in rows), default=float("nan")))
                ratio = (got["fp32"][0] / got["bf16"][0], got["fp32"][1] / got["bf16"][1])
                res.setdefault("bf16_over_fp32", {})[f"{fam}/B={B}"] = ratio
                print(f"{fam:6} B={B:<4} default x{ratio[0]:.2f}   best x{ratio[1]:.2f}")
    print("\n== DECODE_TABLE rows these numbers support (a row covers the batches above the previous row's"
          " bound; {} = the default form)")
    for fam, rows in table.items():
        mod = km if fam == "mamba2" else kg
        measured = {itemsize for _, itemsize, _ in rows}
        # the committed rows of state dtypes this run did not measure stay; the measured ones are replaced
        kept = [tuple(r) for r in mod.DECODE_TABLE if r[1] is not None and r[1] not in measured]
        if any(cfg for _, _, cfg in rows):
            merged = kept + [r for r in rows if r[2] or any(c for b_, i, c in rows if i == r[1] and b_ > r[0])]
            print(f"# paste into replayssm/kernels/{'mamba2' if fam == 'mamba2' else 'gdn'}.py:")
            print(f"DECODE_TABLE = {merged!r}")
        else:
            print(f"{fam}: no form beat the default by 3%; DECODE_TABLE keeps {mod.DECODE_TABLE!r}")
    res["table_rows"] = {k: [list(r) for r in v] for k, v in table.items()}
    res["wall_s"] = time.time() - t_start
    path = _write(res, args.out)
    print(f"wrote {path} in {res['wall_s']:.0f} s")
    return 0


def _write(res: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "tune_replay_decode.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return path


if __name__ == "__main__":
    sys.exit(main())
