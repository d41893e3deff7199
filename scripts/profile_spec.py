"""Where an engine step's wall time goes, plain decode vs greedy speculative verify (GPU).

Runs the engine (``LLM``, CUDA graphs) on a random-weight model of a bench preset (a Mamba-2
preset's width at fewer layers, or a whole hybrid preset), with the bench's oracle drafter (known continuation, each draft
right with probability ``--accept``), and reports per engine step:

* wall time of the step, unsynchronised (what the benchmark sees);
* the same step cut into phases with a device sync around each (draft, verify/decode
  call, host sync + bookkeeping), which attributes host time;
* GPU kernel time per decode step from ``torch.profiler`` (kernels inside graphs included;
  the prefill step is left out of the profile).

Usage (GPU)::

    PYTHONPATH=. python3 scripts/profile_spec.py --preset 2.7b --layers 16 --batch 16 --dtype float32
    PYTHONPATH=. python3 scripts/profile_spec.py --preset nemotron-h-4b --batch 256 --dtype bfloat16 --modes replay
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from replayssm.bench.e2e import PRESETS, OracleDrafter, _prompts, _random_model_dir
from replayssm.bench.hybrid_presets import HYBRID_PRESETS, random_hybrid_dir
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.models import load_model


DEV = "cuda"


def _sync():
    if DEV.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(obj, name: str, acc: dict, key: str):
    """Wrap ``obj.name`` so that each call's synchronised wall time adds to ``acc[key]``."""
    f = getattr(obj, name)

    def g(*a, **k):
        _sync()
        t = time.perf_counter()
        out = f(*a, **k)
        _sync()
        acc[key] += time.perf_counter() - t
        return out

    setattr(obj, name, g)
    return f


def run(model, args, mode: str, spec: bool, refs: dict, prompts) -> dict:
    B = args.batch
    sp = SpeculativeConfig("ngram", num_tokens=args.num_tokens) if spec else None
    llm = LLM(model, device=DEV, dtype=args.dtype, decode_mode=mode, buffer_size=args.buffer_size,
              speculative=sp, max_num_seqs=B, cuda_graphs=DEV.startswith("cuda"), max_seq_len=args.max_seq_len)
    if spec:
        llm.drafter = OracleDrafter(refs, args.num_tokens, args.accept, int(model.config.vocab_size), llm.device)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    warm = [p[:-1] + [(p[-1] + 1) % 7] for p in prompts]
    for p in warm:
        refs.setdefault(tuple(p), refs[tuple(prompts[0])])
    llm.generate(warm, SamplingParams(max_tokens=12, ignore_eos=True))  # captures graphs
    out = {"mode": mode, "spec": spec, "capture_s": llm.capture_s}

    def gen(prof=None):
        seqs = [llm.add_request(p, params) for p in prompts]
        llm.step()  # prefill (+ first step)
        _sync()
        if prof is not None:  # decode steps only
            prof.start()
        n, t0 = 0, time.perf_counter()
        while llm.has_unfinished():
            llm.step()
            n += 1
        _sync()
        return seqs, n, time.perf_counter() - t0

    seqs, n, wall = gen()
    toks = sum(len(s.output_ids) - 1 for s in seqs)
    out.update(steps=n, step_ms=wall / n * 1e3, tok_s=toks / wall,
               acc=sum(sum(s.accepted_lengths) / max(1, len(s.accepted_lengths)) for s in seqs) / len(seqs))
    # phases (synchronised)
    acc = defaultdict(float)
    if spec:
        _timed(llm.drafter, "propose", acc, "draft")
        _timed(llm.runner, "greedy_verify_step", acc, "verify_call")
    else:
        _timed(llm.runner, "decode", acc, "decode_call")
        _timed(llm.sampler, "sample", acc, "sample")
    _timed(llm, "step", acc, "step")
    seqs, n2, _ = gen()
    out["phases_ms"] = {k: v / (n2 + 1) * 1e3 for k, v in acc.items()}
    # GPU kernel time per step
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.startswith("cuda") else []))
    seqs, n3, _ = gen(prof)
    prof.stop()
    ka = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ka) / n3 / 1e3
    out["gpu_ms_per_step"] = gpu
    out["graph_keys"] = sorted(str(k) for k in llm.runner._graphs)
    out["graph_failed"] = sorted(str(k) for k in llm.runner._graph_failed)
    out["top_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60)
    out["top_gpu"] = ka.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60)
    llm = None  # not del: gen() above closes over it
    if DEV.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="2.7b")
    ap.add_argument("--layers", type=int, default=None, help="default: 16 for Mamba-2 presets, all for hybrids")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--buffer-size", type=int, default=16)
    ap.add_argument("--modes", default="recurrent,replay")
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tables", action="store_true", help="print the profiler tables")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    args.max_seq_len = 256
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset in HYBRID_PRESETS:
            mdir = random_hybrid_dir(args.preset, tmp, num_layers=args.layers)
        else:
            PRESETS["_prof"] = dict(PRESETS[args.preset], num_hidden_layers=args.layers or 16)
            mdir = _random_model_dir("_prof", tmp)
        model = load_model(mdir, device=DEV, dtype=getattr(torch, args.dtype))
    args.layers = model.config.num_hidden_layers
    prompts = _prompts(args.batch, 32, int(model.config.vocab_size), seed=1)
    ref = LLM(model, device=DEV, dtype=args.dtype, decode_mode="recurrent", max_num_seqs=args.batch,
              max_seq_len=args.max_seq_len)
    outs = ref.generate(prompts, SamplingParams(max_tokens=args.max_tokens + 8, ignore_eos=True))
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
    del ref
    print(f"{args.preset} width, {args.layers} layers, {args.dtype}, B={args.batch}, T={args.num_tokens}, "
          f"oracle accept {args.accept}")
    for mode in args.modes.split(","):
        for spec in (False, True):
            r = run(model, args, mode, spec, refs, prompts)
            ph = " ".join(f"{k}={v:.2f}" for k, v in r["phases_ms"].items())
            print(f"{mode:>9} {'spec' if spec else 'plain':>5}: step {r['step_ms']:.2f} ms, gpu {r['gpu_ms_per_step']:.2f}"
                  f" ms, {r['tok_s']:.0f} tok/s, acc {r['acc']:.2f}, {r['steps']} steps | synced: {ph}")
            print(f"    capture {r['capture_s']:.1f} s; graphs {r['graph_keys']} failed {r['graph_failed']}")
            if args.tables:
                print(r["top_cpu"])
                print(r["top_gpu"])


if __name__ == "__main__":
    main()
