"""FP8 decode GEMM sweep on one GPU (~4 min on an H100/H200): the ``stream`` kernel's launch table.

For every FP8-quantized linear shape ``[N, K]`` of the nemotron-h-4b and qwen3-next-4b presets
(block-128 weights) and ``M`` in 1, 4, 16, 32, 64 rows:

1. measures the copy ceiling first (``triton.testing.do_bench`` of a 1 GiB ``copy_``: read +
   write bytes over time);
2. checks every launch against the float64 reference of its scheme (weight-only: the
   dequantized weight; FP8 activations: ``linear_act_quant``): max relative error, bf16 output;
3. times, by CUDA-graph replay of at least 20 launches cycling through enough weight copies
   that they do not stay in L2 (a decode step's situation), bf16 ``F.linear`` of the
   dequantized weight, the current table's launch, the ``stream`` variants (FMA / ``tl.dot``,
   BLOCK_N, waves (split-K), reductions ``sum`` / ``atomic`` / ``fixup``, warps, stages) and,
   from 17 rows, FP8-activation ``tl.dot`` launches;
4. prints per (shape, M) the bytes (weight + scales; activations), µs of bf16 / current /
   best, the best's weight GB/s and its fraction of the copy ceiling, and the winner; then per
   M the launch with the least layer-weighted time per model step over both presets (valid on
   every shape) against bf16 and the current table.

Writes ``$OUT/fp8_gemm_table.json`` (or ``--out``): ``{"buckets": {M: fields}, "shapes":
[{bucket, N, K, config}]}``, which ``replayssm.kernels.fp8_gemm.use_table`` installs (copy it
to ``replayssm/assets/fp8_gemm_table.json`` to make it the default, or point
``REPLAYSSM_FP8_TABLE`` at it); and ``$OUT/tune_fp8_gemv.json`` (every measurement).

    PYTHONPATH=. python scripts/tune_fp8_gemv.py [--ms 1,64,16,4,32] [--budget 210]

Then prefill (``--prefill-m``, 2048 rows) where K is not a multiple of 512 (Nemotron's
3136 and 12544): bf16 against each way ``cublas`` entries handle it (``CUBLAS_K_FALLBACK``:
the Triton ``dot``, ``pad`` K with zero blocks then ``_scaled_mm``, ``dequant`` then
``F.linear``), checked; the fastest valid one goes into the table as ``cublas_k_fallback``.

``--budget`` (seconds): decode variants past it are skipped (listed as skipped; the table
then covers what was measured); the prefill section stops 30 s later.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tune_fp8_gemm import PRESETS, rel, shapes  # noqa: E402
from tune_fp8_gemm import graph_us as _graph_us  # noqa: E402

from replayssm.kernels import fp8_gemm as KF  # noqa: E402
from replayssm.kernels.fp8_gemm import GemmConfig  # noqa: E402
from replayssm.ops.fp8 import naive as Q  # noqa: E402

DEV = "cuda"
BLOCK = (128, 128)
T0 = time.perf_counter()
L2_BYTES = 120e6            # weight bytes a graph cycles through (> 2x L2 of an H100/H200)


def S(**kw) -> GemmConfig:
    return GemmConfig("stream", act_quant=False, **kw)


#: ``stream`` variants per row class (FMA below 16 rows, tl.dot from 16); bounded so the sweep fits
VARIANTS = {
    "small": [S(block_m=4, block_n=16, reduce="fixup", waves=8),
              S(block_m=4, block_n=8, reduce="fixup", waves=8),
              S(block_m=4, block_n=32, reduce="fixup", waves=8, num_warps=8),
              S(block_m=4, block_n=16, reduce="fixup", waves=16),
              S(block_m=4, block_n=16, reduce="sum", waves=8),
              S(block_m=4, block_n=16, reduce="atomic", waves=8),
              S(block_m=16, block_n=32, reduce="fixup", waves=4, num_stages=3),
              S(block_m=16, block_n=64, reduce="fixup", waves=4, num_stages=4)],
    "mid": [S(block_m=16, block_n=32, reduce="fixup", waves=4, num_stages=3),
            S(block_m=16, block_n=64, reduce="fixup", waves=4, num_stages=4),
            S(block_m=16, block_n=64, reduce="fixup", waves=8, num_stages=3),
            S(block_m=16, block_n=128, reduce="fixup", waves=2, num_stages=3),
            S(block_m=16, block_n=64, reduce="sum", waves=4, num_stages=4),
            S(block_m=16, block_n=64, reduce="atomic", waves=4, num_stages=4),
            S(block_m=8, block_n=16, reduce="fixup", waves=8)],
    "big": [S(block_m=64, block_n=32, reduce="fixup", waves=4, num_stages=3),
            S(block_m=64, block_n=64, reduce="fixup", waves=4, num_stages=3),
            S(block_m=64, block_n=64, reduce="fixup", waves=2, num_stages=4),
            S(block_m=64, block_n=128, reduce="fixup", waves=2, num_stages=3, num_warps=8),
            S(block_m=64, block_n=64, reduce="sum", waves=4, num_stages=3),
            S(block_m=64, block_n=64, reduce="atomic", waves=4, num_stages=3),
            GemmConfig("dot", prequant=False, block_m=64, block_n=64, num_stages=4),
            GemmConfig("dot", prequant=True, block_m=64, block_n=32, num_stages=4)],
}


def row_class(M: int) -> str:
    return "small" if M <= 4 else ("mid" if M <= 16 else "big")


def copy_ceiling() -> float:
    """Bytes/s of a 1 GiB device copy (read + write)."""
    import triton.testing

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300)
    return 2 * n / (ms * 1e-3)          # a, b freed on return


def graph_us(call, copies: int, reps: int = 5) -> float:
    """µs per call: at least 20 calls cycling through ``copies`` weight copies in one CUDA
    graph (:func:`tune_fp8_gemm.graph_us`)."""
    return _graph_us(call, copies, reps, min_calls=20)


_PREP: dict = {}


def prepare(N: int, K: int) -> dict:
    """e4m3 weights + scales (copies), the bf16 dequantized weight (copies), the float64 one."""
    if (N, K) not in _PREP:           # kept across M (about 7 GB for every shape of both presets)
        g = torch.Generator(device=DEV).manual_seed(N * 7 + K)
        w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).bfloat16()
        q, s = Q.quantize_block(w, BLOCK)
        wd = Q.dequantize_block(q, s, BLOCK, torch.float64)
        wb = wd.bfloat16()              # bf16 GEMM of the same (dequantized) weight
        fp8_bytes = N * K + s.numel() * 4
        copies = max(1, min(128, math.ceil(L2_BYTES / fp8_bytes)))
        _PREP[(N, K)] = dict(wd=wd, fp8_bytes=fp8_bytes, copies=copies, gen=g,
                             qs=[q] + [q.clone() for _ in range(copies - 1)],
                             ss=[s] + [s.clone() for _ in range(copies - 1)],
                             wb=[wb] + [wb.clone() for _ in range(copies - 1)])
    return _PREP[(N, K)]


def run(sh: dict, M: int, budget: float, ceiling: float) -> dict:
    N, K = sh["N"], sh["K"]
    P = prepare(N, K)
    wd, fp8_bytes, copies, qs, ss, wb, g = (P[k] for k in ("wd", "fp8_bytes", "copies", "qs", "ss", "wb", "gen"))
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    ref_w = x.double() @ wd.T
    ref_a = Q.dequantize_groups(*Q.quantize_groups(x, 128), 128) @ wd.T
    row = dict(preset=sh["preset"], names=sh["names"], N=N, K=K, M=M, count=sh["count"], copies=copies,
               weight_bytes=fp8_bytes, act_bytes=M * K * 2, out_bytes=M * N * 2, variants={})
    row["bf16_us"] = graph_us(lambda i: F.linear(x, wb[i]), copies)
    row["bf16_rel_err"] = rel(F.linear(x, wb[0]), ref_w)
    current = KF.resolve(M, torch.bfloat16, N=N, K=K)
    row["current"] = current.name()
    cands = [current] + [c for c in VARIANTS[row_class(M)] if c != current]
    for cfg in cands:
        name = cfg.name()
        if time.perf_counter() - T0 > budget:
            row["variants"][name] = dict(skipped="budget", config=cfg.to_dict())
            continue
        try:
            y = KF.linear(x, qs[0], ss[0], block=BLOCK, config=cfg)
            err = rel(y, ref_a if cfg.act_quant else ref_w)
            us = graph_us(lambda i: KF.linear(x, qs[i], ss[i], block=BLOCK, config=cfg), copies)
            v = dict(us=us, rel_err=err, ok=err < 1e-2, config=cfg.to_dict(), GBps=fp8_bytes / us / 1e3,
                     ceiling_frac=fp8_bytes / (us * 1e-6) / ceiling)
            if cfg.kernel == "stream":
                pl = KF.stream_plan(M, N, K, cfg, 128, x.device)
                v["plan"] = dict(S=pl["S"], BM=pl["BM"], tiles=pl["tiles"], programs=pl["tiles"] * pl["S"],
                                 reduce=pl["reduce"])
            row["variants"][name] = v
        except Exception as e:      # a launch that does not compile or run here: recorded, not fatal
            row["variants"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}", config=cfg.to_dict())
    good = {k: v for k, v in row["variants"].items() if v.get("ok")}
    if good:
        best = min(good, key=lambda k: good[k]["us"])
        row.update(best=best, best_us=good[best]["us"], best_frac=good[best]["ceiling_frac"],
                   best_err=good[best]["rel_err"])
    return row


def print_row(r: dict) -> None:
    cur = r["variants"].get(r["current"], {})
    cu = f"{cur['us']:8.1f}" if "us" in cur else f"{'-':>8}"
    label = f"{r['preset'][:8]} {'/'.join(r['names'])[:22]}"
    if "best" not in r:
        print(f"{label:<32}{r['N']:>7}{r['K']:>6}{r['M']:>4}  no valid launch: "
              f"{[(k, v.get('error', v.get('skipped'))) for k, v in list(r['variants'].items())[:2]]}")
        return
    print(f"{label:<32}{r['N']:>7}{r['K']:>6}{r['M']:>4}{r['weight_bytes'] / 1e6:>7.1f}{r['bf16_us']:>8.1f}{cu}"
          f"{r['best_us']:>8.1f}{r['bf16_us'] / r['best_us']:>6.2f}x{cur.get('us', float('nan')) / r['best_us']:>6.2f}x"
          f"{r['variants'][r['best']]['GBps']:>6.0f}{r['best_frac']:>6.2f}{r['best_err']:>9.1e}  {r['best']}")


def summarize(res: dict) -> dict:
    """Per M: layer-weighted GEMM µs per model step (both presets) of bf16, the current launch,
    the best single launch valid on every shape, and the per-shape winners; the table."""
    table = {"buckets": {}, "shapes": []}
    print(f"\n{'M':>4}{'bf16':>9}{'current':>9}{'one':>9}{'per-shape':>10}  one launch for every shape "
          "(layer-weighted us per model step; bf16 / x)")
    for M in sorted({r["M"] for r in res["rows"]}):
        rs = [r for r in res["rows"] if r["M"] == M and r["count"] > 0 and "best" in r]
        if not rs:
            continue
        names = set.intersection(*[{k for k, v in r["variants"].items() if v.get("ok")} for r in rs])
        bf = sum(r["count"] * r["bf16_us"] for r in rs)
        cur = sum(r["count"] * r["variants"][r["current"]].get("us", float("nan")) for r in rs)
        shape_best = sum(r["count"] * r["best_us"] for r in rs)
        if not names:
            print(f"{M:>4}  no launch valid on every shape")
            continue
        tot = {n: sum(r["count"] * r["variants"][n]["us"] for r in rs) for n in names}
        one = min(tot, key=tot.get)
        print(f"{M:>4}{bf:>9.0f}{cur:>9.0f}{tot[one]:>9.0f}{shape_best:>10.0f}  {one}  "
              f"(bf16 / current {bf / cur:.2f}x, / one {bf / tot[one]:.2f}x, / per-shape {bf / shape_best:.2f}x)")
        for p in PRESETS:
            pr = [r for r in rs if r["preset"] == p]
            pb = sum(r["count"] * r["bf16_us"] for r in pr)
            pc = sum(r["count"] * r["variants"][r["current"]].get("us", float("nan")) for r in pr)
            ps = sum(r["count"] * r["best_us"] for r in pr)
            if pr:
                print(f"{'':>6}{p}: bf16 {pb:.0f} us, current {pc:.0f} ({pb / pc:.2f}x), per-shape best {ps:.0f} "
                      f"({pb / ps:.2f}x)")
        cfg_one = rs[0]["variants"][one]["config"]
        table["buckets"][str(M)] = cfg_one
        res.setdefault("totals", {})[str(M)] = dict(bf16_us=bf, current_us=cur, one=one, one_us=tot[one],
                                                    per_shape_us=shape_best)
        for r in rs:       # a shape's own winner when it beats the bucket's launch by > 3%
            if r["best_us"] < 0.97 * r["variants"][one]["us"]:
                table["shapes"].append(dict(bucket=M, N=r["N"], K=r["K"], config=r["variants"][r["best"]]["config"]))
    return table


def prefill(sh_all: list, M: int, budget: float, res: dict) -> str | None:
    """Prefill (``M`` rows, the ``cublas`` entry) where K is not a multiple of 512: bf16 vs each
    ``CUBLAS_K_FALLBACK`` (Triton ``dot``, ``pad`` then ``_scaled_mm``, ``dequant`` then
    ``F.linear``), each checked against the float64 reference of its scheme; returns the
    fallback with the least layer-weighted time among those valid on every shape."""
    rows = []
    print(f"\nprefill, M={M}, shapes with K % 512 != 0 (us; rel err):")
    for sh in [s for s in sh_all if s["K"] % 512]:
        if time.perf_counter() - T0 > budget:
            print(f"  {sh['preset']} {'/'.join(sh['names'])}: skipped (budget)")
            continue
        N, K = sh["N"], sh["K"]
        P = prepare(N, K)
        x = torch.randn(M, K, device=DEV, generator=P["gen"]).bfloat16()
        ref_w = x.double() @ P["wd"].T
        ref_a = Q.dequantize_groups(*Q.quantize_groups(x, 128), 128) @ P["wd"].T
        r = dict(preset=sh["preset"], names=sh["names"], N=N, K=K, M=M, count=sh["count"], fallbacks={})
        copies = min(P["copies"], 4)
        r["bf16_us"] = graph_us(lambda i: F.linear(x, P["wb"][i]), copies)
        cub = GemmConfig("cublas")
        keep = KF.CUBLAS_K_FALLBACK
        for fb in KF.PREFILL_FALLBACKS:
            KF.CUBLAS_K_FALLBACK = fb
            try:
                y = KF.linear(x, P["qs"][0], P["ss"][0], block=BLOCK, config=cub)
                err = rel(y, ref_w if fb == "dequant" else ref_a)
                us = graph_us(lambda i: KF.linear(x, P["qs"][i], P["ss"][i], block=BLOCK, config=cub), copies)
                r["fallbacks"][fb] = dict(us=us, rel_err=err, ok=err < 2e-2)
            except Exception as e:
                r["fallbacks"][fb] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                KF.CUBLAS_K_FALLBACK = keep
        del ref_w, ref_a
        rows.append(r)
        cells = "  ".join(f"{fb} {v['us']:.0f} ({v['rel_err']:.1e}{'' if v['ok'] else ' BAD'})" if "us" in v
                          else f"{fb} {v['error'][:60]}" for fb, v in r["fallbacks"].items())
        print(f"  {sh['preset'][:8]} {'/'.join(sh['names'])[:20]:<20}{N:>7}{K:>6}  bf16 {r['bf16_us']:.0f}  {cells}")
    res["prefill"] = rows
    ok = [fb for fb in KF.PREFILL_FALLBACKS if rows and all(r["fallbacks"].get(fb, {}).get("ok") for r in rows)]
    if not ok:
        return None
    tot = {fb: sum(r["count"] * r["fallbacks"][fb]["us"] for r in rows) for fb in ok}
    bf = sum(r["count"] * r["bf16_us"] for r in rows)
    best = min(tot, key=tot.get)
    print("  layer-weighted us (these shapes): bf16 %.0f, " % bf + ", ".join(f"{k} {v:.0f}" for k, v in tot.items())
          + f"  -> cublas_k_fallback = {best!r}")
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,64,16,4,32", help="rows, in the order measured")
    p.add_argument("--budget", type=float, default=200.0, help="seconds after which decode variants are skipped")
    p.add_argument("--prefill-m", type=int, default=2048, help="prefill rows (0: no prefill section)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args()
    ms = [int(m) for m in a.ms.split(",")]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:
        pass
    res["copy_Bps"] = ceiling = copy_ceiling()
    print(f"{res['device']}, torch {res['torch']}, triton {res.get('triton')}; copy ceiling {ceiling / 1e12:.2f} TB/s")
    print(f"{'shape':<32}{'N':>7}{'K':>6}{'M':>4}{'w MB':>7}{'bf16':>8}{'current':>8}{'best':>8}{'bf16/':>7}"
          f"{'cur/':>7}{'GB/s':>6}{'ceil':>6}{'rel err':>9}  best launch (us; GB/s of weight + scale bytes; ceil: that / copy ceiling)")
    sh = [s for s in shapes() if s["count"] > 0]
    for M in ms:
        for s in sh:
            try:
                r = run(s, M, a.budget, ceiling)
                res["rows"].append(r)
                print_row(r)
            except Exception:
                traceback.print_exc()
                res.setdefault("errors", []).append(traceback.format_exc()[-1500:])
    table = summarize(res)
    if a.prefill_m:
        fb = prefill(sh, a.prefill_m, a.budget + 30, res)
        if fb is not None:
            table["cublas_k_fallback"] = fb
    res["table"] = table
    res["seconds"] = time.perf_counter() - T0
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "tune_fp8_gemv.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "fp8_gemm_table.json"), "w") as f:
            json.dump(dict(table, device=res["device"]), f, indent=1)
    KF.table_from_json(table)             # the table parses (validated)
    print(f"\ntable: {len(table['buckets'])} buckets, {len(table['shapes'])} shape entries; done in {res['seconds']:.0f}s")


if __name__ == "__main__":
    main()
