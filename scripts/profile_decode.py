"""Where a decode step's and a verify step's GPU time goes, per layer type.

Builds a random-weight model of a ``bench e2e`` preset (a Mamba-2 preset at fewer layers, or a
hybrid preset: ``nemotron-h-4b`` / ``qwen3-next-4b``, whole or its first ``--layers`` layers),
prefills ``--context`` tokens per row, then for each mode profiles (``torch.profiler``, eager)
one decode step and one verify+commit step of ``--T`` tokens, and times the decode step
replayed from a CUDA graph.  Every mixer and feed-forward module is wrapped in a
``record_function`` named after its type; a type's time is the GPU kernel time launched inside
its modules (``forward`` and ``commit``), and *glue* is the rest of the step's kernel time
(embedding, block norms, residual adds, LM head, step bookkeeping).

Caveat (H100, torch 2.11, 2026-11-25): the profiler does not link Triton launches to the
enclosing ranges, so every Triton kernel (the SSM, attention, MoE, conv and norm kernels) is
counted in *glue*, not in its layer type.  Read the per-kernel table (``--rows``, or
``--top`` into the JSON) for where a step goes.  Usage (GPU):

    python3 scripts/profile_decode.py --preset 2.7b --layers 8 --batch 256
    python3 scripts/profile_decode.py --preset qwen3-next-4b --batch 64 --context 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from replayssm.bench.common import graph_replay_ms
from replayssm.bench.e2e import PRESETS, _random_model_dir
from replayssm.bench.hybrid_presets import HYBRID_PRESETS, random_hybrid_dir
from replayssm.layers.attention import Attention
from replayssm.layers.gdn import GatedDeltaNet
from replayssm.layers.mamba2 import Mamba2Mixer
from replayssm.layers.mlp import GatedMLP, PlainMLP, SigmoidMoE, SoftmaxMoE
from replayssm.models import load_model

LAYER_TYPES = ((Mamba2Mixer, "mamba"), (GatedDeltaNet, "gdn"), (Attention, "attention"), (SoftmaxMoE, "moe"),
               (SigmoidMoE, "moe"), (GatedMLP, "mlp"), (PlainMLP, "mlp"))
TAG = "layer::"


def _labelled(f, label):
    def g(*a, **k):
        with record_function(label):
            return f(*a, **k)

    return g


def label_layers(model) -> None:
    """Wrap each mixer / feed-forward module's ``forward`` and ``commit`` in a profiler range
    ``layer::<type>`` (shared experts inside a MoE count as ``moe``)."""
    inside_moe = set()
    for m in model.modules():
        if isinstance(m, (SoftmaxMoE, SigmoidMoE)):
            inside_moe |= {id(c) for c in m.modules() if c is not m}
    for m in model.modules():
        if id(m) in inside_moe:
            continue
        kind = next((k for cls, k in LAYER_TYPES if isinstance(m, cls)), None)
        if kind is None:
            continue
        m.forward = _labelled(m.forward, TAG + kind)
        if hasattr(m, "commit"):
            m.commit = _labelled(m.commit, TAG + kind)


def by_type(prof, steps: int) -> dict:
    """``{type: ms per step}`` plus ``glue`` and ``total`` (GPU kernel time)."""
    out = defaultdict(float)
    total = 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith(TAG):
            # count only outermost ranges (a layer calling another labelled module)
            p, nested = e.cpu_parent, False
            while p is not None:
                nested |= p.name.startswith(TAG)
                p = p.cpu_parent
            if not nested:
                out[e.name[len(TAG):]] += e.device_time_total
        elif e.device_type != DeviceType.CPU and not e.name.startswith((TAG, "ProfilerStep")):
            total += e.time_range.elapsed_us()
    res = {k: v / steps / 1e3 for k, v in out.items()}
    res["glue"] = total / steps / 1e3 - sum(res.values())
    res["total"] = total / steps / 1e3
    return res


def build(preset: str, layers: int | None, tmp: str):
    if preset in HYBRID_PRESETS:
        return load_model(random_hybrid_dir(preset, tmp, num_layers=layers), device="cuda", dtype=torch.bfloat16)
    PRESETS["_prof"] = dict(PRESETS[preset], num_hidden_layers=layers or 8)
    return load_model(_random_model_dir("_prof", tmp), device="cuda", dtype=torch.bfloat16)


def profile_model(model, batch: int, context: int, T: int, modes, steps: int = 8, rows: int = 0,
                  prefill_chunk: int | None = None, top: int = 0, ops: int = 0) -> list[dict]:
    """Per-type GPU time of a decode step and a verify+commit step for each mode."""
    B, V = batch, int(model.config.vocab_size)
    slots = torch.arange(1, B + 1, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for mode in modes:
        cache = model.make_cache(B + 1, mode=mode, buffer_size=16, max_new=T,
                                 max_seq_len=context + (steps + 40) * (T + 1) + 64)
        # in chunks: the gated-norm kernel's grid (rows = B * T * heads) must stay <= 65535
        chunk = max(1, min(context, prefill_chunk or context))
        for c0 in range(0, context, chunk):
            n = min(chunk, context - c0)
            model.prefill(cache, slots, torch.randint(0, V, (B, n), device="cuda", generator=g),
                          torch.full((B,), n, device="cuda"))
        tok = torch.randint(0, V, (B,), device="cuda", generator=g)
        ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
        acc = torch.randint(1, T + 1, (B,), device="cuda", generator=g)

        def decode(cache=cache):
            model.decode(cache, slots, tok)

        def verify(cache=cache):
            model.verify(cache, slots, ids)
            model.commit(cache, acc)

        row = {"mode": mode, "batch": B, "context": context, "T": T}
        for kind, fn in (("decode", decode), ("verify", verify)):
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=bool(ops)) as prof:
                for _ in range(steps):
                    fn()
                torch.cuda.synchronize()
            row[kind] = by_type(prof, steps)
            if top:
                ka = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:top]
                row[kind + "_top_kernels_ms"] = [(e.key[:90], e.self_device_time_total / steps / 1e3) for e in ka]
            if rows:
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows,
                                                max_name_column_width=70))
            if ops:  # the torch operators (glue) behind the kernels, by input shapes
                print(f"{mode} {kind}: torch ops by GPU time (ms per step), with input shapes")
                ka = [e for e in prof.key_averages(group_by_input_shape=True)
                      if e.key.startswith("aten::") and e.self_device_time_total > 0]
                for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:ops]:
                    print(f"  {e.self_device_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<4} {e.key:<28}"
                          f" {str(e.input_shapes)[:110]}")
        for kind, fn in (("decode", decode), ("verify", verify)):
            try:
                row[kind + "_graph_ms"] = graph_replay_ms(fn)
            except Exception as e:  # report, don't hide
                row[kind + "_graph_ms"] = None
                print(f"{mode}: {kind} graph capture failed: {e!r}"[:400])
        results.append(row)
        cache = decode = verify = None
        torch.cuda.empty_cache()
    return results


def print_table(results: list[dict], title: str) -> None:
    kinds = sorted({k for r in results for s in ("decode", "verify") for k in r[s]} - {"glue", "total"})
    cols = kinds + ["glue", "total"]
    print(f"\n{title}: GPU kernel ms per step by layer type (eager, profiler)")
    print(f"{'mode':>10} {'step':>7} " + " ".join(f"{c:>9}" for c in cols) + f" {'graph':>8}")
    for r in results:
        for s in ("decode", "verify"):
            gms = r.get(s + "_graph_ms")
            print(f"{r['mode']:>10} {s + ('' if s == 'decode' else str(r['T'])):>7} "
                  + " ".join(f"{r[s].get(c, 0.0):9.3f}" for c in cols)
                  + (f" {gms:8.3f}" if gms else f" {'':>8}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="2.7b", choices=sorted(PRESETS) + sorted(HYBRID_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="default: 8 for Mamba-2 presets, all for hybrids")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=32, help="prefilled tokens per row")
    ap.add_argument("--T", type=int, default=5, help="verify tokens")
    ap.add_argument("--modes", default="recurrent,replay")
    ap.add_argument("--rows", type=int, default=0, help="also print the top kernels table (rows)")
    ap.add_argument("--top", type=int, default=0, help="keep the top kernels per step in the JSON")
    ap.add_argument("--ops", type=int, default=0, help="print the top torch operators (with input shapes) per step")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill the context in chunks of this many tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.preset, args.layers, tmp)
    label_layers(model)
    res = profile_model(model, args.batch, args.context, args.T, args.modes.split(","), rows=args.rows,
                        prefill_chunk=args.prefill_chunk, top=args.top, ops=args.ops)
    print_table(res, f"{args.preset} ({model.config.num_hidden_layers} layers), B={args.batch}, "
                     f"context {args.context}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "layers": model.config.num_hidden_layers, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
