"""Prefix caching in ``replayssm bench e2e`` (``--workload shared-prefix|chat``, ``--prefix-memory``).

* **Memory per cached token** (:func:`memory_per_token`): what one cached prompt token costs
  in our scheme — per SSM layer its ring entry and conv input, plus one checkpoint state per
  checkpoint interval ``C`` — against the *state-per-block* scheme (vLLM / SGLang: one full
  state and conv state saved per block of ``B`` tokens, hits rounded down to a block).
  Attention keys/values cost the same in both and are included.  Two columns per scheme:
  *analytic* from the layers' shapes and dtypes, and *measured* from the bytes the model cache
  allocates (its layout, built on the ``meta`` device: no weights, no memory).
* **Shared-prefix workload**: a system prompt of ``--prefix-len`` tokens followed by
  ``--num-questions`` different questions; the first request runs alone (cold), then the
  rest arrive together.  Caching off vs on in one run: time to first token of the first and
  of the others (mean / p50 / p99), wall time and output tokens/s of the batch, hit rate, and
  the share of requests whose greedy output with caching on equals the one with caching off.
* **Chat workload**: ``--conversations`` conversations of ``--turns`` turns; each turn's prompt
  is the conversation so far (earlier prompts and answers) plus a new user message of
  ``--turn-len`` tokens, all conversations' turn ``t`` arriving together.  Three runs: caching
  off; prompts only (``prefix_cache_replies=False``: a turn resumes at the end of the
  previous turn's cached prompt blocks and prefills the answer and the new message); and
  replies cached too (the default: a turn resumes at the end of the previous answer and
  prefills the new message only).  Per turn: mean TTFT and the prompt tokens prefilled.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from ..cache.spec import CacheSpec
from ..engine.config import SamplingParams
from ..engine.llm import LLM
from ..engine.prefix import default_checkpoint_interval
from ..models.cache import ModelCache
from ..models.registry import parse_config
from ..models.registry import model_class
from .common import free_memory, sync

#: block sizes of the state-per-block comparison (hit granularity of that scheme)
STATE_BLOCKS = (16, 64, 256, 1024)


def _meta_model(preset: str, cfg: dict, dtype):
    """The model skeleton of ``cfg`` (a ``config.json`` dict) on the ``meta`` device (shapes only)."""
    parsed = parse_config(cfg, f"preset {preset}")
    with torch.device("meta"):
        return model_class(parsed)(parsed, dtype, "cpu")


def _analytic(model, act: int) -> dict:
    """Per-token / per-sequence bytes from the layers' shapes (``act`` bytes per activation,
    fp32 states and step sizes).  ``entry``: the stored part of a ring entry (Mamba-2: ``Δ``
    only, ``x`` and ``B`` are rebuilt from the conv inputs; GDN: ``u, k, g``)."""
    entry = conv_in = state = conv_state = attn = 0
    for layer in model.stateful_layers():
        if hasattr(layer, "conv_dim"):
            if layer.family == "mamba2":
                entry += 4 * layer.H
                state += 4 * layer.H * layer.d * layer.n
            else:
                entry += act * (layer.HV * layer.V + layer.H * layer.K) + 4 * layer.HV
                state += 4 * layer.HV * layer.K * layer.V
            conv_in += act * layer.conv_dim
            conv_state += act * layer.conv_dim * (layer.conv_kernel - 1)
        else:
            attn += act * 2 * layer.Hkv * layer.Dh
    return dict(entry=entry, conv_in=conv_in, state=state, conv_state=conv_state, attn=attn)


def memory_per_token(preset: str, cfg: dict, dtype: str = "bfloat16", block_size: int = 16,
                     interval: int | None = None, max_seq_len: int = 8192) -> dict:
    """Bytes per cached token of our scheme and of the state-per-block scheme (module
    docstring) for the model of ``cfg`` (``config.json`` of preset ``preset``)."""
    dt = getattr(torch, dtype)
    model = _meta_model(preset, cfg, dt)
    spec = CacheSpec(mode="replay", buffer_size=16, max_new=1, max_seq_len=max_seq_len, block_size=block_size)
    lay = model.cache_layout(spec)
    C = interval or default_checkpoint_interval(lay, max_seq_len)
    a = _analytic(model, torch.empty((), dtype=dt).element_size())
    # measured: the store's block and checkpoint bytes, the conv windows of one slot
    one = ModelCache(model, 2, spec, device=torch.device("meta"))
    conv_state = sum(st["conv"].window.nbytes for st in one.layers.values() if "conv" in st) // one.P
    # a checkpoint row holds a state and a conv window (the window: a state point's)
    ours_a = a["entry"] + a["conv_in"] + (a["state"] + a["conv_state"]) / C + a["attn"]
    ours_m = lay.prefix_block_bytes / block_size + lay.checkpoint_bytes / C + lay.attn_block_bytes / block_size
    row = {"preset": preset, "dtype": dtype, "block_size": block_size, "checkpoint_interval": C,
           "ssm_layers": sum(hasattr(x, "conv_dim") for x in model.stateful_layers()),
           "attention_layers": sum(not hasattr(x, "conv_dim") for x in model.stateful_layers()),
           "entry_bytes": a["entry"], "conv_input_bytes": a["conv_in"], "state_bytes": a["state"],
           "attention_bytes_per_token": a["attn"],
           "ours_analytic": ours_a, "ours_measured": ours_m,
           "ours_measured_parts": {"entries+conv inputs": lay.prefix_block_bytes / block_size,
                                   "checkpoints": lay.checkpoint_bytes / C,
                                   "attention": lay.attn_block_bytes / block_size},
           "state_per_block": {}}
    for B in STATE_BLOCKS:
        row["state_per_block"][B] = {
            "analytic": (a["state"] + a["conv_state"]) / B + a["attn"],
            "measured": (lay.state_bytes + conv_state) / B + lay.attn_block_bytes / block_size}
    return row


def print_memory(rows: list[dict]) -> None:
    print("memory per cached token (KiB; attention keys/values included in both schemes)")
    head = f"{'preset':<15}{'C':>6}{'ours analytic':>15}{'ours measured':>15}"
    head += "".join(f"{'state/' + str(B):>12}" for B in STATE_BLOCKS)
    print(head)
    for r in rows:
        line = f"{r['preset']:<15}{r['checkpoint_interval']:>6}{r['ours_analytic'] / 1024:>15.1f}" \
               f"{r['ours_measured'] / 1024:>15.1f}"
        line += "".join(f"{r['state_per_block'][B]['measured'] / 1024:>12.1f}" for B in STATE_BLOCKS)
        print(line)
    print("(ours resumes at any token; state/B resumes only at multiples of B tokens)")


# ---------------------------------------------------------------------------- workloads
def _drive(llm, prompts, params) -> tuple[list, list[float], float]:
    """Submit ``prompts`` together and step to the end: (sequences, seconds to each first
    token, wall seconds)."""
    t0 = time.perf_counter()
    seqs = [llm.add_request(p, params) for p in prompts]
    first: dict = {}
    while llm.has_unfinished():
        llm.step()
        now = time.perf_counter()
        for s in seqs:
            if s.output_ids and id(s) not in first:
                first[id(s)] = now - t0
    return seqs, [first.get(id(s), float("nan")) for s in seqs], time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _rng_tokens(rng, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run_workload(model, args, workload: str, caching: bool, replies: bool = True) -> dict:
    """One workload with prefix caching off or on (``replies``: finished requests' replies
    cached too; see the module docstring)."""
    vocab = int(model.config.vocab_size)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(device=args.device, dtype=args.dtype, decode_mode=args.workload_mode, buffer_size=args.buffer_size,
              max_num_seqs=args.max_num_seqs, cuda_graphs=args.cuda_graphs, max_seq_len=args.max_seq_len,
              enable_prefix_caching=caching, prefix_checkpoint_interval=args.prefix_checkpoint_interval,
              prefix_cache_replies=replies)
    if args.memory_budget:
        kw["memory_budget"] = int(args.memory_budget)
    llm = LLM(model, **kw)
    llm.warm_up()         # every step kind once (kernel compiles), as a server does; zeroes the counters, syncs
    row = {"workload": workload, "caching": caching, "cache": "off" if not caching else "on" if replies else "prompts",
           "mode": kw["decode_mode"]}
    ttft, wall, outs, prompt_tokens, tokens = [], 0.0, 0, 0, []
    if workload == "shared-prefix":
        system = _rng_tokens(rng, args.prefix_len, vocab)
        prompts = [system + _rng_tokens(rng, args.question_len, vocab) for _ in range(args.num_questions)]
        seqs, t, w = _drive(llm, prompts[:1], params)                # the first request, alone (cold)
        row["ttft_first_ms"] = t[0] * 1e3
        seqs, ttft, wall = _drive(llm, prompts[1:], params)          # the others, together
        outs = sum(len(s.output_ids) for s in seqs)
        tokens = [list(s.output_ids) for s in seqs]
        prompt_tokens = sum(len(p) for p in prompts[1:])
    elif workload == "chat":
        hist = [[] for _ in range(args.conversations)]
        row["ttft_per_turn_ms"], row["prefilled_per_turn"] = [], []
        for _ in range(args.turns):
            prompts = [h + _rng_tokens(rng, args.turn_len, vocab) for h in hist]
            hit0 = llm.prefix_stats().get("prefix_hit_tokens", 0)
            seqs, t, w = _drive(llm, prompts, params)
            row["prefilled_per_turn"].append(sum(len(p) for p in prompts) - llm.prefix_stats().get(
                "prefix_hit_tokens", 0) + hit0)
            hist = [p + s.output_ids for p, s in zip(prompts, seqs)]
            tokens += [list(s.output_ids) for s in seqs]
            ttft += t
            wall += w
            outs += sum(len(s.output_ids) for s in seqs)
            prompt_tokens += sum(len(p) for p in prompts)
            row["ttft_per_turn_ms"].append(sum(t) / len(t) * 1e3)
    else:
        raise ValueError(f"unknown workload {workload!r}")
    sync(args.device)
    st = llm.prefix_stats()
    row.update({"requests": len(ttft), "prompt_tokens": prompt_tokens, "output_tokens": outs, "wall_s": wall,
                "output_tokens_per_s": outs / wall if wall else 0.0,
                "ttft_mean_ms": sum(ttft) / len(ttft) * 1e3, "ttft_p50_ms": _pct(ttft, 0.5) * 1e3,
                "ttft_p99_ms": _pct(ttft, 0.99) * 1e3,
                "hit_rate": st.get("prefix_hit_rate", 0.0), "hit_tokens": st.get("prefix_hit_tokens", 0),
                "prefill_tokens_computed": prompt_tokens - st.get("prefix_hit_tokens", 0),
                "cached_blocks": st.get("prefix_cached_blocks", 0), "evictions": st.get("prefix_evictions", 0),
                "output_ids": tokens})
    if caching:   # what a cached token costs in this engine (measured from its cache's layout)
        lay, ps = llm.plan.layout, llm.plan.prefix_store
        row["checkpoint_interval"] = ps.interval
        row["store_bytes"] = ps.bytes
        row["bytes_per_cached_token"] = (lay.prefix_block_bytes / lay.block_size + lay.checkpoint_bytes / ps.interval
                                         + lay.attn_block_bytes / lay.block_size)
    del llm
    free_memory(args.device)
    print(f"[bench e2e] {workload} caching {row['cache']}: TTFT mean {row['ttft_mean_ms']:.1f} ms, "
          f"{row['output_tokens_per_s']:.0f} tok/s, hit rate {row['hit_rate']:.2f}", file=sys.stderr, flush=True)
    return row


def run(model, args, out: Path, desc: str) -> int:
    """``bench e2e --workload ...``: every workload with caching off and on, one table."""
    res = {"config": {**vars(args), "model_desc": desc}, "runs": []}
    for w in args.workload.split(","):
        for caching, replies in ((False, True), (True, False), (True, True)) if w == "chat" else ((False, True),
                                                                                                (True, True)):
            res["runs"].append(run_workload(model, args, w, caching, replies))
    summ = {}
    for w in args.workload.split(","):
        r = {x["cache"]: x for x in res["runs"] if x["workload"] == w}
        summ[f"{w}_ttft_off_over_on"] = r["off"]["ttft_mean_ms"] / max(r["on"]["ttft_mean_ms"], 1e-9)
        summ[f"{w}_throughput_on_over_off"] = (r["on"]["output_tokens_per_s"]
                                               / max(r["off"]["output_tokens_per_s"], 1e-9))
        if "prompts" in r:
            summ[f"{w}_ttft_prompts_only_over_replies"] = (r["prompts"]["ttft_mean_ms"]
                                                           / max(r["on"]["ttft_mean_ms"], 1e-9))
        # greedy outputs with caching on equal to off (exact up to rounding: a near-tie may flip
        # in low precision; chat turns after a flip see different histories)
        pairs = list(zip(r["off"]["output_ids"], r["on"]["output_ids"]))
        summ[f"{w}_same_output_frac"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
    res["summary"] = summ
    (out / "prefix.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"model: {desc}; dtype {args.dtype}")
    print(f"{'workload':<15}{'cache':<8}{'reqs':>5}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'tok/s':>9}{'hit rate':>9}"
          f"{'computed':>10}{'B/token':>10}")
    for r in res["runs"]:
        bpt = r.get("bytes_per_cached_token")
        print(f"{r['workload']:<15}{r['cache']:<8}{r['requests']:>5}{r['ttft_mean_ms']:>11.1f}"
              f"{r['ttft_p50_ms']:>9.1f}{r['ttft_p99_ms']:>9.1f}{r['output_tokens_per_s']:>9.0f}{r['hit_rate']:>9.2f}"
              f"{r['prefill_tokens_computed']:>10}{(f'{bpt:.0f}' if bpt else '-'):>10}")
    for r in res["runs"]:
        if r.get("ttft_per_turn_ms"):
            print(f"chat, cache {r['cache']:<8} per turn: TTFT ms "
                  + " ".join(f"{x:.1f}" for x in r["ttft_per_turn_ms"])
                  + "; prefilled tokens " + " ".join(str(x) for x in r["prefilled_per_turn"]))
    for k, v in summ.items():
        print(f"{k}: {v:.2f}" + ("" if k.endswith("_frac") else "x"))
    plot = ""
    if not args.no_plots and any(r.get("ttft_per_turn_ms") for r in res["runs"]):
        try:
            plot = " and " + plot_chat([res], out / "prefix_chat_ttft.png")
        except ImportError:
            print("replayssm bench e2e: plot skipped: matplotlib is not installed", file=sys.stderr)
    print(f"wrote {out / 'prefix.json'}{plot}")
    return 0


def plot_chat(results: list[dict], path) -> str:
    """Chat TTFT per turn with prefix caching off and on, one panel per ``prefix.json``
    result (its model in the title); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        for r in res["runs"]:
            if r.get("ttft_per_turn_ms"):
                turns = range(1, len(r["ttft_per_turn_ms"]) + 1)
                label = r.get("cache", "on" if r["caching"] else "off")
                ax.plot(turns, r["ttft_per_turn_ms"], marker="o", label=f"caching {label}")
        cfg = res["config"]
        ax.set_title(f"{cfg.get('preset') or cfg.get('model')}", fontsize=10)
        ax.set_xlabel(f"turn ({cfg['conversations']} chats, +{cfg['turn_len']} tokens each)")
        ax.set_ylabel("mean TTFT (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
