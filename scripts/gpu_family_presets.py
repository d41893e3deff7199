"""Qwen3.5-4B and Granite-4.0-H-Tiny bench presets on one GPU: the issue's two targets.

For each preset (``--presets``; random weights built by the preset machinery, bf16, CUDA
graphs on) it measures decode tokens/s (generated tokens after each request's first, over the
engine's decode time, as ``bench e2e`` reports them) of:

* ``recurrent`` and ``replay`` plain decoding at every ``--batches`` size (one engine per
  form serves every batch size; graphs captured once);
* replay + oracle speculation at ``--spec-batch`` (default 256): the recurrent run's greedy
  continuation drafted, each draft right with probability ``--accept`` (0.8), at most
  ``--num-tokens`` (4) drafts a step, the draft length chosen by ``--policies`` (default the
  engine's adaptive policy).

Targets (as for the other hybrids): replay / recurrent >= 1.25 at B=256, replay speculation /
standard (recurrent) decoding >= 1.8 at B=256; printed ``met`` / ``MISSED``.  Checks (exit
code 1 when one fails): every speculative run's greedy outputs equal plain replay's (rollback
is exact), and plain replay's equal recurrent's (reported per batch as ``mism``).

    PYTHONPATH=. python scripts/gpu_family_presets.py   # sized for < 4 min on an H100 (not yet timed)

Writes ``family_presets.json`` to ``$OUT`` when set.  CPU smoke run (tiny twins):
``--presets qwen3.5-tiny,granite-4.0-h-tiny-smoke --device cpu --batches 2,4 --spec-batch 4
--max-tokens 8``.
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

from replayssm.bench.common import fastest_run, free_memory
from replayssm.bench.e2e import (PRESETS, OracleDrafter, _prompts, _random_model_dir,
                                 format_lengths)
from replayssm.bench.hybrid_presets import HYBRID_PRESETS
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.engine.loading import load

TARGETS = {"replay_vs_recurrent": 1.25, "spec_vs_standard": 1.8}


def _engine(model, args, mode: str, max_batch: int, spec=None) -> LLM:
    return LLM(model, device=args.device, dtype=args.dtype, decode_mode=mode, speculative=spec,
               max_num_seqs=max_batch, max_seq_len=args.max_seq_len, buffer_size=max(16, 2 * (args.num_tokens + 1)))


def _timed(llm: LLM, prompts: list, args, label: str) -> dict:
    """One warm-up then the fastest of ``args.repeats`` timed runs of ``prompts``."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    best = fastest_run(llm, prompts, params, args.device, args.repeats,
                       extra=lambda: {"batch": len(prompts), "capture_s": llm.capture_s})
    print(f"[family presets] {label:<18} B={best['batch']:<4} {best['decode_tokens_per_s']:>9.0f} decode tok/s "
          f"({best['tokens_per_s']:.0f} tok/s overall), acc {best['mean_accepted_length']:.2f}, "
          f"graphs captured in {best['capture_s']:.0f} s"
          + (f", T {format_lengths(best['draft_lengths'])}" if llm.drafter is not None else ""),
          file=sys.stderr, flush=True)
    return best


def run_preset(preset: str, args) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:   # the files go once loaded (disk: two 10-14 GB models)
        model = load(_random_model_dir(preset, tmp), torch.device(args.device), getattr(torch, args.dtype))[0]
    build_s = time.perf_counter() - t0
    V = int(model.config.vocab_size)
    batches = sorted(set(args.batches) | {args.spec_batch})
    prompts = {B: _prompts(B, args.prompt_len, V, seed=B) for B in batches}
    res = {"preset": preset, "build_s": build_s, "runs": {}}
    for mode in ("recurrent", "replay"):
        llm = _engine(model, args, mode, max(batches))
        res["runs"][mode] = {B: _timed(llm, prompts[B], args, mode) for B in batches}
        del llm
        free_memory(args.device)
    B = args.spec_batch
    refs = {tuple(p): o for p, o in zip(prompts[B], res["runs"]["recurrent"][B]["outputs"])}
    for pol in args.policies:
        spec = SpeculativeConfig("ngram", num_tokens=args.num_tokens, spec_policy=pol)
        llm = _engine(model, args, "replay", B, spec)
        llm.drafter = OracleDrafter(refs, args.num_tokens, args.accept, V, llm.device)
        res["runs"][f"spec-{pol}"] = {B: _timed(llm, prompts[B], args, f"replay+oracle {pol}")}
        del llm
        free_memory(args.device)
    outs = {name: {b: r.pop("outputs") for b, r in rows.items()} for name, rows in res["runs"].items()}
    for name, rows in res["runs"].items():   # replay against recurrent, speculation against replay
        base = outs["recurrent"] if name == "replay" else outs["replay"]
        for b, r in rows.items():
            r["mismatch"] = 0 if name == "recurrent" else sum(x != y for x, y in zip(outs[name][b], base[b]))
    res["elapsed_s"] = time.perf_counter() - t0
    del model
    free_memory(args.device)
    return res


def report(res: dict, args) -> tuple[dict, list[str]]:
    """Print the preset's table; returns ``(ratios, failed checks)``."""
    runs, fails, ratios = res["runs"], [], {}
    print(f"\n== {res['preset']} ({args.dtype}, {args.max_tokens} tokens per request, prompt {args.prompt_len}; "
          f"built in {res['build_s']:.0f} s, {res['elapsed_s']:.0f} s in all)")
    print(f"{'B':>5}{'recurrent':>11}{'replay':>10}{'replay/rec':>12}{'mism':>6}")
    for B, rec in runs["recurrent"].items():
        rep = runs["replay"][B]
        ratios[f"replay_vs_recurrent_B{B}"] = r = rep["decode_tokens_per_s"] / rec["decode_tokens_per_s"]
        print(f"{B:>5}{rec['decode_tokens_per_s']:>11.0f}{rep['decode_tokens_per_s']:>10.0f}{r:>11.2f}x"
              f"{rep['mismatch']:>6}")
    B = args.spec_batch
    std = runs["recurrent"][B]["decode_tokens_per_s"]
    print(f"{'spec (B=' + str(B) + ')':<22}{'tok/s':>9}{'/standard':>11}{'/replay':>9}{'acc':>6}{'mism':>6}  chosen T")
    for pol in args.policies:
        s = runs[f"spec-{pol}"][B]
        ratios[f"spec_{pol}_vs_standard_B{B}"] = r = s["decode_tokens_per_s"] / std
        print(f"{'replay+oracle ' + pol:<22}{s['decode_tokens_per_s']:>9.0f}{r:>10.2f}x"
              f"{s['decode_tokens_per_s'] / runs['replay'][B]['decode_tokens_per_s']:>8.2f}x"
              f"{s['mean_accepted_length']:>6.2f}{s['mismatch']:>6}  {format_lengths(s['draft_lengths'])}")
        if s["mismatch"]:
            fails.append(f"{res['preset']} spec {pol} B={B}: {s['mismatch']} outputs differ from plain replay")
    for b, rep in runs["replay"].items():
        if rep["mismatch"]:
            fails.append(f"{res['preset']} B={b}: {rep['mismatch']} replay outputs differ from recurrent")
    rr = ratios.get(f"replay_vs_recurrent_B{B}")
    sp = ratios.get(f"spec_{args.policies[0]}_vs_standard_B{B}")
    print(f"   target replay / recurrent >= {TARGETS['replay_vs_recurrent']:.2f}x at B={B}: {rr:.2f}x "
          f"{'met' if rr >= TARGETS['replay_vs_recurrent'] else 'MISSED'}")
    print(f"   target replay spec ({args.policies[0]}, accept {args.accept}) / standard >= "
          f"{TARGETS['spec_vs_standard']:.2f}x at B={B}: {sp:.2f}x {'met' if sp >= TARGETS['spec_vs_standard'] else 'MISSED'}")
    return ratios, fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen3.5-4b,granite-4.0-h-tiny")
    p.add_argument("--batches", default="64,256", help="plain decoding batch sizes")
    p.add_argument("--spec-batch", type=int, default=256)
    p.add_argument("--policies", default="adaptive", help="draft-length policies (adaptive, fixed), comma separated")
    p.add_argument("--accept", type=float, default=0.8, help="oracle: probability each draft is right")
    p.add_argument("--num-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration (the fastest counts)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.presets = [x for x in args.presets.split(",") if x]
    unknown = [x for x in args.presets if x not in HYBRID_PRESETS and x not in PRESETS]
    if unknown or not args.presets:
        p.error(f"--presets: unknown {unknown} (known: {', '.join(sorted(HYBRID_PRESETS) + sorted(PRESETS))})")
    args.policies = [x for x in args.policies.split(",") if x]
    if not args.policies or any(x not in ("adaptive", "fixed") for x in args.policies):
        p.error(f"--policies takes adaptive and/or fixed, got {args.policies}")
    if not 0.0 <= args.accept <= 1.0 or args.spec_batch < 1 or not args.batches or min(args.batches) < 1:
        p.error("--accept is a probability; --spec-batch and --batches are positive")
    args.max_seq_len = -(-(args.prompt_len + args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {dev_name}; torch {torch.__version__}")
    t0 = time.perf_counter()
    out = {"device": dev_name, "config": dict(vars(args)), "targets": TARGETS, "presets": []}
    fails = []
    for preset in args.presets:
        try:
            res = run_preset(preset, args)
        except Exception:   # report it and go on with the next preset
            fails.append(f"{preset}: FAILED\n{traceback.format_exc()}")
            print(f"[family presets] {preset} FAILED\n{traceback.format_exc()}", flush=True)
            free_memory(args.device)
            continue
        res["ratios"], f = report(res, args)
        fails += f
        out["presets"].append(res)
        if os.environ.get("OUT"):   # what was measured so far, should a later preset fail
            os.makedirs(os.environ["OUT"], exist_ok=True)
            with open(os.path.join(os.environ["OUT"], "family_presets.json"), "w") as fh:
                json.dump(out, fh, indent=1, default=str)
    out["failed_checks"], out["elapsed_s"] = fails, time.perf_counter() - t0
    B, pol = args.spec_batch, args.policies[0]
    print(f"\n{'preset':<26}{f'replay/recurrent B={B}':>22}{f'spec ({pol})/standard B={B}':>30}")
    for res in out["presets"]:
        r = res["ratios"]
        print(f"{res['preset']:<26}{r[f'replay_vs_recurrent_B{B}']:>21.2f}x{r[f'spec_{pol}_vs_standard_B{B}']:>29.2f}x")
    print(f"{'target':<26}{TARGETS['replay_vs_recurrent']:>21.2f}x{TARGETS['spec_vs_standard']:>29.2f}x")
    print("\nchecks: " + ("all passed (speculative outputs equal plain replay's; replay's equal recurrent's)"
                          if not fails else "FAILED\n  " + "\n  ".join(fails)) + f"; {out['elapsed_s']:.0f} s")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "family_presets.json")
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        print(f"wrote {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
