"""Adaptive draft length vs plain replay, fixed-length speculation and standard decoding (one GPU).

On random-weight models of bench presets (``--presets``, default the 2.7B Mamba-2 and the
Qwen3.5-4B hybrid), for each batch size ``B`` in ``--batches`` (B requests of
``--max-tokens`` tokens, all submitted at once) it measures decode tokens per second (the
engine's decode time: prefill left out) of:

* ``standard``: plain decoding in recurrent form (also the greedy reference outputs);
* ``replay``: plain decoding in replay form;
* per drafter (``oracle``, the default: the known continuation, each draft right with
  probability ``--accept``; ``ngram``: prompt lookup, which finds little on random weights;
  ``mtp``: a random MTP head does its drafting work every step and the oracle's tokens are
  verified, as ``bench e2e --spec-method mtp`` does; ``draft``: likewise with a
  random-weight 130M Mamba-2 draft model, for the Mamba-2 presets): speculation with
  ``spec_policy="fixed"`` (always ``--num-tokens`` drafts) and ``"adaptive"`` (the draft
  length, 0 included, chosen per step).

Every speculative run's greedy outputs are compared with plain replay's (``mismatch``
counts requests that differ; it must be 0).  Prints one table per preset and drafter with
the ratios adaptive / replay (target: >= 1.00 at every batch; a check, with a 2% noise
allowance), adaptive / fixed and adaptive / standard (target >= 2.00 at B=256: reported),
the draft lengths the adaptive policy chose (``T=<len>:<steps>``), its probes, its pooled
per-depth acceptance estimate and the drafter host ms per step it predicts per length
(``host ms T1 ..``: the measured ``propose`` time it prices) after the batch; then a summary of the three ratios per preset
and batch.  Writes ``spec_policy.json`` to ``$OUT`` when set.  One engine per configuration
serves every batch size in turn (graphs captured once), so the adaptive policy's estimates
carry over as in a server.  No preset starts past ``--budget-s`` seconds.

Usage (GPU; sized for about 4 minutes on an H100 with the defaults)::

    PYTHONPATH=. python scripts/gpu_spec_policy.py
    PYTHONPATH=. python scripts/gpu_spec_policy.py --presets nemotron-h-4b,qwen3-next-4b --batches 256
    PYTHONPATH=. python scripts/gpu_spec_policy.py --presets qwen3-next-4b --drafters mtp
    PYTHONPATH=. python scripts/gpu_spec_policy.py --presets 2.7b --drafters oracle,ngram,draft --batches 1,16,64

CPU smoke run (tiny model): ``--presets tiny --device cpu --batches 1,4 --max-tokens 12``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from replayssm.bench.common import fastest_run, free_memory, private_copy
from replayssm.bench.e2e import (OracleDrafter, OracleTokens, _prompts, _random_model_dir,
                                 format_host_ms, format_lengths, predicted_host_ms)
from replayssm.bench.random_mtp import add_random_mtp
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.engine.loading import load
from replayssm.engine.spec.policy import AdaptiveLengths

NOISE = 0.98   # adaptive / replay below this fails the check


def _engine(model, args, mode: str, spec=None) -> LLM:
    return LLM(model, device=args.device, dtype=args.dtype, decode_mode=mode, speculative=spec,
               max_num_seqs=max(args.batches), max_seq_len=args.max_seq_len,
               buffer_size=max(16, 2 * (args.num_tokens + 1)))


def _policy_state(llm) -> dict:
    """The adaptive policy's probes and pooled per-depth acceptance (empty for other policies)."""
    L = getattr(llm.executor, "lengths", None)
    if not isinstance(L, AdaptiveLengths):
        return {}
    return {"probes": L.probes, "pooled_alpha": [round(a, 3) for a in L.acceptance.pooled]}


def _host_state(llm, B: int) -> dict:
    """The drafter host ms per step the adaptive policy predicts per length at ``B`` rows."""
    host = predicted_host_ms(getattr(llm.executor, "lengths", None), B)
    return {"predicted_host_ms": host} if host else {}


def _sweep(llm, args, prompts: dict, label: str) -> dict:
    """Time every batch size on one engine: ``{B: row}`` (the fastest of ``--repeats`` by
    decode tokens per second)."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = {}
    for B in args.batches:
        rows[B] = best = fastest_run(llm, prompts[B], params, args.device, args.repeats, extra=lambda B=B: {
            "num_slots": llm.num_slots, **_policy_state(llm), **_host_state(llm, B)})
        extra = ""
        if llm.drafter is not None:
            extra = f"  acc {best['mean_accepted_length']:.2f}  {format_lengths(best['draft_lengths'])}"
            if "pooled_alpha" in best:
                extra += f"  probes {best['probes']}  pooled α {best['pooled_alpha']}"
            if "predicted_host_ms" in best:
                extra += "  " + format_host_ms(best["predicted_host_ms"])
        print(f"[spec policy] {label:<16} B={B:<4} {best['decode_tokens_per_s']:>10.0f} decode tok/s "
              f"({best['tokens_per_s']:.0f} overall){extra}", file=sys.stderr, flush=True)
    return rows


def run_preset(preset: str, args, tmp: str) -> dict:
    t0 = time.perf_counter()
    path = _random_model_dir(preset, tmp)
    mtp = "mtp" in args.drafters
    if mtp:   # the head is written into a private copy (a cached random model stays as it is)
        path = private_copy(path, os.path.join(tmp, f"{preset}-mtp"))
        add_random_mtp(path)
    model = load(path, torch.device(args.device), getattr(torch, args.dtype), mtp=mtp)[0]
    V = int(model.config.vocab_size)
    prompts = {B: _prompts(B, args.prompt_len, V, seed=B) for B in args.batches}
    res = {"preset": preset, "runs": {}}

    llm = _engine(model, args, "recurrent")
    res["runs"]["standard"] = _sweep(llm, args, prompts, "standard")
    refs = {tuple(p): o for B in args.batches for p, o in zip(prompts[B], res["runs"]["standard"][B]["outputs"])}
    del llm
    free_memory(args.device)
    llm = _engine(model, args, "replay")
    res["runs"]["replay"] = _sweep(llm, args, prompts, "replay")
    del llm
    free_memory(args.device)
    draft_dir = None
    if "draft" in args.drafters:
        if preset not in ("2.7b", "130m"):
            raise SystemExit(f"--drafters draft: the 130m draft shares a vocabulary with the Mamba-2 presets only, "
                             f"not {preset}")
        draft_dir = _random_model_dir("130m", tmp, seed=1)
    for d in args.drafters:
        for pol in ("fixed", "adaptive"):
            method = {"mtp": "mtp", "draft": "draft"}.get(d, "ngram")
            spec = SpeculativeConfig(method, num_tokens=args.num_tokens, spec_policy=pol, draft_model=draft_dir
                                     if d == "draft" else None)
            llm = _engine(model, args, "replay", spec)
            if d in ("oracle", "mtp", "draft"):
                oracle = OracleDrafter(refs, args.num_tokens, args.accept, V, llm.device)
                llm.drafter = oracle if d == "oracle" else OracleTokens(llm.drafter, oracle)
            res["runs"][f"{d}-{pol}"] = _sweep(llm, args, prompts, f"{d}-{pol}")
            del llm
            free_memory(args.device)
    base = res["runs"]["replay"]
    for name, rows in res["runs"].items():
        for B, r in rows.items():
            r["mismatch"] = sum(a != b for a, b in zip(r["outputs"], base[B]["outputs"]))
    res["elapsed_s"] = time.perf_counter() - t0
    del model
    free_memory(args.device)
    return res


def _tps(row: dict) -> float:
    return row["decode_tokens_per_s"]


def report(res: dict, args) -> list[str]:
    """Print the tables; returns the failed checks."""
    runs, fails = res["runs"], []
    print(f"\n== {res['preset']} ({args.dtype}, {args.max_tokens} tokens per request, oracle accept {args.accept}, "
          f"num_tokens {args.num_tokens}; decode tok/s; {res['elapsed_s']:.0f} s)")
    for d in args.drafters:
        fx, ad = runs[f"{d}-fixed"], runs[f"{d}-adaptive"]
        print(f"-- drafter {d}")
        print(f"{'B':>5}{'standard':>10}{'replay':>10}{'fixed':>10}{'adaptive':>10}{'ad/replay':>11}{'ad/fixed':>10}"
              f"{'ad/std':>8}{'acc':>6}{'mism':>5}  chosen T (adaptive)")
        for B in args.batches:
            s, r, f, a = (_tps(runs["standard"][B]), _tps(runs["replay"][B]), _tps(fx[B]), _tps(ad[B]))
            mism = fx[B]["mismatch"] + ad[B]["mismatch"]
            print(f"{B:>5}{s:>10.0f}{r:>10.0f}{f:>10.0f}{a:>10.0f}{a / r:>10.2f}x{a / f:>9.2f}x{a / s:>7.2f}x"
                  f"{ad[B]['mean_accepted_length']:>6.2f}{mism:>5}  {format_lengths(ad[B]['draft_lengths'])}"
                  f"  {format_host_ms(ad[B].get('predicted_host_ms', {}))}")
            if a / r < NOISE:
                fails.append(f"{res['preset']} {d} B={B}: adaptive / replay = {a / r:.3f} < {NOISE}")
            if mism:
                fails.append(f"{res['preset']} {d} B={B}: {mism} outputs differ from plain replay")
            if B == 256 and d == "oracle":   # the second target (reported, not a check)
                print(f"      target adaptive / standard >= 2.00x at B=256: {a / s:.2f}x "
                      f"{'met' if a / s >= 2.0 else 'MISSED'}")
    return fails


def summary(presets: list, args) -> dict:
    """adaptive / replay, / fixed, / standard per preset, drafter and batch, one line each;
    returns them as ``{preset: {drafter: {baseline: {B: ratio}}}}``."""
    print(f"\nsummary (decode tok/s ratios of the adaptive policy; B = {', '.join(map(str, args.batches))})")
    out: dict = {}
    for res in presets:
        runs = res["runs"]
        for d in args.drafters:
            ad = runs[f"{d}-adaptive"]
            for name, base in (("replay", runs["replay"]), ("fixed", runs[f"{d}-fixed"]),
                               ("standard", runs["standard"])):
                ratios = {B: _tps(ad[B]) / _tps(base[B]) for B in args.batches}
                out.setdefault(res["preset"], {}).setdefault(d, {})[name] = ratios
                vals = " / ".join(f"{r:.2f}" for r in ratios.values())
                print(f"  {res['preset']:<12} {d:<7} adaptive / {name:<9} {vals}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="2.7b,qwen3.5-4b")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--drafters", default="oracle")
    p.add_argument("--accept", type=float, default=0.8, help="oracle: probability each draft is right")
    p.add_argument("--num-tokens", type=int, default=4, help="most drafts per step (fixed: always)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (the fastest counts)")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no preset past this many seconds")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.drafters = [d for d in args.drafters.split(",") if d]
    bad = [d for d in args.drafters if d not in ("oracle", "ngram", "mtp", "draft")]
    if bad or not 0.0 <= args.accept <= 1.0:
        p.error(f"--drafters takes oracle, ngram, mtp and draft (got {bad}); --accept is a probability")
    args.max_seq_len = -(-(args.prompt_len + args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {dev_name}; torch {torch.__version__}")
    out, fails = {"device": dev_name, "config": {k: v for k, v in vars(args).items()}, "presets": []}, []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for preset in [x for x in args.presets.split(",") if x]:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"skipped {preset}: past --budget-s {args.budget_s:.0f} s")
                out.setdefault("skipped", []).append(preset)
                continue
            res = run_preset(preset, args, tmp)
            fails += report(res, args)
            for rows in res["runs"].values():
                for r in rows.values():
                    r.pop("outputs")
            out["presets"].append(res)
    out["summary"] = summary(out["presets"], args)
    out["elapsed_s"] = time.perf_counter() - t0
    out["failed_checks"] = fails
    print(f"\nchecks ({out['elapsed_s']:.0f} s): " + ("all passed (adaptive >= plain replay at every batch, "
                                                    f"{NOISE} noise allowance; greedy outputs identical)"
                          if not fails else "FAILED\n  " + "\n  ".join(fails)))
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        path = os.path.join(os.environ["OUT"], "spec_policy.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
