"""``replayssm bench e2e --workload prefill``: time to first token, and chunked prefill under load.

Two measurements on one model, driven through :class:`~replayssm.engine.engine.LLMEngine`'s
step API (a step returns host tokens, so the clock after a step has seen its GPU work):

1. **TTFT**: ``B`` prompts of ``P`` tokens submitted together to an idle engine, for each
   ``P`` in ``--ttft-lens`` and ``B`` in ``--ttft-batches``.  TTFT of a request = time from
   submission to its first token; prefill throughput = ``B·P`` / the last TTFT.  The engine
   runs with its chunked-prefill budget (``--max-num-batched-tokens``), so a long prompt is
   processed in chunks that continue from the state the previous chunk left.
2. **Mixed**: ``--mixed-decoders`` requests are decoding (short prompts, ``--mixed-max-tokens``
   each) when ``--mixed-prompts`` prompts of ``--mixed-len`` tokens arrive.  Run with chunked
   prefill on (the budget) and off (a budget that takes every prompt whole in one step):
   total tokens/s, TTFT of the long prompts, and the decoders' longest gap between two
   tokens -- the stall a long prompt causes when it is not chunked.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from ..engine.config import SamplingParams
from ..engine.llm import LLM
from .common import free_memory, sync


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def drive(llm, requests: list[tuple[list[int], SamplingParams]], arrive_after: dict | None = None) -> dict:
    """Run ``requests`` on ``llm`` (an :class:`LLMEngine`) step by step.

    ``arrive_after`` maps a request's index to the step count after which it is submitted
    (default: all at step 0).  Returns per request: ``submit``, ``first`` (time of its first
    token), ``times`` (the time of every step that gave it tokens), ``tokens``; plus ``wall``.
    """
    arrive_after = arrive_after or {}
    rec = [{"submit": None, "first": None, "times": [], "tokens": 0} for _ in requests]
    ids = {}
    steps = 0
    sync(llm.device)
    t0 = time.perf_counter()

    def submit_due():
        for i, (prompt, params) in enumerate(requests):
            if rec[i]["submit"] is None and arrive_after.get(i, 0) <= steps:
                seq = llm.add_request(prompt, params)
                ids[seq.request_id] = i
                rec[i]["submit"] = time.perf_counter()

    submit_due()
    while llm.has_unfinished() or any(r["submit"] is None for r in rec):
        outs = llm.step() if llm.has_unfinished() else []
        steps += 1
        now = time.perf_counter()
        for o in outs:
            r = rec[ids[o.request_id]]
            if len(o.token_ids) > r["tokens"]:
                r["tokens"] = len(o.token_ids)
                r["times"].append(now)
                if r["first"] is None:
                    r["first"] = now
        submit_due()
    wall = time.perf_counter() - t0
    return {"requests": rec, "wall": wall, "steps": steps}


def _max_gap(r: dict) -> float:
    t = r["times"]
    return max((b - a for a, b in zip(t, t[1:])), default=0.0)


def run_ttft(model, args) -> list[dict]:
    """Section 1: TTFT for every (prompt length, batch)."""
    vocab = int(model.config.vocab_size)
    rows = []
    for P in args.ttft_lens:
        for B in args.ttft_batches:
            llm = LLM(model, device=args.device, dtype=args.dtype, decode_mode=args.workload_mode,
                      buffer_size=args.buffer_size, max_num_seqs=B, cuda_graphs=args.cuda_graphs,
                      max_seq_len=-(-(P + 64) // 64) * 64, max_num_batched_tokens=args.max_num_batched_tokens)
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            warm = _random_prompts(B, min(P, args.max_num_batched_tokens), vocab, seed=1)
            drive(llm, [(p, params) for p in warm])        # compiles kernels / captures graphs
            res = drive(llm, [(p, params) for p in _random_prompts(B, P, vocab, seed=P + B)])
            ttft = sorted(r["first"] - r["submit"] for r in res["requests"])
            row = {"prompt_len": P, "batch": B, "ttft_mean_ms": 1e3 * sum(ttft) / B,
                   "ttft_min_ms": 1e3 * ttft[0], "ttft_max_ms": 1e3 * ttft[-1],
                   "prefill_tokens_per_s": B * P / ttft[-1], "max_num_batched_tokens": args.max_num_batched_tokens}
            rows.append(row)
            print(f"[bench e2e] ttft P={P} B={B}: mean {row['ttft_mean_ms']:.1f} ms, max {row['ttft_max_ms']:.1f} ms, "
                  f"{row['prefill_tokens_per_s']:.0f} prefill tok/s", file=sys.stderr, flush=True)
            del llm
            free_memory(args.device)
    return rows


def run_mixed(model, args) -> list[dict]:
    """Section 2: long prompts arriving while others decode, chunked prefill on vs off."""
    vocab = int(model.config.vocab_size)
    D, N, P = args.mixed_decoders, args.mixed_prompts, args.mixed_len

    def workload(seed: int) -> list:
        dec = [(p, SamplingParams(max_tokens=args.mixed_max_tokens, ignore_eos=True))
               for p in _random_prompts(D, 32, vocab, seed=seed)]
        return dec + [(p, SamplingParams(max_tokens=16, ignore_eos=True))
                      for p in _random_prompts(N, P, vocab, seed=seed + 1)]
    # the long prompts arrive one by one, spread over the decoders' first half
    every = max(1, args.mixed_max_tokens // (2 * N))
    arrive = {D + i: 4 + i * every for i in range(N)}
    rows = []
    for label, budget in (("chunked", args.max_num_batched_tokens), ("whole", (D + N) * (P + 64))):
        llm = LLM(model, device=args.device, dtype=args.dtype, decode_mode=args.workload_mode,
                  buffer_size=args.buffer_size, max_num_seqs=D + N, cuda_graphs=args.cuda_graphs,
                  max_seq_len=-(-(max(P + 16, 32 + args.mixed_max_tokens) + 64) // 64) * 64,
                  max_num_batched_tokens=budget)
        drive(llm, workload(5), arrive)     # warm-up: every shape the timed run meets (kernel compiles)
        res = drive(llm, workload(7), arrive)
        r_dec, r_long = res["requests"][:D], res["requests"][D:]
        tokens = sum(r["tokens"] for r in res["requests"])
        gaps = sorted(_max_gap(r) for r in r_dec)
        row = {"prefill": label, "max_num_batched_tokens": budget, "decoders": D, "long_prompts": N, "long_len": P,
               "tokens": tokens, "tokens_per_s": tokens / res["wall"], "wall_s": res["wall"],
               "long_ttft_mean_ms": 1e3 * sum(r["first"] - r["submit"] for r in r_long) / N,
               "decoder_max_gap_ms": 1e3 * gaps[-1], "decoder_median_max_gap_ms": 1e3 * gaps[len(gaps) // 2]}
        rows.append(row)
        print(f"[bench e2e] mixed {label}: {row['tokens_per_s']:.0f} tok/s, long TTFT {row['long_ttft_mean_ms']:.0f} ms,"
              f" decoders' longest gap {row['decoder_max_gap_ms']:.0f} ms", file=sys.stderr, flush=True)
        del llm
        free_memory(args.device)
    return rows


def run(model, args, out: Path, desc: str) -> int:
    """Both sections; writes ``prefill.json`` (and ``prefill_ttft.png``) into ``out``."""
    res = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "model_desc": desc,
           "device_name": torch.cuda.get_device_name() if str(args.device).startswith("cuda") else "cpu"}
    res["ttft"] = run_ttft(model, args)
    res["mixed"] = run_mixed(model, args) if args.mixed_prompts else []
    (out / "prefill.json").write_text(json.dumps(res, indent=1, default=str))
    if not args.no_plots:
        try:
            _plot(res, out / "prefill_ttft.png")
        except ImportError:
            print("replayssm bench e2e: plot skipped: matplotlib is not installed", file=sys.stderr)
    print(f"model: {desc}; device {res['device_name']}; dtype {args.dtype}; mode {args.workload_mode}")
    print(f"{'prompt':>8}{'batch':>7}{'TTFT mean ms':>14}{'TTFT max ms':>13}{'prefill tok/s':>15}")
    for r in res["ttft"]:
        print(f"{r['prompt_len']:>8}{r['batch']:>7}{r['ttft_mean_ms']:>14.1f}{r['ttft_max_ms']:>13.1f}"
              f"{r['prefill_tokens_per_s']:>15.0f}")
    for r in res["mixed"]:
        print(f"mixed {r['prefill']:<8} budget {r['max_num_batched_tokens']:>7}: {r['tokens_per_s']:.0f} tok/s, "
              f"long-prompt TTFT {r['long_ttft_mean_ms']:.0f} ms, decoders' longest gap {r['decoder_max_gap_ms']:.0f} ms"
              f" (median {r['decoder_median_max_gap_ms']:.0f})")
    return 0


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for B in sorted({r["batch"] for r in res["ttft"]}):
        rows = [r for r in res["ttft"] if r["batch"] == B]
        ax.plot([r["prompt_len"] for r in rows], [r["ttft_max_ms"] for r in rows], marker="o", label=f"batch {B}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms, last of the batch)")
    ax.set_title(f"TTFT: {res['model_desc']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
