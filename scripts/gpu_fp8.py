"""FP8 on the GPU, one run (~4 min on an H100): kernel checks, GEMM microbench, model decode and prefill.

1. ``check``: the Triton FP8 GEMM (weight-only and FP8 activations) and ``torch._scaled_mm``
   (per-tensor) against the float64 references at the presets' shapes; FP8 fused experts
   (weight-only and FP8 activations) against the reference at Qwen3-Next-4B's expert shape.
2. ``gemm``: bf16 ``F.linear`` vs the FP8 kernel (FP8 activations / weight-only) vs
   ``torch._scaled_mm`` (per-tensor, row-wise activation scales) at M = 1, 64, 2048
   (``triton.testing.do_bench``: at decode sizes the times include Python launch overhead;
   ``scripts/tune_fp8_gemm.py`` times launches by CUDA-graph replay and picks the table).
3. ``models``: nemotron-h-4b and qwen3-next-4b (random weights, bf16; then quantized in memory
   to block-128 FP8): decode step time in a CUDA graph at B=1 and B=64, recurrent and replay
   modes (tokens/s = B / step; replay's graph is a step between folds),
   the copy-ceiling fraction of each step (bytes a step must read: weights touched, state
   read and written; over the measured copy bandwidth), and prefill time of 1 × 4096 tokens;
   FP8 vs bf16 logits (relative error, top-1 agreement) of a forward over 2 × 48 tokens.

    PYTHONPATH=. python scripts/gpu_fp8.py [--sections check,gemm,models] [--layers N]

Prints a table per section and writes ``$OUT/gpu_fp8.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replayssm.bench.common import graph_replay_ms  # noqa: E402
from replayssm.bench.hybrid_presets import random_hybrid_dir  # noqa: E402
from replayssm.bench.kernels import copy_bandwidth  # noqa: E402
from replayssm.kernels import fp8_gemm as KF  # noqa: E402
from replayssm.kernels import moe as KM  # noqa: E402
from replayssm.layers.linear import Linear  # noqa: E402
from replayssm.layers.mlp import FP8Experts  # noqa: E402
from replayssm.models import load_model  # noqa: E402
from replayssm.models.quantize import quantize_model_  # noqa: E402
from replayssm.ops.fp8 import naive as Q  # noqa: E402
from replayssm.ops.moe import naive as M  # noqa: E402

DEV = "cuda"
T0 = time.perf_counter()
MODES = ("recurrent", "replay")   # replay: the state is read, not rewritten, per step
SHAPES = {"nemotron mlp up": (12544, 3136), "nemotron mlp down": (3136, 12544),
          "nemotron mamba in": (2 * 7680 + 2 * 8 * 128 + 96, 3136), "qwen gdn qkvz": (12288, 2048),
          "qwen attn o": (2048, 4096)}


def bench(fn, rep=50) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def check(res):
    rows = []
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device=DEV, generator=g) * 0.02
        qb, sb = Q.quantize_block(w, (128, 128))
        qt, st = Q.quantize_tensor(w)
        for M_ in (1, 64, 2048):
            x = torch.randn(M_, K, device=DEV, generator=g).bfloat16()
            ref = Q.linear(x.double(), qb, sb, block=(128, 128))
            refa = Q.linear_act_quant(x, qb, sb, block=(128, 128), group=128).double()
            y8 = KF.linear(x, qb, sb, block=(128, 128), act_quant=True)
            yw = KF.linear(x, qb, sb, block=(128, 128), act_quant=False)
            ys = KF.linear(x, qt, st, block=None)                  # _scaled_mm (per-tensor)
            rows.append(dict(shape=name, M=M_, fp8_act_vs_ref=rel(y8, refa), fp8_act_vs_dequant=rel(y8, ref),
                             weight_only_vs_dequant=rel(yw, ref),
                             scaled_mm_vs_dequant=rel(ys, Q.linear(x.double(), qt, st))))
    # experts at Qwen3-Next-4B's shape (64 experts, I=256, top-8)
    E, D, I, k, N = 64, 2048, 256, 8, 64
    x = torch.randn(N, D, device=DEV, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, device=DEV, generator=g)[:k] for _ in range(N)])
    wr = torch.rand(N, k, device=DEV, generator=g).bfloat16()
    q1, s1 = Q.quantize_experts(torch.randn(E, 2 * I, D, device=DEV, generator=g) * 0.02, (128, 128), 2)
    q2, s2 = Q.quantize_experts(torch.randn(E, D, I, device=DEV, generator=g) * 0.02, (128, 128), 1)
    kw = dict(act="silu", gated=True, w1_scale=s1, w2_scale=s2, block=(128, 128))
    ref = M.experts(x.double(), idx, wr.double(), q1, q2, **kw)
    got = KM.experts(x, idx, wr, q1, q2, **kw, act_quant=False)
    got8 = KM.experts(x, idx, wr, q1, q2, **kw)                 # default: FP8 activations too
    res["check"] = dict(gemm=rows, experts_rel=rel(got, ref), experts_fp8_act_rel=rel(got8, ref))
    print(f"{'shape':<20}{'M':>6}{'fp8act/ref':>12}{'fp8act/deq':>12}{'w-only/deq':>12}{'scaled_mm':>11}")
    for r in rows:
        print(f"{r['shape']:<20}{r['M']:>6}{r['fp8_act_vs_ref']:>12.2e}{r['fp8_act_vs_dequant']:>12.2e}"
              f"{r['weight_only_vs_dequant']:>12.2e}{r['scaled_mm_vs_dequant']:>11.2e}")
    print(f"fp8 fused experts vs reference: weight-only rel {res['check']['experts_rel']:.2e}, "
          f"fp8 activations rel {res['check']['experts_fp8_act_rel']:.2e}")
    bad = [r for r in rows if r["fp8_act_vs_ref"] > 2e-2 or r["weight_only_vs_dequant"] > 2e-2
           or r["fp8_act_vs_dequant"] > 0.1 or r["scaled_mm_vs_dequant"] > 0.1]
    res["check"]["ok"] = not bad and res["check"]["experts_rel"] < 2e-2 and res["check"]["experts_fp8_act_rel"] < 0.1
    print("check:", "OK" if res["check"]["ok"] else f"FAILED {bad[:3]}")


def gemm(res):
    rows = []
    g = torch.Generator(device=DEV).manual_seed(1)
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).bfloat16()
        qb, sb = Q.quantize_block(w, (128, 128))
        qt, st = Q.quantize_tensor(w)
        for M_ in (1, 64, 2048):
            x = torch.randn(M_, K, device=DEV, generator=g).bfloat16()
            r = dict(shape=name, M=M_, bf16_ms=bench(lambda: F.linear(x, w)),
                     fp8_act_ms=bench(lambda: KF.linear(x, qb, sb, block=(128, 128), act_quant=True)),
                     fp8_wonly_ms=bench(lambda: KF.linear(x, qb, sb, block=(128, 128), act_quant=False)),
                     scaled_mm_ms=bench(lambda: KF.linear(x, qt, st)))
            rows.append(r)
    res["gemm"] = rows
    print(f"{'shape':<20}{'M':>6}{'bf16 ms':>10}{'fp8 act':>10}{'fp8 w-only':>11}{'_scaled_mm':>11}  best speedup")
    for r in rows:
        best = min(r["fp8_act_ms"], r["fp8_wonly_ms"], r["scaled_mm_ms"])
        print(f"{r['shape']:<20}{r['M']:>6}{r['bf16_ms']:>10.4f}{r['fp8_act_ms']:>10.4f}{r['fp8_wonly_ms']:>11.4f}"
              f"{r['scaled_mm_ms']:>11.4f}  {r['bf16_ms'] / best:.2f}x")


def step_bytes(model, cache, B: int, mode: str) -> float:
    """Bytes a decode step must move: weights it reads (the embedding's B rows; experts by the
    expected share of experts B tokens hit), plus the B rows' cache (states, conv windows,
    the short KV): read and written in recurrent mode, read in replay mode (its appends to the
    buffer are a few entries)."""
    total = 0.0
    for name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            nb = p.numel() * p.element_size()
            if "embed" in name:
                nb = nb / p.shape[0] * B
            elif isinstance(mod, FP8Experts):
                E, k = p.shape[0], getattr(model.config, "num_experts_per_tok", 1)
                nb *= 1 - (1 - k / E) ** B
            total += nb
    return total + (2 if mode == "recurrent" else 1) * cache.nbytes() * B / cache.num_slots


def measure(model, label: str, bw: float, prefill_len: int) -> list[dict]:
    V = int(model.config.vocab_size)
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for mode in MODES:
        for B in (1, 64):
            cache = model.make_cache(B + 1, mode=mode, buffer_size=16, max_seq_len=128)
            slots = torch.arange(1, B + 1, device=DEV)
            model.prefill(cache, slots, torch.randint(0, V, (B, 64), device=DEV, generator=g),
                          torch.full((B,), 64, device=DEV))
            tok = torch.randint(0, V, (B,), device=DEV, generator=g)
            ms = graph_replay_ms(lambda: model.decode(cache, slots, tok), reps=30)
            nbytes = step_bytes(model, cache, B, mode)
            rows.append(dict(weights=label, mode=mode, B=B, step_ms=ms, tokens_per_s=B / (ms / 1e3),
                             copy_ceiling_fraction=(nbytes / bw) / (ms / 1e3), step_GB=nbytes / 1e9))
            cache = None  # not del: the timed lambdas above close over it
            torch.cuda.empty_cache()
    cache = model.make_cache(2, mode="recurrent", max_seq_len=4 * prefill_len + 64)   # 4 prefills of slot 1
    ids = torch.randint(0, V, (1, prefill_len), device=DEV, generator=g)

    def pre():
        model.prefill(cache, torch.tensor([1], device=DEV), ids, torch.tensor([prefill_len], device=DEV))

    pre()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        pre()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    rows.append(dict(weights=label, prefill_tokens=prefill_len, prefill_ms=sorted(ts)[1]))
    cache = None  # not del: pre() above closes over it
    torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def models(res, layers, prefill_len, presets=("nemotron-h-4b", "qwen3-next-4b")):
    bw = copy_bandwidth("cuda", None)
    res["copy_bandwidth_TBps"] = bw / 1e12
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s")
    out = res.setdefault("models", {})
    for preset in presets:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            model = load_model(random_hybrid_dir(preset, tmp, num_layers=layers), device=DEV, dtype=torch.bfloat16)
            print(f"[{time.perf_counter() - T0:.0f}s] {preset}: built and loaded in {time.perf_counter() - t:.0f}s")
        ids = torch.randint(0, int(model.config.vocab_size), (2, 48), device=DEV,
                            generator=torch.Generator(device=DEV).manual_seed(5))
        ref = model(ids).float()
        rows = measure(model, "bf16", bw, prefill_len)
        quantize_model_(model, (128, 128))
        n8 = sum(1 for m in model.modules() if isinstance(m, (Linear, FP8Experts)) and m.fp8)
        got = model(ids).float()
        agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"  {preset}: FP8 vs bf16 logits rel err {rel(got, ref):.3e}, top-1 agreement {agree:.3f}")
        rows += measure(model, "fp8-block128", bw, prefill_len)
        out[preset] = dict(rows=rows, fp8_layers=n8, logits_rel_err=rel(got, ref), top1_agreement=agree)
        del model
        torch.cuda.empty_cache()
        dec = {(r["weights"], r["mode"], r["B"]): r for r in rows if "B" in r}
        pre = {r["weights"]: r["prefill_ms"] for r in rows if "prefill_ms" in r}
        print(f"{preset} ({n8} FP8 layers)   {'mode':<10}{'step ms':>9}{'tok/s':>10}{'copy-ceiling':>14}"
              f"{'GB/step':>9}")
        for (w, mode, B), r in sorted(dec.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            print(f"  {w:<14} B={B:<4}{mode:<10}{r['step_ms']:>9.3f}{r['tokens_per_s']:>10.0f}"
                  f"{r['copy_ceiling_fraction']:>14.2f}{r['step_GB']:>9.2f}")
        for mode in MODES:
            for B in (1, 64):
                sp = dec[("fp8-block128", mode, B)]["tokens_per_s"] / dec[("bf16", mode, B)]["tokens_per_s"]
                out[preset][f"decode_speedup_{mode}_B{B}"] = sp
                print(f"  FP8/bf16 decode tokens/s, {mode} B={B}: {sp:.2f}x")
        out[preset]["prefill_ratio_fp8_over_bf16"] = pre["fp8-block128"] / pre["bf16"]
        print(f"  prefill {prefill_len} tokens: bf16 {pre['bf16']:.1f} ms, fp8 {pre['fp8-block128']:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="check,gemm,models")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers of each preset")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--presets", default="nemotron-h-4b,qwen3-next-4b")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for sec in a.sections.split(","):
        print(f"\n== {sec} [{time.perf_counter() - T0:.0f}s]")
        try:
            {"check": check, "gemm": gemm}.get(sec, lambda r: models(r, a.layers, a.prefill, a.presets.split(",")))(res)
        except Exception:
            traceback.print_exc()
            res[sec + "_error"] = traceback.format_exc()[-2000:]
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "gpu_fp8.json"), "w") as f:
                json.dump(res, f, indent=1)
    print(f"\ndone in {time.perf_counter() - T0:.0f}s")


if __name__ == "__main__":
    main()
