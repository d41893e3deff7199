"""Tensor parallelism's fixed per-step costs on two GPUs: the greedy LM head and rank 0's host time.

The 2.7B random Mamba-2 preset (greedy-margin weights), bf16, replay decode, CUDA graphs, at
B = 1 / 64 / 256 (``--batches``):

* ``TP=1``;
* ``TP=2 gather``: ``REPLAYSSM_TP_GREEDY_LOCAL=0`` (greedy steps gather the vocabulary-sharded
  logits, ``[B, V]`` bf16 per step, then take the argmax: the path before);
* ``TP=2 local``: the default (each rank's shard gives its ``(max, index)`` per row, one
  ``[B, 2]`` all-gather picks the token; no logits gather).

Per row: decode ms per step (the engine's decode time / steps, best of two runs), the
captured decode graph replayed back to back (``graph ms``: the step's device time alone;
TP=2 local replays the greedy-token graph), their difference (``host ms``: what the host
and the ranks' hand-off add per step), tokens/s and its ratio to TP=1, and, at the largest
batch, the graph's NCCL all-gather kernels per step from the profiler.  Checks: TP=2 local's
tokens equal TP=2 gather's exactly (same shard logits, same argmax), the local rows really
ran greedy-token steps; agreement with TP=1's tokens is printed (bf16 sums differ in order
across ranks; the preset's margins keep them equal in practice).

Each TP size runs in a process of its own (``replayssm.bench.isolated``); both TP=2 variants
share one group (the switch is read by rank 0 when an engine builds its runner).
``PYTHONPATH=. python scripts/gpu_tp_greedy.py`` (two GPUs, ~3 min); writes
``gpu_tp_greedy.json`` under ``$OUT``; exit status 1 when a check fails.
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
DEV = os.environ.get("GPU_TP_GREEDY_DEVICE", "cuda:0")     # "cpu": a smoke run of the script itself


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:5.0f}s] {msg}", flush=True)


def _allgather_us(llm, B: int, greedy: bool, replays: int = 10) -> float:
    """µs per step of the all-gather kernels in the decode graph (:func:`graph_kernels`)."""
    from replayssm.bench.common import graph_kernels

    return sum(us for k, us, _ in graph_kernels(llm, B, replays, greedy=greedy) if "AllGather" in k)


class _SendTimer:
    """Rank 0's time from a call's start to its local part (encode the arguments, pickle,
    write the control ring: what tensor parallelism adds to rank 0's host work per message)
    and the decode steps and messages of the timed run (TP=1: zeros)."""

    def __init__(self, model):
        self.group = getattr(model, "_group", None)
        self.send_s, self.messages, self.steps = 0.0, 0, 0
        if self.group is None:
            return
        self.orig = self.group.call

        def call(target, method, local, args=(), kwargs=None, result=None):
            t0 = time.perf_counter()

            def timed_local(*a, **k):
                self.send_s += time.perf_counter() - t0
                return local(*a, **k)

            self.messages += 1
            self.steps += method == "decode"
            return self.orig(target, method, timed_local, args, kwargs, result)

        self.group.call = call

    def reset(self) -> None:
        self.send_s, self.messages, self.steps = 0.0, 0, 0

    def read(self) -> dict:
        return {"send_s": self.send_s, "messages": self.messages, "steps": self.steps}

    def undo(self) -> None:
        if self.group is not None:
            self.group.call = self.orig


def _rows(model, variants, batches, max_tokens: int, budget_s: float) -> list[dict]:
    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.bench.common import fastest_run, free_memory

    t_begin = time.perf_counter()
    V = int(model.config.vocab_size)
    out = []
    for name, env in variants:
        os.environ["REPLAYSSM_TP_GREEDY_LOCAL"] = env
        for B in batches:
            if time.perf_counter() - t_begin > budget_s:
                _log(f"{name} B={B}: skipped (budget)")
                continue
            prompts = e2e._prompts(B, 32, V, seed=B)
            with LLM(model, device=DEV, decode_mode="replay", max_num_seqs=B, cuda_graphs=True,
                     max_seq_len=128) as llm:
                sends = _SendTimer(model)
                r = fastest_run(llm, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), DEV, repeats=2,
                                on_warm=sends.reset, extra=sends.read)
                sends.undo()
                greedy = bool(llm.runner.greedy_decode)
                step_ms = 1e3 * B / r["decode_tokens_per_s"]
                graph_ms = float(llm.runner.replay_ms(B, 20, greedy=greedy))
                row = {"variant": name, "batch": B, "step_ms": step_ms, "graph_ms": graph_ms,
                       "host_ms": step_ms - graph_ms, "decode_tokens_per_s": r["decode_tokens_per_s"],
                       "greedy_token_graphs": greedy, "greedy_steps": int(llm.runner.num_calls["greedy_decode"]),
                       "capture_s": llm.capture_s, "outputs": r["outputs"],
                       "rank0_send_us_per_step": 1e6 * r["send_s"] / max(1, r["steps"]),
                       "messages_per_step": r["messages"] / max(1, r["steps"])}
                if B == max(batches) and DEV.startswith("cuda"):
                    row["allgather_us_per_step"] = _allgather_us(llm, B, greedy)
            free_memory(DEV)
            out.append(row)
            _log(f"{name} B={B}: {step_ms:.2f} ms/step, graph {graph_ms:.2f} ms, host {step_ms - graph_ms:.2f} ms, "
                 f"rank 0 encode+send {row['rank0_send_us_per_step']:.0f} µs/step "
                 f"({row['messages_per_step']:.1f} messages)"
                 + (f", all-gather {row['allgather_us_per_step']:.0f} µs/step" if "allgather_us_per_step" in row else ""))
    return out


def _run_tp(path: str, tp: int, batches, max_tokens: int, budget_s: float) -> dict:
    """One TP size (a fresh process): load, then every variant's rows."""
    from replayssm.engine.loading import load

    t = time.perf_counter()
    if tp == 1:
        model = load(path, torch.device(DEV), torch.bfloat16, 1)[0]
        variants = [("TP=1", "1")]
    else:
        from replayssm.distributed import TensorParallelGroup

        group = TensorParallelGroup(tp, DEV)
        model = group.load_model(path, "bfloat16")
        model.owns_group = True
        variants = [("TP=2 gather", "0"), ("TP=2 local", "1")]
    _log(f"TP={tp}: loaded in {time.perf_counter() - t:.1f} s")
    try:
        rows = _rows(model, variants, batches, max_tokens, budget_s - (time.perf_counter() - t))
    finally:
        if tp > 1:
            model.close()
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--budget-s", type=float, default=210.0, help="wall seconds to start rows within")
    ap.add_argument("--preset", default="2.7b", help="the random Mamba-2 preset (tiny: a CPU smoke run with "
                                                     "GPU_TP_GREEDY_DEVICE=cpu)")
    a = ap.parse_args()
    from replayssm.bench import e2e
    from replayssm.bench.isolated import run_isolated

    batches = [int(b) for b in a.batches.split(",")]
    cuda = DEV.startswith("cuda")
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count(),
           "preset": a.preset, "rows": [], "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir(a.preset, tmp)
        _log("checkpoint written")
        for tp in (1, 2):
            left = a.budget_s - (time.perf_counter() - T0)
            share = max(30.0, 0.4 * left if tp == 1 else left)    # TP=2 runs two variants
            r = run_isolated(_run_tp, path, tp, batches, a.max_tokens, share, timeout_s=share + 150)
            if "error" in r:
                _log(f"TP={tp} failed: {r['error']}")
                res["errors"].append({"tp": tp, "error": r["error"]})
                continue
            res["rows"] += r["rows"]
    rows = {(r["variant"], r["batch"]): r for r in res["rows"]}
    ok = not res["errors"]
    print(f"\n{'variant':<13}{'B':>5}{'ms/step':>9}{'graph ms':>10}{'host ms':>9}{'send µs':>9}{'tok/s':>9}"
          f"{'÷ TP=1':>8}{'all-gather µs':>15}{'= gather':>10}{'= TP=1':>8}")
    for r in res["rows"]:
        base = rows.get(("TP=1", r["batch"]))
        gath = rows.get(("TP=2 gather", r["batch"]))
        ratio = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else float("nan")
        same_g = "-"
        if r["variant"] == "TP=2 local" and gath is not None:
            same = r["outputs"] == gath["outputs"]
            ok &= same and r["greedy_steps"] > 0
            same_g = "yes" if same else "NO"
        same_1 = "-"
        if base is not None and r["variant"] != "TP=1":
            pairs = list(zip(r["outputs"], base["outputs"]))
            same_1 = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
        ag = r.get("allgather_us_per_step")
        print(f"{r['variant']:<13}{r['batch']:>5}{r['step_ms']:>9.2f}{r['graph_ms']:>10.2f}{r['host_ms']:>9.2f}"
              f"{r['rank0_send_us_per_step']:>9.0f}{r['decode_tokens_per_s']:>9.0f}{ratio:>7.2f}x{(f'{ag:.0f}' if ag is not None else '-'):>15}"
              f"{same_g:>10}{same_1:>8}")
        r["ratio_to_tp1"] = ratio
    for r in res["rows"]:
        r.pop("outputs")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "gpu_tp_greedy.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"checks {'passed' if ok else 'FAILED'}; total {time.perf_counter() - T0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
