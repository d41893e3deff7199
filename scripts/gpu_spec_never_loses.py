"""Speculation never loses: adaptive draft length against plain replay, fixed T and standard decoding (one GPU).

For each preset of ``--presets`` (random weights, bf16, CUDA graphs; default ``qwen3.5-4b``
and the 2.7B Mamba-2; ``nemotron-h-4b`` and ``qwen3-next-4b`` also work) and each batch
size ``B`` of ``--batches`` (B requests of ``--max-tokens`` tokens submitted at once, one
engine per configuration serving every B in turn) it measures decode tokens/s of

* ``standard``: plain decoding in recurrent form (the greedy reference),
* ``replay``: plain decoding in replay form,
* ``fixed``: replay + oracle speculation (the reference continuation, each draft right
  with probability ``--accept``), always ``--num-tokens`` drafts,
* ``adaptive``: the same with the engine's adaptive draft length (0 included),

and prints, per preset, the ratios adaptive / replay (target >= 1.00 at every B: a check),
adaptive / standard (target >= 2.00 at B=256 for the 2.7B and the two hybrid presets:
reported), the chosen-T histogram, and the cost table the adaptive policy built at start-up
(``t`` flush-free, ``+flush`` when every row flushes, ``pred`` the price it used with its
expected flush share) next to the step times it actually ran (mean of the adaptive and
fixed runs' steps at that bucket, ``n`` steps), so a wrong table shows.  It also prints, per
preset at the largest B, the FLOPs and bytes of one standard step, one plain replay step
and one verify step of each draft length (weights touched, states read and written at the
expected flush share, ring entries, attention KV), their roofline times at this GPU's
measured matmul and copy rates, and the ceiling of speculation / standard they imply at
the oracle's acceptance.  Checks (exit 1): greedy outputs of every run equal plain
replay's, and adaptive >= plain replay at every B (decode tokens/s, 2% noise allowance).

    PYTHONPATH=. python scripts/gpu_spec_never_loses.py        # sized for ~4 min on an H100 (not yet timed)
    PYTHONPATH=. python scripts/gpu_spec_never_loses.py --presets nemotron-h-4b,qwen3-next-4b
    PYTHONPATH=. python scripts/gpu_spec_never_loses.py --presets qwen3.5-4b --null-slot   # before / after

Writes ``spec_never_loses.json`` to ``$OUT``.  Stops starting presets past ``--budget-s``.
CPU smoke run: ``--presets qwen3.5-tiny --device cpu --batches 1,4 --max-tokens 12``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

from replayssm.bench.common import fastest_run, free_memory
from replayssm.bench.e2e import OracleDrafter, _prompts, _random_model_dir, format_lengths
from replayssm.engine.batching import bucket_for
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.engine.loading import load
from replayssm.engine.spec.policy import AdaptiveLengths, expected_tokens, flush_fraction
from replayssm.engine.warmup import measure_step_costs

NOISE = 0.98   # adaptive / replay below this fails the check


# ---- runs -----------------------------------------------------------------------------------
def _engine(model, args, mode: str, spec=None) -> LLM:
    return LLM(model, device=args.device, dtype=args.dtype, decode_mode=mode, speculative=spec,
               max_num_seqs=max(args.batches), max_seq_len=args.max_seq_len, buffer_size=args.buffer_size)


class StepLog:
    """Per-step times of an engine: ``(bucket, T) -> [seconds]`` (plain engines: their decode
    calls; speculative ones: what the executor reports to its length policy) and, for the
    adaptive policy, the price it predicted for each chosen step."""

    def __init__(self, llm: LLM):
        self.llm, self.ex = llm, llm.executor
        self.buckets = llm.runner.buckets
        self.seen, self.pred = defaultdict(list), defaultdict(list)
        self.on = False
        if self.ex.lengths is None:
            decode = self.ex.decode

            def timed_decode(seqs, reserve=True):
                t0 = time.perf_counter()
                out = decode(seqs, reserve)   # ends with the step's host sync
                if self.on:
                    self.seen[(bucket_for(self.buckets, len(seqs)), 0)].append(time.perf_counter() - t0)
                return out

            self.ex.decode = timed_decode
            return
        L = self.ex.lengths
        observe = L.observe

        def logged_observe(seqs, T, accepted, seconds, host=None):
            if self.on and seconds is not None:
                self.seen[(bucket_for(self.buckets, len(seqs)), T)].append(seconds)
            return observe(seqs, T, accepted, seconds, host)

        L.observe = logged_observe
        if isinstance(L, AdaptiveLengths):
            choose = L.choose

            def logged_choose(seqs):
                T = choose(seqs)
                if self.on:
                    Bp = L.bucket(len(seqs))
                    self.pred[(Bp, T)].append(L.costs.get(Bp, T) + L._flush_part.get(T, 0.0))
                return T

            L.choose = logged_choose

    def start(self):
        self.seen.clear()
        self.pred.clear()
        self.on = True


def _sweep(llm: LLM, args, prompts: dict, label: str) -> dict:
    """Every batch size on one engine: ``{B: row}`` (the fastest of ``--repeats``)."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    log = StepLog(llm)
    rows = {}
    for B in args.batches:
        rows[B] = best = fastest_run(llm, prompts[B], params, args.device, args.repeats, on_warm=log.start,
                                     extra=lambda: {
            "steps_ms": {f"{b},{t}": 1e3 * sum(v) / len(v) for (b, t), v in log.seen.items()},
            "steps_n": {f"{b},{t}": len(v) for (b, t), v in log.seen.items()},
            "pred_ms": {f"{b},{t}": 1e3 * sum(v) / len(v) for (b, t), v in log.pred.items()}})
        print(f"[never loses] {label:<9} B={B:<4} {best['decode_tokens_per_s']:>9.0f} decode tok/s "
              f"({best['tokens_per_s']:.0f} overall)"
              + (f"  acc {best['mean_accepted_length']:.2f}  {format_lengths(best['draft_lengths'])}"
                 if llm.drafter is not None else ""), file=sys.stderr, flush=True)
    return rows


def _policy_tables(llm: LLM) -> dict:
    """The adaptive policy's start-up tables (ms): ``{"t": {key: ms}, "flush": ..., "ring": L}``."""
    c = llm.executor.lengths.costs
    return {"t": {f"{b},{t}": 1e3 * v for (b, t), v in c.table.items()},
            "flush": {f"{b},{t}": 1e3 * v for (b, t), v in c.flush.items()}, "ring": c.ring}


# ---- FLOPs and bytes ------------------------------------------------------------------------
def measured_peaks(device) -> dict:
    """bf16 matmul FLOP/s (8192^3) and the device copy rate (``bench kernels``' 1 GiB copy
    kernel, read + write), medians of ``triton.testing.do_bench`` (CUDA only)."""
    if not str(device).startswith("cuda"):
        return {"flops": float("nan"), "bytes": float("nan")}
    import triton.testing as tt

    from replayssm.bench.kernels import Timer, copy_bandwidth

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = tt.do_bench(lambda: a @ a, warmup=10, rep=50, return_mode="median")
    return {"flops": 2 * 8192 ** 3 / (ms * 1e-3), "bytes": copy_bandwidth("cuda", Timer("cuda"))}


def weight_counts(model) -> dict:
    """Matmul weight elements: ``dense`` (every 2-D+ weight but embeddings, convolutions and
    routed experts; the head included), ``experts`` (routed experts) and the routing
    fraction ``k / E`` (1 without experts); ``bytes_per``: the weights' element size."""
    dense = experts = 0
    size = 2
    tied = not any("lm_head" in n for n, _ in model.named_parameters())
    for n, p in model.named_parameters():
        size = p.element_size()
        if "embed" in n:
            dense += p.numel() if tied else 0
        elif p.dim() < 2 or "conv1d" in n:
            continue
        elif ".experts." in n:
            experts += p.numel()
        else:
            dense += p.numel()
    cfg = model.config
    E = getattr(cfg, "num_experts", 0) or getattr(cfg, "n_routed_experts", 0) or 0
    k = getattr(cfg, "num_experts_per_tok", 0) or 0
    return {"dense": dense, "experts": experts, "route": (k / E) if E and experts else 1.0, "bytes_per": size}


def step_cost(w: dict, layout, B: int, nodes: int, form: str, L: int, context: int, phi: float) -> dict:
    """FLOPs and bytes of one step of ``B`` rows and ``nodes`` tokens per row: matmuls
    ``2 · tokens · active weights``; bytes: the weights touched (every routed expert some
    token picks: ``1 - (1 - k/E)^tokens``), per row the checkpoint state read (recurrent:
    and written; replay: written at flush share ``phi``), the ring read at its mean fill and
    the new entries written, the attention KV over ``context`` tokens."""
    tok = B * nodes
    flops = 2.0 * tok * (w["dense"] + w["route"] * w["experts"])
    touched = 1.0 - (1.0 - w["route"]) ** tok if w["route"] < 1.0 else 1.0
    wbytes = w["bytes_per"] * (w["dense"] + touched * w["experts"])
    S, e = layout.state_bytes, layout.entry_bytes
    if form == "recurrent":
        row = 2 * S
    else:
        fill = (L - 1) / 2 if nodes == 1 else max(L - 2 * nodes, 0) / 2
        row = S + phi * S + (fill + nodes) * e
    row += (context + nodes) * layout.attn_token_bytes
    return {"flops": flops, "bytes": wbytes + B * row, "weight_bytes": wbytes, "row_bytes": row}


def roofline(model, args, B: int, peaks: dict) -> dict:
    """Standard, plain replay and verify steps at batch ``B``: FLOPs, bytes, roofline ms, and
    the ceiling of speculation / standard at acceptance ``--accept``."""
    w = weight_counts(model)
    L, ctx = args.buffer_size, args.prompt_len + args.max_tokens // 2
    lay = {f: model.cache_layout(mode=f, buffer_size=L, max_seq_len=args.max_seq_len) for f in ("recurrent", "replay")}
    alpha = [args.accept] * args.num_tokens
    out = {"B": B, "weights": w, "state_bytes_per_row": lay["replay"].state_bytes,
           "entry_bytes": lay["replay"].entry_bytes, "steps": {}}

    def ms(c):
        return 1e3 * max(c["flops"] / peaks["flops"], c["bytes"] / peaks["bytes"])

    std = step_cost(w, lay["recurrent"], B, 1, "recurrent", L, ctx, 0.0)
    out["steps"]["standard"] = dict(std, ms=ms(std), tokens_per_row=1.0)
    plain = step_cost(w, lay["replay"], B, 1, "replay", L, ctx, flush_fraction(L, 1, 1.0))
    out["steps"]["replay"] = dict(plain, ms=ms(plain), tokens_per_row=1.0)
    for T in sorted({1, 2, args.num_tokens} | ({4} if args.num_tokens >= 4 else set())):
        E = expected_tokens(alpha, T)
        c = step_cost(w, lay["replay"], B, T + 1, "replay", L, ctx, flush_fraction(L, T + 1, E))
        out["steps"][f"verify T={T}"] = dict(c, ms=ms(c), tokens_per_row=E)
    for v in out["steps"].values():
        v["ceiling_vs_standard"] = (v["tokens_per_row"] / v["ms"]) / (1.0 / out["steps"]["standard"]["ms"]) \
            if v["ms"] == v["ms"] else float("nan")
    return out


# ---- one preset -----------------------------------------------------------------------------
def run_preset(preset: str, args, peaks: dict) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:   # the files go once loaded
        model = load(_random_model_dir(preset, tmp), torch.device(args.device), getattr(torch, args.dtype))[0]
    V = int(model.config.vocab_size)
    prompts = {B: _prompts(B, args.prompt_len, V, seed=B) for B in args.batches}
    res = {"preset": preset, "build_s": time.perf_counter() - t0, "runs": {}, "tables": {}}
    for name, mode in (("standard", "recurrent"), ("replay", "replay")):
        llm = _engine(model, args, mode)
        res["runs"][name] = _sweep(llm, args, prompts, name)
        del llm
        free_memory(args.device)
    refs = {tuple(p): o for B in args.batches for p, o in zip(prompts[B], res["runs"]["standard"][B]["outputs"])}
    for pol in ["fixed", "adaptive"] + (["adaptive-null"] if args.null_slot else []):
        spec = SpeculativeConfig("ngram", num_tokens=args.num_tokens, spec_policy=pol.split("-")[0])
        llm = _engine(model, args, "replay", spec)
        if pol == "adaptive":
            res["tables"] = _policy_tables(llm)   # as measured at start-up, before any step
        if pol == "adaptive-null" and llm.runner.device.type == "cuda":   # the table as timed before: null-slot rows
            L = llm.executor.lengths
            L.costs.table.update(measure_step_costs(llm.runner, [(T, L.nodes[T], L.tree) for T in L.lengths])[0])
            L.costs.flush.clear()
            L.costs.ring = None
            res["tables_null_slot"] = _policy_tables(llm)
        llm.drafter = OracleDrafter(refs, args.num_tokens, args.accept, V, llm.device)
        res["runs"][pol] = _sweep(llm, args, prompts, pol)
        del llm
        free_memory(args.device)
    base = res["runs"]["replay"]
    for rows in res["runs"].values():
        for B, r in rows.items():
            r["mismatch"] = sum(a != b for a, b in zip(r["outputs"], base[B]["outputs"]))
    res["roofline"] = roofline(model, args, max(args.batches), peaks)
    res["elapsed_s"] = time.perf_counter() - t0
    del model
    free_memory(args.device)
    return res


def _ms(d: dict, key: str) -> str:
    v = d.get(key)
    return f"{v:8.2f}" if v is not None else f"{'-':>8}"


def report(res: dict, args) -> list[str]:
    runs, fails, p = res["runs"], [], res["preset"]
    print(f"\n== {p} ({args.dtype}, {args.max_tokens} tokens per request, oracle accept {args.accept}, at most "
          f"{args.num_tokens} drafts, ring {args.buffer_size}; built in {res['build_s']:.0f} s, "
          f"{res['elapsed_s']:.0f} s in all)")
    print(f"{'B':>5}{'standard':>10}{'replay':>10}{'fixed':>10}{'adaptive':>10}{'ad/repl':>9}{'ad/std':>8}"
          f"{'fx/repl':>9}{'ad/repl wall':>13}{'acc':>6}{'mism':>5}  chosen T (adaptive)")
    for B in args.batches:
        s, r, f, a = (runs[k][B]["decode_tokens_per_s"] for k in ("standard", "replay", "fixed", "adaptive"))
        wall = runs["adaptive"][B]["tokens_per_s"] / runs["replay"][B]["tokens_per_s"]
        mism = sum(runs[k][B]["mismatch"] for k in runs)
        print(f"{B:>5}{s:>10.0f}{r:>10.0f}{f:>10.0f}{a:>10.0f}{a / r:>8.2f}x{a / s:>7.2f}x{f / r:>8.2f}x"
              f"{wall:>12.2f}x{runs['adaptive'][B]['mean_accepted_length']:>6.2f}{mism:>5}  "
              f"{format_lengths(runs['adaptive'][B]['draft_lengths'])}")
        if "adaptive-null" in runs:
            n = runs["adaptive-null"][B]["decode_tokens_per_s"]
            print(f"{'':>5}  null-slot table: {n:.0f} decode tok/s = {n / r:.2f}x replay  "
                  f"{format_lengths(runs['adaptive-null'][B]['draft_lengths'])}")
        if a / r < NOISE:
            fails.append(f"{p} B={B}: adaptive / replay = {a / r:.3f} < {NOISE}")
        if mism:
            fails.append(f"{p} B={B}: {mism} outputs differ from plain replay")
    B = max(args.batches)
    if p in ("2.7b", "nemotron-h-4b", "qwen3-next-4b"):
        a_s = runs["adaptive"][B]["decode_tokens_per_s"] / runs["standard"][B]["decode_tokens_per_s"]
        print(f"   target adaptive / standard >= 2.00x at B={B}: {a_s:.2f}x {'met' if a_s >= 2.0 else 'MISSED'}")
    tb = res["tables"]
    if tb.get("t"):
        print(f"-- cost table (ms) the adaptive policy built at start-up vs the steps it ran (ring {tb['ring']}); "
              f"pred = t + flush share x flush at the chosen steps")
        print(f"{'B':>5}{'bucket':>7}{'T':>3}{'t':>8}{'+flush':>8}{'pred':>8}{'adapt':>8}{'n':>5}{'fixed':>8}{'n':>5}"
              f"{'replay':>8}")
        for B in args.batches:
            Bp = bucket_for(sorted({int(k.split(',')[0]) for k in tb["t"]}), B)
            ad, fx, rp = runs["adaptive"][B], runs["fixed"][B], runs["replay"][B]
            for T in sorted({int(k.split(',')[1]) for k in tb["t"]}):
                k = f"{Bp},{T}"
                print(f"{B:>5}{Bp:>7}{T:>3}{_ms(tb['t'], k)}{_ms(tb['flush'], k)}{_ms(ad['pred_ms'], k)}"
                      f"{_ms(ad['steps_ms'], k)}{ad['steps_n'].get(k, 0):>5}{_ms(fx['steps_ms'], k)}"
                      f"{fx['steps_n'].get(k, 0):>5}{_ms(rp['steps_ms'], k) if T == 0 else f'{chr(32) * 8}'}")
    rf = res["roofline"]
    w = rf["weights"]
    print(f"-- one step at B={rf['B']}: roofline at this GPU's measured rates; weights {w['dense'] / 1e9:.2f} G dense"
          f" + {w['experts'] / 1e9:.2f} G routed (k/E {w['route']:.3f}); state {rf['state_bytes_per_row'] / 2 ** 20:.1f}"
          f" MiB/row, ring entry {rf['entry_bytes'] / 2 ** 10:.1f} KiB")
    print(f"{'step':<12}{'TFLOP':>8}{'GB':>8}{'weights GB':>11}{'MB/row':>8}{'ms':>8}{'tok/row':>8}{'ceiling vs std':>15}")
    for name, v in rf["steps"].items():
        print(f"{name:<12}{v['flops'] / 1e12:>8.2f}{v['bytes'] / 1e9:>8.2f}{v['weight_bytes'] / 1e9:>11.2f}"
              f"{v['row_bytes'] / 1e6:>8.1f}{v['ms']:>8.2f}{v['tokens_per_row']:>8.2f}{v['ceiling_vs_standard']:>14.2f}x")
    return fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen3.5-4b,2.7b")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--accept", type=float, default=0.8, help="oracle: probability each draft is right")
    p.add_argument("--num-tokens", type=int, default=4, help="most drafts per step (fixed: always)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (the fastest counts)")
    p.add_argument("--buffer-size", type=int, default=None, help="replay ring L (default max(16, 2 (k + 1)))")
    p.add_argument("--budget-s", type=float, default=270.0, help="start no preset past this many seconds")
    p.add_argument("--null-slot", action="store_true",
                   help="also run adaptive on a table timed the old way (null-slot rows, no flush prices)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.batches = sorted(int(b) for b in args.batches.split(",") if b)
    if not 0.0 <= args.accept <= 1.0 or args.num_tokens < 1 or not args.batches or min(args.batches) < 1:
        p.error("--accept is a probability, --num-tokens >= 1, --batches positive")
    args.buffer_size = args.buffer_size or max(16, 2 * (args.num_tokens + 1))
    if args.buffer_size < 2 * (args.num_tokens + 1):
        p.error(f"--buffer-size must be >= 2 (num_tokens + 1) = {2 * (args.num_tokens + 1)}")
    args.max_seq_len = -(-(args.prompt_len + args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peaks = measured_peaks(args.device)
    print(f"device {dev_name}; torch {torch.__version__}; measured bf16 matmul {peaks['flops'] / 1e12:.0f} TFLOP/s, "
          f"copy {peaks['bytes'] / 1e12:.2f} TB/s")
    out = {"device": dev_name, "peaks": peaks, "config": dict(vars(args)), "presets": [], "skipped": []}
    fails, t0 = [], time.perf_counter()
    for preset in [x for x in args.presets.split(",") if x]:
        if time.perf_counter() - t0 > args.budget_s:
            out["skipped"].append(preset)
            print(f"\n== {preset}: skipped (past --budget-s {args.budget_s:.0f} s)")
            continue
        res = run_preset(preset, args, peaks)
        fails += report(res, args)
        for rows in res["runs"].values():
            for r in rows.values():
                r.pop("outputs")
        out["presets"].append(res)
    out["failed_checks"] = fails
    print("\nchecks: " + ("all passed (adaptive >= plain replay at every batch within 2%; greedy outputs identical)"
                          if not fails else "FAILED\n  " + "\n  ".join(fails)))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "spec_never_loses.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
