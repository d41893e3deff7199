"""Where the JAX backend's decode step goes on the GPU, kernel by kernel, against the PyTorch
engine's captured step (one GPU, about 2 minutes).

For the random-weight ``--preset`` (default the 2.7B Mamba-2), bf16, batch ``--batch``:

* JAX: one warm ``JaxLLM.generate`` (compiles), then one traced with ``jax.profiler`` (a
  Perfetto trace); every GPU kernel event of the trace is grouped by name: launches and µs
  per decode step (the loop's steps), the kernels' total against the step's wall time (the
  rest is gaps between kernels: launch latency, host work, synchronisation);
* PyTorch: the engine's decode graph of the same batch replayed back to back under
  ``torch.profiler`` (``runner.replay_ms``), the same per-kernel table.

The two tables side by side say whether JAX is slower because it launches more kernels
(fusion), because its kernels are slower (the GEMV / scan kernels XLA picks), or because of
the gaps.  Prints both tables and a summary line; writes ``profile_jax.json`` to ``$OUT``.

    PYTHONPATH=. python scripts/profile_jax.py [--preset 2.7b] [--batch 1] [--mode replay]

``--preset tiny`` runs on CPU (a smoke test: the CPU trace has no GPU kernels).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch


def _options(items) -> dict:
    """``NAME=VALUE`` strings as compiler options (ints, booleans, else text)."""
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        low = v.strip().lower()
        out[k.strip()] = True if low == "true" else False if low == "false" else int(v) if v.strip().lstrip("-").isdigit() else v
    return out


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="2.7b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mode", default="replay", choices=("replay", "recurrent"))
    p.add_argument("--max-tokens", type=int, default=33)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--layer-loop", default=None, choices=(None, "scan", "group", "unroll"))
    p.add_argument("--layer-group", type=int, default=8, help="--layer-loop group: layers per group")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compiler option over the backend's (repeatable; VALUE an int, true/false or text)")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", default=os.environ.get("OUT"))
    return p.parse_args()


def _trace_kernels(trace_dir: str) -> tuple[dict, list]:
    """``{kernel name: [launches, total µs]}`` of the GPU events of the Perfetto trace under
    ``trace_dir`` (processes whose name says GPU / device / stream), and the process names."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True) + \
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return {}, []
    with gzip.open(sorted(files, key=os.path.getmtime)[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if any(k in n.lower() for k in ("gpu", "/device:", "stream"))
           and "host" not in n.lower()}
    out: dict = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            r = out[e.get("name", "?")]
            r[0] += 1
            r[1] += float(e.get("dur", 0.0))
    return dict(out), sorted(set(names.values()))


def _table(title: str, rows: dict, rows_n: int) -> None:
    tot_n = sum(r[0] for r in rows.values())
    tot_us = sum(r[1] for r in rows.values())
    print(f"\n{title}: {tot_n:.0f} launches, {tot_us:.0f} µs of kernels per step")
    for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:rows_n]:
        print(f"  {us:9.1f} µs {n:6.1f}x  {name[:100]}")


def main() -> int:
    a = _args()
    import jax

    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.bench.common import graph_kernels
    from replayssm.jax.generate import JaxLLM
    from replayssm.jax.params import from_torch_model
    from replayssm.models import load_model

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda:0", "bfloat16") if cuda else ("cpu", "float32")
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "jax": jax.__version__, "preset": a.preset,
           "batch": a.batch, "mode": a.mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    B = a.batch
    with tempfile.TemporaryDirectory() as tmp:
        tmodel = load_model(e2e._random_model_dir(a.preset, tmp), device=device, dtype=dtype)
        spec, params = from_torch_model(tmodel, dtype)
        prompts = e2e._prompts(B, a.prompt_len, spec.vocab_size, seed=B)
        sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
        jl = JaxLLM((spec, params), decode_mode=a.mode, buffer_size=16, chunk_size=64, layer_loop=a.layer_loop,
                    layer_group=a.layer_group, compiler_options=_options(a.xla_option) or None)
        jl.generate(prompts, sp)                      # compile
        jl.generate(prompts, sp)
        trace_dir = os.path.join(tmp, "trace")
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        jout = jl.generate(prompts, sp)
        jax.profiler.stop_trace()
        st = dict(jl.last_stats)
        steps = max(int(st.get("loop_steps", a.max_tokens - 1)), 1)
        kern, procs = _trace_kernels(trace_dir)
        jrows = {k: [n / steps, us / steps] for k, (n, us) in kern.items()}
        res["jax"] = {"decode_s": st["decode_s"], "steps": steps, "step_us": 1e6 * st["decode_s"] / steps,
                      "processes": procs, "kernels": sorted(([k, *v] for k, v in jrows.items()), key=lambda r: -r[2])[:80]}
        print(f"[profile_jax] trace processes: {procs}", file=sys.stderr)
        _table(f"JAX ({a.mode}, B={B}; step {res['jax']['step_us']:.0f} µs wall over {steps} loop steps)",
               jrows, a.rows)
        if cuda:
            with LLM(tmodel, device=device, dtype=dtype, decode_mode=a.mode, buffer_size=16, max_num_seqs=B,
                     cuda_graphs=True, max_seq_len=-(-(a.prompt_len + a.max_tokens + 16) // 64) * 64) as llm:
                tout = llm.generate(prompts, sp)
                graph_ms = llm.runner.replay_ms(B, 20)
                trows = {k: [n, us] for k, us, n in graph_kernels(llm, B)}
            res["torch"] = {"graph_us": 1e3 * graph_ms,
                            "kernels": sorted(([k, *v] for k, v in trows.items()), key=lambda r: -r[2])[:80]}
            _table(f"PyTorch engine (graph replay {1e3 * graph_ms:.0f} µs)", trows, a.rows)
            same = sum(sum(x == y for x, y in zip(j.token_ids, t.token_ids)) for j, t in zip(jout, tout))
            res["greedy_equal_frac"] = same / max(sum(len(t.token_ids) for t in tout), 1)
            jn, jus = sum(r[0] for r in jrows.values()), sum(r[1] for r in jrows.values())
            tn, tus = sum(r[0] for r in trows.values()), sum(r[1] for r in trows.values())
            print(f"\nsummary B={B} {a.mode}: JAX {jn:.0f} launches, {jus:.0f} µs kernels, "
                  f"{res['jax']['step_us']:.0f} µs a step | PyTorch {tn:.0f} launches, {tus:.0f} µs kernels, "
                  f"{1e3 * graph_ms:.0f} µs a graph replay | greedy equal {res['greedy_equal_frac']:.3f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile_jax.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
