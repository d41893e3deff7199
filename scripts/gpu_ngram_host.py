"""N-gram speculation at large batch on one GPU: its host time per step and whether it
ever loses against plain decoding (Qwen3-Next-4B-class preset, bf16, replay form, CUDA graphs).

Random weights accept nothing real, so every n-gram step verifies the *oracle's* tokens
(each request's greedy continuation from the plain run, each draft kept with probability
``--accept``) while the n-gram drafter does all of its own work every step (gpu_mtp.py's
recipe).  At each batch in ``--batches``: no speculation, then n-gram with the fixed
length (always ``--num-tokens`` drafts) and with the adaptive policy (the engine's
default).  Per row: generated tok/s and the ratio to none, mean accepted length, the
n-gram drafter's own ``propose`` host ms per speculative step (median, mean and max over
the steps: a pause shows as the max), the oracle wrapper's host ms on top (bench cost, not
the drafter's), the chosen draft lengths, the policy's predicted host ms per length,
full garbage collections during the timed run (and the longest), greedy mismatches against
the plain run (must be 0).  The n-gram rows run twice: as built, then (policies
``fixed+frz``, ``adaptive+frz``; the adaptive policy keeps what it learnt in the first) after
``gc.freeze()``, what ``LLM(gc_freeze=True)`` does once an engine is built
(``--no-gc-freeze`` skips the second pass).  Last, the n-gram
drafter's device proposals (three made back to back, then read) against the plain scan.

Usage (one H100 or H200; about 2-3 minutes)::

    PYTHONPATH=. python scripts/gpu_ngram_host.py

writes ``gpu_ngram_host.json`` to ``$OUT`` when set.  CPU smoke run (tiny model, no graphs):
``--preset qwen3-next-tiny --device cpu --batches 2,4 --max-tokens 8``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from replayssm.bench.common import free_memory, warm_then_time
from replayssm.bench.e2e import (
    OracleDrafter,
    OracleTokens,
    _prompts,
    _random_model_dir,
    draft_length_steps,
    format_host_ms,
    format_lengths,
    predicted_host_ms,
)
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.engine.loading import load
from replayssm.engine.spec.policy import AdaptiveLengths, FixedLengths


class HostTimes:
    """``inner`` with every ``propose`` call's host seconds recorded."""

    def __init__(self, inner):
        self.inner, self.times = inner, []
        self.method = getattr(inner, "method", "?")
        self.runner = getattr(inner, "runner", None)

    def __getattr__(self, name):
        if name == "fused_step":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, seqs, k=None):
        t0 = time.perf_counter()
        out = self.inner.propose(seqs, k)
        self.times.append(time.perf_counter() - t0)
        return out

    def ms(self) -> dict:
        t = self.times or [0.0]
        return {"median": 1e3 * statistics.median(t), "mean": 1e3 * statistics.fmean(t), "max": 1e3 * max(t),
                "calls": len(self.times)}


class FullGCs:
    """Full collections (generation 2) and their pauses while active."""

    def __init__(self):
        self.pauses, self._t0 = [], 0.0

    def __call__(self, phase, info):
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)

    def __enter__(self):
        self.pauses = []
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def sweep(llm, args, batches, prompts, refs, policy: str) -> list[dict]:
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    inner, V, rows = llm.drafter, int(llm.model.config.vocab_size), []
    for B in batches:
        own = outer = None
        if inner is not None:
            own = HostTimes(inner)
            outer = HostTimes(OracleTokens(own, OracleDrafter(refs, args.num_tokens, args.accept, V, llm.device)))
            llm.drafter = outer

        def clear(own=own, outer=outer):
            if own is not None:
                own.times.clear()
                outer.times.clear()

        with FullGCs() as gcs:
            outs, wall = warm_then_time(llm, prompts[B], prompts[B], params, args.device, on_warm=clear)
        gen = sum(len(o.token_ids) for o in outs)
        row = {"batch": B, "drafter": "none" if inner is None else "ngram", "policy": policy,
               "tokens_per_s": gen / wall, "wall_s": wall, "steps": llm.stats["steps"],
               "mean_accepted_length": sum(o.mean_accepted_length for o in outs) / len(outs),
               "full_gcs": len(gcs.pauses), "max_gc_ms": 1e3 * max(gcs.pauses, default=0.0),
               "outputs": [o.token_ids for o in outs]}
        if own is not None:
            row["propose_ms"] = own.ms()
            wrapped = outer.ms()
            row["oracle_ms_mean"] = wrapped["mean"] - row["propose_ms"]["mean"]
            row["draft_lengths"] = draft_length_steps(llm.stats)
            row["predicted_host_ms"] = predicted_host_ms(llm.executor.lengths, B)
        rows.append(row)
        p = row.get("propose_ms", {})
        print(f"[ngram_host] {row['drafter']:<6}{policy:<13} B={B:<4} {row['tokens_per_s']:>9.0f} tok/s  acc "
              f"{row['mean_accepted_length']:.2f}  propose ms med {p.get('median', 0):.3f} mean {p.get('mean', 0):.3f} "
              f"max {p.get('max', 0):.2f} ({p.get('calls', 0)} calls)  oracle +{row.get('oracle_ms_mean', 0):.3f}  "
              f"{format_lengths(row.get('draft_lengths', {}))}  {format_host_ms(row.get('predicted_host_ms', {}))}  "
              f"full gc {row['full_gcs']} (max {row['max_gc_ms']:.1f} ms)", file=sys.stderr, flush=True)
    llm.drafter = inner
    return rows


def check_proposals(drafter, V: int, k: int) -> int:
    """Rows whose device proposal (tokens, valid) differs from the plain scan, over three
    proposals made back to back without a sync (the staging buffer's reuse), then read."""
    import random

    from replayssm.engine.sequence import Sequence
    from replayssm.engine.spec import ngram_continuations

    rng = random.Random(0)
    batches = []
    for b in range(3):
        seqs = []
        for i in range(64 + b):
            motif = [rng.randrange(V) for _ in range(rng.randint(1, 8))]
            s = Sequence((motif * 40)[:rng.randint(2, 60)], SamplingParams(max_tokens=rng.randint(1, 40)))
            s.output_ids += [rng.choice(motif) for _ in range(rng.randint(1, min(3, s.params.max_tokens)))]
            seqs.append(s)
        drafter.prefill(seqs)
        batches.append((seqs, drafter.propose(seqs, k)))
    bad = 0
    for seqs, prop in batches:
        if prop is None:   # nothing found in any row
            toks, valid = [[s.last_token] for s in seqs], [[True] for _ in seqs]
        else:
            toks, valid = prop.tokens.tolist(), prop.valid.tolist()
        for s, t, v in zip(seqs, toks, valid):
            length = min(k, max(s.remaining - 1, 0))
            c = ngram_continuations(s.prompt_ids + s.output_ids, drafter.n_min, drafter.n_max, length, 1) \
                if length > 0 else []
            c = c[0] if c else []
            bad += [x for x, ok in zip(t[1:], v[1:]) if ok] != c or t[0] != s.last_token or v[0] is not True
        for s in seqs:
            drafter.release(s)
    return bad


def report(rows: list[dict]) -> list[str]:
    base = {r["batch"]: r for r in rows if r["drafter"] == "none"}
    fails = []
    print(f"\n{'B':>5} {'drafter':<7}{'policy':<13}{'tok/s':>9}{'vs none':>9}{'acc':>6}{'prop med':>9}{'mean':>7}"
          f"{'max':>7}{'oracle':>8}{'gc':>4}{'gc ms':>7}{'mism':>5}  chosen T / priced host ms")
    for r in sorted(rows, key=lambda r: (r["batch"], r["drafter"] != "none", r["policy"])):
        b = base[r["batch"]]
        r["vs_none"] = r["tokens_per_s"] / b["tokens_per_s"]
        r["mismatch"] = sum(x != y for x, y in zip(r["outputs"], b["outputs"]))
        p = r.get("propose_ms", {})
        print(f"{r['batch']:>5} {r['drafter']:<7}{r['policy']:<13}{r['tokens_per_s']:>9.0f}{r['vs_none']:>8.2f}x"
              f"{r['mean_accepted_length']:>6.2f}{p.get('median', float('nan')):>9.3f}{p.get('mean', float('nan')):>7.3f}"
              f"{p.get('max', float('nan')):>7.2f}{r.get('oracle_ms_mean', float('nan')):>8.3f}{r['full_gcs']:>4}"
              f"{r['max_gc_ms']:>7.1f}{r['mismatch']:>5}  {format_lengths(r.get('draft_lengths', {}))}  "
              f"{format_host_ms(r.get('predicted_host_ms', {}))}")
        if r["mismatch"]:
            fails.append(f"B={r['batch']} {r['drafter']} {r['policy']}: {r['mismatch']} greedy mismatches")
    return fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-next-4b")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--num-tokens", type=int, default=4)
    p.add_argument("--accept", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    max_seq_len = -(-(args.prompt_len + args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    buffer_size = max(16, 2 * (args.num_tokens + 1))
    batches = [int(b) for b in args.batches.split(",") if b]
    t0 = time.perf_counter()
    res = {"config": dict(vars(args)), "rows": []}

    def engine(model, spec=None):
        return LLM(model, device=args.device, dtype=dtype, decode_mode="replay", speculative=spec,
                   max_num_seqs=max(batches), max_seq_len=max_seq_len, buffer_size=buffer_size)

    with tempfile.TemporaryDirectory() as tmp:
        model = load(_random_model_dir(args.preset, tmp), torch.device(args.device), getattr(torch, dtype))[0]
        V = int(model.config.vocab_size)
        res["config"]["device_name"] = torch.cuda.get_device_name() if cuda else "cpu"
        prompts = {B: _prompts(B, args.prompt_len, V, seed=B) for B in batches}
        llm = engine(model)
        rows = sweep(llm, args, batches, prompts, None, "-")
        refs = {tuple(prompts[r["batch"]][i]): o for r in rows for i, o in enumerate(r["outputs"])}
        res["rows"] += rows
        del llm
        free_memory(args.device)
        llm = engine(model, SpeculativeConfig("ngram", num_tokens=args.num_tokens))
        adaptive = llm.executor.lengths
        llm.executor.lengths = FixedLengths((args.num_tokens,))
        res["rows"] += sweep(llm, args, batches, prompts, refs, "fixed")
        name = "adaptive" if isinstance(adaptive, AdaptiveLengths) else type(adaptive).__name__
        llm.executor.lengths = adaptive
        res["rows"] += sweep(llm, args, batches, prompts, refs, name)
        if args.gc_freeze:   # what LLM(gc_freeze=True) does once built (the adaptive policy keeps its estimates)
            gc.collect()
            gc.freeze()
            try:
                llm.executor.lengths = FixedLengths((args.num_tokens,))
                res["rows"] += sweep(llm, args, batches, prompts, refs, "fixed+frz")
                llm.executor.lengths = adaptive
                res["rows"] += sweep(llm, args, batches, prompts, refs, name + "+frz")
            finally:
                gc.unfreeze()
        res["proposal_mismatches"] = check_proposals(llm.drafter, V, args.num_tokens)
        print(f"[ngram_host] device proposals vs the plain scan: {res['proposal_mismatches']} rows differ",
              file=sys.stderr, flush=True)
    fails = report(res["rows"])
    if res["proposal_mismatches"]:
        fails.append(f"{res['proposal_mismatches']} n-gram proposals differ from the plain scan")
    for r in res["rows"]:
        r.pop("outputs", None)
    res["elapsed_s"] = time.perf_counter() - t0
    res["fails"] = fails
    print(f"\n{args.preset}, {res['config']['device_name']}, {dtype}, T={args.num_tokens}, oracle acceptance "
          f"{args.accept}, {args.max_tokens} tokens per request; "
          f"{res['elapsed_s']:.0f} s")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "gpu_ngram_host.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    for f in fails:
        print("FAIL:", f)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
