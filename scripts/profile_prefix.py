"""Where a prefix-cached chat turn's time goes: the store's checkpoint and resume calls.

Runs the ``bench e2e --workload chat`` pattern on a random-weight preset (``--conversations``
histories, each turn the whole history plus ``--turn-len`` new tokens, ``--max-tokens``
generated) with prefix caching on, after the engine's ``warm_up()``, twice (the second pass
from an empty store), driving the engine step by step as ``bench e2e`` does, and prints per
turn the time to first tokens (mean, and the last request's with the steps it took) and the
time inside each prefix-store call and engine part until the last first token, measured with
a device sync before and after it (``--no-caching``: the baseline's TTFT and steps only):

* ``checkpoint_many`` -- the checkpoints a step's prefills took (slot copies, or folds of the
  stored entries, ``_fold``; Mamba-2 computes ``x, B`` from the conv inputs inside it);
* ``load_many`` -- the step's resumes (fold into the nearest checkpoint, conv
  windows; ``_apply``);
* ``save_states`` -- the state points of a step's finished replies (the next turn resumes at
  a reply's end; ``--no-replies``: prompts only).

With ``--profile-turn K`` the second pass's turn K also runs under ``torch.profiler`` and the
top operators by device and by host time are printed (launch counts, syncs, copies).  The
timers and the profiler slow what they measure; compare turns, not absolute times.  Usage:

    python3 scripts/profile_prefix.py --preset nemotron-h-4b --cuda-graphs --profile-turn 1   # GPU
    python3 scripts/profile_prefix.py --preset nemotron-h-tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import random
import tempfile
import time

import torch

import replayssm.models.prefix as prefix_ops
from replayssm.bench.e2e import _random_model_dir
from replayssm.engine.config import SamplingParams
from replayssm.engine.llm import LLM

TIMED = ("checkpoint_many", "_checkpoint_wave", "_fold", "load_many", "_apply", "save_states")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(f, name: str, device: str, secs: dict, calls: dict):
    """``f`` with a device sync before and after each call, its seconds and calls counted
    under ``name``."""
    def timed(*a, **k):
        _sync(device)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _sync(device)
            secs[name] += time.perf_counter() - t
            calls[name] += 1
    return timed


def _timers(device: str) -> tuple[dict, dict]:
    """Wrap the prefix-store functions (module attributes, looked up at call time) in synced
    timers; returns (seconds, calls) per name, cleared by the caller."""
    secs, calls = collections.defaultdict(float), collections.Counter()
    for name in TIMED:
        setattr(prefix_ops, name, _timed(getattr(prefix_ops, name), name, device, secs, calls))
    return secs, calls


def _drive(llm, prompts, params, device: str, secs: dict) -> tuple[list, float, float, int, dict]:
    """Submit ``prompts`` together and step to the end, as ``bench e2e`` does; returns
    (sequences, mean and last seconds to a first token, steps until every request had one,
    the timers' seconds spent in those steps)."""
    _sync(device)
    t0 = time.perf_counter()
    seqs = [llm.add_request(p, params) for p in prompts]
    first, steps, upto = {}, 0, {}
    while llm.has_unfinished():
        llm.step()
        if len(first) < len(seqs):
            steps += 1
            now = time.perf_counter()
            for s in seqs:
                if s.output_ids and id(s) not in first:
                    first[id(s)] = now - t0
            if len(first) == len(seqs):
                upto = dict(secs)
    ttft = list(first.values())
    return seqs, sum(ttft) / len(ttft), max(ttft), steps, upto


def _compiled_since(t0: float) -> list[str]:
    """Names of the Triton kernels whose cache entries appeared since ``t0`` (wall clock)."""
    root = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    names = []
    for f in glob.glob(os.path.join(root, "*", "*.json")):
        if os.path.getmtime(f) >= t0 and not os.path.basename(f).startswith("__grp__"):
            names.append(os.path.basename(f)[:-5])
    return sorted(names)


def _engine_timers(llm, device: str, secs: dict, calls: dict) -> None:
    """Synced timers around the engine's parts of a step (instance attributes)."""
    parts = [(llm.prefix_cache, "resume"), (llm.runner, "prefill"), (llm.executor, "decode"), (llm.scheduler, "schedule"),
             (llm, "_postprocess"), (llm.prefix_cache, "after_prefill"), (llm.prefix_cache, "write_checkpoints")]
    for obj, name in parts:
        setattr(obj, name, _timed(getattr(obj, name), name, device, secs, calls))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="nemotron-h-4b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=4288)
    ap.add_argument("--checkpoint-interval", type=int, default=None, help="default: the engine's rule")
    ap.add_argument("--profile-turn", type=int, default=None, help="profile this turn of the second pass")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--no-caching", action="store_true", help="prefix caching off (the baseline's steps)")
    ap.add_argument("--no-replies", action="store_true", help="cache prompts only, not finished replies")
    ap.add_argument("--compiles", action="store_true",
                    help="print the Triton kernels compiled during each turn (read from $TRITON_CACHE_DIR, "
                         "which should start empty)")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    secs, calls = _timers(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(_random_model_dir(args.preset, tmp), device=args.device, dtype=dtype, decode_mode="replay",
                  max_num_seqs=max(args.conversations, 1), max_seq_len=args.max_seq_len,
                  cuda_graphs=args.cuda_graphs, enable_prefix_caching=not args.no_caching,
                  prefix_checkpoint_interval=None if args.no_caching else args.checkpoint_interval,
                  prefix_cache_replies=not args.no_replies)
        if not args.no_caching:
            _engine_timers(llm, args.device, secs, calls)
        llm.warm_up()
        interval = llm.plan.prefix_store.interval if llm.plan.prefix_store is not None else None
        print(f"{args.preset} on {args.device} ({dtype}); checkpoint interval {interval}")
        rng = random.Random(0)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for rep in range(2):
            if rep and not args.no_caching:            # the second pass starts from an empty store
                while llm.prefix_cache.index.evict_one():
                    pass
            hist = [[] for _ in range(args.conversations)]
            for turn in range(args.turns):
                prompts = [h + [rng.randrange(llm.vocab_size) for _ in range(args.turn_len)] for h in hist]
                secs.clear()
                calls.clear()
                prof = None
                if rep == 1 and turn == args.profile_turn:
                    acts = [torch.profiler.ProfilerActivity.CPU]
                    if args.device.startswith("cuda"):
                        acts.append(torch.profiler.ProfilerActivity.CUDA)
                    prof = torch.profiler.profile(activities=acts)
                    prof.__enter__()
                t, t_wall = time.perf_counter(), time.time()
                seqs, mean, last, steps, upto = _drive(llm, prompts, params, args.device, secs)
                wall = time.perf_counter() - t
                if prof is not None:
                    prof.__exit__(None, None, None)
                parts = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in sorted(upto.items(), key=lambda kv: -kv[1]))
                print(f"pass {rep} turn {turn} (prompt {len(prompts[0])}): TTFT mean {1e3 * mean:.0f} ms, "
                      f"last {1e3 * last:.0f} ms in {steps} steps [{parts or 'untimed'}]; turn {1e3 * wall:.0f} ms",
                      flush=True)
                if args.compiles:
                    print("  compiled:", _compiled_since(t_wall) or "nothing")
                hist = [p + list(s.output_ids) for p, s in zip(prompts, seqs)]
                if prof is not None:
                    dev_key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
                    print(prof.key_averages().table(sort_by=dev_key, row_limit=20))
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
