"""Replay decode forms and tiles vs batch size, beside the peers (GPU), plus verify kernels.

For each family and batch: the peer's step, then every decode variant (flush form, scores
kernel, tile, warps) at fills h = 0, L/2, L-2 (non-flush), h = L-1 (every row flushes) and
staggered fills (1/L of the rows flush each step).  The flush-cycle average is estimated as
``(15 × mean(non-flush) + flush) / 16`` (non-flush cost is linear in h).  Every variant is
first checked against the naive op on a small batch (outputs and states after a flush step).
Then verify: T drafts at a non-flush (h = 0) and an all-flush (h = L - T) fill per variant, and
the snapshot baseline.  Shapes: the bench's (Mamba-2 128×64×128 G=8, GDN HV=32 H=16 K=V=128).

    PYTHONPATH=. python3 scripts/tune_decode.py --peers ../../.peers --batches 1,64,256
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/tune_decode.py --device cpu --shape-scale 16 --batches 2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from replayssm.bench.kernels import (GDN_SHAPE, M2_SHAPE, Timer, _ring, _set_fill, gdn_bytes, gdn_inputs, gdn_setup,
                                     load_peers, m2_bytes, m2_inputs, m2_setup)
from replayssm.kernels import gdn as kg
from replayssm.kernels import mamba2 as km
from replayssm.ops.gdn import naive as ng
from replayssm.ops.mamba2 import naive as nm


def _scaled(s: dict, k: int) -> dict:
    return {key: (max(2, v // k) if key in ("H", "HK", "HV", "d", "n", "K", "V") else v) for key, v in s.items()}


# The 2026-11-23 run also timed the Mamba-2 `split` and `apart` flush forms, removed since
# (docs/BENCHMARKS.md, "Decode flush forms").
M2_BIG = [dict(pre_scores=True, block_d=32, num_warps=2), dict(pre_scores=True, block_d=32, num_warps=4),
          dict(pre_scores=True, block_d=64, num_warps=4), dict(pre_scores=False, block_d=32, num_warps=2)]
M2_SMALL = [dict(pre_scores=False, block_d=32, num_warps=2), dict(pre_scores=False, block_d=32, num_warps=4)]
GDN_BIG = [dict(flush_mode="split", pre_scores=False, block_v=32, num_warps=1),  # the 2026-11-23 default
           dict(flush_mode="split", pre_scores=True, block_v=32, num_warps=1),
           dict(flush_mode="apart", pre_scores=True, block_v=32, num_warps=1),
           dict(flush_mode="apart", pre_scores=True, block_v=32, num_warps=2),
           dict(flush_mode="apart", pre_scores=True, block_v=64, num_warps=2),
           dict(flush_mode="fused", pre_scores=True, block_v=32, num_warps=4)]
GDN_SMALL = [dict(flush_mode="split", pre_scores=False, block_v=32, num_warps=1),
             dict(flush_mode="fused", pre_scores=False, block_v=32, num_warps=4),
             dict(flush_mode="fused", pre_scores=False, block_v=32, num_warps=2)]
M2_VERIFY = [dict(block_d=64, num_warps=2), dict(block_d=32, num_warps=4), dict(block_d=64, num_warps=8)]
GDN_VERIFY = [dict(impl="rows"), dict(impl="rows", block_v=32, num_warps=4), dict(impl="dot"),
              dict(impl="dot", block_v=64, num_warps=8), dict(impl="dot", block_v=32, num_warps=4)]


def _key(v: dict) -> str:
    return json.dumps(v, sort_keys=True)


def _relerr(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-30)) if not torch.isnan(b).any() else float("nan")


def check_decode(fam, s, setup, inputs, mod, naive, variants, dev, dtype) -> dict:
    """Each variant vs the naive op: 2 decode steps on 8 rows (one flushing on each step)."""
    Bt, L = 8, 16
    slots = torch.arange(1, Bt + 1, device=dev)
    out = {}
    for var in variants:
        torch.manual_seed(0)
        buf = setup(Bt, L, s, dev, dtype)
        ref = type(buf)(*(t.clone() for t in buf.__dict__.values()))
        ring = _ring(Bt + 1, L, dev)
        _set_fill(ring, slots, 0, stagger=True)
        ring.length[slots] = torch.tensor([L - 1, L - 2, 3, 0, 5, 9, 14, 1], device=dev)
        err = 0.0
        for _ in range(2):
            inp = inputs(Bt, s, dev, dtype)
            plan = ring.plan_decode(slots)
            a = naive.replay_decode(ref, plan, **inp, check=False, **({"route": "output"} if fam == "gdn" else {}))
            b = mod.replay_decode(buf, plan, **inp, **var)
            err = max(err, _relerr(a, b), _relerr(ref.state[1:], buf.state[1:]))
            ring.commit(plan)
        out[_key(var)] = err
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--verify-T", default="1,2,4,6")
    ap.add_argument("--fams", default="mamba2,gdn")
    ap.add_argument("--parts", default="decode,verify")
    ap.add_argument("--peers", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape-scale", type=int, default=1)
    ap.add_argument("--big-from", type=int, default=64, help="batches from here time the large-batch variants")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    timer = Timer(dev, quick=True)
    peers = load_peers(args.peers) if dev == "cuda" else {}
    L = args.L
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", peers=list(peers),
               date=time.strftime("%Y-%m-%d %H:%M"), decode=[], verify=[], checks={})
    lines = []
    fams = [f for f in args.fams.split(",")]
    parts = args.parts.split(",")
    t_start = time.time()
    for fam in fams:
        m2 = fam == "mamba2"
        s = _scaled(M2_SHAPE if m2 else GDN_SHAPE, args.shape_scale)
        setup, inputs, mod, naive = (m2_setup, m2_inputs, km, nm) if m2 else (gdn_setup, gdn_inputs, kg, ng)
        big, small = (M2_BIG, M2_SMALL) if m2 else (GDN_BIG, GDN_SMALL)
        if "decode" not in parts:
            continue
        res["checks"][fam] = chk = check_decode(fam, s, setup, inputs, mod, naive, big + small, dev, dtype)
        print(f"{fam} decode variants vs naive: max rel err {max(chk.values()):.2e}", flush=True)
        for Bt in [int(b) for b in args.batches.split(",")]:
            slots = torch.arange(1, Bt + 1, device=dev)
            inp = inputs(Bt, s, dev, dtype)
            peer = float("nan")
            if m2 and "mamba_ssm" in peers:
                st = torch.randn(Bt, s["H"], s["d"], s["n"], device=dev)
                H, d, n = s["H"], s["d"], s["n"]
                A3 = inp["A"][:, None, None].expand(H, d, n)
                dt3 = inp["dt"][:, :, None].expand(Bt, H, d)
                bias = torch.zeros(H, device=dev)[:, None].expand(H, d)
                D2 = inp["D"][:, None].expand(H, d)
                f = peers["mamba_ssm"]
                peer = timer(lambda: f(st, inp["x"], dt3, A3, inp["B"], inp["C"], D=D2, dt_bias=bias,
                                       dt_softplus=False))
                del st
            if not m2 and "fla" in peers:
                st = torch.randn(Bt, s["HV"], s["K"], s["V"], device=dev) * 0.05
                f = peers["fla"]
                q, k, v = inp["q"][:, None], inp["k"][:, None], inp["v"][:, None]
                g, beta = inp["g"][:, None], inp["beta"][:, None]
                peer = timer(lambda: f(q, k, v, g=g, beta=beta, initial_state=st, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True))
                del st
            buf = setup(Bt, L, s, dev, dtype)
            ring = _ring(Bt + 1, L, dev)
            for var in (big if Bt >= args.big_from else small):
                ts = {}
                for h in (0, L // 2, L - 2, L - 1, "stag"):
                    if h == "stag":
                        _set_fill(ring, slots, 0, stagger=True)
                    else:
                        _set_fill(ring, slots, h)
                    plan = ring.plan_decode(slots)
                    ts[str(h)] = timer(lambda: mod.replay_decode(buf, plan, **inp, **var))
                nonflush = (ts["0"] + ts[str(L // 2)] + ts[str(L - 2)]) / 3
                cyc = ((L - 1) * nonflush + ts[str(L - 1)]) / L
                bytes_fn = m2_bytes if m2 else gdn_bytes
                vb = 2 if dtype != torch.float32 else 4
                cyc_bytes = sum(bytes_fn(Bt, s, h, h == L - 1, "replay", vb) for h in range(L)) / L
                row = dict(fam=fam, B=Bt, var=var, peer_us=peer, steps_us=ts, cycle_us=cyc,
                           cycle_TBps=cyc_bytes / (cyc * 1e-6) / 1e12, x_peer=peer / cyc, x_peer_stag=peer / ts["stag"])
                res["decode"].append(row)
                line = (f"{fam:>6} B={Bt:<4} {_key(var):<86} h0 {ts['0']:7.1f} flush {ts[str(L - 1)]:7.1f} "
                        f"stag {ts['stag']:7.1f} cyc {cyc:7.1f} ({row['cycle_TBps']:.2f} TB/s) peer {peer:7.1f} "
                        f"x{peer / cyc:5.2f} / stag x{peer / ts['stag']:5.2f}")
                print(line, flush=True)
                lines.append(line)
            del buf
            if dev == "cuda":
                torch.cuda.empty_cache()
        with open(os.path.join(args.out, "tune_decode.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    if "verify" in parts:
        Bt = int(args.batches.split(",")[-1])
        slots = torch.arange(1, Bt + 1, device=dev)
        for fam in fams:
            m2 = fam == "mamba2"
            s = _scaled(M2_SHAPE if m2 else GDN_SHAPE, args.shape_scale)
            setup, inputs, mod = (m2_setup, m2_inputs, km) if m2 else (gdn_setup, gdn_inputs, kg)
            buf = setup(Bt, L, s, dev, dtype)
            ring = _ring(Bt + 1, L, dev)
            state0 = buf.state.clone()
            for T in [int(t) for t in args.verify_T.split(",")]:
                inp = inputs(Bt, s, dev, dtype, T)
                if m2:
                    pool = torch.randn(Bt + 1, s["H"], s["d"], s["n"], device=dev)
                    snaps = torch.empty(Bt, T, s["H"], s["d"], s["n"], device=dev)
                else:
                    pool = torch.randn(Bt + 1, s["HV"], s["K"], s["V"], device=dev) * 0.05
                    snaps = torch.empty(Bt, T, s["HV"], s["K"], s["V"], device=dev)
                snap = timer(lambda: mod.snapshot_verify(pool, slots, **inp, snapshots=snaps))
                del pool, snaps
                ref = {}
                for var in (M2_VERIFY if m2 else GDN_VERIFY):
                    ts, err = [], 0.0
                    try:
                        for h in (0, L - T):
                            _set_fill(ring, slots, h)
                            plan = ring.plan_verify(slots, T, "verify")
                            buf.state.copy_(state0)
                            y = mod.replay_verify(buf, plan, **inp, **var).float()
                            if h not in ref:
                                ref[h] = (y, buf.state.clone())
                            else:
                                err = max(err, _relerr(ref[h][0], y), _relerr(ref[h][1], buf.state))
                            ts.append(timer(lambda: mod.replay_verify(buf, plan, **inp, **var)))
                    except Exception as exc:  # a tile the compiler rejects: report it
                        print(f"{fam} verify T={T} {var}: failed {repr(exc)[:200]}", flush=True)
                        continue
                    row = dict(fam=fam, B=Bt, T=T, var=var, nonflush_us=ts[0], flush_us=ts[1], snapshot_us=snap,
                               rel_err_vs_first=err)
                    res["verify"].append(row)
                    line = (f"{fam:>6} verify B={Bt} T={T} {_key(var):<52} {ts[0]:8.1f} {ts[1]:8.1f} us "
                            f"snapshot {snap:8.1f} x{snap / ts[0]:4.2f}/x{snap / ts[1]:4.2f} err {err:.1e}")
                    print(line, flush=True)
                    lines.append(line)
            del buf, state0
            if dev == "cuda":
                torch.cuda.empty_cache()
            with open(os.path.join(args.out, "tune_decode.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    print(f"--- done in {time.time() - t_start:.0f}s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
