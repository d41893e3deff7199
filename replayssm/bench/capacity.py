"""Capacity under load for ``bench serve``: admission policies at equal memory.

``bench serve --preemption-modes swap,off,off-fit`` starts one server per configuration and
mode, all with the same ``--memory-budget`` (``--budget-seqs N`` sizes it), and reads from
each server, while the load runs, how many sequences it holds at once:

* ``swap``: optimistic admission (a request is admitted on its prompt's blocks; when the
  block pools run dry a sequence is swapped to host memory and restored exactly later);
* ``off``: worst-case reservation (each admitted request reserves the blocks of
  ``prompt + max_tokens`` tokens for its whole life), with the same slots as ``swap``;
* ``off-fit``: worst-case reservation with its slot count sized to the budget: the most
  slots ``S`` with ``S * (fixed + worst case) <= budget``, so that no slot's fixed memory
  (states, rings) sits idle for lack of blocks.  At equal memory this is the fairest
  baseline: with hybrids, whose per-slot SSM state is large beside the attention KV of one
  token, it admits far more than ``off`` with ``swap``'s slots.

The budget is planned here exactly as the engine plans it (:func:`plan_caches` on the
model's ``meta``-device skeleton: no weights are read).  Concurrency is the
``replayssm:num_requests_running`` gauge (sequences holding a cache slot), sampled every
``--metrics-interval`` seconds: its peak and its time average over the load window (each
sample held until the next).  A request is *lost* unless it ends with its stop (finish
reason ``stop``) or its full ``max_tokens`` (``length``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass

PREEMPTION_CONFIGS = ("swap", "off", "off-fit")
RUNNING = "replayssm:num_requests_running"
WAITING = "replayssm:num_requests_waiting"


# ---- the memory plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetPlan:
    """One memory budget and what it holds: ``slots`` cache slots of ``fixed`` bytes each,
    block pools of ``pool`` bytes (``blocks`` blocks of ``block_size`` tokens), and a
    worst-case request (``worst_tokens`` tokens with the verify window) of ``worst_bytes``."""

    budget: int
    slots: int
    fixed: int
    per_token: int
    block_size: int
    pool: int
    blocks: int
    worst_tokens: int
    worst_bytes: int

    @property
    def worst_case_seqs(self) -> int:
        """Sequences worst-case reservation admits at once: ``min(slots, pool // worst_bytes)``."""
        return min(self.slots, self.pool // self.worst_bytes) if self.worst_bytes else self.slots

    def fit_slots(self) -> int:
        """The most slots ``S`` whose worst-case sequences all fit the budget beside their
        fixed parts: ``S * fixed + S * worst_bytes <= budget - store``, at least 1."""
        room = self.pool + self.slots * self.fixed      # budget less the prefix store
        return max(1, room // (self.fixed + self.worst_bytes))

    def describe(self) -> str:
        from ..engine.cache_plan import fmt_bytes as f

        return (f"budget {f(self.budget)}: {self.slots} slots x {f(self.fixed)} fixed + {self.blocks} blocks of "
                f"{self.block_size} tokens ({self.per_token} B/token, {f(self.pool)} in all); a worst-case request "
                f"({self.worst_tokens} tokens) reserves {f(self.worst_bytes)}: {self.worst_case_seqs} at once")


def engine_config(args, mode: str, spec: bool, max_num_seqs: int, budget: int | None):
    """The :class:`EngineConfig` a server of ``bench serve``'s flags builds (without a
    drafter model: plain decoding or n-gram speculation)."""
    from ..engine.config import EngineConfig, SpeculativeConfig

    if spec and args.spec_method != "ngram":
        raise ValueError(f"--budget-seqs and off-fit plan the caches here: speculation {args.spec_method!r} "
                         f"brings a drafter cache they do not size (use ngram, or give --memory-budget)")
    sp = SpeculativeConfig("ngram", num_tokens=args.num_tokens, prompt_lookup_min=args.prompt_lookup_min,
                           prompt_lookup_max=args.prompt_lookup_max) if spec else None
    return EngineConfig(decode_mode=mode, buffer_size=args.buffer_size, max_num_seqs=max_num_seqs,
                        memory_budget=budget, max_seq_len=args.max_seq_len, kv_block_size=args.kv_block_size,
                        auto_threshold=args.auto_threshold, speculative=sp, gpu_memory_utilization=None,
                        enable_prefix_caching=args.enable_prefix_caching,
                        prefix_checkpoint_interval=args.prefix_checkpoint_interval,
                        prefix_cache_fraction=args.prefix_cache_fraction, ssm_state_dtype=args.ssm_state_dtype)


def meta_model(model_dir: str, dtype: str):
    """The model skeleton of ``model_dir``'s ``config.json`` on the ``meta`` device."""
    import torch

    from ..models.registry import model_class, read_config

    cfg = read_config(model_dir)
    with torch.device("meta"):
        return model_class(cfg)(cfg, getattr(torch, dtype), "cpu")


def server_dtype(args) -> str:
    """The dtype the servers load in (``serve``'s rule: bfloat16 on CUDA, float32 on CPU)."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def plan_budget(model, ec, worst_tokens: int) -> BudgetPlan:
    """What the engine makes of ``ec`` (its :func:`plan_caches`, on the meta device) and the
    bytes a request of ``worst_tokens`` tokens (prompt + max_tokens) reserves without
    preemption (plus one verify window, as :meth:`BlockManager.plan` counts)."""
    import torch

    from ..engine.cache_plan import plan_caches

    if ec.max_seq_len is None:
        raise ValueError("planning the budget needs --max-seq-len")
    plan = plan_caches(ec, torch.device("meta"), model.config, int(model.config.vocab_size), model.cache_layout)
    mem = plan.memory
    limit = plan.max_seq_len - mem.verify_tokens
    worst = mem.dynamic(min(worst_tokens, limit) + mem.verify_tokens)
    budget = ec.memory_budget
    pool = 0 if budget is None else budget - plan.store_bytes - plan.num_slots * mem.fixed
    blocks = plan.spec.attn_num_blocks or plan.spec.kv_num_blocks or 0
    return BudgetPlan(budget or 0, plan.num_slots, mem.fixed, mem.per_token, mem.block_size, pool, blocks,
                      min(worst_tokens, limit), worst)


def size_budget(model, ec, worst_tokens: int, seqs: int) -> BudgetPlan:
    """The budget whose block pools hold ``seqs`` worst-case requests beside ``ec.max_num_seqs``
    slots (the prefix store, if any, takes its share on top)."""
    if seqs < 1:
        raise ValueError(f"--budget-seqs must be >= 1, got {seqs}")
    budget = 1 << 50
    for _ in range(8):   # the prefix store's share depends on the budget: settle it
        p = plan_budget(model, dataclasses.replace(ec, memory_budget=budget), worst_tokens)
        if p.slots != ec.max_num_seqs:
            raise ValueError(f"the budget does not hold {ec.max_num_seqs} slots")
        if p.worst_bytes == 0:
            raise ValueError("this model's caches do not grow with the context (no attention KV, no KV-only "
                             "entries): worst-case reservation never binds, there is nothing to compare")
        want = seqs * p.worst_bytes
        if p.pool == want:
            return p
        budget += want - p.pool
    raise ValueError("could not settle a budget (prefix store sizing did not converge)")


# ---- concurrency sampling ---------------------------------------------------------------------
def gauge_values(text: str, names: tuple[str, ...]) -> list[float]:
    """The values of the metrics ``names`` in Prometheus text (summed over label sets)."""
    out = [0.0] * len(names)
    for line in text.splitlines():
        if line.startswith("replayssm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                out[names.index(name)] += float(line.rpartition(" ")[2])
    return out


async def sample_running(client, url: str, every: float, stop: asyncio.Event, t0: float) -> list:
    """``[(seconds since t0, running, waiting)]`` from ``/metrics`` every ``every`` seconds
    until ``stop`` is set (a failed scrape is skipped)."""
    samples = []
    while not stop.is_set():
        try:
            r = await client.get(url + "/metrics", timeout=10)
            if RUNNING in r.text:   # (a server without our gauges gives no samples)
                run, wait = gauge_values(r.text, (RUNNING, WAITING))
                samples.append((time.perf_counter() - t0, run, wait))
        except Exception:   # noqa: BLE001  (a missed sample is not a failed run)
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass
    return samples


def concurrency(samples: list, duration: float) -> dict:
    """Peak and time-averaged running sequences over ``[first sample, duration]`` (each
    sample's value held until the next sample)."""
    if not samples:
        return {"peak_running": float("nan"), "mean_running": float("nan"), "peak_waiting": float("nan"),
                "num_samples": 0}
    area, span = 0.0, 0.0
    for (t, r, _), nxt in zip(samples, samples[1:] + [(max(duration, samples[-1][0]), 0, 0)]):
        dt = max(0.0, nxt[0] - t)
        area += r * dt
        span += dt
    mean = area / span if span > 0 else samples[0][1]
    return {"peak_running": max(s[1] for s in samples), "mean_running": mean,
            "peak_waiting": max(s[2] for s in samples), "num_samples": len(samples)}


# ---- completeness and outputs ------------------------------------------------------------------
def lost(result, max_tokens: int) -> bool:
    """A request is lost unless it ended with its stop or its full ``max_tokens``."""
    if not result.ok:
        return True
    if result.finish_reason == "stop":
        return False
    return not (result.finish_reason == "length" and result.output_tokens == max_tokens)


def outputs_digest(results) -> str:
    """SHA-256 of every request's output token ids, in request order."""
    h = hashlib.sha256()
    for r in results:
        h.update(json.dumps(r.token_ids).encode())
        h.update(b";")
    return h.hexdigest()


# ---- the comparison -----------------------------------------------------------------------------
def split_name(name: str) -> tuple[str, str | None]:
    """``"replay/swap"`` -> ``("replay", "swap")``; a name without a mode -> ``(name, None)``."""
    base, _, mode = name.rpartition("/")
    return (base, mode) if base and mode in PREEMPTION_CONFIGS else (name, None)


def compare(runs: dict, outputs: dict) -> list[dict]:
    """``swap`` against each worst-case configuration of the same base configuration and
    rate: ratios of mean and peak concurrency and of output tokens/s, and how many requests'
    outputs differ (``outputs``: ``{(name, rate): [token ids per request]}``)."""
    rows = []
    for name, rs in runs.items():
        base, mode = split_name(name)
        if mode != "swap":
            continue
        for other in ("off", "off-fit"):
            ref = runs.get(f"{base}/{other}")
            if ref is None:
                continue
            for a in rs:
                b = next((x for x in ref if x["rate"] == a["rate"]), None)
                if b is None:
                    continue
                oa, ob = outputs.get((name, a["rate"])), outputs.get((f"{base}/{other}", a["rate"]))
                diff = None if oa is None or ob is None else sum(x != y for x, y in zip(oa, ob))
                rows.append({"config": base, "rate": a["rate"], "baseline": other,
                             "mean_concurrency_ratio": _ratio(a["mean_running"], b["mean_running"]),
                             "peak_concurrency_ratio": _ratio(a["peak_running"], b["peak_running"]),
                             "throughput_ratio": _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
                             "differing_outputs": diff,
                             "lost": {"swap": a["lost"], other: b["lost"]}})
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")


def format_tables(res: dict) -> str:
    """The concurrency table of every run and the swap ratios."""
    runs = res["runs"]
    w = max([len(n) for n in runs] + [6]) + 2
    out = [f"{'config':<{w}}{'rate':>6}{'slots':>7}{'blocks':>8}{'peak':>6}{'mean':>7}{'preempt':>8}{'sent':>6}"
           f"{'lost':>5}{'out tok/s':>11}{'TTFT mean':>11}{'p99':>9}{'E2E mean':>10}{'p99':>9}"]
    for name, rows in runs.items():
        for r in rows:
            out.append(f"{name:<{w}}{str(r['rate']):>6}{_i(r.get('slots')):>7}{_i(r.get('kv_blocks')):>8}"
                       f"{_i(r['peak_running']):>6}{r['mean_running']:>7.1f}{_i(r.get('preemptions')):>8}"
                       f"{r['sent']:>6}{r['lost']:>5}{r['output_tokens_per_s']:>11.1f}{r['mean_ttft_ms']:>11.1f}"
                       f"{r['p99_ttft_ms']:>9.1f}{r['mean_e2e_ms']:>10.1f}{r['p99_e2e_ms']:>9.1f}")
    for c in res.get("capacity", []):
        same = {None: "not compared", 0: "identical"}.get(c["differing_outputs"], f"{c['differing_outputs']} differ")
        out.append(f"swap / {c['baseline']} ({c['config']} @ {c['rate']}): mean concurrency "
                   f"{c['mean_concurrency_ratio']:.2f}x, peak {c['peak_concurrency_ratio']:.2f}x, output tok/s "
                   f"{c['throughput_ratio']:.2f}x; outputs {same}; lost {c['lost']}")
    return "\n".join(out)


def _i(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return str(int(v))


def plot_running(res: dict, series: dict, path) -> str | None:
    """Running sequences over time, one line per configuration (the last rate's load)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, samples in series.items():
        if samples:
            ax.step([s[0] for s in samples], [s[1] for s in samples], where="post", label=name)
    ax.set_xlabel("seconds into the load")
    ax.set_ylabel("running sequences")
    ax.set_title(res["config"].get("model_desc", ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)

