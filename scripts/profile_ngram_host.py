"""Host time of the n-gram drafter's ``propose`` per step, on the CPU (no model, no GPU).

``B`` sequences (prompts of ``--prompt-len``; outputs grow by 1..``--num-tokens`` tokens a
step, ~3 on average, as verify steps at acceptance 0.7 keep them) of random or repetitive
token streams; every step calls ``propose`` on:

* ``ngram``: :class:`NgramDrafter` alone (what the engine runs);
* ``oracle``: the bench's :class:`OracleDrafter` alone (gpu_mtp.py's proposal source);
* ``oracle(ngram)``: :class:`OracleTokens` around both, what gpu_mtp.py's ``TimedDrafter``
  times as "host ms" (the n-gram drafter's work plus the oracle's);

and prints ms per step (median and max over the steps), the full garbage collections the
run saw with their longest pause, and with ``--profile`` the top cProfile entries of the
``ngram`` variant.  ``--check`` compares every proposal with the plain reference
(:func:`ngram_continuations`)::

    PYTHONPATH=. python scripts/profile_ngram_host.py --batch 256 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time

import torch

from replayssm.bench.e2e import OracleDrafter, OracleTokens
from replayssm.engine.config import SamplingParams
from replayssm.engine.sequence import Sequence
from replayssm.engine.spec.ngram import NgramDrafter, ngram_continuations


def _streams(B: int, P: int, total: int, vocab: int, repetitive: bool, seed: int) -> list[list[int]]:
    """``B`` token streams of ``P + total`` tokens: a motif of 8 repeated (with a token in 16
    changed) or uniform random tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(B):
        if repetitive:
            motif = [rng.randrange(vocab) for _ in range(8)]
            s = [motif[i % 8] if rng.random() > 1 / 16 else rng.randrange(vocab) for i in range(P + total)]
        else:
            s = [rng.randrange(vocab) for _ in range(P + total)]
        out.append(s)
    return out


def run(drafter_kind: str, B: int, P: int, max_tokens: int, k: int, repetitive: bool, vocab: int = 151_936,
        check: bool = False, profile: bool = False, seed: int = 0) -> dict:
    """Steps until every row is done; returns per-step host ms and GC pauses."""
    streams = _streams(B, P, max_tokens, vocab, repetitive, seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [Sequence(s[:P], params) for s in streams]
    for s, st in zip(seqs, streams):
        s.output_ids.append(st[P])   # the prefill's token
    refs = {tuple(st[:P]): st[P:] for st in streams}
    ngram = NgramDrafter(k, 1, 3, "cpu")
    oracle = OracleDrafter(refs, k, 0.7, vocab, "cpu")
    drafter = {"ngram": ngram, "oracle": oracle, "oracle(ngram)": OracleTokens(ngram, oracle)}[drafter_kind]
    rng = random.Random(seed + 1)
    pauses: list[float] = []
    t_gc = [0.0]

    def on_gc(phase, info):
        if info.get("generation") != 2:
            return
        if phase == "start":
            t_gc[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - t_gc[0])

    drafter.prefill(seqs)   # the engine indexes the prompts at the prefill, outside the steps
    gc.callbacks.append(on_gc)
    prof = cProfile.Profile() if profile else None
    times, bad = [], 0
    try:
        while True:
            live = [s for s in seqs if s.remaining > 0]
            if not live:
                break
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            prop = drafter.propose(live, k)
            times.append(time.perf_counter() - t0)
            if prof:
                prof.disable()
            if check and drafter_kind == "ngram":
                bad += _check(live, prop, k)
            for s in live:
                st = refs[tuple(s.prompt_ids)]
                n = min(rng.randint(1, k + 1), s.remaining)
                s.output_ids.extend(st[len(s.output_ids):len(s.output_ids) + n])
    finally:
        gc.callbacks.remove(on_gc)
    out = {"drafter": drafter_kind, "batch": B, "repetitive": repetitive, "steps": len(times),
           "median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times),
           "max_ms": 1e3 * max(times), "full_gcs": len(pauses), "max_gc_ms": 1e3 * max(pauses, default=0.0),
           "mismatches": bad}
    if prof:
        out["profile"] = prof
    return out


def _check(seqs, prop, k) -> int:
    """Rows whose proposal differs from :func:`ngram_continuations` (the plain reference)."""
    bad = 0
    toks = None if prop is None else prop.tokens.tolist()
    valid = None if prop is None else prop.valid.tolist()
    for b, s in enumerate(seqs):
        ids = s.prompt_ids + s.output_ids
        length = min(k, max(s.remaining - 1, 0))
        ref = ngram_continuations(ids, 1, 3, length, 1) if length > 0 else []
        want = ref[0] if ref else []
        got = [] if toks is None else [t for t, v in zip(toks[b][1:], valid[b][1:]) if v]
        if got != want or (toks is not None and toks[b][0] != s.last_token):
            bad += 1
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-tokens", type=int, default=4)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--drafters", default="ngram,oracle,oracle(ngram)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'drafter':<15}{'stream':<12}{'B':>5}{'steps':>7}{'median ms':>11}{'mean ms':>9}{'max ms':>9}"
          f"{'full gc':>8}{'gc max ms':>10}{'mism':>6}")
    profiled = None
    for kind in args.drafters.split(","):
        for rep in (False, True):
            r = run(kind, args.batch, args.prompt_len, args.max_tokens, args.num_tokens, rep, check=args.check,
                    profile=args.profile and kind == "ngram" and rep)
            profiled = r.get("profile") or profiled
            print(f"{kind:<15}{'repetitive' if rep else 'random':<12}{r['batch']:>5}{r['steps']:>7}"
                  f"{r['median_ms']:>11.3f}{r['mean_ms']:>9.3f}{r['max_ms']:>9.2f}{r['full_gcs']:>8}"
                  f"{r['max_gc_ms']:>10.2f}{r['mismatches']:>6}")
    if profiled is not None:
        print("\n== cProfile: ngram, repetitive streams")
        pstats.Stats(profiled, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
