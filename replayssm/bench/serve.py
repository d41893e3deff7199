"""``replayssm bench serve``: a serving benchmark against the OpenAI-compatible server.

Like ``vllm bench serve``: requests arrive as a Poisson process at each of
``--request-rates`` (``inf``: all at once), each a streaming ``/v1/completions`` call with a
fixed prompt and output length (``--prompt-len`` / ``--output-len``, or per request from a
JSONL ``--dataset`` with ``prompt`` (text or token ids) and optionally ``output_len``).
Per rate it reports request throughput, output tokens/s, TTFT, TPOT (time per output token
after the first) and ITL (gap between two streamed chunks; a speculative step's several
tokens arrive in one chunk) at p50/p90/p99, and the mean accepted length read from the
server's ``/metrics``.

It starts the server itself, once per configuration, and compares configurations in one
run (``--configs``):

* ``replay``      replay-buffer decoding
* ``replay+spec`` replay decoding with speculation (``--spec-method``, default n-gram)
* ``recurrent``   the recurrent form (standard decoding: state read and written per token)
* ``snapshot``    recurrent form with speculation (one stored state per draft: what
                  vLLM/SGLang do for SSM speculation)

Without ``--model`` a random-weight model of ``--preset`` size is written first (the presets
of ``bench e2e``: Mamba-2 sizes, ``nemotron-h-4b``, ``qwen3-next-4b`` and their tiny twins).  Its
greedy next token is a fixed permutation of the current one, so ``--prompt-kind walk`` (the
default for presets) builds prompts ``A + A[:k]`` from greedy walks ``A`` of the model
itself: prompt lookup then finds the continuation, as on repetitive real text, and both
speculative configurations see the same drafts.
``--prompt-kind random`` gives prompts where nothing is found (speculation overhead only).
``--stop-at LO,HI`` (walk prompts) makes an early-stop workload: every request still asks for
``--output-len`` tokens (what an admission that reserves the worst case must hold room for)
but carries ``stop_token_ids`` with the walk's token at a position drawn uniformly from
``[LO, HI]``, so under greedy decoding it ends there (or earlier, where the walk repeats
that token), as chat replies end long before their ``max_tokens``.
``--preemption-modes swap,off,off-fit`` runs each configuration once per admission policy at
one memory budget (``--budget-seqs N``: the slots plus N worst-case requests) and compares
how many sequences each server holds at once (:mod:`replayssm.bench.capacity`).  The
server's running gauge is sampled from ``/metrics`` during every load (``--metrics-interval``),
and a request that ends without its stop or its full output counts as lost.
``--url`` benchmarks a server that is already running (one configuration).  Engine flags go
to the servers it starts, ``--data-parallel-size N`` (N replicas behind one endpoint) included.

Writes ``serve.json`` and ``serve.png`` (TTFT / TPOT / output tokens/s against the rate) to
``--out``.  ``--smoke`` is a small CPU run for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..argtypes import nonnegative_float, nonnegative_int, positive_float, positive_int
from ..server.cli import add_engine_args
from .capacity import (PREEMPTION_CONFIGS, compare, concurrency, engine_config, format_tables, lost, meta_model,
                       outputs_digest, plan_budget, plot_running, sample_running, server_dtype, size_budget)
from .e2e import PRESETS, _random_model_dir
from .hybrid_presets import HYBRID_PRESETS, TINY_OF

CONFIGS = {
    "replay": dict(mode="replay", spec=False),
    "replay+spec": dict(mode="replay", spec=True),
    "recurrent": dict(mode="recurrent", spec=False),
    "snapshot": dict(mode="recurrent", spec=True),
}


# ---- the server process ------------------------------------------------------------------------
class ServerProcess:
    """``replayssm serve`` in a subprocess on 127.0.0.1, an ephemeral port."""

    def __init__(self, model: str, flags: list[str], log_path: Path):
        cmd = [sys.executable, "-m", "replayssm", "serve", model, "--port", "0", *flags]
        self.log_path = log_path
        self._log = open(log_path, "w")
        root = str(Path(__file__).resolve().parents[2])    # this replayssm, whatever the cwd
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if self.url is None and "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    def wait(self, timeout: float) -> str:
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"server did not start (log {self.log_path}):\n{tail}")
        return self.url

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def engine_flags(args, mode: str, spec: bool) -> list[str]:
    """Server flags: every engine option given to the benchmark, plus the configuration's."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    out = ["--mode", mode, "--max-queue", str(100_000), "--log-level", "warning"]
    for a in p._actions:
        if a.dest in ("mode", "speculative", "speculative_config", "help") or not a.option_strings:
            continue
        v = getattr(args, a.dest, a.default)
        if v == a.default or v is None:
            continue
        flag = a.option_strings[0]
        out += [flag] if isinstance(v, bool) else [flag, str(v)]
    if spec:
        out += ["--speculative", args.spec_method]
    return out


# ---- requests --------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    error: str = ""
    finish_reason: str = ""
    token_ids: list = field(default_factory=list)   # with return_ids (servers bench serve started)


async def one_request(client, url: str, model: str, prompt, output_len: int, temperature: float,
                      stop_token_ids: list[int] | None = None, return_ids: bool = False) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    if return_ids:   # our server's extension: each chunk's token ids
        body["return_token_ids"] = True
    r = Result()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = chunk["error"].get("message", "error")
                    return r
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                    r.prompt_len = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices"):
                    ch = chunk["choices"][0]
                    r.finish_reason = ch.get("finish_reason") or r.finish_reason
                    r.token_ids += ch.get("token_ids") or []
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
        r.latency = time.perf_counter() - t0
        r.ok = r.output_tokens > 0
        if not r.ok:
            r.error = "no tokens"
    except Exception as e:  # a failed request is counted, not fatal
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_rate(url: str, model: str, requests: list, rate: float, temperature: float, seed: int,
                   max_concurrency: int | None, desc: str, return_ids: bool = False, metrics_every: float = 0.0,
                   samples: list | None = None) -> tuple[list[Result], float]:
    """Send ``requests`` ``[(prompt, output_len[, stop_token_ids])]`` with Poisson arrivals at
    ``rate`` per second.  With ``metrics_every > 0`` the server's running / waiting gauges are
    sampled that often while the load runs, into ``samples`` (:func:`capacity.sample_running`)."""
    import httpx

    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _progress(len(requests), desc)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        async def send(p, n, stop):
            if sem is None:
                res = await one_request(client, url, model, p, n, temperature, stop, return_ids)
            else:
                async with sem:
                    res = await one_request(client, url, model, p, n, temperature, stop, return_ids)
            bar.update(1)
            return res

        tasks = []
        t0 = time.perf_counter()
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_running(client, url, metrics_every, done, t0)) \
            if metrics_every > 0 else None
        for i, (p, n, *stop) in enumerate(requests):
            tasks.append(asyncio.create_task(send(p, n, stop[0] if stop else None)))
            if math.isfinite(rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
        if sampler is not None:
            done.set()
            got = await sampler
            if samples is not None:
                samples.extend(got)
    bar.close()
    return results, dur


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def _pct(xs: list, q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[Result], dur: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    row = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": dur,
           "request_throughput": len(ok) / dur, "output_tokens_per_s": out_tokens / dur,
           "total_tokens_per_s": (out_tokens + sum(r.prompt_len for r in ok)) / dur,
           "output_tokens": out_tokens, "errors": sorted({r.error for r in results if not r.ok})[:5]}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", [r.latency for r in ok])):
        row[f"mean_{name}_ms"] = 1000 * sum(xs) / len(xs) if xs else float("nan")
        for q in (50, 90, 99):
            row[f"p{q}_{name}_ms"] = 1000 * _pct(xs, q)
    return row


def scrape(url: str) -> dict:
    """The server's metrics by name (labels dropped, finish reasons summed); histogram
    buckets as ``name{le=X}``."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, val = line.rpartition(" ")
            base = name.split("{")[0]
            if 'le="' in name:
                base += "{le=" + name.split('le="')[1].split('"')[0] + "}"
            out[base] = out.get(base, 0.0) + float(val) if "finished_reason" in name else float(val)
    return out


SLOW_STEP_S = 0.5   # a step longer than this stalls every stream in flight (bench serve reports them)


def step_counts(before: dict, after: dict) -> tuple[int, int]:
    """``(engine steps, steps longer than SLOW_STEP_S)`` between two scrapes."""
    name = "replayssm:engine_step_seconds"
    d = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    steps = d(name + "_count")
    return int(steps), int(steps - d(f"{name}_bucket{{le={SLOW_STEP_S}}}"))


def model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# ---- prompts ---------------------------------------------------------------------------------------
def load_dataset(path: str, n: int, default_out: int) -> list:
    reqs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            reqs.append((d["prompt"], int(d.get("output_len", default_out))))
            if len(reqs) == n:
                break
    if not reqs:
        raise ValueError(f"{path}: no requests (JSONL lines with a 'prompt')")
    while len(reqs) < n:
        reqs += reqs[: n - len(reqs)]
    return reqs


def make_prompts(args, url: str, model: str, vocab: int) -> list:
    """``[(prompt token ids, output_len)] * num_prompts`` for the chosen prompt kind."""
    rng = random.Random(args.seed)
    P, out_len, n = args.prompt_len, args.output_len, args.num_prompts
    if args.prompt_kind == "random":
        return [([rng.randrange(vocab) for _ in range(P)], out_len) for _ in range(n)]
    if args.prompt_kind == "motif":
        out = []
        for _ in range(n):
            motif = [rng.randrange(vocab) for _ in range(8)]
            out.append(((motif * (P // 8 + 1))[:P], out_len))
        return out
    # walk: A + A[:k] with A a greedy walk of a tokens: the greedy continuation is A[k:], which
    # prompt lookup finds in the first copy.  It covers the output when a - k >= output_len,
    # i.e. a >= (P + output_len) / 2; k stays >= 1 (and >= P/4 when the output is short)
    a = max(-(-(P + out_len) // 2), P - max(4, P // 4))
    a = min(a, P - 1)
    k = P - a
    starts = [rng.randrange(vocab) for _ in range(n)]
    stop_at = args.stop_at
    if stop_at is None:
        ids = asyncio.run(_greedy_walk_ids(url, model, starts, a))
        return [(w + w[:k], out_len) for w in ids]
    # early stops: the walk long enough to know the continuation's token at position HI
    lo, hi = stop_at
    ids = asyncio.run(_greedy_walk_ids(url, model, starts, max(a, k + hi)))
    return [early_stop_request(w, a, k, rng.randint(lo, hi), out_len) for w in ids]


def early_stop_request(walk: list[int], a: int, k: int, stop_pos: int, out_len: int) -> tuple:
    """``(walk[:a] + walk[:k], out_len, [walk[k + stop_pos - 1]])``: the prompt's greedy
    continuation is ``walk[k:]``, so the request's ``stop_pos``-th token is the stop token
    (it ends there, or earlier where the walk repeats it).  ``walk`` must reach ``k + stop_pos``."""
    if not 1 <= stop_pos <= len(walk) - k:
        raise ValueError(f"stop position {stop_pos} is past the walk's known continuation ({len(walk) - k} tokens)")
    return walk[:a] + walk[:k], out_len, [walk[k + stop_pos - 1]]


async def _greedy_walk_ids(url, model, starts, length):
    """``[t] + greedy continuation`` (``length`` token ids) for each start token ``t``."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        async def walk(t):
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": [t], "max_tokens": length - 1, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            ch = r.json()["choices"][0]
            return [t] + list(ch["token_ids"])
        return await asyncio.gather(*(walk(t) for t in starts))


# ---- plots -------------------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [("p50_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"), ("p50_tpot_ms", "TPOT p50 (ms)"),
              ("output_tokens_per_s", "output tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    rates = sorted({r["rate"] for c in res["runs"] for r in res["runs"][c]}, key=lambda x: (x == "inf", x))
    xs = {r: i for i, r in enumerate(rates)}
    for name, rows in res["runs"].items():
        for ax, (key, title) in zip(axes, panels):
            ax.plot([xs[r["rate"]] for r in rows], [r[key] for r in rows], marker="o", label=name)
    for ax, (_, title) in zip(axes, panels):
        ax.set_xticks(range(len(rates)))
        ax.set_xticklabels([str(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(res["config"].get("model_desc", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---- main ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: random weights of --preset)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS) + sorted(HYBRID_PRESETS),
                   help="random-weight model: a Mamba-2 of bench e2e's sizes, or a Nemotron-H hybrid")
    p.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--configs", default="replay,replay+spec,recurrent,snapshot",
                   help=f"server configurations to compare: {','.join(CONFIGS)}")
    p.add_argument("--spec-method", default="ngram", choices=["ngram", "draft", "tree"])
    p.add_argument("--request-rates", default="1,4,16,inf", help="requests per second (inf: all at once)")
    p.add_argument("--num-prompts", type=positive_int, default=200, help="requests per rate")
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--dataset", default=None, help="JSONL: {'prompt': text or ids, 'output_len': n} per line")
    p.add_argument("--prompt-kind", default=None, choices=["walk", "random", "motif"],
                   help="synthetic prompts (default: walk for presets, motif for --model)")
    p.add_argument("--stop-at", type=_stop_range, default=None, metavar="LO,HI",
                   help="early-stop workload (walk prompts, greedy): each request asks for --output-len tokens "
                        "but stops at a token position drawn from [LO, HI]")
    p.add_argument("--preemption-modes", type=_modes, default=None, metavar="MODES",
                   help="compare admission policies at equal memory: each configuration once per mode, from swap "
                        "(optimistic admission, preemption), off (worst-case reservation, the same slots) and "
                        "off-fit (worst-case reservation, slots sized to the budget); e.g. swap,off,off-fit")
    p.add_argument("--budget-seqs", type=positive_int, default=None, metavar="N",
                   help="set --memory-budget (the same for every server) to --max-num-seqs slots plus the blocks "
                        "of N worst-case requests (prompt + --output-len tokens), planned as the engine plans it")
    p.add_argument("--metrics-interval", type=nonnegative_float, default=0.1, metavar="SECONDS",
                   help="sample the server's running / waiting gauges this often during the load (0: off)")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0)
    p.add_argument("--max-concurrency", type=positive_int, default=None, help="cap on requests in flight")
    p.add_argument("--warmup", type=nonnegative_int, default=4, help="requests before each configuration's runs")
    p.add_argument("--server-timeout", type=positive_float, default=1200.0, help="seconds to wait for a server to start")
    p.add_argument("--out", default="out/bench_serve")
    p.add_argument("--smoke", action="store_true", help="small CPU run (CI)")
    p.add_argument("--no-plot", action="store_true")
    add_engine_args(p)
    return p


def _stop_range(text: str) -> tuple[int, int]:
    """``"LO,HI"`` -> ``(LO, HI)`` with ``1 <= LO <= HI``."""
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {lo},{hi}")
    return lo, hi


def _modes(text: str) -> list[str]:
    """``"swap,off"`` -> ``["swap", "off"]`` (each of :data:`PREEMPTION_CONFIGS`, no repeats)."""
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in PREEMPTION_CONFIGS]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes from {','.join(PREEMPTION_CONFIGS)}, got {text!r}")
    return modes


def _check_capacity_args(args) -> str | None:
    """Why the capacity flags do not go together (None: they do)."""
    modes = args.preemption_modes or []
    if args.url and (modes or args.budget_seqs):
        return "--preemption-modes and --budget-seqs start their own servers: not with --url"
    if args.budget_seqs and args.memory_budget is not None:
        return "give either --budget-seqs or --memory-budget, not both"
    if "off-fit" in modes and args.memory_budget is None and not args.budget_seqs:
        return "off-fit sizes its slots to the memory budget: give --memory-budget or --budget-seqs"
    if (args.budget_seqs or "off-fit" in modes) and args.max_seq_len is None:
        return "--budget-seqs and off-fit plan the caches: give --max-seq-len (or synthetic prompts)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        if args.model is None:
            args.preset = TINY_OF.get(args.preset, "tiny")
        args.device = args.device or "cpu"
        args.num_prompts = min(args.num_prompts, 8)
        args.prompt_len, args.output_len = min(args.prompt_len, 24), min(args.output_len, 8)
        args.request_rates = "8,inf" if args.request_rates == "1,4,16,inf" else args.request_rates
        args.torch_threads = args.torch_threads or 1
        args.warmup = min(args.warmup, 2)
        args.num_tokens = min(args.num_tokens, 3)
    try:
        rates = [float(r) for r in args.request_rates.split(",") if r]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):   # also refuses nan
        print(f"replayssm bench serve: error: --request-rates must be positive numbers or inf, got "
              f"{args.request_rates!r}", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad and not args.url:
        print(f"replayssm bench serve: error: unknown configs {bad}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    if any(CONFIGS[c]["spec"] for c in configs if c in CONFIGS) and args.spec_method == "draft" \
            and not args.draft_model and not args.url:
        print("replayssm bench serve: error: --spec-method draft needs --draft-model", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.max_seq_len is None and not args.dataset:   # the context the workload needs
        args.max_seq_len = max(256, -(-(args.prompt_len + args.output_len + 64) // 64) * 64)
    why = _check_capacity_args(args)
    if why:
        print(f"replayssm bench serve: error: {why}", file=sys.stderr)
        return 2
    kind = args.prompt_kind or ("motif" if args.model else "walk")
    args.prompt_kind = kind
    if args.stop_at is not None:
        if kind != "walk" or args.dataset:
            print("replayssm bench serve: error: --stop-at needs walk prompts (no --dataset)", file=sys.stderr)
            return 2
        if args.stop_at[1] > args.output_len:
            print(f"replayssm bench serve: error: --stop-at {args.stop_at[0]},{args.stop_at[1]} reaches past "
                  f"--output-len {args.output_len}", file=sys.stderr)
            return 2
    res = {"config": {k: v for k, v in vars(args).items()}, "runs": {}, "accepted_length": {}}
    runs = [(f"{c}/{m}", c, m) for c in configs for m in args.preemption_modes] if args.preemption_modes \
        else [(c, c, None) for c in configs]
    return_ids = not args.url
    outputs, series = {}, {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, desc = args.model, f"model {args.model}"
        if args.url:
            desc = f"server {args.url}"
            runs = [("server", "server", None)]
        elif model_dir is None:
            family = HYBRID_PRESETS[args.preset][0]["model_type"] if args.preset in HYBRID_PRESETS else "mamba2"
            print(f"[bench serve] writing a random-weight {family} ({args.preset})", file=sys.stderr, flush=True)
            model_dir = _random_model_dir(args.preset, tmp)
            desc = f"random-weight {family} ({args.preset})"
        res["config"]["model_desc"] = desc
        try:
            overrides = _memory_plans(args, model_dir, runs, res)
        except ValueError as e:
            print(f"replayssm bench serve: error: {e}", file=sys.stderr)
            return 2
        requests = None
        for name, base, pmode in runs:
            server = None
            try:
                if args.url:
                    url = args.url
                else:
                    cfg = CONFIGS[base]
                    flags = engine_flags(argparse.Namespace(**{**vars(args), **overrides.get(name, {})}),
                                         cfg["mode"], cfg["spec"])
                    if args.model is None:   # not the random-model cache's directory name
                        flags += ["--served-model-name", f"random-{args.preset}"]
                    print(f"[bench serve] {name}: replayssm serve {model_dir} {' '.join(flags)}", file=sys.stderr,
                          flush=True)
                    t0 = time.perf_counter()
                    log = out / f"server_{name.replace('+', '_').replace('/', '_')}.log"
                    server = ServerProcess(model_dir, flags, log)
                    url = server.wait(args.server_timeout)
                    res.setdefault("startup_s", {})[name] = time.perf_counter() - t0
                mname = model_name(url)
                if requests is None:   # the same requests for every configuration
                    if args.dataset:
                        requests = load_dataset(args.dataset, args.num_prompts, args.output_len)
                    else:
                        vocab = _vocab(model_dir) if model_dir else 256
                        requests = make_prompts(args, url, mname, vocab)
                    res["config"]["num_requests"] = len(requests)
                warm = requests[: args.warmup]
                if warm:
                    asyncio.run(run_rate(url, mname, warm, float("inf"), args.temperature, args.seed, None,
                                         f"{name} warm-up"))
                rows = []
                for rate in rates:
                    before = scrape(url)
                    samples = []
                    results, dur = asyncio.run(run_rate(url, mname, requests, rate, args.temperature, args.seed,
                                                        args.max_concurrency, f"{name} @ {rate:g} req/s", return_ids,
                                                        args.metrics_interval, samples))
                    after = scrape(url)
                    row = summarize(results, dur)
                    steps = after.get("replayssm:spec_decode_steps_total", 0) - before.get(
                        "replayssm:spec_decode_steps_total", 0)
                    toks = after.get("replayssm:spec_decode_tokens_total", 0) - before.get(
                        "replayssm:spec_decode_tokens_total", 0)
                    row["mean_accepted_length"] = toks / steps if steps else float("nan")
                    row["engine_steps"], row["slow_steps"] = step_counts(before, after)
                    row["rate"] = "inf" if math.isinf(rate) else rate
                    row.update(_capacity_row(results, requests, dur, samples, before, after, return_ids))
                    if return_ids:
                        outputs[(name, row["rate"])] = [r.token_ids for r in results]
                    series[f"{name} @ {row['rate']}"] = samples
                    res.setdefault("running_samples", {}).setdefault(name, {})[str(row["rate"])] = samples
                    rows.append(row)
                    print(f"[bench serve] {name} @ {row['rate']} req/s: {row['output_tokens_per_s']:.0f} out tok/s, "
                          f"TTFT p50 {row['p50_ttft_ms']:.0f} ms, TPOT p50 {row['p50_tpot_ms']:.1f} ms, "
                          f"acc {row['mean_accepted_length']:.2f}, failed {row['failed']}, lost {row['lost']}, "
                          f"running peak {_num(row['peak_running'])} mean {row['mean_running']:.1f}, "
                          f"{_num(row['preemptions'])} preemptions, "
                          f"{row['slow_steps']} of {row['engine_steps']} steps over {SLOW_STEP_S} s", file=sys.stderr,
                          flush=True)
                res["runs"][name] = rows
            finally:
                if server is not None:
                    server.stop()
    res["capacity"] = compare(res["runs"], outputs)
    res["elapsed_s"] = time.perf_counter() - t_start
    (out / "serve.json").write_text(json.dumps(res, indent=1, default=str))
    png = None if args.no_plot else plot(res, out / "serve.png")
    if png and args.preemption_modes:
        plot_running(res, series, out / "running.png")
    w = max([len(n) for n in res["runs"]] + [11]) + 2
    hdr = (f"{'config':<{w}}{'rate':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}"
           f"{'p99':>8}{'ITL p50':>9}{'p99':>8}{'acc':>6}{'fail':>5}")
    print(f"{desc}; {len(requests or [])} requests per rate, prompt {args.prompt_len} ({kind}), "
          f"output {args.output_len}" + (f", stops drawn in [{args.stop_at[0]}, {args.stop_at[1]}]"
                                         if args.stop_at else "") + "; times in ms")
    print(hdr)
    for name, rows in res["runs"].items():
        for r in rows:
            print(f"{name:<{w}}{str(r['rate']):>6}{r['request_throughput']:>8.2f}{r['output_tokens_per_s']:>11.1f}"
                  f"{r['p50_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>9.1f}{r['p50_tpot_ms']:>10.2f}{r['p99_tpot_ms']:>8.2f}"
                  f"{r['p50_itl_ms']:>9.2f}{r['p99_itl_ms']:>8.2f}{r['mean_accepted_length']:>6.2f}"
                  f"{r['failed']:>5}")
    if args.metrics_interval > 0:
        for name, plan in res.get("memory_plans", {}).items():
            print(f"{name}: {plan['describe']}")
        print("concurrency (running sequences, sampled from /metrics every "
              f"{args.metrics_interval:g} s; lost: requests without their stop or full output)")
        print(format_tables(res))
    print(f"wrote {out / 'serve.json'}" + (f" and {png}" if png else "") + f" in {res['elapsed_s']:.1f}s")
    failed = sum(r["failed"] + r["lost"] for rows in res["runs"].values() for r in rows)
    return 1 if failed else 0


def _num(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0f}"


def _memory_plans(args, model_dir, runs: list, res: dict) -> dict:
    """Size the budget (``--budget-seqs``) and each run's slots (``off-fit``); returns the
    engine flags each run overrides ``{name: {dest: value}}`` and records every run's plan
    in ``res["memory_plans"]`` (nothing to do without a budget to plan)."""
    modes = args.preemption_modes or []
    over = {name: {"preemption_mode": "off" if m == "off-fit" else m} for name, _, m in runs if m}
    if args.url or (not args.budget_seqs and args.memory_budget is None):
        if modes:
            print("[bench serve] note: no --budget-seqs / --memory-budget: each server sizes its caches from the "
                  "memory free when it starts (--gpu-memory-utilization), not from one stated budget",
                  file=sys.stderr, flush=True)
        return over
    model = meta_model(model_dir, server_dtype(args))
    worst = args.prompt_len + args.output_len
    if args.budget_seqs:
        cfg = CONFIGS[runs[0][1]]
        bp = size_budget(model, engine_config(args, cfg["mode"], cfg["spec"], args.max_num_seqs, None), worst,
                         args.budget_seqs)
        args.memory_budget = bp.budget
        res["config"]["memory_budget"] = bp.budget
        print(f"[bench serve] --budget-seqs {args.budget_seqs}: --memory-budget {bp.budget} "
              f"({bp.budget / 2 ** 20:.1f} MiB)", file=sys.stderr, flush=True)
    plans = res.setdefault("memory_plans", {})
    for name, base, mode in runs:
        cfg = CONFIGS[base]
        try:
            ec = engine_config(args, cfg["mode"], cfg["spec"], args.max_num_seqs, int(args.memory_budget))
        except ValueError:
            if "off-fit" in modes or args.budget_seqs:
                raise
            continue   # a plain --memory-budget run whose plan is not ours to show
        bp = plan_budget(model, ec, worst)
        if mode == "off-fit":
            slots = bp.fit_slots()
            over[name]["max_num_seqs"] = slots
            bp = plan_budget(model, dataclasses.replace(ec, max_num_seqs=slots), worst)
        plans[name] = {**dataclasses.asdict(bp), "worst_case_seqs": bp.worst_case_seqs, "describe": bp.describe()}
        print(f"[bench serve] {name}: {bp.describe()}", file=sys.stderr, flush=True)
    return over


def _capacity_row(results: list, requests: list, dur: float, samples: list, before: dict, after: dict,
                  return_ids: bool) -> dict:
    """Concurrency, preemptions, slots / blocks and completeness of one rate's load."""
    reasons = {}
    for r in results:
        reasons[r.finish_reason or "none"] = reasons.get(r.finish_reason or "none", 0) + 1
    row = concurrency(samples, dur)
    pre = "replayssm:num_preemptions_total"
    row.update(sent=len(results), lost=sum(lost(r, req[1]) for r, req in zip(results, requests)),
               finish_reasons=reasons,
               preemptions=after[pre] - before.get(pre, 0.0) if pre in after else None,
               slots=after.get("replayssm:total_slots"), kv_blocks=after.get("replayssm:kv_total_blocks"))
    if return_ids:
        row["outputs_sha256"] = outputs_digest(results)
    return row


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
