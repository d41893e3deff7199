"""JAX backend on the GPU: speed against the PyTorch engine, bandwidth, prefill MFU, and
tensor-parallel scaling, in one run each (2.7B random-weight Mamba-2 preset, bf16).

One GPU (about 4 minutes; ``--time-budget`` skips what is left and still prints the table)::

    PYTHONPATH=. python scripts/gpu_jax.py

* decode tokens/s of the PyTorch engine (CUDA graphs) and of ``JaxLLM`` (one compiled loop)
  at B = 1, 64, 16 in the replay and recurrent forms, and their ratio; the greedy tokens of
  both at B = 64 (replay) compared;
* bytes per decode step (the least a step must move: every weight but the embedding once,
  plus per row: recurrent, the states and conv windows read and written; replay, the
  checkpoint ``S0`` read, the ring read at its mean fill ``(L-1)/2`` and one entry written,
  the flush's state write every ``L`` steps) times JAX steps/s, over the copy bandwidth
  measured here (``y = x + 1`` on a 2 GiB array: 2 bytes moved per byte);
* one variant against the default at B = 1 and 64 (``--variant``): ``unroll`` (the default:
  another layer loop than ``--layer-loop``'s -- ``"scan"`` against the grouped or unrolled
  loop, ``JaxLLM(layer_loop="unroll")`` against the scan: per-layer weights and caches read in
  place instead of sliced out of stacked arrays; its first call compiles every layer, so it
  takes longer) or ``reduce`` (``replayssm.jax.ops.set_step_readout``: outputs
  read from the old state beside the update): tokens/s over the engine's, and its greedy
  tokens against the default's;
* with ``--cost-analysis``: per decode row, the bytes of one compiled decode step as XLA
  compiles it here (``replayssm.jax.costs``: optimized HLO, loops counted) beside the ideal;
* prefill tokens/s with final states written at 16x512 and 64x256 (engine ``model.prefill``
  vs ``jax.jit`` of the JAX prefill, SSD chunk 64 and 128, the better kept), and MFU
  (``2 · params · tokens / s`` over the card's dense bf16 peak, 989 TFLOP/s for H100/H200).

Layer loops and XLA options (one GPU, about 5 minutes)::

    PYTHONPATH=. python scripts/gpu_jax.py --loops [--variants unroll,scan-dsf,scan-stock,group8]

* the PyTorch engine (CUDA graphs) at B = 1, 64, 16 in both forms, once;
* each variant (a layer loop and an XLA option set, :data:`LOOP_VARIANTS`) in its own
  process, killed at its time cap (``--variant-cap``; a slow compile cannot eat the call):
  the loop's compile seconds (first call minus a timed call), decode tok/s and its ratio to
  the engine's, ideal bytes per step times steps/s over the copy bandwidth measured here,
  the HLO bytes of one decode step as XLA compiles it for this GPU over the ideal (B = 1 and
  64, replay, when time is left), and its B = 1 greedy tokens against the engine's;
  ``--cache-dir`` gives the children JAX's persistent compilation cache (name a variant
  twice to time a warm start).

Two GPUs::

    PYTHONPATH=. python scripts/gpu_jax.py --tp 2

* ``JaxLLM(tensor_parallel_size=1)`` and ``=2`` at B = 64 (both forms, ``--layer-loop``'s loop,
  by default JaxLLM's: the grouped one): decode tokens/s, the
  ratio, and whether the greedy tokens agree (``jax.sharding``; the compiler inserts the
  collectives).

Prints a table; writes ``gpu_jax.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch allocates beside jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

PEAK_BF16 = 989e12


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="2: the tensor-parallel run (two GPUs)")
    p.add_argument("--preset", default="2.7b")
    p.add_argument("--batch-sizes", default="1,64,16")
    p.add_argument("--modes", default="replay,recurrent")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--buffer-size", type=int, default=16)
    p.add_argument("--prefill-shapes", default="16x512,64x256")
    p.add_argument("--prefill-chunks", default="64,128")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layer-loop", default=None, choices=("scan", "group", "unroll"),
                   help="the JAX runs' layer loop (default: JaxLLM's, the grouped loop)")
    p.add_argument("--variant", default="unroll", choices=("unroll", "reduce", "none"),
                   help="timed against the default at B = 1 and 64")
    p.add_argument("--cost-analysis", action="store_true",
                   help="compile each decode step abstractly and print its HLO bytes beside the ideal")
    p.add_argument("--time-budget", type=float, default=210.0, help="seconds; later measurements are skipped")
    p.add_argument("--loops", action="store_true", help="layer loops x XLA option sets, one process each")
    p.add_argument("--variants", default="unroll,scan-dsf,scan-stock,group8", help="--loops: of LOOP_VARIANTS")
    p.add_argument("--variant-cap", default="unroll=110,unroll-stock=60,*=45",
                   help="--loops: seconds per variant process (NAME=S, *=default)")
    p.add_argument("--loops-budget", type=float, default=285.0, help="--loops: seconds for the whole call")
    p.add_argument("--cache-dir", default=None, help="--loops: JAX persistent compilation cache of the children")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-in", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    for v in a.variants.split(",") if a.loops else []:
        if v not in LOOP_VARIANTS:
            p.error(f"unknown variant {v!r}: one of {sorted(LOOP_VARIANTS)}")
    return a


#: XLA's own option values (the backend's defaults dropped: replayssm.jax.compiler)
_STOCK = {"xla_gpu_enable_triton_gemm": None, "xla_gpu_autotune_level": None}
#: --loops variants: (layer_loop, layer_group, compiler_options over the backend's defaults)
LOOP_VARIANTS = {
    "unroll": ("unroll", 8, {}),                   # per-layer weights and caches, backend options
    "unroll-stock": ("unroll", 8, _STOCK),         # the same with XLA's autotuning and Triton GEMMs
    "unroll-at1": ("unroll", 8, {"xla_gpu_autotune_level": 1}),   # cuBLAS, a short autotune
    "scan": ("scan", 8, {}),                       # one scan over stacked weights, backend options
    "scan-stock": ("scan", 8, _STOCK),             # the loop measured before (0.42-0.49x)
    "scan-dsf": ("scan", 8, {"xla_gpu_enable_dynamic_slice_fusion": True}),   # cuBLAS reads the slice in place?
    "group8": ("group", 8, {}),                    # scan over groups of 8, the group unrolled
    "group8-dsf": ("group", 8, {"xla_gpu_enable_dynamic_slice_fusion": True}),
    # XLA's dot merger concatenates the weights of projections that share their input (the
    # Mamba-2 in_proj's z and x blocks: bf16[10240, 2560], 52 MB written and read again per
    # layer and step) into one GEMM; a threshold of 0 MB keeps the GEMMs apart
    "scan-nomerge": ("scan", 8, {"xla_gpu_dot_merger_threshold_mb": 0}),
    "scan-dsf-nomerge": ("scan", 8, {"xla_gpu_enable_dynamic_slice_fusion": True,
                                     "xla_gpu_dot_merger_threshold_mb": 0}),
    "group8-nomerge": ("group", 8, {"xla_gpu_dot_merger_threshold_mb": 0}),
    "unroll-nomerge": ("unroll", 8, {"xla_gpu_dot_merger_threshold_mb": 0}),
    "group16-nomerge": ("group", 16, {"xla_gpu_dot_merger_threshold_mb": 0}),
    "group32-nomerge": ("group", 32, {"xla_gpu_dot_merger_threshold_mb": 0}),
}


class Run:
    def __init__(self, args):
        self.args, self.t0, self.res = args, time.perf_counter(), {"decode": [], "prefill": [], "tp": [], "skipped": []}

    def left(self, what: str) -> bool:
        if time.perf_counter() - self.t0 > self.args.time_budget:
            self.res["skipped"].append(what)
            return False
        return True

    def log(self, kind: str, row: dict):
        self.res[kind].append(row)
        print(f"[gpu_jax] {kind}: {row}", file=sys.stderr, flush=True)
        self.save()

    def save(self):
        out = os.environ.get("OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "gpu_jax.json"), "w") as f:
                json.dump(self.res, f, indent=1, default=str)


def _copy_bandwidth(jax, jnp) -> float:
    """Bytes/s of ``y = x + 1`` over a 2 GiB float32 array (read + write)."""
    x = jnp.zeros((1 << (29 if jax.default_backend() != "cpu" else 24),), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    n = x.size
    del x
    return 2 * 4 * n / min(times)


def _sizes(spec, params, L: int, ctx: float = 0.0) -> dict:
    """Per-step byte counts of :data:`__doc__` (weights, per-row state / window / ring bytes);
    ``kv`` reads the entries of the row's whole context (``ctx`` tokens on average) and no state;
    ``auto`` is counted as replay (its rows switch at the threshold)."""
    import jax

    leaves = jax.tree_util.tree_leaves(params)
    wbytes = sum(a.size * a.dtype.itemsize for a in leaves) - params["embed"].size * params["embed"].dtype.itemsize
    if "head" not in params:   # tied: the head reads the embedding once
        wbytes += params["embed"].size * params["embed"].dtype.itemsize
    st = win = ring = 0
    for sb, cnt in spec.stages:
        m = sb.mixer
        if m.kind == "mamba":
            st += cnt * m.H * m.d * m.n * 4
            win += cnt * (m.W - 1) * m.conv_dim * 2
            ring += cnt * (m.H * m.d * 2 + m.G * m.n * 2 + m.H * 4)      # rx, rB (bf16), rdt (fp32) per entry
    rec = 2 * st + 2 * win
    rep = st + ring * ((L - 1) / 2 + 1) + st / L + 2 * win
    kv = ring * max(ctx, 1.0) + 2 * win
    return {"weights": wbytes, "recurrent_row": rec, "replay_row": rep, "kv_row": kv, "auto_row": rep,
            "state_row": st}


def _jax_decode(JaxLLM, SamplingParams, spec, params, mode, B, prompts, args, tp=1, layer_loop=None, llm=None):
    llm = llm or JaxLLM((spec, params), decode_mode=mode, buffer_size=args.buffer_size, chunk_size=64,
                        tensor_parallel_size=tp, layer_loop=layer_loop or args.layer_loop)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompts, sp)
    first = time.perf_counter() - t
    stats = []
    for _ in range(args.repeats):
        llm.generate(prompts, sp)
        stats.append(dict(llm.last_stats))
    dec = statistics.median(s["decode_s"] for s in stats)
    gen = stats[-1]["generated"]
    call = statistics.median(s["decode_s"] + s["prefill_s"] for s in stats)
    return {"tok_s": (gen - B) / dec, "layer_loop": llm.layer_loop, "steps": stats[-1]["loop_steps"], "decode_s": dec, "first_call_s": first,
            "compile_s": first - call,
            "tokens": [o.token_ids for o in out]}


def _other_loop(loop: str) -> str:
    """The layer loop the ``unroll`` variant times against ``loop``: the unrolled one against
    the scan, the scan against the grouped or unrolled loop."""
    return "unroll" if loop == "scan" else "scan"


def single(args, run: Run):
    import jax
    import jax.numpy as jnp

    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.bench.common import free_memory
    from replayssm.jax import model as M
    from replayssm.jax import ops
    from replayssm.jax.costs import loop_params, step_costs
    from replayssm.jax.generate import JaxLLM, _with_chunk
    from replayssm.jax.params import from_torch_model
    from replayssm.models import load_model
    from types import SimpleNamespace

    cuda = torch.cuda.is_available()   # a CPU run (tiny preset) only checks that the script works
    device, dtype = ("cuda:0", "bfloat16") if cuda else ("cpu", "float32")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run.res["env"] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "jax": jax.__version__, "jax_devices": str(jax.devices()),
                      "torch": torch.__version__}
    bw = _copy_bandwidth(jax, jnp)
    run.res["copy_GBps"] = bw / 1e9
    print(f"[gpu_jax] copy bandwidth {bw / 1e9:.0f} GB/s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir(args.preset, tmp)
        tmodel = load_model(path, device=device, dtype=dtype)
        spec, params = from_torch_model(tmodel, dtype)
        nparams = sum(a.size for a in jax.tree_util.tree_leaves(params))
        sizes = _sizes(spec, params, args.buffer_size, args.prompt_len + args.max_tokens / 2)
        run.res["sizes"] = sizes
        need = args.prompt_len + args.max_tokens + 16
        ns = SimpleNamespace(max_tokens=args.max_tokens, prompt_len=args.prompt_len, device=device, dtype=dtype,
                             buffer_size=args.buffer_size, cuda_graphs=cuda, max_seq_len=-(-need // 64) * 64,
                             spec_method=None, oracle_accept=1.0)
        def decode(mode, B):
            r = e2e._run(LLM, SamplingParams, tmodel, ns, B, mode)
            prompts = e2e._prompts(B, args.prompt_len, spec.vocab_size, seed=B)
            j = _jax_decode(JaxLLM, SamplingParams, spec, params, mode, B, prompts, args)
            match = None
            if B == 64 and mode == "replay":   # greedy tokens vs the engine (eager) on the same prompts
                ref = LLM(tmodel, device=device, dtype=dtype, decode_mode=mode, buffer_size=args.buffer_size,
                          max_num_seqs=B, max_seq_len=ns.max_seq_len).generate(
                              prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
                same = sum(sum(a == b for a, b in zip(t, o.token_ids)) for t, o in zip(j["tokens"], ref))
                match = same / sum(len(o.token_ids) for o in ref)
                free_memory(device)
            red = None
            if args.variant != "none" and B in (1, 64) and run.left(f"{args.variant} {mode} B={B}"):
                if args.variant == "reduce":   # the step readout (replayssm.jax.ops)
                    ops.set_step_readout("reduce")
                    try:
                        red = _jax_decode(JaxLLM, SamplingParams, spec, params, mode, B, prompts, args)
                    finally:
                        ops.set_step_readout("dot")
                else:                          # the other layer loop
                    other = _other_loop(j["layer_loop"])
                    red = _jax_decode(JaxLLM, SamplingParams, spec, params, mode, B, prompts, args, layer_loop=other)
                same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(red["tokens"], j["tokens"]))
                red["match_dot"] = same / sum(len(x) for x in j["tokens"])
            cost = None
            if args.cost_analysis and run.left(f"cost analysis {mode} B={B}"):
                p = loop_params(params, j["layer_loop"], 8)
                cost = step_costs(spec, p, mode, B, args.buffer_size, top=3)
            row_bytes = sizes[f"{mode}_row"]
            step_bytes = sizes["weights"] + B * row_bytes
            steps_s = j["tok_s"] / B
            run.log("decode", {"mode": mode, "batch": B, "torch_tok_s": r["decode_tokens_per_s"],
                               "jax_tok_s": j["tok_s"], "ratio": j["tok_s"] / r["decode_tokens_per_s"],
                               "jax_first_call_s": j["first_call_s"], "bytes_per_step": step_bytes,
                               "jax_bw_frac": step_bytes * steps_s / bw,
                               "torch_bw_frac": step_bytes * r["decode_tokens_per_s"] / B / bw,
                               "tokens_match_torch": match,
                               "jax_reduce_tok_s": red and red["tok_s"],
                               "reduce_ratio": red and red["tok_s"] / r["decode_tokens_per_s"],
                               "reduce_tokens_match_dot": red and red["match_dot"],
                               "layer_loop": j["layer_loop"],
                               "variant": args.variant if args.variant != "unroll" else _other_loop(j["layer_loop"]),
                               "variant_first_call_s": red and red["first_call_s"],
                               "step_hlo_bytes": cost and cost["hlo"], "step_ideal_bytes": cost and cost["ideal"],
                               "step_xla_bytes": cost and cost["xla"], "step_top": cost and cost["top"]})

        batches = [int(b) for b in args.batch_sizes.split(",")]
        first, later = [b for b in batches if b in (1, 64)], [b for b in batches if b not in (1, 64)]
        for B in first:                  # B = 1 and 64 first (bandwidth), then prefill, then the rest
            for mode in args.modes.split(","):
                if run.left(f"decode {mode} B={B}"):
                    decode(mode, B)
        for shape in [s for s in args.prefill_shapes.split(",") if s]:   # "": no prefill
            B, T = (int(v) for v in shape.split("x"))
            if not run.left(f"prefill {shape}"):
                continue
            cache = tmodel.make_cache(B + 1, mode="replay", buffer_size=args.buffer_size, max_seq_len=T + 64,
                                      device=device)
            slots = torch.arange(1, B + 1, device=device)
            ids = torch.randint(0, spec.vocab_size, (B, T), device=device)
            lengths = torch.full((B,), T, dtype=torch.long, device=device)
            times = []
            for rep in range(args.repeats + 1):
                cache.release(slots)
                sync()
                t = time.perf_counter()
                tmodel.prefill(cache, slots, ids, lengths)
                sync()
                if rep:
                    times.append(time.perf_counter() - t)
            t_torch = min(times)
            del cache
            free_memory(device)
            best = None
            jids = jnp.asarray(ids.cpu().numpy(), jnp.int32)
            jlen = jnp.full((B,), T, jnp.int32)
            for q in [int(c) for c in args.prefill_chunks.split(",")]:
                sq = _with_chunk(spec, q)
                fn = jax.jit(lambda p, i, n, c, sq=sq: M.prefill(sq, p, c, i, n), donate_argnums=(3,) if cuda else ())
                jc = M.init_cache(sq, B, "replay", args.buffer_size, T + 64)
                _, jc = jax.block_until_ready(fn(params, jids, jlen, jc))
                ts = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    _, jc = jax.block_until_ready(fn(params, jids, jlen, jc))
                    ts.append(time.perf_counter() - t)
                del jc, fn
                if best is None or min(ts) < best[1]:
                    best = (q, min(ts))
            flops = 2 * nparams * B * T
            run.log("prefill", {"shape": shape, "torch_tok_s": B * T / t_torch, "jax_tok_s": B * T / best[1],
                                "ratio": t_torch / best[1], "jax_chunk": best[0], "torch_mfu": flops / t_torch / PEAK_BF16,
                                "jax_mfu": flops / best[1] / PEAK_BF16})
        for B in later:
            for mode in args.modes.split(","):
                if run.left(f"decode {mode} B={B}"):
                    decode(mode, B)
    _table(run.res)


_LOOP_ORDER = [("replay", 1), ("replay", 64), ("recurrent", 1), ("recurrent", 64), ("replay", 16), ("recurrent", 16)]


def _caps(text: str) -> dict:
    caps = {}
    for part in text.split(","):
        k, v = part.split("=")
        caps[k.strip()] = float(v)
    return caps


def loops(args, run: Run):
    """The --loops comparison (module docstring): engine once, then a process per variant."""
    import pickle
    import subprocess

    import jax
    import jax.numpy as jnp

    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.bench.common import free_memory
    from replayssm.jax.params import from_torch_model
    from replayssm.models import load_model
    from types import SimpleNamespace

    cuda = torch.cuda.is_available()   # a CPU run (tiny preset) only checks that the script works
    device, dtype = ("cuda:0", "bfloat16") if cuda else ("cpu", "float32")
    run.res.update(env={"device": torch.cuda.get_device_name() if cuda else "cpu", "jax": jax.__version__,
                        "torch": torch.__version__}, loops=[], torch=[])
    bw = _copy_bandwidth(jax, jnp)
    run.res["copy_GBps"] = bw / 1e9
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    order = [(m, b) for m, b in _LOOP_ORDER if m in modes and b in batches] + \
        [(m, b) for b in batches for m in modes if (m, b) not in _LOOP_ORDER]
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir(args.preset, tmp)
        tmodel = load_model(path, device=device, dtype=dtype)
        spec, params = from_torch_model(tmodel, dtype)
        run.res["sizes"] = _sizes(spec, params, args.buffer_size)
        blob = os.path.join(tmp, "params.pkl")
        with open(blob, "wb") as f:   # the children load this (no torch model to build)
            pickle.dump((spec, jax.device_get(params)), f, protocol=5)
        del params
        need = args.prompt_len + args.max_tokens + 16
        ns = SimpleNamespace(max_tokens=args.max_tokens, prompt_len=args.prompt_len, device=device, dtype=dtype,
                             buffer_size=args.buffer_size, cuda_graphs=cuda, max_seq_len=-(-need // 64) * 64,
                             spec_method=None, oracle_accept=1.0)
        for mode, B in order:
            r = e2e._run(LLM, SamplingParams, tmodel, ns, B, mode)
            run.log("torch", {"mode": mode, "batch": B, "tok_s": r["decode_tokens_per_s"]})
        prompts = e2e._prompts(1, args.prompt_len, spec.vocab_size, seed=1)
        ref = LLM(tmodel, device=device, dtype=dtype, decode_mode="replay", buffer_size=args.buffer_size,
                  max_num_seqs=1, max_seq_len=ns.max_seq_len).generate(
                      prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))[0].token_ids
        del tmodel
        free_memory(device)
        caps = _caps(args.variant_cap)
        for v in args.variants.split(","):
            left = args.loops_budget - (time.perf_counter() - run.t0)
            cap = min(caps.get(v, caps.get("*", 45.0)), left)
            if cap < 20:
                run.res["skipped"].append(f"variant {v}")
                continue
            out = os.path.join(tmp, f"rows-{v}-{len(run.res['loops'])}.jsonl")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--child-in", blob, "--child-out", out,
                   "--modes", args.modes, "--batch-sizes", args.batch_sizes, "--max-tokens", str(args.max_tokens),
                   "--prompt-len", str(args.prompt_len), "--buffer-size", str(args.buffer_size),
                   "--repeats", str(args.repeats)] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
            t = time.perf_counter()
            try:
                rc = subprocess.run(cmd, timeout=cap, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            rows = []
            if os.path.exists(out):
                with open(out) as f:
                    rows = [json.loads(line) for line in f if line.strip()]
            torch_tok = {(r["mode"], r["batch"]): r["tok_s"] for r in run.res["torch"]}
            for r in rows:
                if "tok_s" in r:
                    tt = torch_tok.get((r["mode"], r["batch"]))
                    step_bytes = run.res["sizes"]["weights"] + r["batch"] * run.res["sizes"][f"{r['mode']}_row"]
                    r.update(ratio=tt and r["tok_s"] / tt, bw_frac=step_bytes * r["tok_s"] / r["batch"] / bw,
                             torch_bw_frac=tt and step_bytes * tt / r["batch"] / bw)
                    if r.get("tokens") is not None:
                        r["match_torch"] = sum(a == b for a, b in zip(r.pop("tokens"), ref)) / len(ref)
            run.log("loops", {"variant": v, "rc": rc, "wall_s": time.perf_counter() - t, "cap_s": cap, "rows": rows})
    _loops_table(run.res)


def _child(args):
    """One --loops variant (own process): every (mode, B) it has time for, a row each."""
    import pickle

    import jax

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from replayssm import SamplingParams
    from replayssm.bench import e2e
    from replayssm.jax import costs
    from replayssm.jax.compiler import compiler_options
    from replayssm.jax.generate import JaxLLM

    loop, group, extra = LOOP_VARIANTS[args.child]
    opts = compiler_options(extra)

    def emit(row):
        with open(args.child_out, "a") as f:
            f.write(json.dumps({"variant": args.child, **row}, default=str) + "\n")

    with open(args.child_in, "rb") as f:
        spec, params = pickle.load(f)
    params = jax.device_put(params)
    emit({"options": opts, "layer_loop": loop, "layer_group": group})
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    order = [(m, b) for m, b in _LOOP_ORDER if m in modes and b in batches] + \
        [(m, b) for b in batches for m in modes if (m, b) not in _LOOP_ORDER]
    llms = {}
    p = costs.loop_params(params, loop, group)

    def step_bytes(B):   # one decode step's bytes as XLA compiles it here (B = 1 early: it is cheap)
        c = costs.step_costs(spec, p, "replay", B, args.buffer_size, top=3, compiler_options=opts)
        emit({"mode": "replay", "batch": B, "hlo_over_ideal": c["hlo_over_ideal"], "step_compile_s": c["compile_s"],
              "top": c["top"]})

    for n, (mode, B) in enumerate(order):
        if mode not in llms:   # one engine per form: its programs are cached per batch shape
            llms[mode] = JaxLLM((spec, params), decode_mode=mode, buffer_size=args.buffer_size, chunk_size=64,
                                layer_loop=loop, layer_group=group, compiler_options=extra)
        prompts = e2e._prompts(B, args.prompt_len, spec.vocab_size, seed=B)
        j = _jax_decode(JaxLLM, SamplingParams, spec, None, mode, B, prompts, args, llm=llms[mode])
        emit({"mode": mode, "batch": B, "tok_s": j["tok_s"], "compile_s": j["compile_s"],
              "first_call_s": j["first_call_s"], "tokens": j["tokens"][0] if B == 1 and mode == "replay" else None})
        if n == 0 and 1 in batches:
            step_bytes(1)
    if 64 in batches:
        step_bytes(64)


def _loops_table(res: dict):
    print(json.dumps(res.get("env", {})))
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s; weights {res['sizes']['weights'] / 1e9:.2f} GB/step")
    print("torch (CUDA graphs) tok/s: " + ", ".join(f"{r['mode']} B={r['batch']} {r['tok_s']:.0f}" for r in res["torch"]))
    print(f"{'variant':<13}{'mode':<10}{'B':>4}{'compile s':>10}{'jax tok/s':>10}{'jax/torch':>10}{'jax %copy':>10}"
          f"{'torch %copy':>12}{'match':>7}{'HLO/ideal':>10}")
    for v in res["loops"]:
        rows = [r for r in v["rows"] if "mode" in r]
        hlo = {r["batch"]: r["hlo_over_ideal"] for r in rows if "hlo_over_ideal" in r}
        for r in [r for r in rows if "tok_s" in r]:
            m = "-" if r.get("match_torch") is None else f"{r['match_torch']:.2f}"
            h = hlo.get(r["batch"]) if r["mode"] == "replay" else None
            tb = "-" if r.get("torch_bw_frac") is None else f"{100 * r['torch_bw_frac']:.0f}%"
            ra = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
            print(f"{v['variant']:<13}{r['mode']:<10}{r['batch']:>4}{r['compile_s']:>10.1f}{r['tok_s']:>10.0f}{ra:>10}"
                  f"{100 * r['bw_frac']:>9.0f}%{tb:>12}{m:>7}{'-' if h is None else f'{h:.2f}':>10}")
        if not any("tok_s" in r for r in rows):
            print(f"{v['variant']:<13}no decode row within {v['cap_s']:.0f} s (rc {v['rc']})")
        elif v["rc"] != 0:
            print(f"{v['variant']:<13}stopped at its {v['cap_s']:.0f}-s cap (rc {v['rc']}); rows above are what finished")
    for s in res["skipped"]:
        print(f"skipped (time budget): {s}")


def tensor_parallel(args, run: Run):
    import jax

    from replayssm import SamplingParams
    from replayssm.bench import e2e
    from replayssm.jax.generate import JaxLLM
    from replayssm.jax.params import from_torch_model
    from replayssm.models import load_model

    run.res["env"] = {"jax": jax.__version__, "jax_devices": str(jax.devices())}
    if len(jax.devices()) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices; jax sees {jax.devices()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir(args.preset, tmp)
        spec, params = from_torch_model(load_model(path, device="cpu", dtype="bfloat16"), "bfloat16")
        B = 64
        prompts = e2e._prompts(B, args.prompt_len, spec.vocab_size, seed=B)
        for mode in args.modes.split(","):
            if not run.left(f"tp {mode}"):
                continue
            one = _jax_decode(JaxLLM, SamplingParams, spec, params, mode, B, prompts, args, tp=1)
            many = _jax_decode(JaxLLM, SamplingParams, spec, params, mode, B, prompts, args, tp=args.tp)
            same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(one["tokens"], many["tokens"]))
            run.log("tp", {"mode": mode, "batch": B, "layer_loop": many["layer_loop"], "tp1_tok_s": one["tok_s"], f"tp{args.tp}_tok_s": many["tok_s"],
                           "ratio": many["tok_s"] / one["tok_s"],
                           "tokens_match": same / sum(len(x) for x in one["tokens"])})
    _table(run.res)


def _table(res: dict):
    print(json.dumps(res.get("env", {})))
    if "copy_GBps" in res:
        print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s; weights {res['sizes']['weights'] / 1e9:.2f} GB/step")
    if res["decode"]:
        print(f"{'mode':<10}{'B':>4}{'torch tok/s':>13}{'jax tok/s':>11}{'jax/torch':>10}{'jax %copy':>10}"
              f"{'torch %copy':>12}{'match':>7}  {'variant/torch (tokens = default)':<33}{'HLO GB/step (ideal)':<20}")
        for r in res["decode"]:
            m = "-" if r["tokens_match_torch"] is None else f"{r['tokens_match_torch']:.2f}"
            red = "-" if not r.get("reduce_ratio") else f"{r['reduce_ratio']:.2f}x ({r['reduce_tokens_match_dot']:.2f})"
            red = red if red == "-" else f"{r.get('variant', 'reduce')} {red}"
            hb = "-" if not r.get("step_hlo_bytes") else f"{r['step_hlo_bytes'] / 1e9:.2f} ({r['step_ideal_bytes'] / 1e9:.2f})"
            print(f"{r['mode']:<10}{r['batch']:>4}{r['torch_tok_s']:>13.0f}{r['jax_tok_s']:>11.0f}{r['ratio']:>9.2f}x"
                  f"{100 * r['jax_bw_frac']:>9.0f}%{100 * r['torch_bw_frac']:>11.0f}%{m:>7}  {red:<33}{hb:<20}")
    if res["prefill"]:
        print(f"{'prefill':<9}{'torch tok/s':>13}{'jax tok/s':>11}{'jax/torch':>10}{'chunk':>6}{'torch MFU':>10}{'jax MFU':>9}")
        for r in res["prefill"]:
            print(f"{r['shape']:<9}{r['torch_tok_s']:>13.0f}{r['jax_tok_s']:>11.0f}{r['ratio']:>9.2f}x{r['jax_chunk']:>6}"
                  f"{100 * r['torch_mfu']:>9.1f}%{100 * r['jax_mfu']:>8.1f}%")
    for r in res["tp"]:
        keys = [k for k in r if k.startswith("tp") and k.endswith("_tok_s")]
        print(f"TP {r['mode']:<10} B={r['batch']} ({r['layer_loop']}): " + ", ".join(f"{k} {r[k]:.0f}" for k in keys)
              + f"; ratio {r['ratio']:.2f}x; tokens match {r['tokens_match']:.2f}")
    for s in res["skipped"]:
        print(f"skipped (time budget): {s}")


def main():
    args = _args()
    if args.child:
        _child(args)
        return
    run = Run(args)
    if args.loops:
        loops(args, run)
    elif args.tp > 1:
        tensor_parallel(args, run)
    else:
        single(args, run)
    run.res["elapsed_s"] = time.perf_counter() - run.t0
    run.save()
    print(f"elapsed {run.res['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
