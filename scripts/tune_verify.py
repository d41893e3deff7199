"""Verify-kernel tiles vs batch size (GPU): times replay verify of ``T`` queries for each
(tile, warps) variant at a non-flush fill (h = 0), a flush fill (h = L - T) and a mixed one
(h = 0 … L-1 across the rows: those with h + T > L flush, as in a running batch), beside the
replay decode step at the same batch, and checks every variant's outputs against the
default's.  Shapes: Mamba-2 of the 2.7B model (H=80, d=64, n=128, G=1) and the bench's GDN.

    PYTHONPATH=. python3 scripts/tune_verify.py --batches 1,4,16,64,256 --T 5
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from replayssm.bench.kernels import GDN_SHAPE, Timer, _ring, _set_fill, gdn_inputs, gdn_setup, m2_inputs, m2_setup
from replayssm.kernels import gdn as kg
from replayssm.kernels import mamba2 as km

M2_27B = dict(H=80, d=64, n=128, G=1)
M2_SHAPES = {"2.7b": M2_27B, "nemotron-h-4b": dict(H=96, d=80, n=128, G=8)}
#: the forms before 2026-11-25 evening (Mamba-2: scores in every program, ``C S0ᵀ``, 2 warps;
#: GDN: whole 128-wide V tiles on 4 warps), the unsplit large-grid form of 2026-11-26 and
#: neighbours of today's defaults
M2_VARIANTS = ([dict(pre_scores=False, state_left=False, num_warps=2), dict(state_left=False),
                dict(pre_scores=False), dict(num_warps=2), dict(state_left=True),
                dict(block_d=32, num_warps=1, pre_scores=True, state_left=True),
                dict(block_d=16, num_warps=1, pre_scores=True, state_left=True),
                dict(block_d=64, num_warps=2, pre_scores=True, state_left=True),
                dict(block_d=64, num_warps=4, pre_scores=True, state_left=True),
                dict(split=False), dict(readout=dict(block_n=32)), dict(readout=dict(block_d=16))])
GDN_VARIANTS = ([dict(impl="dot", block_v=128, num_warps=4), dict(impl="dot", block_v=64, num_warps=4)])


def _scaled(s: dict, k: int) -> dict:
    return {key: (max(1, v // k) if key in ("H", "HK", "HV", "G") else v) for key, v in s.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--T", default="5")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--fams", default="mamba2,gdn")
    ap.add_argument("--m2-shape", default="2.7b", choices=sorted(M2_SHAPES), help="the Mamba-2 layer's shape")
    ap.add_argument("--variants", default=None, help="JSON list of Mamba-2 variants instead of the built-in list")
    ap.add_argument("--gdn-variants", default=None, help="JSON list of GDN variants instead of the built-in list")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1")
    ap.add_argument("--shape-scale", type=int, default=1, help="divide head counts (dry runs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    timer = Timer(args.device, quick=True)
    dev, dt = args.device, torch.bfloat16
    L = args.L
    res = []
    for fam, s, setup, inputs, mod, variants in (
            ("mamba2", _scaled(M2_SHAPES[args.m2_shape], args.shape_scale), m2_setup, m2_inputs, km,
             json.loads(args.variants) if args.variants else M2_VARIANTS),
            ("gdn", _scaled(GDN_SHAPE, args.shape_scale), gdn_setup, gdn_inputs, kg,
             json.loads(args.gdn_variants) if args.gdn_variants else GDN_VARIANTS)):
        if fam not in args.fams.split(","):
            continue
        for Bt in [int(b) for b in args.batches.split(",")]:
            slots = torch.arange(1, Bt + 1, device=dev)
            buf = setup(Bt, L, s, dev, dt)
            ring = _ring(Bt + 1, L, dev)
            dec_in = inputs(Bt, s, dev, dt)
            _set_fill(ring, slots, 0)
            plan = ring.plan_decode(slots) if hasattr(ring, "plan_decode") else ring.plan_verify(slots, 1, "decode")
            saved = {k: t.clone() for k, t in vars(buf).items() if isinstance(t, torch.Tensor)}  # state and ring

            def restore():
                for k, t in saved.items():
                    getattr(buf, k).copy_(t)
            dec = timer(lambda: mod.replay_decode(buf, plan, **dec_in))
            _set_fill(ring, slots, L - 1)  # every row flushes
            plan = ring.plan_decode(slots) if hasattr(ring, "plan_decode") else ring.plan_verify(slots, 1, "decode")
            dec_flush = timer(lambda: mod.replay_decode(buf, plan, **dec_in))
            print(f"{fam:>6} B={Bt:<4} decode {dec:8.1f} us, every row flushing {dec_flush:8.1f} us", flush=True)
            restore()
            for T in [int(t) for t in args.T.split(",")]:
                inp = inputs(Bt, s, dev, dt, T)
                ref = {}
                for var in [{}] + variants:
                    ts, err = [], 0.0
                    try:
                        for h in (0, L - T, "mixed"):
                            _set_fill(ring, slots, 0 if h == "mixed" else h, stagger=h == "mixed")
                            plan = ring.plan_verify(slots, T, "verify")
                            restore()
                            y = mod.replay_verify(buf, plan, **inp, **var)
                            if not var:
                                ref[h] = y.float()
                            else:
                                err = max(err, float((y.float() - ref[h]).abs().max() / ref[h].abs().max()))
                            ts.append(timer(lambda: mod.replay_verify(buf, plan, **inp, **var)))
                    except Exception as e:  # a tile the kernel cannot take: report it
                        print(f"{fam} B={Bt} T={T} {var}: failed {repr(e)[:160]}", flush=True)
                        continue
                    row = dict(fam=fam, B=Bt, T=T, var=var or "default", nonflush_us=ts[0], flush_us=ts[1],
                               mixed_us=ts[2], decode_us=dec, decode_flush_us=dec_flush, rel_err=err)
                    res.append(row)
                    print(f"{fam:>6} B={Bt:<4} T={T} {json.dumps(var or 'default'):<34} {ts[0]:8.1f} {ts[1]:8.1f}"
                          f" {ts[2]:8.1f} us"
                          f"  (decode {dec:7.1f} us, x{(ts[0] + ts[1]) / 2 / dec:4.2f}) err {err:.1e}", flush=True)
            buf = None  # not del: the timed lambdas above close over it
            if dev == "cuda":
                torch.cuda.empty_cache()
    with open(os.path.join(args.out, "tune_verify.json"), "w") as f:
        json.dump(res, f, indent=1)
    # best per (fam, B, T)
    best = {}
    for r in res:
        k = (r["fam"], r["B"], r["T"])
        c = r["nonflush_us"] + r["flush_us"]
        if k not in best or c < best[k][0]:
            best[k] = (c, r)
    for k, (c, r) in sorted(best.items()):
        d = next(x for x in res if (x["fam"], x["B"], x["T"]) == k and x["var"] == "default")
        print(f"best {k}: {r['var']} {c / 2:.1f} us vs default {(d['nonflush_us'] + d['flush_us']) / 2:.1f} us")


if __name__ == "__main__":
    main()
