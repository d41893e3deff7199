"""Check and tune the packed prefill kernels on the GPU in one run (device time is scarce).

    PYTHONPATH=. python scripts/tune_prefill.py --peers ../../.peers --out $OUT/tune --budget 330

1. correctness at real shapes (bf16, plus fp32): packed batches of mixed lengths (empty,
   1, chunk±1, long) in the pool form with NaN-poisoned rows, against the reference ops —
   outputs, final states / pool rows, GDN ``u``, the short conv and its windows;
2. the peers (``mamba_chunk_scan_combined``, fla ``chunk_gated_delta_rule``) at the bench
   shapes, with the relative difference of their final states to ours;
3. tile/warp/stage variants of our kernels at every shape, round-robin over the families
   until ``--budget`` seconds have passed since the start.

Writes ``tune_prefill.json`` and prints a table (best variant per family and shape vs peer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from replayssm.bench import prefill as BP
from replayssm.cache import conv as RC
from replayssm.kernels import conv as KC
from replayssm.kernels import gdn_prefill as KG
from replayssm.kernels import mamba2_prefill as KM
from replayssm.ops.gdn import naive as NG
from replayssm.ops.mamba2 import naive as N2

M2_VARIANTS = [dict(block_t=t, block_d=d, num_warps=w, num_stages=s, precompute_cb=p) for t, d, w, s, p in (
    (64, 64, 4, 2, True), (64, 32, 4, 2, True), (64, 16, 4, 2, True), (32, 64, 4, 2, True), (32, 32, 4, 2, True),
    (32, 16, 4, 2, True), (64, 64, 4, 3, True), (64, 32, 4, 3, True), (128, 64, 8, 2, True),
    (128, 32, 8, 2, True), (128, 32, 4, 2, True), (64, 64, 8, 2, True), (32, 64, 4, 3, True),
    (64, 32, 4, 1, True), (64, 64, 4, 2, False), (32, 32, 4, 2, False))]
GDN_VARIANTS = [dict(block_v=v, num_warps=w, num_stages=s) for v, w, s in (
    (64, 4, 2), (32, 4, 2), (64, 8, 2), (32, 4, 3), (64, 4, 3), (16, 4, 2), (128, 8, 2), (64, 8, 3), (32, 8, 2))]
WU_VARIANTS = [dict(inv=i, num_warps=w) for i, w in ((0, 4), (1, 4), (2, 4), (1, 8), (2, 8), (0, 8))]
LENS = [0, 1, 63, 64, 65, 1000, 2500, 17, 0, 129]


def log(*a):
    print(*a, flush=True)


def cu_of(lens, dev):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.int32)


def pool_case(N, shape, P, dev, seed):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(P - 1, generator=g)[:N] + 1
    fresh = torch.rand(N, generator=g) < 0.4
    pool = torch.full((P,) + shape, float("nan"))
    pool[slots[~fresh]] = torch.randn((int((~fresh).sum()),) + shape, generator=g) * 0.1
    others = sorted(set(range(P)) - set(slots.tolist()))
    return pool.to(dev), slots.to(dev), fresh.to(dev), others


def correctness(dev) -> dict:
    res = {}
    cu = cu_of(LENS, dev)
    Nt, N = sum(LENS), len(LENS)
    for fam in ("mamba2", "mamba2_g8", "gdn"):
        s = BP.FAMILIES[fam]
        for dtype in ((torch.bfloat16, torch.float32) if fam != "mamba2_g8" else (torch.bfloat16,)):
            key = f"{fam}_{str(dtype)[6:]}"
            if fam.startswith("mamba2"):
                c = BP.m2_case(1, Nt, s, dev, dtype, seed=1)
                args = (BP.packed(c["x"]), BP.packed(c["dt"]), c["A"], BP.packed(c["B"]), BP.packed(c["C"]), c["D"])
                shape = (s["H"], s["d"], s["n"])
                kern, ref, kw = KM.chunked_prefill_varlen, N2.chunked_prefill_varlen, {}
            else:
                c = BP.gdn_case(1, Nt, s, dev, dtype, seed=1)
                args = tuple(BP.packed(c[k]) for k in ("q", "k", "v", "g", "beta"))
                shape = (s["HV"], s["K"], s["V"])
                kern, ref, kw = KG.chunked_prefill_varlen, NG.chunked_prefill_varlen, dict(return_u=True)
            pool, slots, fresh, others = pool_case(N, shape, N + 5, dev, 3)
            rpool = pool.clone()
            rout = ref(*args, cu_seqlens=cu, state_pool=rpool, slots=slots, fresh=fresh, check=False, **kw)
            for extra in ([dict(inv=1), dict(inv=2)] if fam == "gdn" else [dict(precompute_cb=False)]):
                p2 = pool.clone()
                o2 = kern(*args, cu_seqlens=cu, state_pool=p2, slots=slots, fresh=fresh, check=False, **kw, **extra)
                res[key + "_" + "_".join(f"{a}{b}" for a, b in extra.items()) + "_y"] = BP.relerr(o2[0], rout[0])
                res[key + "_" + "_".join(f"{a}{b}" for a, b in extra.items()) + "_pool"] = BP.relerr(p2[slots],
                                                                                                      rpool[slots])
            out = kern(*args, cu_seqlens=cu, state_pool=pool, slots=slots, fresh=fresh, check=True, **kw)
            res[key + "_y"] = BP.relerr(out[0], rout[0])
            res[key + "_pool"] = BP.relerr(pool[slots], rpool[slots])
            res[key + "_untouched"] = bool(torch.isnan(pool[others]).all())
            if len(out) == 3:
                res[key + "_u"] = BP.relerr(out[2], rout[2])
            log(key, {k: v for k, v in res.items() if k.startswith(key)})
    # short conv: Mamba-2 2.7B xBC width, bf16 window pool
    C, W = (5376, 4) if dev == "cuda" else (40, 4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(Nt, C + 64, generator=g).to(dev, torch.bfloat16)[:, :C]
    w = torch.randn(C, W, generator=g).to(dev)
    b = torch.randn(C, generator=g).to(dev)
    pool, slots, fresh, others = pool_case(N, (C, W - 1), N + 5, dev, 4)
    pool = pool.to(torch.bfloat16)
    rpool = pool.clone()
    o = KC.conv_prefill_varlen(x, w, b, cu, pool, slots, fresh, "silu")
    r = RC.conv_prefill_varlen(x, w, b, cu, rpool, slots, fresh, "silu", check=False)
    res["conv_out"] = BP.relerr(o, r)
    res["conv_window_exact"] = bool(torch.equal(pool[slots], rpool[slots]))
    res["conv_untouched"] = bool(torch.isnan(pool[others].float()).all())
    log("conv", res["conv_out"], res["conv_window_exact"], res["conv_untouched"])
    return res


def compiled_stats() -> list[str]:
    """Registers, spills and shared memory of every compiled prefill kernel variant."""
    out = []
    for name, fn in (("m2_cb", KM._m2_cb_kernel), ("m2_scan", KM._m2_prefill_kernel), ("gdn_wu", KG._gdn_wu_kernel),
                     ("gdn_scan", KG._gdn_scan_kernel)):
        try:
            for caches in fn.device_caches.values():
                for key, k in caches[0].items():
                    md = k.metadata
                    out.append(f"{name}: regs={k.n_regs} spills={k.n_spills} shared={getattr(md, 'shared', '?')} "
                               f"warps={getattr(md, 'num_warps', '?')} stages={getattr(md, 'num_stages', '?')} "
                               f"{str(key)[-160:]}")
        except Exception as exc:
            out.append(f"{name}: stats unavailable ({exc!r})"[:200])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=None)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "tune"))
    ap.add_argument("--budget", type=float, default=330.0, help="seconds from start after which tuning stops")
    ap.add_argument("--families", default="mamba2,gdn,mamba2_g8")
    ap.add_argument("--shapes", default="1x8192,16x2048,64x512,4x32768")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--no-peers", action="store_true", help="skip the peers (their autotuning takes minutes)")
    ap.add_argument("--try-compile", action="store_true", help="time torch.compile of the reference at one shape")
    ap.add_argument("--dry", action="store_true", help="CPU interpreter, smoke dims (checks the script itself)")
    args = ap.parse_args()
    T0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    dev = "cpu" if args.dry else "cuda"
    if args.dry:
        BP.FAMILIES.update(BP.SMOKE)
        LENS[:] = [0, 1, 63, 64, 65, 17]
        res = {"device": "cpu (dry run)"}
    else:
        res = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    import triton

    res["triton"], res["torch"] = triton.__version__, torch.__version__
    log(res)
    path = os.path.join(args.out, "tune_prefill.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    if not args.skip_correctness:
        try:
            res["correctness"] = correctness(dev)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            res["correctness_error"] = repr(exc)
        save()
        log(f"[{time.time() - T0:.0f}s] correctness done")
    fams = args.families.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    peers = {} if args.no_peers else BP.load_prefill_peers(args.peers)
    res["peers"] = {k: (v if isinstance(v, str) else "ok") for k, v in peers.items()}
    log("peers", res["peers"])
    cases = {}
    res["rows"] = {}
    for fam in fams:
        for Bt, T in shapes:
            make = BP.m2_case if fam.startswith("mamba2") else BP.gdn_case
            c = make(Bt, T, BP.FAMILIES[fam], dev)
            key = f"{fam} {Bt}x{T}"
            row = res["rows"].setdefault(key, {"variants": []})
            try:
                y, S = BP.ours(fam, c)
                call = BP.peer_call(fam, c, peers)
                if call is not None:
                    t = time.time()
                    out = call()
                    row["peer_first_call_s"] = time.time() - t
                    row["peer_vs_ours_state"] = BP.relerr(S, out[-1])
                    row["peer_vs_ours_y"] = BP.relerr(y, out[0])
                    row["peer_ms"] = BP.time_ms(call, dev, quick=True)
                    del out
                row["default_ms"] = BP.time_ms(lambda: BP.ours(fam, c), dev, quick=True)
                if fam == "gdn":
                    args_wu = []
                    for name in ("k", "v", "g", "beta"):
                        t2, st = KG._rows(BP.packed(c[name]))
                        args_wu += [t2, st]
                    s = BP.FAMILIES[fam]
                    row["wu_ms"] = BP.time_ms(lambda: KG.wu_pass(*args_wu, c["cu"], Bt, s["HK"]), dev, quick=True)
            except Exception as exc:
                import traceback

                traceback.print_exc()
                row["error"] = repr(exc)[:400]
            cases[key] = (fam, c)
            log(f"[{time.time() - T0:.0f}s] {key}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "variants"))
    save()
    # the GDN w/u kernel alone
    if "gdn" in fams:
        for kw in WU_VARIANTS:
            for key, (f2, c) in cases.items():
                if f2 != "gdn":
                    continue
                args_wu = []
                for name in ("k", "v", "g", "beta"):
                    t2, st = KG._rows(BP.packed(c[name]))
                    args_wu += [t2, st]
                try:
                    ms = BP.time_ms(lambda: KG.wu_pass(*args_wu, c["cu"], c["cu"].numel() - 1,
                                                       BP.FAMILIES["gdn"]["HK"], **kw), dev, quick=True)
                    res["rows"][key].setdefault("wu_variants", []).append(dict(kw, ms=ms))
                except Exception as exc:
                    res["rows"][key].setdefault("wu_variants", []).append(dict(kw, error=repr(exc)[:300]))
            log(f"[{time.time() - T0:.0f}s] wu {kw}: " + ", ".join(
                f"{k}={r['wu_variants'][-1].get('ms', -1):.3f}" for k, r in res["rows"].items() if "wu_variants" in r))
        save()
    # round-robin over the families' variant lists
    lists = {f: list(M2_VARIANTS if f.startswith("mamba2") else GDN_VARIANTS) for f in fams}
    while any(lists.values()) and time.time() - T0 < args.budget:
        for fam in fams:
            if not lists[fam] or time.time() - T0 >= args.budget:
                continue
            kw = lists[fam].pop(0)
            for key, (f2, c) in cases.items():
                if f2 != fam:
                    continue
                try:
                    ms = BP.time_ms(lambda: BP.ours(fam, c, **kw), dev, quick=True)
                    res["rows"][key]["variants"].append(dict(kw, ms=ms))
                except Exception as exc:
                    res["rows"][key]["variants"].append(dict(kw, error=repr(exc)[:300]))
            log(f"[{time.time() - T0:.0f}s] {fam} {kw}: " + ", ".join(
                f"{k.split()[1]}={[v.get('ms', -1) for v in r['variants'] if all(v.get(a) == b for a, b in kw.items())][0]:.3f}"
                for k, r in res["rows"].items() if k.startswith(fam + " ")))
        save()
    if args.try_compile:  # how long torch.compile of the reference takes (for the bench's budget)
        for fam in fams:
            key = [k for k, (f2, _) in cases.items() if f2 == fam][1:2]
            if not key:
                continue
            c = cases[key[0]][1]
            try:
                if fam.startswith("mamba2"):
                    fn = torch.compile(N2.chunked_prefill, dynamic=False)
                else:
                    fn = BP.gdn_compiled_reference()
                t = time.time()
                BP.reference(fam, c, fn)
                res["rows"][key[0]]["compile_s"] = time.time() - t
                res["rows"][key[0]]["compiled_ms"] = BP.time_ms(lambda: BP.reference(fam, c, fn), dev, quick=True)
                res["rows"][key[0]]["ref_ms"] = BP.time_ms(lambda: BP.reference(fam, c), dev, quick=True)
            except Exception as exc:
                res["rows"][key[0]]["compile_error"] = repr(exc)[:300]
            log(f"[{time.time() - T0:.0f}s] compile trial {key[0]}: " + str({k: v for k, v in res["rows"][key[0]].items()
                                                                          if "comp" in k or k == "ref_ms"}))
    res["compiled"] = compiled_stats()
    for line in res["compiled"]:
        log(line)
    # summary
    lines = [f"{'case':<22} {'peer':>8} {'default':>8} {'best':>8} {'x peer':>7}  best variant"]
    for key, row in res["rows"].items():
        ok = [v for v in row["variants"] if "ms" in v]
        best = min(ok, key=lambda v: v["ms"]) if ok else None
        b = min(best["ms"], row.get("default_ms", 1e9)) if best else row.get("default_ms", float("nan"))
        p = row.get("peer_ms", float("nan"))
        lines.append(f"{key:<22} {p:8.3f} {row.get('default_ms', float('nan')):8.3f} {b:8.3f} {p / b:7.2f}  "
                     f"{ {k: v for k, v in best.items() if k != 'ms'} if best else '-'}")
    res["summary"] = lines
    save()
    log("\n".join(lines))
    log(f"total {time.time() - T0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
