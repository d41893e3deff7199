"""Capacity under load on one GPU: optimistic admission with preemption (``swap``) against
worst-case reservation, at one memory budget, through ``replayssm serve`` and ``bench serve``.

The random-weight ``nemotron-h-4b`` hybrid (bf16, CUDA graphs), requests that ask for
``--output-len`` (2048) tokens but stop at a position drawn from ``--stop-at`` (64..512) of
their greedy walk, all sent at once.  One ``--memory-budget`` for every server:
``--max-num-seqs`` (64) slots plus the blocks of ``--budget-seqs`` (12) worst-case requests.
Three servers (``bench serve --preemption-modes swap,off,off-fit``):

* ``swap``     optimistic admission, sequences swapped to host when the blocks run out;
* ``off``      worst-case reservation with the same slots: it admits ``--budget-seqs``;
* ``off-fit``  worst-case reservation with its slots sized to the budget (the most slots
               whose worst cases fit beside their fixed parts: no slot memory left idle).

Reported per server, from its ``/metrics`` sampled every 0.1 s during the load: peak and
time-averaged running sequences, preemptions, slots and blocks; requests sent / lost (lost:
ended without its stop or its full output); output tokens/s; mean / p99 TTFT and E2E; the
ratios swap / off and swap / off-fit against the target (>= 1.5x the concurrent sequences of
worst-case reservation at equal memory, no request lost), and whether the greedy outputs
are identical across servers.

    PYTHONPATH=. python scripts/gpu_capacity.py [--output-len 2048] [--num-prompts 200] [--budget-seqs 12]
        [--modes swap,off,off-fit] [--ssm-state-dtype bfloat16]

Needs the serve extra (fastapi, uvicorn, prometheus-client) and httpx: without them it says
so and exits 2.  Writes ``gpu_capacity.json`` and bench serve's files (serve.json, plots,
server logs) to ``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 1.5


def _missing() -> list[str]:
    return [m for m in ("fastapi", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]


def _f(v, spec=".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="nemotron-h-4b")
    p.add_argument("--modes", default="swap,off,off-fit")
    p.add_argument("--budget-seqs", type=int, default=12)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--stop-at", default="64,512")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--ssm-state-dtype", default="auto", help="the servers' SSM state dtype (bfloat16 halves a slot)")
    p.add_argument("--device", default=None, help="cpu: a mechanics check off the GPU machine (tiny preset)")
    args = p.parse_args(argv)
    missing = _missing()
    if missing:
        print(f"gpu_capacity: the serve extra is missing ({', '.join(missing)}): install fastapi, uvicorn, "
              f"prometheus-client and httpx (pip install 'replayssm[serve]', or wheels carried to this machine)",
              file=sys.stderr)
        return 2
    import torch

    from replayssm.bench.serve import main as bench_main
    from replayssm.engine.cache_plan import fmt_bytes

    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_capacity: no CUDA device (pass --device cpu for a mechanics check)", file=sys.stderr)
        return 2
    out_root = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_capacity_"))
    bench_out = out_root / "bench_capacity"
    bench_args = ["--preset", args.preset, "--configs", "replay", "--preemption-modes", args.modes,
                  "--budget-seqs", str(args.budget_seqs), "--max-num-seqs", str(args.max_num_seqs),
                  "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--stop-at", args.stop_at,
                  "--num-prompts", str(args.num_prompts), "--request-rates", args.request_rate, "--warmup", "8",
                  "--metrics-interval", "0.1", "--ssm-state-dtype", args.ssm_state_dtype, "--out", str(bench_out)]
    if args.device == "cpu":
        bench_args += ["--device", "cpu", "--torch-threads", "1"]
    print("[gpu_capacity] replayssm bench serve " + " ".join(bench_args), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rc = bench_main(bench_args)
    wall = time.perf_counter() - t0
    path = bench_out / "serve.json"
    if not path.exists():
        print(f"gpu_capacity: bench serve wrote no results (exit {rc}); logs in {bench_out}", file=sys.stderr)
        return 1
    res = json.loads(path.read_text())
    plans = res.get("memory_plans", {})
    rows = {name: rs[0] for name, rs in res["runs"].items()}
    device = torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu"
    summary = {"device": device, "preset": args.preset, "bench_args": bench_args, "bench_rc": rc, "wall_s": wall,
               "memory_budget": res["config"].get("memory_budget"), "plans": plans, "runs": rows,
               "capacity": res.get("capacity", []), "startup_s": res.get("startup_s", {})}
    print(f"\n== capacity at equal memory: {args.preset} on {device}; {args.num_prompts} requests at rate "
          f"{args.request_rate}, prompt {args.prompt_len}, max_tokens {args.output_len}, stops drawn in "
          f"[{args.stop_at}]; memory budget {fmt_bytes(summary['memory_budget'] or 0)} for each ==")
    hdr = (f"{'mode':<16}{'slots':>6}{'blocks':>7}{'worst':>6}{'peak':>6}{'mean':>7}{'preempt':>8}{'sent':>6}"
           f"{'lost':>5}{'out tok/s':>10}{'TTFT mean':>10}{'p99':>8}{'E2E mean':>10}{'p99':>8}")
    print(hdr)
    for name, r in rows.items():
        pl = plans.get(name, {})
        print(f"{name:<16}{_f(r.get('slots'), '.0f'):>6}{_f(r.get('kv_blocks'), '.0f'):>7}"
              f"{_f(pl.get('worst_case_seqs'), 'd'):>6}{_f(r['peak_running'], '.0f'):>6}{_f(r['mean_running']):>7}"
              f"{_f(r.get('preemptions'), '.0f'):>8}{r['sent']:>6}{r['lost']:>5}{_f(r['output_tokens_per_s'], '.0f'):>10}"
              f"{_f(r['mean_ttft_ms'], '.0f'):>10}{_f(r['p99_ttft_ms'], '.0f'):>8}{_f(r['mean_e2e_ms'], '.0f'):>10}"
              f"{_f(r['p99_e2e_ms'], '.0f'):>8}")
    print("(worst: sequences worst-case reservation admits at once in that plan; times in ms)")
    lost = sum(r["lost"] for r in rows.values())
    verdicts = []
    for c in summary["capacity"]:
        ok = c["mean_concurrency_ratio"] >= TARGET and lost == 0
        verdicts.append({"baseline": c["baseline"], "met": ok})
        same = {None: "not compared", 0: "identical"}.get(c["differing_outputs"], f"{c['differing_outputs']} differ")
        print(f"swap / {c['baseline']:<8} mean concurrency {_f(c['mean_concurrency_ratio'], '.2f')}x, peak "
              f"{_f(c['peak_concurrency_ratio'], '.2f')}x, output tok/s {_f(c['throughput_ratio'], '.2f')}x; "
              f"greedy outputs {same}; target >= {TARGET}x with no request lost: {'met' if ok else 'MISSED'}")
    print(f"requests lost: {lost} of {sum(r['sent'] for r in rows.values())}; wall {wall:.0f} s "
          f"(server starts {', '.join(f'{k} {v:.0f} s' for k, v in summary['startup_s'].items())})")
    summary["verdicts"] = verdicts
    (out_root / "gpu_capacity.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {out_root / 'gpu_capacity.json'}")
    return 0 if rc == 0 and lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
