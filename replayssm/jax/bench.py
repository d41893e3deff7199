"""Benchmark: the JAX backend's compiled decode loop against the PyTorch engine (CUDA graphs).

For each random-weight Mamba-2 preset of ``replayssm bench e2e`` (same builder, same
weights, same prompts), and each decode form and batch size:

* decode tokens/s of the PyTorch engine (``LLM``, ``cuda_graphs=True`` on CUDA) measured by
  ``replayssm.bench.e2e._run``, and of ``JaxLLM`` (one ``lax.while_loop`` for the whole
  decode phase; the first call compiles and is reported separately);
* prefill tokens/s (with final states written) of the engine's ``model.prefill`` and of the
  JAX chunked prefill (``jax.jit``), at a few (batch x tokens) shapes and SSD chunk sizes.

Both backends hold the same weights at once (bf16 on CUDA) and alternate per measurement,
so a run stopped by ``--time-budget`` still has matched pairs.  JAX does not preallocate GPU
memory here (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) so that torch can allocate beside it.

Run on the GPU machine (one call)::

    python scripts/bench_jax.py --out $OUT/bench_jax

Writes ``bench_jax.json`` (rewritten after every measurement, so a run cut short keeps
what it measured) and prints a short table last.  ``--smoke`` is a small CPU run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ..bench import e2e
from ..bench.common import free_memory
from ..engine.config import SamplingParams
from ..engine.llm import LLM
from ..models import load_model
from .params import from_torch_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_jax", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/bench_jax")
    p.add_argument("--presets", default="2.7b,small",
                   help="in this order (the time budget skips what is left): the large model first")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--modes", default="replay,recurrent")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--buffer-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=64, help="SSD chunk of the JAX decode runs' prefill")
    p.add_argument("--prefill-shapes", default="1x2048,16x512,64x256", help="BxT prefill shapes")
    p.add_argument("--prefill-chunks", default="64,256", help="SSD chunk sizes tried for the JAX prefill")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after the warm-up")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds; later measurements are skipped")
    p.add_argument("--no-torch", action="store_true", help="JAX only")
    p.add_argument("--layer-loop", default=None, choices=("scan", "group", "unroll"),
                   help="the JAX decode loop's layer loop (default: JaxLLM's, the grouped loop)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run")
    return p


class _Out:
    def __init__(self, path: Path, res: dict):
        self.path, self.res = path, res

    def add(self, kind: str, row: dict) -> None:
        self.res[kind].append(row)
        self.path.write_text(json.dumps(self.res, indent=1, default=str))
        print(f"[bench jax] {kind}: {row}", file=sys.stderr, flush=True)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU with torch
    # jax (an optional extra) is imported here, after the allocator setting above
    import jax
    import jax.numpy as jnp

    from . import model as M
    from .generate import JaxLLM, _with_chunk

    if args.smoke:
        args.presets, args.batch_sizes, args.max_tokens, args.prompt_len = "tiny", "1,4", 12, 16
        args.prefill_shapes, args.prefill_chunks, args.repeats = "2x64", "16", 1
    cuda = torch.cuda.is_available()
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    dtype = "bfloat16" if cuda else "float32"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
           "jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()],
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": dtype}
    res = {"config": vars(args), "env": env, "decode": [], "prefill": [], "skipped": []}
    out = _Out(out_dir / "bench_jax.json", res)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.prefill_shapes.split(",") if s]
    chunks = [int(c) for c in args.prefill_chunks.split(",") if c]

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_start > args.time_budget:
            res["skipped"].append(what)
            return True
        return False

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for preset in [p for p in args.presets.split(",") if p]:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            path = e2e._random_model_dir(preset, tmp)
            tmodel = load_model(path, device=device, dtype=dtype)
            spec, params = from_torch_model(tmodel, dtype)
            vocab = spec.vocab_size
            print(f"[bench jax] {preset}: built and loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            need = args.prompt_len + args.max_tokens + 16
            ns = SimpleNamespace(max_tokens=args.max_tokens, prompt_len=args.prompt_len, device=device, dtype=dtype,
                                 buffer_size=args.buffer_size, cuda_graphs=cuda, max_seq_len=-(-need // 64) * 64,
                                 spec_method=None, oracle_accept=1.0)
            # ---- decode: the PyTorch engine (CUDA graphs on CUDA), then the JAX loop, per row
            for mode in modes:
                for B in batches:
                    if not args.no_torch and not over_budget(f"torch decode {preset} {mode} B={B}"):
                        r = e2e._run(LLM, SamplingParams, tmodel, ns, B, mode)
                        out.add("decode", {"preset": preset, "backend": "torch", "mode": mode, "batch": B,
                                           "decode_tokens_per_s": r["decode_tokens_per_s"],
                                           "generated": r["generated"], "decode_s": r["decode_s"],
                                           "capture_s": r["capture_s"], "peak_memory_GB": r["peak_memory_GB"]})
                    if over_budget(f"jax decode {preset} {mode} B={B}"):
                        continue
                    llm = JaxLLM((spec, params), decode_mode=mode, buffer_size=args.buffer_size,
                                 chunk_size=args.chunk_size, layer_loop=args.layer_loop)
                    prompts = e2e._prompts(B, args.prompt_len, vocab, seed=B)
                    t1 = time.perf_counter()
                    jax_out = llm.generate(prompts, sp)
                    first = time.perf_counter() - t1
                    match = None
                    if B == batches[0]:   # greedy tokens vs the engine (eager) on the same prompts
                        ref = LLM(tmodel, device=device, dtype=dtype, decode_mode=mode, buffer_size=args.buffer_size,
                                  max_num_seqs=B, max_seq_len=ns.max_seq_len).generate(prompts, sp)
                        same = [sum(a == b for a, b in zip(o.token_ids, r.token_ids)) for o, r in zip(jax_out, ref)]
                        match = sum(same) / sum(len(r.token_ids) for r in ref)
                        free_memory(device)
                    stats = []
                    for _ in range(args.repeats):
                        llm.generate(prompts, sp)
                        stats.append(dict(llm.last_stats))
                    dec = _median([s["decode_s"] for s in stats])
                    gen = stats[-1]["generated"]
                    out.add("decode", {"preset": preset, "backend": "jax", "mode": mode, "batch": B,
                                       "decode_tokens_per_s": (gen - B) / dec, "generated": gen, "decode_s": dec,
                                       "prefill_s": _median([s["prefill_s"] for s in stats]),
                                       "first_call_s": first, "loop_steps": stats[-1]["loop_steps"],
                                       "layer_loop": llm.layer_loop,
                                       "tokens_match_torch": match})
                    del llm
            # ---- prefill (final states written): the engine's model.prefill, then JAX per chunk size
            for B, T in shapes:
                if not args.no_torch and not over_budget(f"torch prefill {preset} {B}x{T}"):
                    cache = tmodel.make_cache(B + 1, mode="replay", buffer_size=args.buffer_size,
                                              max_seq_len=T + 64, device=device)
                    slots = torch.arange(1, B + 1, device=device)
                    ids = torch.randint(0, vocab, (B, T), device=device)
                    lengths = torch.full((B,), T, dtype=torch.long, device=device)
                    times = []
                    for rep in range(args.repeats + 1):
                        cache.release(slots)
                        sync()
                        t1 = time.perf_counter()
                        tmodel.prefill(cache, slots, ids, lengths)
                        sync()
                        if rep:
                            times.append(time.perf_counter() - t1)
                    out.add("prefill", {"preset": preset, "backend": "torch", "batch": B, "tokens": T, "chunk": 64,
                                        "s": _median(times), "tokens_per_s": B * T / _median(times)})
                    del cache
                    free_memory(device)
                for q in chunks:
                    if over_budget(f"jax prefill {preset} {B}x{T} chunk {q}"):
                        continue
                    sq = _with_chunk(spec, q)

                    def run(p, ids, lengths, cache, sq=sq):
                        return M.prefill(sq, p, cache, ids, lengths)

                    # the cache is an argument (donated on GPUs), as the engine's is allocated once
                    fn = jax.jit(run, donate_argnums=(3,) if cuda else ())
                    cache = M.init_cache(sq, B, "replay", args.buffer_size, T + 64)
                    ids = jnp.asarray(torch.randint(0, vocab, (B, T)).numpy(), jnp.int32)
                    lengths = jnp.full((B,), T, jnp.int32)
                    t1 = time.perf_counter()
                    _, cache = jax.block_until_ready(fn(params, ids, lengths, cache))
                    first = time.perf_counter() - t1
                    times = []
                    for _ in range(args.repeats):
                        t1 = time.perf_counter()
                        _, cache = jax.block_until_ready(fn(params, ids, lengths, cache))
                        times.append(time.perf_counter() - t1)
                    out.add("prefill", {"preset": preset, "backend": "jax", "batch": B, "tokens": T, "chunk": q,
                                        "s": _median(times), "tokens_per_s": B * T / _median(times),
                                        "first_call_s": first})
                    del cache
                    del fn
            del tmodel
            free_memory(device)
            del params
    res["elapsed_s"] = time.perf_counter() - t_start
    out.path.write_text(json.dumps(res, indent=1, default=str))
    _table(res)
    return 0


def _table(res: dict) -> None:
    env = res["env"]
    print(f"device {env['device']} ({env['dtype']}); jax {env['jax']} on {env['jax_backend']}; "
          f"torch {env['torch']}; {env['date']}")
    print(f"{'preset':<7}{'mode':<10}{'B':>4}{'torch tok/s':>13}{'jax tok/s':>11}{'jax/torch':>10}")
    keys = sorted({(r["preset"], r["mode"], r["batch"]) for r in res["decode"]}, key=lambda k: (k[0], k[1], k[2]))
    for pr, mode, B in keys:
        got = {r["backend"]: r["decode_tokens_per_s"] for r in res["decode"]
               if (r["preset"], r["mode"], r["batch"]) == (pr, mode, B)}
        t, j = got.get("torch"), got.get("jax")
        ratio = f"{j / t:.2f}x" if t and j else "-"
        print(f"{pr:<7}{mode:<10}{B:>4}{t or float('nan'):>13.1f}{j or float('nan'):>11.1f}{ratio:>10}")
    print(f"{'preset':<7}{'prefill':<10}{'chunk':>6}{'tokens/s':>14}{'backend':>9}")
    for r in res["prefill"]:
        print(f"{r['preset']:<7}{str(r['batch']) + 'x' + str(r['tokens']):<10}{r['chunk']:>6}"
              f"{r['tokens_per_s']:>14.0f}{r['backend']:>9}")
    for s in res["skipped"]:
        print(f"skipped (time budget): {s}")
    print(f"elapsed {res.get('elapsed_s', 0):.0f}s")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
