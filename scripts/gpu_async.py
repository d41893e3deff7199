"""Async scheduling: decode steps with the host work overlapped vs synchronous, TP=1 and TP=2.

The 2.7B random Mamba-2 preset (greedy-margin weights), bf16, replay decode, CUDA graphs, at
B = 1 / 64 / 256 (``--batches``), each TP size (``--tp``) in a process of its own
(``replayssm.bench.isolated``), and a hybrid row (``--hybrid``, default nemotron-h-4b at
B = 64, one GPU).  Per TP size: a synchronous engine and one with ``async_scheduling=True``
(``max(batches)`` slots each), one after the other in the same process, each timed at every
B on its decode steps alone: the requests are added and prefilled (their first token), then
the engine steps until all are done (every request ``--max-tokens`` tokens, ``ignore_eos``) between device syncs; ms per
step = that time / steps (all host work included: scheduling, output processing, under TP
the control message), tokens/s = decode tokens / that time; best of two runs after a warm
run.  ``graph ms``: the captured decode graph replayed back to back (``runner.replay_ms``:
the step's device time alone; the greedy-token graph where the engine uses it); ``host
ms`` = ms per step - graph ms (what the host adds per step; async scheduling should take
it towards 0).  ``overlap``: the share of decode steps that were launched before the
previous step's tokens were read.

Checks (exit status 1 when one fails): async tokens equal sync tokens exactly at every
(TP, B), the async rows really overlapped (more than half the steps).  Printed: TP=2 ÷
TP=1 tokens/s for sync and for async, and TP=2's agreement with TP=1's tokens.

``PYTHONPATH=. python scripts/gpu_async.py`` (two GPUs for ``--tp 1,2``; ~4 min); writes
``gpu_async.json`` under ``$OUT``.  A CPU smoke run of the script itself:
``PYTHONPATH=. python scripts/gpu_async.py --device cpu --preset tiny --hybrid nemotron-h-tiny
--batches 1,4 --max-tokens 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:5.0f}s] {msg}", flush=True)


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def _decode_run(llm, prompts, params, dev: str) -> dict:
    """Add ``prompts``, step until each has its first token (prefill), then time the decode
    steps to the end; ``{step_ms, decode_tokens_per_s, steps, outputs, overlapped}``."""
    seqs = [llm.add_request(p, params) for p in prompts]
    while any(not s.output_ids and not s.is_finished for s in seqs):
        llm._step()
    before = dict(llm.stats)
    done = sum(len(s.output_ids) for s in seqs)
    _sync(dev)
    t0 = time.perf_counter()
    steps = 0
    while llm.has_unfinished():
        llm._step()
        steps += 1
    _sync(dev)
    dt = time.perf_counter() - t0
    toks = sum(len(s.output_ids) for s in seqs) - done
    lagged = llm.stats.get("async_steps", 0) - before.get("async_steps", 0)
    return {"step_ms": 1e3 * dt / max(steps, 1), "decode_tokens_per_s": toks / dt, "steps": steps,
            "overlapped": lagged / max(steps, 1), "outputs": [list(s.output_ids) for s in seqs]}


def _engine_rows(model, label: str, batches, args, max_seq_len: int = 128) -> list[dict]:
    """A synchronous engine, then an async one (one at a time, ``max(batches)`` slots, graphs
    of every bucket captured once), each timed at every batch size."""
    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.bench.common import free_memory

    V = int(model.config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    cuda = args.device.startswith("cuda")
    out = []
    for asy in (False, True):
        with LLM(model, device=args.device, dtype="bfloat16" if cuda else "float32", decode_mode="replay",
                 max_num_seqs=max(batches), cuda_graphs=cuda, max_seq_len=max_seq_len, async_scheduling=asy) as llm:
            for B in batches:
                prompts = e2e._prompts(B, 32, V, seed=B)
                llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))   # compile, warm
                best = None
                for _ in range(2):
                    r = _decode_run(llm, prompts, params, args.device)
                    if best is None or r["step_ms"] < best["step_ms"]:
                        best = r
                greedy = bool(llm.runner.greedy_decode)
                graph_ms = float(llm.runner.replay_ms(B, 20, greedy=greedy))
                row = {"model": label, "async": asy, "batch": B, **best, "graph_ms": graph_ms,
                       "host_ms": best["step_ms"] - graph_ms, "greedy_token_graphs": greedy,
                       "capture_s": llm.capture_s}
                out.append(row)
                _log(f"{label} {'async' if asy else 'sync '} B={B}: {row['step_ms']:.2f} ms/step, graph "
                     f"{graph_ms:.2f} ms, host {row['host_ms']:.2f} ms, {row['decode_tokens_per_s']:.0f} tok/s, "
                     f"overlapped {row['overlapped']:.0%}")
        free_memory(args.device)
    return out


def _run_tp(path: str, tp: int, batches, args, hybrid_path: str | None) -> dict:
    """One TP size (a fresh process): load, then sync and async rows; TP=1 adds the hybrid row."""
    from replayssm.engine.loading import load

    t = time.perf_counter()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if tp == 1:
        model = load(path, dev, dtype, 1)[0]
    else:
        from replayssm.distributed import TensorParallelGroup

        group = TensorParallelGroup(tp, args.device)
        model = group.load_model(path, str(dtype).replace("torch.", ""))
        model.owns_group = True
    _log(f"TP={tp}: loaded in {time.perf_counter() - t:.1f} s")
    try:
        rows = _engine_rows(model, f"TP={tp}", batches, args)
    finally:
        if tp > 1:
            model.close()
    del model
    if tp == 1 and hybrid_path is not None:
        from replayssm.bench.common import free_memory

        free_memory(args.device)
        hyb = load(hybrid_path, dev, dtype, 1)[0]
        rows += _engine_rows(hyb, f"{args.hybrid} TP=1", [args.hybrid_batch], args)
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, each in its own process")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--preset", default="2.7b", help="random Mamba-2 preset (tiny: CPU smoke run)")
    ap.add_argument("--hybrid", default="nemotron-h-4b", help="hybrid preset of the one-GPU hybrid row ('none': skip)")
    ap.add_argument("--hybrid-batch", type=int, default=64)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    from replayssm.bench import e2e
    from replayssm.bench.hybrid_presets import random_hybrid_dir
    from replayssm.bench.isolated import run_isolated

    batches = [int(b) for b in a.batches.split(",")]
    tps = [int(t) for t in a.tp.split(",")]
    cuda = a.device.startswith("cuda")
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count(),
           "preset": a.preset, "hybrid": a.hybrid, "max_tokens": a.max_tokens, "rows": [], "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir(a.preset, tmp)
        hybrid_path = None if a.hybrid == "none" else random_hybrid_dir(a.hybrid, tmp)
        _log("checkpoints written")
        for tp in tps:
            r = run_isolated(_run_tp, path, tp, batches, a, hybrid_path if tp == 1 else None, timeout_s=400)
            if "error" in r:
                _log(f"TP={tp} failed: {r['error']}")
                res["errors"].append({"tp": tp, "error": r["error"]})
                continue
            res["rows"] += r["rows"]
    res["rows"].sort(key=lambda r: (r["model"], r["batch"], r["async"]))
    rows = {(r["model"], r["async"], r["batch"]): r for r in res["rows"]}
    ok = not res["errors"]
    print(f"\n{'model':<22}{'sched':<7}{'B':>5}{'ms/step':>9}{'graph ms':>10}{'host ms':>9}{'tok/s':>9}"
          f"{'overlap':>9}{'async÷sync':>12}{'= sync':>8}")
    for r in res["rows"]:
        base = rows.get((r["model"], False, r["batch"]))
        speed, same = "-", "-"
        if r["async"] and base is not None:
            speed = f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f}x"
            eq = r["outputs"] == base["outputs"]
            ok &= eq and r["overlapped"] > 0.5
            same = "yes" if eq else "NO"
        print(f"{r['model']:<22}{'async' if r['async'] else 'sync':<7}{r['batch']:>5}{r['step_ms']:>9.2f}"
              f"{r['graph_ms']:>10.2f}{r['host_ms']:>9.2f}{r['decode_tokens_per_s']:>9.0f}{r['overlapped']:>8.0%} "
              f"{speed:>11}{same:>8}")
    if 1 in tps and 2 in tps:
        print(f"\n{'B':>5}{'TP=2÷TP=1 sync':>16}{'TP=2÷TP=1 async':>17}{'TP=2 = TP=1 tokens':>20}")
        res["tp_ratios"] = []
        for B in batches:
            one = [rows.get(("TP=1", asy, B)) for asy in (False, True)]
            two = [rows.get(("TP=2", asy, B)) for asy in (False, True)]
            if None in one or None in two:
                continue
            rs = [t["decode_tokens_per_s"] / o["decode_tokens_per_s"] for o, t in zip(one, two)]
            pairs = list(zip(two[1]["outputs"], one[1]["outputs"]))
            agree = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
            res["tp_ratios"].append({"batch": B, "sync": rs[0], "async": rs[1], "tokens_agree": agree})
            print(f"{B:>5}{rs[0]:>15.3f}x{rs[1]:>16.3f}x{agree:>20}")
    for r in res["rows"]:
        r.pop("outputs")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "gpu_async.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"checks {'passed' if ok else 'FAILED'}; total {time.perf_counter() - T0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
