"""Tensor-parallel startup on two GPUs: TP=1 vs TP=2, phase by phase.

For the shipped tiny Mamba-2 and the random-weight 2.7B preset, each configuration starts in
a fresh process (so nothing compiled or loaded in one run helps the next, except Triton's
disk cache: round 1 runs with an empty one, round 2 with the one round 1 filled) and times

* ``imports``: the process start and ``import torch, replayssm`` (from the parent's clock);
* TP=1: ``load`` (``engine.loading.load``), ``llm`` (``LLM(...)``: caches, CUDA graphs);
* TP=2: ``group`` (``TensorParallelGroup(2, "cuda:0")``), ``load`` (``group.load_model``),
  ``llm``; plus every rank's phases from ``group.startup_times`` (worker process start and
  imports, CUDA and NCCL init, the all-reduce's symmetric-memory setup, shard read, copy to
  the device, cache making, graph capture, Triton compiles);
* ``ready``: process start to a built engine; ``ld+cap``: the group's start, the load and
  the engine (caches, CUDA graph capture) — what the target compares (TP=2 under 2x
  TP=1); then it generates 16 greedy tokens for 4
  prompts, and TP=2's tokens are compared with TP=1's (the 2.7B preset's lm_head is a
  permutation of its embedding: greedy tokens are far from ties, so they must match).

``PYTHONPATH=. python scripts/gpu_tp_startup.py`` (two GPUs; ``--budget-s`` stops starting
runs past that wall time, default 150: about 3 minutes in all; ``--device cpu --models
tiny`` is a smoke test without GPUs).  Prints a row per run, each TP=2 run's per-rank
phases and each pair's ratios; writes ``gpu_tp_startup.json`` under ``$OUT`` (or ``--out``).
The 2.7B checkpoint is written once under ``--ckpt-dir`` and reused by later calls.  A
child prints its result before the group's teardown and then ends (``os._exit``): a
teardown given up cannot hold the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# top-level imports stay stdlib-only: a TP=2 child's worker re-imports this module (spawn)

PROMPTS = [[5, 17, 99, 3], [11, 12, 13, 14, 15, 16], [200, 7], [42] * 9]
LLM_KW = {"decode_mode": "replay", "max_num_seqs": 64, "max_seq_len": 256, "cuda_graphs": True}


def child(tp: int, path: str, t_spawn: float, device: str) -> dict:
    """One run in this (fresh) process; returns the timings and the greedy tokens."""
    t_main = time.time()
    import torch

    from replayssm import LLM, SamplingParams
    from replayssm.distributed import TensorParallelGroup
    from replayssm.distributed.startup import (
        StartupTimes,
        activate,
        watch_triton_compiles,
    )
    from replayssm.engine.loading import load

    out = {"tp": tp, "imports": time.time() - t_spawn, "imports_in_process": time.time() - t_main}
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    watch_triton_compiles()
    own = StartupTimes()
    activate(own)                      # TP=1's compiles; a TP=2 group activates its own
    t0 = time.perf_counter()
    group = None
    if tp == 1:
        model = load(path, dev, torch.bfloat16, 1)[0]
        sync()
    else:
        group = TensorParallelGroup(tp, dev)
        out["group"] = time.perf_counter() - t0
        model = group.load_model(path, "bfloat16")
        sync()
        fin = model.local.tp_fused      # the setup ran beside the reading: did it still succeed?
        out["allreduce"] = model.local.tp.allreduce.method
        out["fused"] = "off" if fin is None else ("on" if fin.ok else f"unavailable: {fin.why_not}")
    t1 = time.perf_counter()
    out["load"] = t1 - t0 - out.get("group", 0.0)
    llm = LLM(model, device=dev, dtype="bfloat16", **dict(LLM_KW, cuda_graphs=cuda))
    sync()
    t2 = time.perf_counter()
    out["llm"], out["capture"] = t2 - t1, llm.capture_s
    out["ready"] = time.time() - t_spawn
    if group is not None:
        out["ranks"] = {str(r): v for r, v in group.startup_times.items()}
        out["triton_compile"] = out["ranks"]["0"].get("triton_compile", 0.0)
    else:
        out["triton_compile"] = own.as_dict().get("triton_compile", 0.0)
    out["load_capture"] = out.get("group", 0.0) + out["load"] + out["llm"]   # from the call to a ready engine
    res = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    out["tokens"] = [list(r.token_ids) for r in res]
    return out


def run_child(tp: int, path: str, env: dict, timeout_s: float, device: str) -> dict:
    t = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--device", device, "--child", str(tp), path, repr(t)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"tp": tp, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"tp": tp, "error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def _checkpoint(name: str, root: str) -> str:
    """The random preset ``name``'s checkpoint under ``root``, written once (the 2.7B preset
    takes ~26 s) and reused by later calls; a half-written one is written again."""
    import shutil

    from replayssm.bench.e2e import _random_model_dir

    done = os.path.join(root, f"{name}.complete")
    if os.path.exists(done):
        with open(done) as f:
            path = f.read().strip()
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    where = os.path.join(root, name)
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    path = _random_model_dir(name, where)
    with open(done, "w") as f:
        f.write(path)
    return path


def _row(model: str, rnd: int, r: dict) -> str:
    if "error" in r:
        return f"{model:<6}{rnd:>3}{r['tp']:>4}  ERROR {r['error'][-600:]}"
    def f(k):
        return f"{r[k]:>8.1f}" if k in r else f"{'-':>8}"

    return f"{model:<6}{rnd:>3}{r['tp']:>4}" + "".join(f(k) for k in
                                                      ("imports", "group", "load", "llm", "capture",
                                                       "triton_compile", "ready", "load_capture"))


def _ranks_table(ranks: dict) -> str:
    from replayssm.distributed.startup import format_times

    return format_times({int(k): v for k, v in ranks.items()}, "  per-rank phases (s)")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", nargs=3, metavar=("TP", "PATH", "T_SPAWN"))
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--device", default="cuda:0", help="rank 0's device (cpu: a smoke test, no graphs)")
    p.add_argument("--models", default="tiny,2.7b")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "replayssm-tp-startup"),
                   help="where the random presets' checkpoints are written once and reused by later calls")
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(int(a.child[0]), a.child[1], float(a.child[2]), a.device)), flush=True)
        # the result is out: end now, whatever the group's teardown would do (a teardown given
        # up leaves torch.distributed initialised; the workers see their driver gone and exit)
        sys.stderr.flush()
        os._exit(0)

    t_start = time.perf_counter()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res: dict = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton-cache"))
        models = []
        for name in a.models.split(","):
            if name == "tiny":
                models.append((name, os.path.join(here, "replayssm", "assets", "tiny-mamba2")))
                continue
            t = time.perf_counter()
            models.append((name, _checkpoint(name, a.ckpt_dir)))
            res[f"write_checkpoint_s_{name}"] = time.perf_counter() - t
            print(f"{name} checkpoint ready in {time.perf_counter() - t:.1f} s ({models[-1][1]})", flush=True)
        head = f"{'model':<6}{'rnd':>3}{'tp':>4}" + "".join(f"{h:>8}" for h in (
            "imports", "group", "load", "llm", "capture", "compile", "ready", "ld+cap"))
        print("seconds; round 1: empty Triton cache, round 2: warm; ready = process start to built engine")
        print(head, flush=True)
        for rnd in range(1, a.rounds + 1):
            for name, path in models:
                pair = {}
                for tp in (1, 2):
                    left = a.budget_s - (time.perf_counter() - t_start)
                    if left < 15:
                        res.setdefault("stopped", f"budget: skipped from {name} round {rnd} TP={tp}")
                        break
                    r = run_child(tp, path, env, max(30.0, left + 60), a.device)
                    r.update(model=name, round=rnd)
                    res["runs"].append(r)
                    pair[tp] = r
                    print(_row(name, rnd, r), flush=True)
                    if tp == 2 and "ranks" in r:
                        print(f"  all-reduce {r.get('allreduce')}, fused finish {r.get('fused')}", flush=True)
                        print(_ranks_table(r["ranks"]), flush=True)
                if 1 in pair and 2 in pair and "tokens" in pair[1] and "tokens" in pair[2]:
                    same = pair[1]["tokens"] == pair[2]["tokens"]
                    ratio = pair[2]["ready"] / pair[1]["ready"]
                    load_ratio = (pair[2]["group"] + pair[2]["load"]) / pair[1]["load"]
                    lc_ratio = pair[2]["load_capture"] / pair[1]["load_capture"]
                    res.setdefault("pairs", []).append({"model": name, "round": rnd, "tokens_match": same,
                                                        "ready_ratio": ratio, "load_ratio": load_ratio,
                                                        "load_capture_ratio": lc_ratio,
                                                        "tp2_load_capture_s": pair[2]["load_capture"]})
                    print(f"  {name} round {rnd}: load+capture TP=2 / TP=1 = {lc_ratio:.2f}x "
                          f"({pair[2]['load_capture']:.1f} s vs {pair[1]['load_capture']:.1f} s; target < 2x); "
                          f"ready (from process start) {ratio:.2f}x; group+load / load = {load_ratio:.2f}x; "
                          f"greedy tokens {'match' if same else 'DIFFER'}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_tp_startup.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    bad = [q for q in res.get("pairs", []) if q["model"] != "tiny" and not q["tokens_match"]]
    return 1 if bad or any("error" in r for r in res["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
