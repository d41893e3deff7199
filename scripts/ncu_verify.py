"""Launch the decode and verify kernels once each (after a warm-up), for Nsight Compute to
read their counters (GPU):

    ncu --kernel-name regex:'_m2_|_gdn_' --metrics launch__registers_per_thread,... \\
        python3 scripts/ncu_verify.py --fam mamba2 --batch 256 --T 5
    python3 scripts/ncu_verify.py --fam gdn --variants rows:32:1,dot:64:4 --T 4
    python3 scripts/ncu_verify.py --m2-shape nemotron-h-4b --variants '{}' '{"block_d": 16}'

Variants: Mamba-2 ``block_d:num_warps``; GDN ``impl:block_v:num_warps``; or JSON dicts of the
verify call's keyword arguments (one per argument).
"""

from __future__ import annotations

import argparse
import json

import torch

from replayssm.bench.kernels import GDN_SHAPE, _ring, _set_fill, gdn_inputs, gdn_setup, m2_inputs, m2_setup
from replayssm.kernels import gdn as kg
from replayssm.kernels import mamba2 as km

M2_27B = dict(H=80, d=64, n=128, G=1)
M2_SHAPES = {"2.7b": M2_27B, "nemotron-h-4b": dict(H=96, d=80, n=128, G=8)}


def _verify_kwargs(fam: str, v: str) -> dict:
    if v.startswith("{"):
        return json.loads(v)
    if fam == "mamba2":
        bd, nw = v.split(":")
        return dict(block_d=int(bd), num_warps=int(nw))
    impl, bv, nw = v.split(":")
    return dict(impl=impl, block_v=int(bv), num_warps=int(nw))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fam", default="mamba2", choices=("mamba2", "gdn"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--variants", default=None, nargs="*",
                    help="mamba2: block_d:num_warps,...; gdn: impl:block_v:num_warps,...; or JSON dicts")
    ap.add_argument("--m2-shape", default="2.7b", choices=sorted(M2_SHAPES))
    ap.add_argument("--fill", type=int, default=0, help="committed entries per row (L - T: every row flushes)")
    args = ap.parse_args()
    Bt, T, L = args.batch, args.T, args.L
    m2 = args.fam == "mamba2"
    s, setup, inputs, mod = ((M2_SHAPES[args.m2_shape], m2_setup, m2_inputs, km) if m2 else
                             (GDN_SHAPE, gdn_setup, gdn_inputs, kg))
    variants = args.variants or ["64:2,32:2" if m2 else "rows:32:1,dot:64:4"]
    variants = [v for arg in variants for v in ([arg] if arg.startswith("{") else arg.split(","))]
    slots = torch.arange(1, Bt + 1, device="cuda")
    buf = setup(Bt, L, s, "cuda", torch.bfloat16)
    ring = _ring(Bt + 1, L, "cuda")
    _set_fill(ring, slots, args.fill)
    dec = inputs(Bt, s, "cuda", torch.bfloat16)
    inp = inputs(Bt, s, "cuda", torch.bfloat16, T)

    def launch(decode: bool) -> None:
        if decode:
            mod.replay_decode(buf, ring.plan_decode(slots), **dec)
        for v in variants:
            mod.replay_verify(buf, ring.plan_verify(slots, T, "verify"), **inp, **_verify_kwargs(args.fam, v))

    for _ in range(2):  # warm-up: compile everything first
        launch(True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launch(args.fill == 0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
