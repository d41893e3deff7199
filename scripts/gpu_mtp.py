"""MTP drafting on the Qwen3-Next-class preset: what it costs per step, where that time goes,
and what it buys against no speculation, n-gram and a draft model (one GPU, one call).

Random weights accept nothing real, so every speculative run verifies the *oracle's* tokens
(each request's greedy continuation from the plain run, each draft kept with probability
``--accept``) while the drafter does all of its own work every step (``bench mtp``'s
recipe): acceptance is the same for every drafter and the difference is what each costs.
bf16, replay form, CUDA graphs.  Sections:

1. **end to end** at each batch in ``--batches``: no speculation, n-gram, the MTP head (each
   drafter with ``spec_policy="fixed"``, always ``--num-tokens`` drafts, and ``"adaptive"``,
   the engine's default, whose chosen draft lengths and, after the batch, predicted drafter
   host ms per length (``host ms T1 .. T4``: what it prices ``propose`` at), predicted device
   step ms per length and pooled per-depth acceptance are printed; MTP also with every step
   forced to ``T = 0``, policy "T=0": what a plain step costs with the MTP drafter, whose
   head defers its catch-up into a window, against no speculation), and the draft model (a
   random 512-wide 8-layer Mamba-2 with the target's vocabulary) at ``--draft-batches``.
   Per row: generated tok/s, ratio to none, the mean accepted length, draft ms per
   speculative step (CUDA events from the start of ``propose`` to the completion of its
   kernels: the GPU is idle when a step starts) and host ms per step (the ``propose`` call
   alone), greedy mismatches against the plain run (must be 0).  One engine per drafter
   serves every batch in turn (graphs captured once); fixed and adaptive share it.
2. **breakdown** (MTP engine, null-slot rows, CUDA-graph replays back to back): the decode
   graph, the verify graph (``T`` drafts), the MTP draft graph, its catch-up-only graph,
   the window's write before a plain step ("w write", eager) and one window pass ("w pass":
   ``T + 1`` deferred pairs per row), draft then verify chained ("d+v"), the fused
   draft-and-verify graph (``mtp_fused``; "fused") and the sum of the two graphs alone, the
   LM head's GEMM (+ argmax) alone, one pass of the head's decoder layer over
   1 and ``T + 1`` pairs, the draft step priced as those parts ("parts": ``T`` heads, one
   catch-up pass, ``T - 1`` one-pair passes), and the bytes a draft step reads with the floor
   they give at the measured copy bandwidth; a kernel table (``torch.profiler``) of one MTP draft-graph replay
   at the smallest and largest batch: kernel time vs the replay's wall time.
3. **sync check**: engine steps (lengths scripted through runs of ``T = 0``) with
   ``torch.cuda.set_sync_debug_mode`` on from the start of ``propose`` to the return of the
   verify step and from ``plain_step`` to the return of the decode step: the count of
   synchronising CUDA calls and where each came from, for the MTP drafter (its own drafts:
   the window's passes and, with ``mtp_fused``, the fused graphs run here) and for the
   bench's oracle wrapper around it, twice each ("first": one-off work such as a lazy
   capture may sync; the second pass must count 0); each run's greedy output is checked
   against the plain run (must be 0 mismatches).

Usage (one H100 or H200; meant to take under 4 minutes; ``--no-fused`` and
``--draft-batches ''`` make it shorter)::

    PYTHONPATH=. python scripts/gpu_mtp.py

writes ``gpu_mtp.json`` to ``$OUT`` when set (after every part).  ``--sections breakdown,sync``
skips section 1 (builds the MTP engine alone).  CPU smoke run (tiny model, sections 2-3 are
CUDA-only): ``--preset qwen3-next-tiny --device cpu --batches 1,2 --draft-batches 2 --max-tokens 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch

from replayssm.bench.common import free_memory, graph_replay_ms, private_copy, warm_then_time
from replayssm.bench.e2e import (OracleDrafter, OracleTokens, _prompts, _random_model_dir, draft_length_steps,
                                 format_host_ms, format_lengths, predicted_host_ms, predicted_step_ms)
from replayssm.bench.mtp import TimedDrafter, _draft_dir
from replayssm.bench.random_mtp import add_random_mtp
from replayssm.engine.batching import bucket_for
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.engine.loading import load
from replayssm.engine.model_runner import GraphKey
from replayssm.engine.spec.policy import AdaptiveLengths, FixedLengths, ScriptedLengths


def _engine(model, args, max_batch: int, spec=None) -> LLM:
    return LLM(model, device=args.device, dtype=args.dtype, decode_mode="replay", speculative=spec,
               max_num_seqs=max_batch, max_seq_len=args.max_seq_len, buffer_size=args.buffer_size)


def _sweep(llm, args, batches, prompts, refs, label: str, policy: str) -> list[dict]:
    """Time each batch on ``llm`` (its drafter wrapped: oracle tokens, timed proposals)."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    cuda, V = args.device.startswith("cuda"), int(llm.model.config.vocab_size)
    inner, rows = llm.drafter, []
    for B in batches:
        timer = None
        if inner is not None:
            oracle = OracleDrafter(refs, args.num_tokens, args.accept, V, llm.device)
            timer = llm.drafter = TimedDrafter(OracleTokens(inner, oracle), cuda)
        outs, wall = warm_then_time(llm, prompts[B], prompts[B], params, args.device,
                                    on_warm=None if timer is None else timer.clear_timings)
        stats = dict(llm.stats)
        gen = sum(len(o.token_ids) for o in outs)
        row = {"batch": B, "drafter": label, "policy": policy, "tokens_per_s": gen / wall, "wall_s": wall,
               "mean_accepted_length": sum(o.mean_accepted_length for o in outs) / len(outs),
               "steps": stats["steps"], "outputs": [o.token_ids for o in outs]}
        if timer is not None:
            row["draft_ms_per_step"], row["draft_host_ms_per_step"] = timer.per_step_ms()
            row["draft_steps"] = timer.steps
            row["draft_lengths"] = draft_length_steps(stats)
            host = predicted_host_ms(llm.executor.lengths, B)
            if host:
                row["predicted_host_ms"] = host
                row["predicted_step_ms"] = predicted_step_ms(llm.executor.lengths, B)
                row["pooled_alpha"] = [round(a, 3) for a in llm.executor.lengths.acceptance.pooled]
        rows.append(row)
        print(f"[gpu_mtp] {label:<6} {policy:<8} B={B:<4} {row['tokens_per_s']:>9.0f} tok/s  acc "
              f"{row['mean_accepted_length']:.2f}  draft {row.get('draft_ms_per_step', 0):.2f} ms "
              f"(host {row.get('draft_host_ms_per_step', 0):.2f})  "
              f"{format_lengths(row.get('draft_lengths', {}))}  {format_host_ms(row.get('predicted_host_ms', {}))}"
              + (f"  device ms {' '.join(f'T{t} {v:.2f}' for t, v in row['predicted_step_ms'].items())}"
                 f"  pooled α {row['pooled_alpha']}" if "predicted_step_ms" in row else ""),
              file=sys.stderr, flush=True)
    llm.drafter = inner
    return rows


def _fixed_and_adaptive(llm, args, batches, prompts, refs, label: str, plain: bool = False) -> list[dict]:
    """The drafter with the fixed length (always ``num_tokens``), then the engine's adaptive
    policy; with ``plain``, also every step forced to ``T = 0`` (the drafter's cost of a plain
    step: MTP's window writes and, every ``window`` steps, its passes)."""
    adaptive = llm.executor.lengths
    llm.executor.lengths = FixedLengths((args.num_tokens,))
    rows = _sweep(llm, args, batches, prompts, refs, label, "fixed")
    if plain:
        llm.executor.lengths = ScriptedLengths((args.num_tokens,), [0])
        rows += _sweep(llm, args, batches, prompts, refs, label, "T=0")
    llm.executor.lengths = adaptive
    name = "adaptive" if isinstance(adaptive, AdaptiveLengths) else type(adaptive).__name__
    return rows + _sweep(llm, args, batches, prompts, refs, label, name)


# ---- section 2: the breakdown -------------------------------------------------------------------
def _events_ms(fn, n: int = 20) -> float:
    """Milliseconds per call of ``fn`` (graph replays), ``n`` back to back after one."""
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / n


def _copy_bandwidth(device) -> float:
    """Bytes per second of a 512 MiB device-to-device copy (read + write)."""
    x = torch.empty(256 << 20, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    ms = _events_ms(lambda: y.copy_(x), 10)
    return 2 * (512 << 20) / (ms / 1e3)


def _step_bytes(model, B: int, T: int, K1: int) -> dict:
    """Bytes one chain draft step of ``T`` drafts reads at ``B`` rows: the LM head ``T`` times,
    the head's layer ``T`` times (catch-up of ``K1`` pairs, then 1..T-1 tentative pairs), its
    routed experts at most ``min(E, top_k x tokens)`` per pass."""
    head = model.mtp
    W = model.head_weight()
    lm = W.numel() * W.element_size()
    exp = sum(p.numel() * p.element_size() for n, p in head.named_parameters() if ".experts." in n)
    other = sum(p.numel() * p.element_size() for n, p in head.named_parameters() if ".experts." not in n)
    E = int(getattr(model.config, "num_experts", 0) or 0)
    k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    per_expert = exp / E if E else 0
    tokens = [K1] + list(range(1, T))
    experts = sum(min(E, k * B * t) for t in tokens) * per_expert if E else 0
    return {"lm_head": T * lm, "layer_dense": T * other, "experts_upper": experts,
            "total": T * lm + T * other + experts, "lm_head_once": lm}


def _profile(fn, reps: int = 5) -> dict:
    """Kernel time per call of ``fn`` by kernel name (``torch.profiler``), top 10."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        t = getattr(e, "cuda_time_total", 0) if t is None else t
        if t > 0:
            rows.append((e.key, t / reps / 1e3, e.count / reps))
    rows.sort(key=lambda r: -r[1])
    return {"kernel_ms": sum(r[1] for r in rows), "kernels": sum(r[2] for r in rows),
            "top": [{"name": n[:90], "ms": ms, "per_call": c} for n, ms, c in rows[:10]]}


def _null(graphs, key, count_at=None):
    """The captured entry of ``key`` with its static index inputs reset to null-slot rows
    (the last real step's slots would be written again by a replay), or None."""
    g = graphs.get(key)
    if g is None:
        return None
    ins = g[1] if isinstance(g[1], (tuple, list)) else (g[1],)
    with torch.inference_mode():   # the graphs' static inputs are inference tensors
        _null_inputs(ins, count_at)
    return g


def _null_inputs(ins, count_at) -> None:
    for i, t in enumerate(ins):
        if t.dtype == torch.bool:    # valid: the root only
            t.zero_()
            t[:, 0] = True
        elif i == count_at:          # MTP pair counts: one pair
            t.fill_(1)
        elif not (t.dim() == 2 and i == 2 and count_at is None):   # a verify step's parent stays a chain
            t.zero_()


def breakdown(llm, model, args, batches) -> dict:
    dev, T = llm.device, args.num_tokens
    steps, runner = llm.drafter.steps, llm.runner
    form = runner._form()
    bw = _copy_bandwidth(dev)
    D = int(model.config.hidden_size)
    W = model.head_weight()
    out = {"copy_bandwidth_GBps": bw / 1e9, "batches": {}}
    print(f"\n== breakdown (null-slot rows, graph replays back to back; copy bandwidth {bw / 1e9:.0f} GB/s)")
    print(f"{'B':>5}{'decode':>8}{'verify':>8}{'draft':>8}{'catchup':>8}{'catch1':>8}{'w write':>8}{'w pass':>8}"
          f"{'d+v':>8}{'fused':>8}{'d+v sum':>8}"
          f"{'lm_head':>8}"
          f"{'+argmax':>8}{'pass 1':>8}{f'pass {T + 1}':>8}{'parts':>8}{'bytes GB':>9}{'floor':>7}   (ms)")
    for B in batches:
        Bp = bucket_for(runner.buckets, B)
        r = {"bucket": Bp}
        g = _null(runner._graphs, GraphKey("decode", Bp, form))
        r["decode_ms"] = _events_ms(g[0].replay) if g else float("nan")
        v = _null(runner._graphs, GraphKey("spec", Bp, form, T + 1, False))
        d = _null(steps.runner._graphs, (Bp, T + 1), count_at=3)
        c = _null(steps.plain_runner._graphs, (Bp, 1), count_at=3)
        c1 = _null(steps.plain_runner1._graphs, (Bp, 1), count_at=3)
        r["verify_ms"] = _events_ms(v[0].replay) if v else float("nan")
        r["draft_ms"] = _events_ms(d[0].replay) if d else float("nan")
        r["catchup_ms"] = _events_ms(c[0].replay) if c else float("nan")
        r["catchup_1pair_ms"] = _events_ms(c1[0].replay) if c1 else float("nan")
        r["draft_then_verify_ms"] = (_events_ms(lambda: (d[0].replay(), v[0].replay())) if d and v
                                     else float("nan"))
        fz = llm.drafter.fused
        f = _null(fz._graphs_for_form()._graphs, (Bp, T + 1), count_at=3) if fz is not None else None
        r["fused_ms"] = _events_ms(f[0].replay) if f else float("nan")
        # a plain step's drafter work with the window (its write, eager) and one window pass (graph)
        w, wp = llm.drafter.null_step(Bp, 0), llm.drafter.null_flush(Bp)
        r["window_write_ms"] = _events_ms(w) if w and llm.drafter.window else float("nan")
        r["window_pass_ms"] = _events_ms(wp) if wp else float("nan")
        x = torch.randn(Bp, D, dtype=W.dtype, device=dev)
        with torch.inference_mode():
            r["lm_head_ms"] = graph_replay_ms(lambda: torch.nn.functional.linear(x, W))
            r["lm_head_argmax_ms"] = graph_replay_ms(lambda: torch.nn.functional.linear(x, W).argmax(-1))
            for n in (1, T + 1):   # one pass of the head's layer (verify + roll back) on the null slot
                slots = torch.zeros(Bp, dtype=torch.long, device=dev)
                toks = torch.zeros(Bp, n, dtype=torch.long, device=dev)
                hid = torch.zeros(Bp, n, D, dtype=W.dtype, device=dev)
                zero = torch.zeros(Bp, dtype=torch.long, device=dev)

                def one_pass():
                    steps.head.verify(steps.cache, slots, toks, hid)
                    steps.head.commit(steps.cache, zero)

                r[f"layer_pass_{n}_ms"] = graph_replay_ms(one_pass)
        r["bytes"] = _step_bytes(model, Bp, T, steps.width)
        r["byte_floor_ms"] = r["bytes"]["total"] / bw * 1e3
        # the draft step as its parts: T heads (+ argmax), the catch-up pass, T - 1 tentative
        # passes (1..T-1 pairs; priced as one pair each, a lower bound)
        r["parts_ms"] = (T * r["lm_head_argmax_ms"] + r[f"layer_pass_{T + 1}_ms"]
                         + (T - 1) * r["layer_pass_1_ms"])
        out["batches"][B] = r
        print(f"{B:>5}{r['decode_ms']:>8.2f}{r['verify_ms']:>8.2f}{r['draft_ms']:>8.2f}{r['catchup_ms']:>8.2f}"
              f"{r['catchup_1pair_ms']:>8.2f}{r['window_write_ms']:>8.3f}{r['window_pass_ms']:>8.2f}"
              f"{r['draft_then_verify_ms']:>8.2f}{r['fused_ms']:>8.2f}"
              f"{r['draft_ms'] + r['verify_ms']:>8.2f}{r['lm_head_ms']:>8.3f}"
              f"{r['lm_head_argmax_ms']:>8.3f}{r['layer_pass_1_ms']:>8.3f}{r[f'layer_pass_{T + 1}_ms']:>8.3f}"
              f"{r['parts_ms']:>8.2f}{r['bytes']['total'] / 1e9:>9.2f}{r['byte_floor_ms']:>7.2f}")
    for B in sorted({batches[0], batches[-1]}):   # kernel tables last (the profiler may slow what follows)
        d = steps.runner._graphs.get((bucket_for(runner.buckets, B), T + 1))
        if d is not None:
            try:
                out["batches"][B]["profile"] = _profile(d[0].replay)
            except Exception as e:  # profiling may be unavailable on the machine
                out["batches"][B]["profile"] = {"error": repr(e)}
    for B, r in out["batches"].items():
        p = r.get("profile")
        if not p:
            continue
        if "error" in p:
            print(f"-- profile B={B}: {p['error']}")
            continue
        print(f"-- MTP draft graph at B={B}: {p['kernels']:.0f} kernels, {p['kernel_ms']:.2f} ms of kernel time "
              f"in a {r['draft_ms']:.2f} ms replay")
        for k in p["top"]:
            print(f"   {k['ms']:>7.3f} ms  x{k['per_call']:<4.0f} {k['name']}")
    return out


# ---- section 3: host syncs between drafting and verify ---------------------------------------
class _SyncWindow:
    """Turns CUDA sync warnings on at ``propose`` and at ``plain_step`` (MTP: the window
    write, or a full window's passes); the verify and decode steps' wrappers turn them off."""

    def __init__(self, inner, fused: bool = False):
        self.inner, self.fused = inner, fused

    def __getattr__(self, name):
        if name == "fused_step":   # (the property's AttributeError lands here)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, seqs, k=None):
        torch.cuda.set_sync_debug_mode(1)
        return self.inner.propose(seqs, k)

    def plain_step(self, seqs):
        torch.cuda.set_sync_debug_mode(1)
        return self.inner.plain_step(seqs)

    @property
    def fused_step(self):
        """The fused step (when asked for): its window ends with its return (it verified too)."""
        inner = getattr(self.inner, "fused_step", None) if self.fused else None
        if inner is None:
            raise AttributeError("fused_step")

        def run(seqs, k=None):
            torch.cuda.set_sync_debug_mode(1)
            try:
                return inner(seqs, k)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return run


def _where() -> str:
    """The innermost project frames of the current Python stack (where a sync warning came from)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "replayssm" in f.filename or "gpu_mtp" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def sync_check(llm, args, prompts, refs) -> dict:
    """Synchronising CUDA calls from the start of ``propose`` to the verify step's return and
    from ``plain_step`` to the decode step's return (lengths scripted through ``T = 0`` runs,
    so MTP's window writes and its passes on resume run too), with where each came from."""
    inner = llm.drafter
    runner = llm.runner
    verify, decode = runner.greedy_verify_step, runner.decode
    V = int(llm.model.config.vocab_size)

    def closing(fn):
        def run(*a, **kw):
            try:
                return fn(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return run

    adaptive = llm.executor.lengths
    T = args.num_tokens
    runner.greedy_verify_step, runner.decode = closing(verify), closing(decode)
    out, where, mism = {}, {}, {}
    try:
        pairs = [("mtp", inner)] + ([("mtp fused", inner)] if getattr(inner, "fused", None) is not None else [])
        if refs:   # the benchmarks' oracle wrapper (needs the plain run's continuations)
            pairs.append(("oracle(mtp)", OracleTokens(inner, OracleDrafter(refs, T, args.accept, V, llm.device))))
        for name, d in pairs:
            for rep in range(2):   # the second pass: what remains once everything ran once
                llm.executor.lengths = ScriptedLengths((T,), [T, 0, 0, 0, T, 0, T, T])
                llm.drafter = _SyncWindow(d, fused=name == "mtp fused")
                seen = []
                with warnings.catch_warnings():   # (restores showwarning on exit)
                    warnings.simplefilter("always")
                    warnings.showwarning = lambda msg, *a, **k: seen.append((str(msg), _where()))
                    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
                syncs = [w for m, w in seen if "synchroniz" in m]
                key = name if rep else f"{name} (first)"
                out[key] = len(syncs)
                where[key] = sorted(set(syncs))
                if refs:   # greedy output of the captured graphs (window passes, fused steps) = plain decoding
                    mism[key] = sum(o.token_ids[:len(r)] != r for o, r in
                                    ((o, refs[tuple(p)][:24]) for o, p in zip(outs, prompts)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        llm.drafter, llm.executor.lengths = inner, adaptive
        del runner.greedy_verify_step, runner.decode
    print("\n== sync check: synchronising CUDA calls from propose to verify and from plain_step to decode: "
          + ", ".join(f"{k} {v}" for k, v in out.items()))
    for k, ws in where.items():
        for w in ws:
            print(f"   {k}: {w}")
    if mism:
        print("   greedy mismatches against the plain run: " + ", ".join(f"{k} {v}" for k, v in mism.items()))
    return {"counts": out, "where": where, "mismatch": mism}


def report(rows: list[dict]) -> None:
    base = {r["batch"]: r for r in rows if r["drafter"] == "none"}
    print(f"\n{'B':>5} {'drafter':<7}{'policy':<9}{'tok/s':>9}{'vs none':>9}{'acc':>6}{'draft ms':>10}{'host ms':>9}"
          f"{'mism':>5}  chosen T")
    for r in sorted(rows, key=lambda r: (r["batch"], r["drafter"] != "none")):
        b = base.get(r["batch"])
        rel = r["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
        r["vs_none"] = rel
        r["mismatch"] = sum(x != y for x, y in zip(r["outputs"], b["outputs"])) if b else None
        print(f"{r['batch']:>5} {r['drafter']:<7}{r['policy']:<9}{r['tokens_per_s']:>9.0f}{rel:>8.2f}x"
              f"{r['mean_accepted_length']:>6.2f}{r.get('draft_ms_per_step', float('nan')):>10.2f}"
              f"{r.get('draft_host_ms_per_step', float('nan')):>9.2f}{r['mismatch'] or 0:>5}  "
              f"{format_lengths(r.get('draft_lengths', {}))}  {format_host_ms(r.get('predicted_host_ms', {}))}")


def _save(res: dict) -> None:
    """Write what was measured so far to ``$OUT/gpu_mtp.json`` (after every part: a run cut
    short by a time limit still leaves its rows)."""
    if not os.environ.get("OUT"):
        return
    os.makedirs(os.environ["OUT"], exist_ok=True)
    rows = [{k: v for k, v in r.items() if k != "outputs"} for r in res["rows"]]
    with open(os.path.join(os.environ["OUT"], "gpu_mtp.json"), "w") as f:
        json.dump({**res, "rows": rows}, f, indent=1, default=str)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-next-4b")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--draft-batches", default="16", help="batches of the draft-model rows ('' skips them)")
    p.add_argument("--drafters", default="ngram,mtp", help="besides none (and the draft model)")
    p.add_argument("--num-tokens", type=int, default=4)
    p.add_argument("--accept", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--sections", default="e2e,breakdown,sync")
    p.add_argument("--no-fused", dest="fused", action="store_false",
                   help="build the MTP engine without mtp_fused (no fused graphs to capture, time, sync-check)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    cuda = args.device.startswith("cuda")
    args.dtype = "bfloat16" if cuda else "float32"
    args.max_seq_len = -(-(args.prompt_len + args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    args.buffer_size = max(16, 2 * (args.num_tokens + 1))
    batches = [int(b) for b in args.batches.split(",") if b]
    dbatches = [int(b) for b in args.draft_batches.split(",") if b]
    drafters = [d for d in args.drafters.split(",") if d]
    sections = set(args.sections.split(","))
    t0 = time.perf_counter()
    res = {"config": {k: v for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = private_copy(_random_model_dir(args.preset, tmp), os.path.join(tmp, "target-mtp"))
        add_random_mtp(path)
        dt = getattr(torch, args.dtype)
        model = load(path, torch.device(args.device), dt, mtp=True)[0]
        V = int(model.config.vocab_size)
        res["config"]["device_name"] = torch.cuda.get_device_name() if cuda else "cpu"
        res["config"]["mtp_params"] = sum(q.numel() for q in model.mtp.parameters())
        prompts = {B: _prompts(B, args.prompt_len, V, seed=B) for B in sorted(set(batches + dbatches))}
        print(f"[gpu_mtp] model ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        e2e = "e2e" in sections
        refs: dict = {}
        if e2e:
            llm = _engine(model, args, max(batches + dbatches))
            rows = _sweep(llm, args, sorted(set(batches + dbatches)), prompts, None, "none", "-")
            refs = {tuple(prompts[r["batch"]][i]): o for r in rows for i, o in enumerate(r["outputs"])}
            res["rows"] += rows
            _save(res)
            del llm
            free_memory(args.device)
        else:   # sections 2-3 alone: the MTP engine only
            drafters, dbatches = ["mtp"], []
        if dbatches:   # before the MTP engine, which stays for sections 2-3
            dm = load(_draft_dir(V, tmp, 512, 8), torch.device(args.device), dt)[0]
            llm = _engine(model, args, max(dbatches), SpeculativeConfig("draft", num_tokens=args.num_tokens,
                                                                        draft_model=dm))
            res["rows"] += _fixed_and_adaptive(llm, args, dbatches, prompts, refs, "draft")
            _save(res)
            del llm, dm
            free_memory(args.device)
        mtp_llm = None
        for d in drafters:
            fused = {"mtp_fused": args.fused} if d == "mtp" else {}
            spec = SpeculativeConfig(d, num_tokens=args.num_tokens, **fused)
            llm = _engine(model, args, max(batches), spec)
            costs = getattr(llm.executor.lengths, "costs", None)   # the start-up table (CUDA), ms
            res["config"][f"{d}_start_cost_table_ms"] = {f"{b},{t}": v * 1e3 for (b, t), v
                                                         in (costs.table.items() if costs else [])}
            res["config"][f"{d}_capture_s"] = llm.capture_s
            if e2e:
                res["rows"] += _fixed_and_adaptive(llm, args, batches, prompts, refs, d, plain=(d == "mtp"))
                _save(res)
            if d == "mtp":
                mtp_llm = llm
            else:
                del llm
                free_memory(args.device)
        if res["rows"]:
            report(res["rows"])
        if mtp_llm is not None and cuda and "sync" in sections:
            B = min(4, max(batches))
            res["sync_check"] = sync_check(mtp_llm, args, prompts[max(batches)][:B], refs)
            _save(res)
        if mtp_llm is not None and cuda and "breakdown" in sections:
            res["breakdown"] = breakdown(mtp_llm, model, args, batches)
    for r in res["rows"]:
        r.pop("outputs", None)
    res["elapsed_s"] = time.perf_counter() - t0
    print(f"\n{args.preset}, {res['config']['device_name']}, {args.dtype}, T={args.num_tokens}, oracle "
          f"acceptance {args.accept}, {args.max_tokens} tokens per request; {res['elapsed_s']:.0f} s")
    fails = [f"B={r['batch']} {r['drafter']} {r['policy']}: {r['mismatch']} greedy mismatches"
             for r in res["rows"] if r.get("mismatch")]
    fails += [f"sync check {k}: {v} synchronising calls" for k, v in res.get("sync_check", {}).get("counts", {}).items()
              if v and "first" not in k]
    fails += [f"sync check {k}: {v} greedy mismatches" for k, v in res.get("sync_check", {}).get("mismatch", {}).items()
              if v]
    res["fails"] = fails
    _save(res)
    for f in fails:
        print("FAIL:", f)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
