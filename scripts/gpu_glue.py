"""Fused gate preparation and cached parameter tensors on vs off (``REPLAYSSM_FUSED_GATES``).

For each preset (``--presets``: random weights from the bench preset machinery, bf16, CUDA
graphs) and decode form (replay; recurrent too for qwen3.5-4b), one engine per switch value
(the switch is read per call; each engine captures its own graphs) serves greedy requests at
every ``--batches`` size, then reports:

* ``ms``: the captured decode graph replayed back to back (``llm.runner.replay_ms``) per batch;
* ``kernels``: kernels per step (profiler over ``--replays`` graph replays at ``--profile-batch``),
  and the top kernels' µs per step;
* ``mism``: greedy tokens that differ between switch on and off (must be 0; exit code 1 if not).

    PYTHONPATH=. python scripts/gpu_glue.py          # sized for < 4 min on an H100 (not yet timed)

Writes ``gpu_glue.json`` to ``$OUT`` when set.
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


def _profile(llm, B: int, replays: int) -> dict:
    from replayssm.bench.common import graph_kernels

    ks = graph_kernels(llm, B, replays)
    return {"kernels_per_step": sum(n for _, _, n in ks), "us_per_step": sum(us for _, us, _ in ks),
            "top": [(k[:70], us, n) for k, us, n in ks[:12]]}


def run_config(model, mode: str, fused: str, args, prompts: dict) -> dict:
    from replayssm.bench.common import free_memory
    from replayssm.engine.config import SamplingParams
    from replayssm.engine.llm import LLM

    os.environ["REPLAYSSM_FUSED_GATES"] = fused
    Bmax = max(args.batches)
    llm = LLM(model, device="cuda", decode_mode=mode, max_num_seqs=Bmax, cuda_graphs=True, max_seq_len=128)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    out = {"tokens": {}, "ms": {}}
    for B in args.batches:
        out["tokens"][B] = [o.token_ids for o in llm.generate(prompts[B], params)]
        out["ms"][B] = float(llm.runner.replay_ms(B, args.reps))
    out["profile"] = _profile(llm, args.profile_batch, args.replays)
    del llm
    free_memory("cuda")
    return out


def main() -> int:
    from replayssm.bench import e2e
    from replayssm.bench.common import free_memory
    from replayssm.engine.loading import load

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="2.7b,nemotron-h-4b,qwen3.5-4b")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--profile-batch", type=int, default=64)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--reps", type=int, default=30, help="graph replays per ms figure")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--budget-s", type=float, default=220, help="start no new preset past this wall time")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args()
    a.batches = sorted({int(b) for b in a.batches.split(",")} | {a.profile_batch})
    res = {"device": torch.cuda.get_device_name(), "presets": {}}
    bad = 0
    for preset in a.presets.split(","):
        if time.perf_counter() - T0 > a.budget_s:
            print(f"[glue] budget spent, {preset} skipped", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            model = load(e2e._random_model_dir(preset, tmp), torch.device("cuda"), torch.bfloat16)[0]
        V = int(model.config.vocab_size)
        prompts = {B: e2e._prompts(B, 32, V, seed=B) for B in a.batches}
        modes = ["replay", "recurrent"] if preset.startswith("qwen3.5") else ["replay"]
        for mode in modes:
            r = {f: run_config(model, mode, f, a, prompts) for f in ("0", "1")}
            mism = {B: sum(x != y for x, y in zip(r["0"]["tokens"][B], r["1"]["tokens"][B])) for B in a.batches}
            bad += sum(mism.values())
            res["presets"][f"{preset}/{mode}"] = {
                "ms_off": r["0"]["ms"], "ms_on": r["1"]["ms"], "mismatch": mism,
                "profile_off": r["0"]["profile"], "profile_on": r["1"]["profile"]}
            print(f"[glue {time.perf_counter() - T0:.0f}s] {preset}/{mode} done", file=sys.stderr, flush=True)
        del model
        free_memory("cuda")

    print(f"device: {res['device']}  (ms: decode graph per step; off = REPLAYSSM_FUSED_GATES=0)")
    print(f"{'preset/form':<22}{'B':>5}{'ms off':>9}{'ms on':>9}{'on/off':>8}{'mism':>6}")
    for name, row in res["presets"].items():
        for B in a.batches:
            off, on = row["ms_off"][B], row["ms_on"][B]
            print(f"{name:<22}{B:>5}{off:>9.3f}{on:>9.3f}{on / off:>8.3f}{row['mismatch'][B]:>6}")
        po, pn = row["profile_off"], row["profile_on"]
        print(f"{'':<22}kernels/step at B={a.profile_batch}: off {po['kernels_per_step']:.0f} "
              f"({po['us_per_step']:.0f} µs)  on {pn['kernels_per_step']:.0f} ({pn['us_per_step']:.0f} µs)")
        for tag, pr in (("off", po), ("on", pn)):
            top = "; ".join(f"{k[:38]} {us:.0f}µs x{c:.0f}" for k, us, c in pr["top"][:8])
            print(f"{'':<24}top kernels {tag}: {top}")
    print("greedy tokens on == off: " + ("OK" if bad == 0 else f"MISMATCH ({bad} requests)"))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_glue.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
