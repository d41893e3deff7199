"""Where a decode step's GPU time goes: random-weight Mamba-2 of a bench preset's width
(fewer layers), one decode step per mode under ``torch.profiler`` (eager), plus the step
time replayed from a CUDA graph.  Usage (GPU):

    python3 scripts/profile_decode.py --preset 2.7b --layers 8 --batch 256
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from replayssm.bench.e2e import PRESETS, _random_model_dir
from replayssm.models import load_model


def graph_step_ms(model, cache, slots, tok, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model.decode(cache, slots, tok)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model.decode(cache, slots, tok)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="2.7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--modes", default="recurrent,replay")
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    PRESETS["_prof"] = dict(PRESETS[args.preset], num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(_random_model_dir("_prof", tmp), device="cuda", dtype=torch.bfloat16)
    B, V = args.batch, int(model.config.vocab_size)
    slots = torch.arange(1, B + 1, device="cuda")
    for mode in args.modes.split(","):
        cache = model.make_cache(B + 1, mode=mode, buffer_size=16, max_new=1, max_seq_len=4096)
        ids = torch.randint(0, V, (B, 32), device="cuda")
        model.prefill(cache, slots, ids, torch.full((B,), 32, device="cuda"))
        tok = torch.randint(0, V, (B,), device="cuda")
        for _ in range(3):
            model.decode(cache, slots, tok)
        torch.cuda.synchronize()
        steps = 16
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                model.decode(cache, slots, tok)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        total = sum(e.self_device_time_total for e in ka) / steps / 1e3
        print(f"\n=== {mode}: B={B}, {args.layers} layers of {args.preset}: GPU kernel time "
              f"{total:.2f} ms/step ({total / args.layers:.3f} ms/layer)")
        print(ka.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
        try:
            print(f"{mode}: CUDA-graph step {graph_step_ms(model, cache, slots, tok):.2f} ms")
        except Exception as e:  # report, don't hide
            print(f"{mode}: graph capture failed: {e!r}"[:400])
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
