"""Data-parallel serving on a multi-GPU machine: one engine in the API process
(``serve --engine-in-process``), one engine in a process of its own (``--engine-process on``,
the default on CUDA) and ``--data-parallel-size N`` (N = visible GPUs, or ``--dp``) on a
random-weight hybrid preset.

For each server it starts ``replayssm serve`` (CUDA graphs, warm-up), checks correctness
(greedy token ids of a few prompts, one at a time, identical across the three servers; with
N replicas, requests sharing a prefix all routed to one replica, read from ``/metrics``), then
runs ``replayssm bench serve --url`` at rate inf with ``--per-replica`` requests per replica
(each replica sees the same load as the single engine) and reports output tokens/s, the
ratios engine process / in-process and ``tok/s(N) / tok/s(1)`` (against both single-engine
servers; target ``>= 0.9 N`` against the engine process, the same machinery), plus the CPU
seconds of the API process, the engine processes and the benchmark client (a saturated API
or client process is what would cap the ratio).

    PYTHONPATH=. python scripts/gpu_dp.py [--preset nemotron-h-4b] [--dp N] [--only in-process,engine-process,dp,tp] [--tp 2]

``tp`` adds one server of one engine over ``--tp`` GPUs (``serve --tensor-parallel-size``),
measured the same way; its ratio is against the engine-process server on one GPU.

Needs the serve extra (fastapi, uvicorn, prometheus-client) and httpx: without them it says
so and exits 2.  Prints a table; writes ``gpu_dp.json`` (and the bench and server logs) to
``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _missing() -> list[str]:
    return [m for m in ("fastapi", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (from /proc; 0 when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _greedy(url: str, model: str, prompts: list, n: int) -> list:
    import httpx

    out = []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": n, "temperature": 0,
                                                      "ignore_eos": True, "return_token_ids": True}, timeout=300)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def _routed(url: str) -> dict:
    import httpx

    got = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("replayssm:dp_replica_requests_routed_total{"):
            rep = int(re.search(r'replica="(\d+)"', line).group(1))
            got[rep] = got.get(rep, 0.0) + float(line.rpartition(" ")[2])
    return got


#: the servers compared: (name, replicas or None for --dp, engine placement flags); "TP" is
#: one engine over ``--tp`` GPUs (``serve --tensor-parallel-size``), its flags set in main
SERVERS = (("in-process", 1, ["--engine-in-process"]), ("engine proc", 1, ["--engine-process", "on"]),
           ("DP", None, []), ("TP", 1, None))


def run_size(dp: int, model_dir: str, args, out: Path, name: str = "DP", where: tuple = ()) -> dict:
    from replayssm.bench.serve import ServerProcess, model_name
    from replayssm.bench.serve import main as bench_main

    flags = ["--data-parallel-size", str(dp), "--max-num-seqs", str(args.max_num_seqs), "--max-seq-len", "512",
             "--max-queue", "100000", "--log-level", "warning", "--log-stats-interval", "0", *where]
    if args.device == "cpu":   # a mechanics check off the GPU machine
        flags += ["--device", "cpu", "--torch-threads", "1"]
    tag = f"dp{dp}" + ("_" + name.replace(" ", "_").replace("-", "_") if dp == 1 else "")
    print(f"[gpu_dp] {name} (DP={dp}): replayssm serve {model_dir} {' '.join(flags)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    server = ServerProcess(model_dir, flags, out / f"server_{tag}.log")
    row: dict = {"server": name, "dp": dp}
    try:
        url = server.wait(args.server_timeout)
        row["startup_s"] = time.perf_counter() - t0
        name = model_name(url)
        row["greedy"] = _greedy(url, name, PROMPTS, 16)
        if dp > 1:   # prefix affinity: one shared 64-token prefix, 8 requests one after the other
            before = _routed(url)
            _greedy(url, name, [SHARED + [i + 1] for i in range(8)], 2)
            after = _routed(url)
            row["affinity_routes"] = {r: after[r] - before.get(r, 0.0) for r in after}
        pids = [server.proc.pid] + _children(server.proc.pid)
        cpu0 = {p: _cpu_s(p) for p in pids}
        client0 = time.process_time()
        n = args.per_replica * dp
        bench_out = out / f"bench_{tag}"
        rc = bench_main(["--url", url, "--configs", "replay", "--request-rates", "inf", "--num-prompts", str(n),
                         "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                         "--prompt-kind", "random", "--warmup", str(min(n, args.max_num_seqs * dp)),
                         "--out", str(bench_out), "--no-plot"])
        row["client_cpu_s"] = time.process_time() - client0
        cpu = {p: _cpu_s(p) - cpu0[p] for p in pids}
        row["api_cpu_s"] = cpu[server.proc.pid]
        row["replica_cpu_s"] = sum(v for p, v in cpu.items() if p != server.proc.pid)
        res = json.loads((bench_out / "serve.json").read_text())
        r = res["runs"]["server"][0]
        row.update(requests=n, failed=r["failed"], bench_rc=rc, out_tok_s=r["output_tokens_per_s"],
                   wall_s=r.get("duration_s"), ttft_p50_ms=r["p50_ttft_ms"], tpot_p50_ms=r["p50_tpot_ms"])
    except Exception as e:  # report what was measured
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        server.stop()
    return row


PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(24 + 5 * i)] for i in range(6)]
SHARED = [(11 * j) % 250 + 1 for j in range(64)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="nemotron-h-4b", help="a bench preset (random weights; a hybrid by default)")
    p.add_argument("--dp", type=int, default=None, help="replicas to compare with one (default: visible GPUs)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--per-replica", type=int, default=192, help="requests per replica in the timed run")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--only", default="in-process,engine-process,dp",
                   help="which servers to run, a comma list of in-process, engine-process, dp, tp (default: the first three)")
    p.add_argument("--tp", type=int, default=2, help="the TP server's tensor-parallel size (--only ...,tp)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: check the script's mechanics with a tiny preset (no timing claim)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_dp_"))
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"preset": args.preset, "args": vars(args)}
    only = {"in-process": "in-process", "engine-process": "engine proc", "dp": "DP", "tp": "TP"}
    bad = [x for x in args.only.split(",") if x not in only]
    if bad or not args.only:
        p.error(f"--only takes a comma list of {', '.join(only)}; got {args.only!r}")
    only = {only[x] for x in args.only.split(",")}
    missing = _missing()
    if missing:
        msg = (f"gpu_dp: cannot run: {', '.join(missing)} not installed (the serve extra: "
               f"pip install 'replayssm[serve]', or fastapi uvicorn prometheus-client httpx); nothing measured")
        print(msg)
        result["error"] = msg
        (out / "gpu_dp.json").write_text(json.dumps(result, indent=1))
        return 2
    import torch

    from replayssm.bench.e2e import _random_model_dir

    gpus = torch.cuda.device_count() if args.device == "cuda" else os.cpu_count()
    n = args.dp or gpus
    if "DP" in only and (n < 2 or n > gpus):
        msg = f"gpu_dp: needs --dp N with 2 <= N <= visible GPUs ({gpus}); got {n}"
        print(msg)
        result["error"] = msg
        (out / "gpu_dp.json").write_text(json.dumps(result, indent=1))
        return 2
    result["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)] if args.device == "cuda" else ["cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        print(f"[gpu_dp] writing a random-weight {args.preset}", file=sys.stderr, flush=True)
        model_dir = _random_model_dir(args.preset, tmp)
        result["write_s"] = time.perf_counter() - t0
        tp_flags = ["--tensor-parallel-size", str(args.tp)]
        rows = [run_size(size or n, model_dir, args, out, name, tp_flags if where is None else where)
                for name, size, where in SERVERS if name in only]
    result["rows"] = rows
    by = {r["server"]: r for r in rows}
    inproc, proc, many, tp = (by.get(k) for k in ("in-process", "engine proc", "DP", "TP"))
    ok = all("error" not in r for r in rows)
    if ok:
        result["greedy_identical"] = all(r["greedy"] == rows[0]["greedy"] for r in rows)

        def ratio(a, b):
            if a is None or b is None:
                return None
            return a["out_tok_s"] / b["out_tok_s"] if b["out_tok_s"] else float("nan")

        result["ratio_engine_process"] = ratio(proc, inproc)
        result["ratio"] = ratio(many, proc)
        result["ratio_vs_in_process"] = ratio(many, inproc)
        result["ratio_tp"] = ratio(tp, proc)
        if many is not None:
            routes = many.get("affinity_routes", {})
            result["affinity_one_replica"] = sorted(routes.values(), reverse=True)[:2] == [8.0, 0.0] \
                if len(routes) > 1 else None
            result["target"] = 0.9 * n
            if result["ratio"] is not None:
                result["meets_target"] = result["ratio"] >= 0.9 * n
    (out / "gpu_dp.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"gpu_dp: {args.preset} (random weights), {result['gpus'][0]} x{gpus}; rate inf, prompt {args.prompt_len}, "
          f"output {args.output_len}, {args.per_replica} requests and {args.max_num_seqs} slots per replica")
    print(f"{'server':>12}{'DP':>3}{'reqs':>6}{'fail':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"
          f"{'start s':>9}{'API cpu s':>10}{'engine cpu s':>13}{'client cpu s':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['server']:>12}{r['dp']:>3}  error: {r['error']}")
            continue
        print(f"{r['server']:>12}{r['dp']:>3}{r['requests']:>6}{r['failed']:>5}{r['out_tok_s']:>11.0f}"
              f"{r['ttft_p50_ms']:>10.0f}{r['tpot_p50_ms']:>10.2f}{r['startup_s']:>9.0f}{r['api_cpu_s']:>10.1f}"
              f"{r['replica_cpu_s']:>13.1f}{r['client_cpu_s']:>13.1f}")
    if ok:
        print(f"greedy tokens identical across {', '.join(r['server'] for r in rows)}: {result['greedy_identical']}")
        if many is not None:
            print(f"shared-prefix requests on one replica: {result['affinity_one_replica']} "
                  f"({many.get('affinity_routes')})")
        if result["ratio_engine_process"] is not None:
            print(f"throughput ratio engine process / in-process (DP=1): {result['ratio_engine_process']:.2f}")
        if result["ratio"] is not None:
            verdict = "met" if result["meets_target"] else "MISSED"
            if args.device == "cpu":
                verdict = "cpu: a mechanics check, no timing claim"
            print(f"throughput ratio DP={n} / DP=1 engine process: {result['ratio']:.2f} (target >= {0.9 * n:.1f}: "
                  f"{verdict})")
        if result["ratio_vs_in_process"] is not None:
            print(f"throughput ratio DP={n} / DP=1 in-process: {result['ratio_vs_in_process']:.2f}")
        if result["ratio_tp"] is not None:
            print(f"throughput ratio TP={args.tp} / one GPU (engine process): {result['ratio_tp']:.2f}")
    print(f"wrote {out / 'gpu_dp.json'}")
    return 0 if ok and result["greedy_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
