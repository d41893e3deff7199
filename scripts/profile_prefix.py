"""Where a prefix-cached chat turn's time goes: the store's checkpoint and resume calls.

Runs the ``bench e2e --workload chat`` pattern on a random-weight preset (``--conversations``
histories, each turn the whole history plus ``--turn-len`` new tokens, ``--max-tokens``
generated) with prefix caching on, twice (the second pass has no kernel compiles), and
prints per turn the wall time and the time inside each prefix-store call, measured with a
device sync before and after it:

* ``checkpoint_many`` -- the checkpoints a step's prefills took (slot copies, or folds of the
  stored entries; Mamba-2 rebuilds ``x, B`` from the conv inputs first: ``_fold_source``);
* ``load_many`` -- the step's resumes (fold into the nearest checkpoint, ring entries, conv
  windows; ``_apply``).

With ``--profile-turn K`` the second pass's turn K also runs under ``torch.profiler`` and the
top operators by device and by host time are printed (launch counts, syncs, copies).  The
timers and the profiler slow what they measure; compare turns, not absolute times.  Usage:

    python3 scripts/profile_prefix.py --preset nemotron-h-4b --profile-turn 1        # GPU
    python3 scripts/profile_prefix.py --preset nemotron-h-tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
import time

import torch

import replayssm.models.prefix as prefix_ops
from replayssm.bench.e2e import _random_model_dir
from replayssm.engine.config import SamplingParams
from replayssm.engine.llm import LLM

TIMED = ("checkpoint_many", "_checkpoint_wave", "_fold_source", "load_many", "_apply")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timers(device: str) -> tuple[dict, dict]:
    """Wrap the prefix-store functions (module attributes, looked up at call time) in synced
    timers; returns (seconds, calls) per name, cleared by the caller."""
    secs, calls = collections.defaultdict(float), collections.Counter()

    def wrap(name):
        f = getattr(prefix_ops, name)

        def timed(*a, **k):
            _sync(device)
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                _sync(device)
                secs[name] += time.perf_counter() - t
                calls[name] += 1
        setattr(prefix_ops, name, timed)

    for name in TIMED:
        wrap(name)
    return secs, calls


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
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    secs, calls = _timers(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(_random_model_dir(args.preset, tmp), device=args.device, dtype=dtype, decode_mode="replay",
                  max_num_seqs=max(args.conversations, 1), max_seq_len=args.max_seq_len,
                  cuda_graphs=args.cuda_graphs, enable_prefix_caching=True,
                  prefix_checkpoint_interval=args.checkpoint_interval)
        print(f"{args.preset} on {args.device} ({dtype}); checkpoint interval {llm.prefix_store.interval}")
        rng = random.Random(0)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for rep in range(2):
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
                _sync(args.device)
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                _sync(args.device)
                wall = time.perf_counter() - t
                if prof is not None:
                    prof.__exit__(None, None, None)
                parts = ", ".join(f"{k} {1e3 * v:.0f} ms x{calls[k]}" for k, v in secs.items())
                print(f"pass {rep} turn {turn} (prompt {len(prompts[0])}): {1e3 * wall:.0f} ms; {parts or 'no store calls'}",
                      flush=True)
                hist = [p + o.token_ids for p, o in zip(prompts, outs)]
                if prof is not None:
                    dev_key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
                    print(prof.key_averages().table(sort_by=dev_key, row_limit=20))
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
