"""Where the single-engine server's step loop waits: the engine on a thread of the API process
(``serve --engine-in-process``) against the engine in a process of its own (``--engine-process on``),
under many streaming clients.

For each configuration it starts ``replayssm serve``, runs ``--clients`` streaming completions at
once (``--rounds`` times, ``--max-tokens`` each, ``ignore_eos``) and splits the wall time of the
thread that steps the engine (the API process's busiest non-main thread in-process, the engine
process's main thread otherwise) with ``/proc/<pid>/task/<tid>/schedstat``:

* ``run``:   on a CPU;
* ``runq``:  runnable but waiting for a CPU (other processes: the OS, not the GIL);
* ``blocked``: neither: for a thread that always has a step to run this is the wait for the
  GIL (in-process: uvicorn, the SSE chunks, JSON and the engine thread take turns) or, in the
  engine process, on the pipe.

Per engine step: wall time, and each share, plus the API process's main-thread CPU and the
output tokens/s the clients saw.  A CPU-only microbenchmark (tiny model by default); on a
shared machine ``runq`` varies from run to run, ``blocked`` is the number to read.

    PYTHONPATH=. python scripts/profile_server_gil.py [--clients 32] [--max-tokens 64] [--device cpu]

Writes ``profile_server_gil.json`` to ``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sched(pid: int, tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable waiting for one) of thread ``tid``; (0, 0) when gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    out = []
    for tid in threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def truncated(model: str, layers: int, root: str) -> str:
    """A copy of ``model`` with its first ``layers`` layers only (``model`` itself for 0)."""
    import shutil

    from safetensors.torch import load_file, save_file

    cfg = json.loads((Path(model) / "config.json").read_text())
    if not layers or layers >= cfg["num_hidden_layers"]:
        return model
    d = Path(root) / f"{Path(model).name}-{layers}l"
    shutil.copytree(model, d, ignore=shutil.ignore_patterns("mtp*", "*.png", "*log*.json", "mtp_*"))
    cfg["num_hidden_layers"] = layers
    cfg.pop("num_nextn_predict_layers", None)
    (d / "config.json").write_text(json.dumps(cfg))
    keep = re.compile(r"\.layers\.(\d+)\.")
    for f in d.glob("*.safetensors"):
        sd = load_file(str(f))
        sd = {k: v for k, v in sd.items() if not keep.search(k) or int(keep.search(k).group(1)) < layers}
        save_file(sd, str(f), metadata={"format": "pt"})
    return str(d)


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


async def one(client, url: str, prompt: list, max_tokens: int) -> tuple[int, float | None, float]:
    """(completion tokens, time of the first chunk with text, time of the last) of one stream."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    first, last, n = None, None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = time.perf_counter()
            if first is None:
                first = last
            if '"usage": {' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
    return n, first, last


async def load(url: str, clients: int, rounds: int, max_tokens: int, prompt_len: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = []
        for r in range(rounds):
            prompts = [[(31 * (r * clients + i) + 7 * j) % 200 + 1 for j in range(prompt_len)] for i in range(clients)]
            results += await asyncio.gather(*(one(client, url, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    toks = sum(n for n, _, _ in results)
    tpots = sorted((b - a) / (n - 1) for n, a, b in results if n > 1 and a is not None)
    return {"tokens": toks, "wall_s": wall, "out_tok_s": toks / wall, "tpot_p50_ms": 1e3 * tpots[len(tpots) // 2]}


def run_config(mode: str, args, out: Path) -> dict:
    from replayssm.bench.serve import ServerProcess

    flags = ["--engine-process", mode, "--mode", args.mode, "--max-num-seqs", str(args.clients), "--max-queue", "100000",
             "--log-level", "warning", "--log-stats-interval", "0", "--device", args.device]
    if args.device == "cpu":
        flags += ["--torch-threads", str(args.torch_threads)]
    server = ServerProcess(args.model_dir, flags, out / f"server_{mode}.log")
    row: dict = {"engine_process": mode}
    try:
        url = server.wait(300)
        asyncio.run(load(url, args.clients, 1, 4, args.prompt_len))   # warm: first compiles, allocations
        api = server.proc.pid
        # every thread of the API process and its children (the engine process; the
        # multiprocessing resource tracker); after the run the busiest one other than the API
        # process's main thread is the one stepping the engine
        cand = [(pid, t) for pid in [api] + children(api) for t in threads(pid)]
        before = {k: sched(*k) for k in cand}
        api_main0 = sched(api, api)
        steps0, step_s0 = metric(url, "replayssm:engine_steps_total"), metric(url, "replayssm:engine_step_seconds_sum")
        t0 = time.perf_counter()
        res = asyncio.run(load(url, args.clients, args.rounds, args.max_tokens, args.prompt_len))
        wall = time.perf_counter() - t0
        after = {k: sched(*k) for k in cand}
        api_main1 = sched(api, api)
        steps = metric(url, "replayssm:engine_steps_total") - steps0
        step_s = metric(url, "replayssm:engine_step_seconds_sum") - step_s0
        tid = max((k for k in cand if k != (api, api)), key=lambda k: after[k][0] - before[k][0])
        row["engine_thread"] = "API process thread" if tid[0] == api else "engine process " + \
            ("main thread" if tid[0] == tid[1] else "thread")
        run = after[tid][0] - before[tid][0]
        runq = after[tid][1] - before[tid][1]
        blocked = max(wall - run - runq, 0.0)
        per = 1e3 / steps if steps else float("nan")
        row.update(res, steps=steps, wall_per_step_ms=wall * per, step_call_ms=step_s * per,
                   run_per_step_ms=run * per, runq_per_step_ms=runq * per, blocked_per_step_ms=blocked * per,
                   blocked_share=blocked / wall, api_main_cpu_s=api_main1[0] - api_main0[0])
    except Exception as e:  # report what was measured
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        server.stop()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "replayssm" / "assets" / "tiny-mamba2"))
    p.add_argument("--layers", type=int, default=1,
                   help="keep the model's first K layers (a copy; 0: all): a step of a few ms, as on a GPU")
    p.add_argument("--mode", default="recurrent", help="decode mode (the cheapest CPU step by default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gil_"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = truncated(args.model, args.layers, tmp)
        rows = [run_config(m, args, out) for m in ("off", "on")]
    (out / "profile_server_gil.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"profile_server_gil: {Path(args.model).name} ({args.layers or 'all'} layers, {args.mode}) on {args.device}, {args.clients} streaming clients x "
          f"{args.rounds} rounds, {args.max_tokens} tokens each; per engine step (ms): wall = run + runq + blocked")
    print(f"{'engine':>10}{'out tok/s':>11}{'TPOT p50':>10}{'steps':>7}{'wall':>8}{'step()':>8}{'run':>8}{'runq':>8}"
          f"{'blocked':>9}{'API main cpu s':>16}")
    for r in rows:
        name = "in-proc" if r["engine_process"] == "off" else "own proc"
        if "error" in r:
            print(f"{name:>10}  error: {r['error']}")
            continue
        print(f"{name:>10}{r['out_tok_s']:>11.0f}{r['tpot_p50_ms']:>10.2f}{r['steps']:>7.0f}{r['wall_per_step_ms']:>8.2f}"
              f"{r['step_call_ms']:>8.2f}{r['run_per_step_ms']:>8.2f}{r['runq_per_step_ms']:>8.2f}"
              f"{r['blocked_per_step_ms']:>9.2f}{r['api_main_cpu_s']:>16.1f}")
    print(f"wrote {out / 'profile_server_gil.json'}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
