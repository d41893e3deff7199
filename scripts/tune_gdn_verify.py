"""GDN verify forms against a decode step and the snapshot baseline (GPU).

For the GDN layer shapes of the Qwen3.5-4B and Qwen3-Next-4B presets (read from
``replayssm/bench/hybrid_presets.py``; shapes that coincide are timed once), batches
B = 256, 64, 16, 1 and T = 5 (T = 4 and 3: staggered fills only), bf16 and fp32 checkpoint
states:

* correctness first: every verify variant against the float64 naive op on the GPU (B = 16,
  a mixed fill with flush and non-flush rows): max relative error of ``y``, the stored states
  and the appended ring entries;
* µs (CUDA-graph replays, median) of: the decode step (default form) at a non-flush fill and at
  staggered fills (1/16 of the rows flush), the snapshot baseline, and each verify variant at
  the largest non-flush fill (h = L − 2T), staggered fills, and every row flushing (h = L − T);
  % of copy bandwidth from the bytes each call must move.

Variants: the default (``verify_form``), ``impl="dot"``, ``impl="rows"``, and at T = 5 the dot
kernel with the flush rows folded by the separate fold kernel (``fused_fold=False``).  (A
``split`` form, a per key-head prep kernel and a state-streaming readout, lost at every shape
on the H100 and was removed: docs/KERNEL_NOTES.md.)
``--counts`` prints the byte / FLOP / schedule count of one verify call (no GPU).

    PYTHONPATH=. python scripts/tune_gdn_verify.py            # ~3-4 min on an H100; JSON to $OUT
    PYTHONPATH=. python scripts/tune_gdn_verify.py --counts   # the count table only
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/tune_gdn_verify.py --device cpu --batches 2 --state-dtypes float32
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from replayssm.bench import hybrid_presets as hp
from replayssm.bench.kernels import Timer, _ring, _set_fill, copy_bandwidth, gdn_inputs
from replayssm.cache.buffers import GDNBuffers
from replayssm.kernels import gdn as kg
from replayssm.ops.gdn import naive as ng

L = 16
PRESETS = {"qwen3.5-4b": hp.QWEN3_5_4B, "qwen3-next-4b": hp.QWEN3_NEXT_4B}


def gdn_shapes() -> dict:
    """``{shape: [preset names]}`` of the presets' GDN layers."""
    out: dict = {}
    for name, cfg in PRESETS.items():
        s = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
             cfg["linear_value_head_dim"])
        out.setdefault(s, []).append(name)
    return out


def variants(T: int) -> list[dict]:
    base = [{}, dict(impl="dot"), dict(impl="rows")]
    return base + [dict(impl="dot", fused_fold=False)] if T >= 5 else base


def call(buf, plan, inp, var: dict):
    """One verify call with the variant's arguments."""
    return kg.replay_verify(buf, plan, **inp, **var)


def setup(Bt: int, s: dict, dev: str, state_dtype, dt=torch.bfloat16, seed: int = 0) -> GDNBuffers:
    torch.manual_seed(seed)
    buf = GDNBuffers.allocate(Bt, L, s["HK"], s["HV"], s["K"], s["V"], dtype=dt, state_dtype=state_dtype, device=dev)
    buf.state.copy_((torch.randn(buf.state.shape, device=dev) * 0.05).to(state_dtype))
    buf.u.normal_()
    buf.k.copy_(torch.nn.functional.normalize(torch.randn(buf.k.shape, device=dev), dim=-1).to(dt))
    buf.g.uniform_(-0.3, -0.01)
    return buf


def verify_bytes(Bt, s, h_mean, flush_frac, T, sb, ring_b=2) -> float:
    """Bytes a verify call must move: state read (+ written back for flush rows), the
    committed ring entries read, inputs, outputs, and the appended entries written."""
    HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]
    state = HV * K * V * sb
    entry = HV * V * ring_b + HK * K * ring_b + HV * 4
    inputs = 2 * HK * K * 2 + HV * V * 2 + 2 * HV * 4
    return Bt * (state * (1 + flush_frac) + h_mean * entry + T * (inputs + HV * V * 2 + entry))


def decode_bytes(Bt, s, h_mean, flush_frac, sb) -> float:
    return verify_bytes(Bt, s, h_mean, flush_frac, 1, sb)


# ----------------------------------------------------------------------------------- counts
def counts(s: dict, Bt: int, T: int, h: int, sb: int = 4) -> dict:
    """One verify call by the current default schedule (``impl="dot"``: one program per (row,
    value head, V-block)) against a decode step: programs, bytes, tensor-core FLOPs issued
    (padded tiles) and useful, per-program chains.  A count, not a measurement."""
    HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]
    REP, TP, LP, BKC = HV // HK, max(16, 1 << (T - 1).bit_length()), 16, 32
    big = Bt * HV >= 2048
    BV = 64 if big else 128
    nv, nk = V // BV, K // BKC
    prog = Bt * HV * nv
    # dot kernel, per program
    chunk_tc = 2 * (2 * TP * TP * BKC) + 2 * (2 * TP * LP * BKC) + 2 * (2 * TP * BKC * BV)
    tail_tc = 2 * (2 * TP * LP * BV) + 2 * TP * TP * BV
    dot_tc = prog * (nk * chunk_tc + tail_tc)
    scores_tc = prog * nk * (2 * (2 * TP * TP * BKC) + 2 * (2 * TP * LP * BKC))
    useful = Bt * HK * (2 * 2 * T * T * K + 2 * 2 * T * h * K) + Bt * HV * (
        2 * 2 * T * K * V + 2 * 2 * T * h * V + 2 * T * T * V + T * T * V)
    # bytes the programs request (L2 -> SM), dot kernel
    req = prog * (K * BV * sb + 2 * 2 * T * K * 2 + h * K * 2 + h * BV * 2 + T * BV * 2 + T * BV * 2 * 2)
    # operands staged through shared memory for tl.dot (fp32, written and read once each)
    smem = prog * (nk * 4 * (2 * TP * BKC + LP * BKC + BKC * BV) + 4 * (2 * TP * LP + LP * BV + TP * TP + TP * BV))
    return dict(
        B=Bt, T=T, h=h, state_bytes=Bt * HV * K * V * sb,
        verify_bytes=verify_bytes(Bt, s, h, 0.0, T, sb), decode_bytes=decode_bytes(Bt, s, h, 0.0, sb),
        dot_tile=f"{BV}x{K}, {2 if big else 4} warps", dot_programs=prog, dot_state_passes=1,
        dot_qk_passes=2, dot_request_bytes=req, dot_smem_staged=smem,
        dot_tc_flops=dot_tc, dot_tc_flops_scores=scores_tc, useful_flops=useful,
        dot_chain=f"{2 * nk} K-chunk steps, {6 * nk + 3} dots, {T - 1} solve steps on [{TP},{BV}]",
        score_redundancy=REP * nv, row_padding=TP / T)


def print_counts(shapes) -> list:
    rows = []
    for (HK, HV, K, V), names in shapes.items():
        s = dict(HK=HK, HV=HV, K=K, V=V)
        print(f"== counts {'/'.join(names)}: HK={HK} HV={HV} K={K} V={V}, fp32 state")
        print(f"{'B':>4} {'h':>3} {'state MB':>9} {'verify MB':>9} {'decode MB':>9} {'progs':>6} {'req MB':>7} "
              f"{'smem MB':>8} {'TC GF':>6} {'scores':>6} {'useful':>6}")
        for Bt in (256, 64):
            for h in (1, 4, 8, 11):
                c = counts(s, Bt, 5, h)
                rows.append(dict(c, shape=[HK, HV, K, V], presets=names))
                print(f"{Bt:>4} {h:>3} {c['state_bytes'] / 1e6:9.1f} {c['verify_bytes'] / 1e6:9.1f} "
                      f"{c['decode_bytes'] / 1e6:9.1f} {c['dot_programs']:>6} {c['dot_request_bytes'] / 1e6:7.1f} "
                      f"{c['dot_smem_staged'] / 1e6:8.1f} {c['dot_tc_flops'] / 1e9:6.2f} "
                      f"{c['dot_tc_flops_scores'] / 1e9:6.2f} {c['useful_flops'] / 1e9:6.2f}")
            print(f"     dot tile {c['dot_tile']}: {c['dot_chain']}; scores recomputed by {c['score_redundancy']} "
                  f"programs, rows padded {c['row_padding']:.1f}x")
    return rows


# ----------------------------------------------------------------------------------- checks
def check_variant(s, dev, var, T) -> dict:
    """Max relative errors of a variant against the float64 naive op (B = 16, mixed fill)."""
    Bt = 16
    slots = torch.arange(1, Bt + 1, device=dev)
    ring = _ring(Bt + 1, L, dev)
    _set_fill(ring, slots, 0, stagger=True)
    ring.length[slots] = ring.length[slots].clamp(max=L - T)
    plan = ring.plan_verify(slots, T, "verify")
    buf = setup(Bt, s, dev, torch.float32, seed=1)
    ref = GDNBuffers(*(t.double() for t in (buf.state, buf.u, buf.k, buf.g)))
    inp = gdn_inputs(Bt, s, dev, torch.bfloat16, T)
    y_ref = ng.replay_verify(ref, plan, **{k: t.double() for k, t in inp.items()})
    y = call(buf, plan, inp, var)

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    return dict(y=rel(y, y_ref), state=rel(buf.state, ref.state), u=rel(buf.u.nan_to_num(), ref.u.nan_to_num()),
                k=rel(buf.k.nan_to_num(), ref.k.nan_to_num()), flush_rows=int(plan.flush.sum()))


# ----------------------------------------------------------------------------------- timing
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--T", default="5,4,3")
    ap.add_argument("--state-dtypes", default="bfloat16,float32")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds; later configs are skipped past it")
    ap.add_argument("--counts", action="store_true", help="print the count table only (no GPU)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 on shapes / 8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = gdn_shapes()
    res: dict = dict(counts=print_counts(shapes))
    if args.counts:
        return
    t0 = time.time()
    dev = args.device
    if dev == "cpu":
        shapes = {tuple(max(2, x // 8) for x in shp): names for shp, names in shapes.items()}
    timer = Timer(dev, quick=True)
    bw = copy_bandwidth(dev, timer)
    res.update(device=torch.cuda.get_device_name() if dev == "cuda" else dev, copy_TBps=bw / 1e12, checks=[], rows=[],
               skipped=[])
    print(f"device {res['device']}  copy {bw / 1e12:.2f} TB/s")
    for (HK, HV, K, V), names in shapes.items():
        s = dict(HK=HK, HV=HV, K=K, V=V)
        tag = "/".join(names)
        for T in [int(t) for t in args.T.split(",")]:
            for var in variants(T):
                e = check_variant(s, dev, var, T)
                ok = e["y"] < 2e-2 and e["state"] < 1e-4 and e["u"] < 2e-2 and e["k"] < 1e-2
                res["checks"].append(dict(shape=tag, T=T, var=var or "default", ok=ok, **e))
                print(f"check {tag} T={T} {json.dumps(var or 'default'):<20} y {e['y']:.1e} state {e['state']:.1e} "
                      f"u {e['u']:.1e} k {e['k']:.1e} ({e['flush_rows']} flush rows) {'ok' if ok else 'FAIL'}",
                      flush=True)
        # the largest batch first: the budget, if it runs out, cuts the small batches
        for Bt, sdt in [(b, getattr(torch, d)) for b in sorted((int(x) for x in args.batches.split(",")), reverse=True)
                        for d in args.state_dtypes.split(",")]:
            sb = torch.tensor([], dtype=sdt).element_size()
            if True:
                if time.time() - t0 > args.budget:
                    res["skipped"].append(dict(shape=tag, state=str(sdt), B=Bt))
                    print(f"skip {tag} {sdt} B={Bt}: past the {args.budget:.0f} s budget", flush=True)
                    continue
                slots = torch.arange(1, Bt + 1, device=dev)
                buf = setup(Bt, s, dev, sdt)
                ring = _ring(Bt + 1, L, dev)
                dec_in = gdn_inputs(Bt, s, dev, torch.bfloat16)
                _set_fill(ring, slots, L // 2)
                plan = ring.plan_decode(slots)
                dec = timer(lambda: kg.replay_decode(buf, plan, **dec_in))
                _set_fill(ring, slots, 0, stagger=True)
                plan_m = ring.plan_decode(slots)
                dec_mix = timer(lambda: kg.replay_decode(buf, plan_m, **dec_in))
                hs = ring.length[slots].float()
                dec_mix_b = decode_bytes(Bt, s, float(hs.mean()), float(plan_m.flush.float().mean()), sb)
                print(f"{tag} state={str(sdt)[6:]} B={Bt}: decode {dec:7.1f} us (h={L // 2}), mixed {dec_mix:7.1f} us "
                      f"({100 * dec_mix_b / (dec_mix * 1e-6) / bw:4.0f}% copy)", flush=True)
                for T in [int(t) for t in args.T.split(",")]:
                    inp = gdn_inputs(Bt, s, dev, torch.bfloat16, T)
                    pool = buf.state
                    snaps = torch.empty(Bt, T, HV, K, V, dtype=sdt, device=dev)
                    snap = timer(lambda: kg.snapshot_verify(pool, slots, **inp, snapshots=snaps))
                    snaps = None
                    fills = {"nonflush": L - 2 * T, "mixed": "mixed", "flush": L - T} if T >= 5 else {"mixed": "mixed"}
                    for var in variants(T):
                        ts, by = {}, {}
                        try:
                            for fname, h in fills.items():
                                _set_fill(ring, slots, 0 if h == "mixed" else h, stagger=h == "mixed")
                                if h == "mixed":
                                    ring.length[slots] = ring.length[slots].clamp(max=L - T)
                                vplan = ring.plan_verify(slots, T, "verify")
                                ts[fname] = timer(lambda: call(buf, vplan, inp, var))
                                by[fname] = verify_bytes(Bt, s, float(ring.length[slots].float().mean()),
                                                         float(vplan.flush.float().mean()), T, sb)
                        except Exception as e:  # a launch the kernel cannot take: report it
                            print(f"  T={T} {var}: failed {repr(e)[:160]}", flush=True)
                            continue
                        pct = {f: 100 * by[f] / (ts[f] * 1e-6) / bw for f in ts}
                        row = dict(shape=tag, state=str(sdt), B=Bt, T=T, var=var or "default", us=ts, pct_copy=pct,
                                   decode_us=dec, decode_mixed_us=dec_mix, snapshot_us=snap,
                                   x_decode=ts["mixed"] / dec_mix, x_snapshot=snap / ts["mixed"])
                        res["rows"].append(row)
                        print(f"  T={T} {json.dumps(var or 'default'):<46} " + " ".join(
                            f"{f} {ts[f]:7.1f}" for f in ts) + f" us  mixed {pct['mixed']:3.0f}% copy, "
                            f"x{row['x_decode']:.2f} decode, snapshot {snap:7.1f} us "
                            f"(snapshot/verify {row['x_snapshot']:.2f})",
                            flush=True)
                buf = None
                if dev == "cuda":
                    torch.cuda.empty_cache()
    best: dict = {}
    for r in res["rows"]:
        key = (r["shape"], r["state"], r["B"], r["T"])
        if key not in best or r["us"]["mixed"] < best[key]["us"]["mixed"]:
            best[key] = r
    print("== best by mixed fill (against the default)")
    for key, r in sorted(best.items()):
        d = next(x for x in res["rows"] if (x["shape"], x["state"], x["B"], x["T"]) == key and x["var"] == "default")
        print(f"{key}: {json.dumps(r['var'])} {r['us']['mixed']:.1f} us (x{r['x_decode']:.2f} decode) vs default "
              f"{d['us']['mixed']:.1f} us (x{d['x_decode']:.2f})")
    res["elapsed_s"] = time.time() - t0
    print(f"elapsed {res['elapsed_s']:.0f} s; checks {'all ok' if all(c['ok'] for c in res['checks']) else 'FAILED'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_gdn_verify.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
