"""Launch the Mamba-2 decode and verify kernels once each (after a warm-up), for Nsight
Compute to read their counters (GPU):

    ncu --kernel-name regex:'_m2_' --launch-skip-before-match 0 ... \\
        python3 scripts/ncu_verify.py --batch 256 --T 5
"""

from __future__ import annotations

import argparse

import torch

from replayssm.bench.kernels import _ring, _set_fill, m2_inputs, m2_setup
from replayssm.kernels import mamba2 as km

M2_27B = dict(H=80, d=64, n=128, G=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--variants", default="64:2,32:2", help="block_d:num_warps,...")
    ap.add_argument("--fill", type=int, default=0, help="committed entries per row (L - T: every row flushes)")
    args = ap.parse_args()
    Bt, T, L, s = args.batch, args.T, args.L, M2_27B
    slots = torch.arange(1, Bt + 1, device="cuda")
    buf = m2_setup(Bt, L, s, "cuda", torch.bfloat16)
    ring = _ring(Bt + 1, L, "cuda")
    _set_fill(ring, slots, args.fill)
    dec = m2_inputs(Bt, s, "cuda", torch.bfloat16)
    inp = m2_inputs(Bt, s, "cuda", torch.bfloat16, T)
    def launch(decode: bool) -> None:
        if decode:
            km.replay_decode(buf, ring.plan_decode(slots), **dec)
        for v in args.variants.split(","):
            bd, nw = v.split(":")
            km.replay_verify(buf, ring.plan_verify(slots, T, "verify"), **inp, block_d=int(bd), num_warps=int(nw))

    for _ in range(2):  # warm-up: compile everything first
        launch(True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launch(args.fill == 0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
