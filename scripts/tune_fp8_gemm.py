"""FP8 GEMM launch sweep on the GPU (~3 min on an H100): picks the default config table.

For every linear shape of the nemotron-h-4b and qwen3-next-4b presets that FP8 quantizes
(plus both vocabularies' ``lm_head``-sized GEMMs, which stay bf16 in the models) and
``M`` in 1, 16, 64, 256, 2048 rows, with block-128 weights:

1. checks every candidate launch (``replayssm.kernels.fp8_gemm.GemmConfig``: gemv, Triton
   dot weight-only / FP8 activations in-tile / quantized beforehand, block-scaled
   ``torch._scaled_mm``) against the float64 reference of its scheme (``linear`` for
   weight-only, ``linear_act_quant`` for FP8 activations): max relative error;
2. times bf16 ``F.linear`` and each candidate by CUDA-graph replay (many calls per graph,
   cycling through enough weight copies that they do not stay in L2, as in a model step);
3. prints per shape and M the best launch (µs, bf16 µs, speedup, GB/s of weight bytes, error,
   the current default's µs), then per M bucket the launch with the least total time over
   the presets' layers (each shape weighted by its layer count) and a ready-to-paste
   ``CONFIGS`` table with the GEMM time per model step it gives against bf16.

    PYTHONPATH=. python scripts/tune_fp8_gemm.py [--ms 1,16,64,256,2048] [--budget 200]

Writes ``$OUT/tune_fp8_gemm.json`` (or ``--out``).  ``--budget`` (seconds) skips the
remaining candidates when exceeded (the tables are then partial; listed as skipped).
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

from replayssm.bench.hybrid_presets import preset_config  # noqa: E402
from replayssm.kernels import fp8_gemm as KF  # noqa: E402
from replayssm.kernels.fp8_gemm import GemmConfig as C  # noqa: E402
from replayssm.layers.linear import Linear  # noqa: E402
from replayssm.models.quant import DEFAULT_SKIP  # noqa: E402
from replayssm.models.registry import model_class, parse_config  # noqa: E402
from replayssm.ops.fp8 import naive as Q  # noqa: E402

DEV = "cuda"
BLOCK = (128, 128)
T0 = time.perf_counter()
PRESETS = ("nemotron-h-4b", "qwen3-next-4b")

#: candidate launches per M bucket (keys as in KF.CONFIGS); the current default is added
CANDIDATES = {
    1: [C("gemv", act_quant=False, block_n=8, unroll=4), C("gemv", act_quant=False, block_n=16, unroll=4),
        C("gemv", act_quant=False, block_n=4, unroll=2, num_warps=1),
        C("gemv", act_quant=False, block_n=4, unroll=4, num_warps=1),
        C("gemv", act_quant=False, block_n=8, unroll=2, num_warps=2),
        C("gemv", act_quant=False, block_n=8, unroll=2), C("gemv", act_quant=False, block_n=16, unroll=2),
        C("gemv", act_quant=False, block_n=32, unroll=4, num_warps=8),
        C("gemv", act_quant=False, block_n=8, unroll=4, split_k=1),
        C("gemv", act_quant=False, block_n=8, unroll=4, split_k=4),
        C("dot", act_quant=False, block_m=16, block_n=32, num_stages=4),
        C("dot", act_quant=False, block_m=16, block_n=64, num_stages=5),
        C("dot", prequant=False, block_m=16, block_n=32, num_stages=4)],
    16: [C("dot", prequant=False, block_m=16, block_n=32, num_stages=4),
         C("dot", prequant=False, block_m=16, block_n=128, num_stages=3),
         C("dot", prequant=True, block_m=16, block_n=64, num_stages=4),
         C("dot", act_quant=False, block_m=16, block_n=64, num_stages=4),
         C("dot", act_quant=False, block_m=16, block_n=32, num_stages=4),
         C("gemv", act_quant=False, block_n=4, unroll=2, num_warps=1)],
    64: [C("dot", prequant=False, block_m=64, block_n=64, num_stages=4),
         C("dot", block_m=64, block_n=32, num_stages=4),
         C("dot", block_m=64, block_n=128, num_stages=3),
         C("dot", block_m=64, block_n=128, num_stages=4, num_warps=8),
         C("dot", act_quant=False, block_m=64, block_n=64, num_stages=4),
         C("dot", act_quant=False, block_m=64, block_n=32, num_stages=4),
         C("dot", block_m=64, block_n=64, num_stages=4, split_k=1),
         C("dot", block_m=64, block_n=32, num_stages=4, split_k=2)],
    256: [C("dot", block_m=64, block_n=64, num_stages=4),
          C("dot", block_m=128, block_n=128, num_stages=4, num_warps=8),
          C("dot", block_m=128, block_n=64, num_stages=4),
          C("dot", act_quant=False, block_m=64, block_n=128, num_stages=4),
          C("cublas")],
    KF.ANY_M: [C("dot", block_m=128, block_n=128, num_stages=3, num_warps=8),
               C("dot", block_m=128, block_n=128, num_stages=4, num_warps=4),
               C("dot", block_m=64, block_n=128, num_stages=4, num_warps=4),
               C("dot", block_m=128, block_n=128, num_stages=4, num_warps=8, group_m=16),
               C("cublas")],
}


def bucket(M: int) -> int:
    return min(b for b in KF.CONFIGS if M <= b)


def _skipped(name: str) -> bool:
    return any(name == s or name.endswith("." + s) for s in DEFAULT_SKIP)


def shapes() -> list[dict]:
    """Distinct ``(N, K)`` of the presets' FP8 linear layers (from the model classes on the
    meta device) with their layer counts, then the two ``lm_head`` sizes."""
    out = {}
    for preset in PRESETS:
        cfg = preset_config(preset)
        parsed = parse_config(cfg, preset)
        with torch.device("meta"):
            model = model_class(parsed)(parsed, torch.bfloat16, "cpu")
        for name, mod in model.named_modules():
            if isinstance(mod, Linear) and not _skipped(name):
                key = (preset, mod.d_out, mod.d_in)
                leaf = name.rpartition(".")[2]
                r = out.setdefault(key, dict(preset=preset, N=mod.d_out, K=mod.d_in, count=0, names=[]))
                r["count"] += 1
                if leaf not in r["names"]:
                    r["names"].append(leaf)
        out[(preset, "head")] = dict(preset=preset, N=int(cfg["vocab_size"]), K=int(cfg["hidden_size"]), count=0,
                                     names=["lm_head (bf16 in the model)"])
        del model
    return list(out.values())


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def graph_us(call, copies: int, reps: int = 5, min_calls: int = 8) -> float:
    """µs per call: ``max(copies, min_calls)`` calls (cycling through ``copies`` weight copies)
    in one CUDA graph, replayed ``reps`` times between events."""
    calls = max(copies, min_calls)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(copies, 2)):
            call(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            call(i % copies)
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    del g
    return t0.elapsed_time(t1) * 1e3 / (reps * calls)


_PREP: dict = {}


def prepare(sh: dict) -> dict:
    """The shape's weights (kept across M): bf16, e4m3 + scales, float64 dequantized, and
    enough copies of each that a graph cycle streams > 2x L2 of FP8 weight."""
    key = (sh["N"], sh["K"])
    if key not in _PREP:
        N, K = key
        g = torch.Generator(device=DEV).manual_seed(N * 7 + K)
        w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).bfloat16()
        q, s = Q.quantize_block(w, BLOCK)
        fp8_bytes = N * K + s.numel() * 4
        copies = max(1, min(32, math.ceil(120e6 / fp8_bytes)))
        _PREP[key] = dict(wd=Q.dequantize_block(q, s, BLOCK, torch.float64), fp8_bytes=fp8_bytes, copies=copies,
                          qs=[q] + [q.clone() for _ in range(copies - 1)], ss=[s] + [s.clone() for _ in range(copies - 1)],
                          wb=[w] + [w.clone() for _ in range(copies - 1)], gen=g)
    return _PREP[key]


def run_shape(sh: dict, ms, budget: float, res: dict) -> None:
    N, K = sh["N"], sh["K"]
    P = prepare(sh)
    wd, fp8_bytes, copies, qs, ss, wb, g = (P[k] for k in ("wd", "fp8_bytes", "copies", "qs", "ss", "wb", "gen"))
    q, s = qs[0], ss[0]
    for M in ms:
        x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
        ref_w = x.double() @ wd.T
        xa = Q.dequantize_groups(*Q.quantize_groups(x, 128), 128)
        ref_a = xa @ wd.T
        del xa
        row = dict(shape=f"{sh['preset']} {'/'.join(sh['names'])}", preset=sh["preset"], N=N, K=K, M=M,
                   count=sh["count"], fp8_MB=fp8_bytes / 1e6, copies=copies, variants={})
        row["bf16_us"] = graph_us(lambda i: F.linear(x, wb[i]), copies)
        cands = list(CANDIDATES[bucket(M)])
        default = KF.config_for(M)
        if default not in cands:
            cands.insert(0, default)
        row["default"] = default.name()
        for cfg in cands:
            if time.perf_counter() - T0 > budget:
                row["variants"][cfg.name()] = dict(skipped="budget")
                continue
            try:
                y = KF.linear(x, q, s, block=BLOCK, config=cfg)
                err = rel(y, ref_a if cfg.act_quant else ref_w)
                us = graph_us(lambda i: KF.linear(x, qs[i], ss[i], block=BLOCK, config=cfg), copies)
                ok = err < 2e-2
                row["variants"][cfg.name()] = dict(us=us, rel_err=err, ok=ok, config=repr(cfg))
                if cfg.kernel == "cublas" and not KF._block_mm_ok(x, q, BLOCK):   # ran the dot fallback
                    row["variants"][cfg.name()]["fallback"] = KF._dot_fallback(True).name()
            except Exception as e:   # a launch that does not compile or run here: recorded, not fatal
                row["variants"][cfg.name()] = dict(error=f"{type(e).__name__}: {str(e)[:300]}", config=repr(cfg))
        if any(c.kernel == "cublas" for c in cands) and K % 128 == 0:
            try:   # rows not a multiple of 16 (padded inside): same scheme, same result
                err = rel(KF.linear(x[:M - 3], q, s, block=BLOCK, config=C("cublas")), ref_a[:M - 3])
                row["cublas_odd_rows_rel_err"] = err
            except Exception as e:
                row["cublas_odd_rows_rel_err"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"    cublas-block at {M - 3} rows: rel err {row['cublas_odd_rows_rel_err']}")
        if any(c.kernel == "cublas" for c in cands) and K % 128 and time.perf_counter() - T0 <= budget:
            # does cuBLAS take a partial last K block?  (the kernel's table does not route it there yet)
            try:
                err = rel(KF._cublas_block(x, q, s, None), ref_a)
                us = graph_us(lambda i: KF._cublas_block(x, qs[i], ss[i], None), copies)
                row["cublas_partial_k"] = dict(us=us, rel_err=err)
            except Exception as e:
                row["cublas_partial_k"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"    cublas-block with K % 128 != 0 (not in the table): {row['cublas_partial_k']}")
        good = {k: v for k, v in row["variants"].items() if v.get("ok")}
        if good:
            best = min(good, key=lambda k: good[k]["us"])
            row.update(best=best, best_us=good[best]["us"], speedup=row["bf16_us"] / good[best]["us"],
                       GBps=fp8_bytes / good[best]["us"] / 1e3, best_err=good[best]["rel_err"])
        res["rows"].append(row)
        print_row(row)


def print_row(r: dict) -> None:
    d = r["variants"].get(r["default"], {})
    dflt = f"{d['us']:8.1f}" if "us" in d else f"{'-':>8}"
    if "best" not in r:
        errs = [f"{k}: {v.get('error', v.get('skipped', 'rel %.2e' % v.get('rel_err', float('nan'))))}"
                for k, v in r["variants"].items()]
        print(f"{r['shape'][:34]:<34}{r['N']:>7}{r['K']:>6}{r['M']:>5}  no valid launch: {errs[:2]}")
        return
    print(f"{r['shape'][:34]:<34}{r['N']:>7}{r['K']:>6}{r['M']:>5}{r['bf16_us']:>8.1f}{r['best_us']:>8.1f}{dflt}"
          f"{r['speedup']:>7.2f}x{r['GBps']:>7.0f}{r['best_err']:>9.1e}  {r['best']}"
          + (" (K % 128: dot fallback)" if "fallback" in r["variants"][r["best"]] else ""))


def summarize(res: dict) -> None:
    """Per M bucket: the launch with the least layer-weighted total time over the model shapes
    (lm_head rows excluded) among those valid on every shape; the suggested table."""
    rows = [r for r in res["rows"] if r["count"] > 0]
    table = {}
    print(f"\n{'bucket':>8}{'M':>6}  {'bf16 us':>9}{'default':>9}{'best':>9}  launch (layer-weighted sum of GEMM time "
          f"per model step, both presets)")
    for b in sorted(KF.CONFIGS):
        for M in sorted({r["M"] for r in rows if bucket(r["M"]) == b}):
            rs = [r for r in rows if r["M"] == M]
            names = set.intersection(*[{k for k, v in r["variants"].items() if v.get("ok")} for r in rs]) if rs else set()
            if not names:
                print(f"{'any' if b == KF.ANY_M else b:>8}{M:>6}  no launch valid on every shape")
                continue
            tot = {n: sum(r["count"] * r["variants"][n]["us"] for r in rs) for n in names}
            bf = sum(r["count"] * r["bf16_us"] for r in rs)
            dname = rs[0]["default"]
            dtot = tot.get(dname, float("nan"))
            best = min(tot, key=tot.get)
            print(f"{'any' if b == KF.ANY_M else b:>8}{M:>6}  {bf:>9.0f}{dtot:>9.0f}{tot[best]:>9.0f}  {best}  (bf16 / best {bf / tot[best]:.2f}x)")
            per_preset = {p: (sum(r["count"] * r["bf16_us"] for r in rs if r["preset"] == p),
                              sum(r["count"] * r["variants"][best]["us"] for r in rs if r["preset"] == p)) for p in PRESETS}
            for p, (pb, pf) in per_preset.items():
                if pf:
                    print(f"{'':>16}{p}: bf16 {pb:.0f} us, fp8 {pf:.0f} us per step ({pb / pf:.2f}x)")
            if b not in table:       # the bucket's own M decides (the first M measured in it)
                table[b] = rs[0]["variants"][best]["config"]
                res.setdefault("bucket_totals", {})[str(M)] = dict(bf16_us=bf, default_us=dtot, best=best,
                                                                   best_us=tot[best], all=tot)
    res["suggested_table"] = {str(k): v for k, v in table.items()}
    if table:
        print("\nSuggested replayssm/kernels/fp8_gemm.py CONFIGS (buckets without a measurement keep the current entry):")
        print("CONFIGS: dict[int, GemmConfig] = {")
        for b in sorted(KF.CONFIGS):
            key = "ANY_M" if b == KF.ANY_M else str(b)
            cfg = table.get(b, repr(KF.CONFIGS[b]))
            print(f"    {key}: {cfg},")
        print("}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,64,2048,16,256", help="rows, in the order measured")
    p.add_argument("--budget", type=float, default=200.0, help="seconds after which candidates are skipped")
    p.add_argument("--heads", action="store_true", default=True)
    p.add_argument("--no-heads", dest="heads", action="store_false", help="leave out the lm_head shapes")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args()
    ms = [int(m) for m in a.ms.split(",")]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [],
           "current_table": {str(k): repr(v) for k, v in KF.CONFIGS.items()}}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:
        pass
    print(f"{res['device']}, torch {res['torch']}, triton {res.get('triton')}")
    print(f"{'shape':<34}{'N':>7}{'K':>6}{'M':>5}{'bf16':>8}{'best':>8}{'dflt':>8}{'bf16/':>8}{'GB/s':>7}{'rel err':>9}"
          "  best launch (us; GB/s of fp8 weight + scales)")
    sh = shapes()
    sh = [s for s in sh if a.heads or s["count"] > 0]
    # M-major order: every shape at the first M before the next M (the budget cuts the least wanted)
    for M in ms:
        for s in sh:
            try:
                run_shape(s, [M], a.budget, res)
            except Exception:
                traceback.print_exc()
                res.setdefault("errors", []).append(traceback.format_exc()[-1500:])
        if a.out:
            _write(res, a.out)
    summarize(res)
    res["seconds"] = time.perf_counter() - T0
    if a.out:
        _write(res, a.out)
    print(f"\ndone in {res['seconds']:.0f}s")


def _write(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tune_fp8_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
