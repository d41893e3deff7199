"""Per-region GPU time of one model step (GPU, eager, synchronised around each region):
decode vs speculative verify + commit, for each cache form.  Regions: every Mamba-2
mixer's in_proj, conv, SSM, gated norm, out_proj and commit, summed over layers, plus the
rest (embedding, block norms, residuals, LM head).

    PYTHONPATH=. python3 scripts/profile_layers.py --preset 2.7b --layers 8 --batch 256 --T 5
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

import torch

from replayssm.bench.e2e import PRESETS, _random_model_dir
from replayssm.layers.mamba2 import Mamba2Mixer
from replayssm.models import load_model

ACC: dict = defaultdict(float)


def _timed(f, key):
    def g(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = f(*a, **k)
        torch.cuda.synchronize()
        ACC[key] += time.perf_counter() - t
        return out

    return g


def instrument(model) -> None:
    for m in model.modules():
        if isinstance(m, Mamba2Mixer):
            m.in_proj.forward = _timed(m.in_proj.forward, "in_proj")
            m.out_proj.forward = _timed(m.out_proj.forward, "out_proj")
            m.norm.forward = _timed(m.norm.forward, "gated_norm")
            m._conv = _timed(m._conv, "conv")
            m._ssm = _timed(m._ssm, "ssm")
            m.commit = _timed(m.commit, "commit")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="2.7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="replay,recurrent")
    args = ap.parse_args()
    PRESETS["_prof"] = dict(PRESETS[args.preset], num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(_random_model_dir("_prof", tmp), device="cuda", dtype=torch.bfloat16)
    instrument(model)
    B, T, V = args.batch, args.T, int(model.config.vocab_size)
    slots = torch.arange(1, B + 1, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for mode in args.modes.split(","):
        cache = model.make_cache(B + 1, mode=mode, buffer_size=args.L, max_new=T, max_seq_len=4096)
        model.prefill(cache, slots, torch.randint(0, V, (B, 32), device="cuda"), torch.full((B,), 32, device="cuda"))
        for kind in ("decode", "verify"):
            for warm in (True, False):
                ACC.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(2 if warm else args.steps):
                    if kind == "decode":
                        model.decode(cache, slots, torch.randint(0, V, (B,), device="cuda", generator=g))
                    else:
                        model.verify(cache, slots, torch.randint(0, V, (B, T), device="cuda", generator=g))
                        acc = torch.randint(1, T + 1, (B,), device="cuda", generator=g)
                        model.commit(cache, acc)
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
            n = args.steps
            parts = {k: v / n * 1e3 for k, v in ACC.items()}
            rest = total / n * 1e3 - sum(parts.values())
            print(f"{mode:>9} {kind:>6} B={B} T={T if kind == 'verify' else 1}: {total / n * 1e3:7.2f} ms/step | "
                  + " ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda x: -x[1]))
                  + f" | rest {rest:.2f}", flush=True)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
