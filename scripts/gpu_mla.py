"""GPU check and timing of the absorbed-MLA decode kernel (``replayssm.kernels.mla``) against
the path MLA decode took before it (the generic ``paged_attention`` over the latent pool as a
multi-query head of ``R + dr`` channels), at Kimi-Linear-48B-A3B's shapes: 32 heads,
``kv_lora_rank`` 512, shared key part 64, bf16, paged blocks of 16 at shuffled ids.

1. Correctness: decode (T=1), chain verify (T=4) and tree verify (4 nodes) at odd context
   lengths, both paths against the float64 reference op; outputs poisoned with NaN first.
2. Kernel timing (CUDA-graph replays): B = 1 / 16 / 64 / 256 × context 1K / 4K, µs of each
   path, speed-up, and the new kernel's latent read (``B · L · 576 · 2`` bytes) per second as
   % of the device's copy bandwidth (a 1 GiB ``copy_``: read + write per byte copied).
3. A small launch sweep (keys per step, warps, stages at B=64 × 4K; splits at four shapes).
4. One whole ``MLAttention`` decode step (projections, up-projections, write, attention)
   old vs new at B = 64 / 256 × 4K.
5. Prefill (packed prompts of 1 × 2048 and 8 × 512 tokens): the generic kernel the layer
   uses for prefill against the MLA kernel, errors against float64 (whether MLA prefill
   should move to the MLA kernel too).

    PYTHONPATH=. python scripts/gpu_mla.py

Prints a short table; writes ``$OUT/gpu_mla.json`` when ``OUT`` is set.  About 2-3 minutes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import torch

from replayssm.kernels import attention as KA
from replayssm.kernels import mla as KM
from replayssm.layers.attention import Attention
from replayssm.layers.context import StepContext
from replayssm.layers.mla import MLAttention
from replayssm.ops.attention import mla as M

DEV, DTYPE = "cuda", torch.bfloat16
H, R, DR, DN, DV, HID, BS = 32, 512, 64, 128, 128, 2304, 16
D = R + DR
SCALE = (DN + DR) ** -0.5
BATCHES, CONTEXTS = (1, 16, 64, 256), (1024, 4096)
_TILES = ([dict(block_n=bn, num_warps=w) for bn in (16, 32, 64) for w in (4, 8)]
          + [dict(block_n=32, num_warps=8, num_stages=st) for st in (2, 3, 4)])
_SPLITS = [dict(num_splits=s) for s in (1, 2, 4, 8, 16, 32, 64)]
SWEEP_SHAPES = ((64, 4096, _TILES + [_SPLITS[i] for i in (0, 2, 3)]), (256, 1024, _SPLITS[:4]),
                (1, 4096, _SPLITS[2:]), (16, 4096, _SPLITS[2:]))
LAYER_BATCHES, LAYER_CTX = (64, 256), 4096
PREFILL_SHAPES = ((1, 2048), (8, 512))
CHECK_LENS = [1000, 37, 4097, 16, 1]
RESULTS: dict = {"device": "", "check": {}, "kernel": [], "sweep": [], "layer": [], "prefill": []}


def bench(fn) -> float:
    """Median µs of ``fn`` in CUDA-graph replays (plain ``do_bench`` if capture fails)."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    try:
        return 1e3 * float(do_bench_cudagraph(fn, rep=40, return_mode="median"))
    except Exception as e:  # pragma: no cover - depends on the device
        print(f"  (graph capture failed: {type(e).__name__}; plain do_bench)")
        return 1e3 * float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def attempt(fn, what: str) -> float:
    """``fn()`` or NaN when it raises (the old path may not compile at 576 channels: its tile
    pads them to 1024); the error is printed and kept in the JSON."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any compile / launch failure is a result here
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        print(f"  {what} failed: {msg}")
        RESULTS.setdefault("errors", []).append(dict(what=what, error=msg))
        return float("nan")


def copy_tbs() -> float:
    from triton.testing import do_bench

    a = torch.empty(1 << 29, dtype=DTYPE, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = float(do_bench(lambda: b.copy_(a), warmup=20, rep=100, return_mode="median"))
    return 2 * a.numel() * 2 / (ms * 1e-3) / 1e12


def make(B: int, lens: list[int], T: int = 1, seed: int = 0, poison: bool = False):
    """Latent pool with every sequence's blocks at shuffled ids, block table, queries of T
    tokens per sequence (the last T positions)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [-(-L // BS) for L in lens]
    NB = 1 + sum(need)
    pool = torch.randn(NB, BS, 1, D, generator=g, device=DEV).to(DTYPE)
    ids = (torch.randperm(NB - 1, generator=g, device=DEV) + 1).to(torch.int32)
    bt = torch.zeros(B, max(need), dtype=torch.int32, device=DEV)
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = ids[k:k + n]
        k += n
    if poison:   # tails of last blocks hold NaN: nobody may read them
        for b, L in enumerate(lens):
            if L % BS:
                pool[bt[b, need[b] - 1].long(), L % BS:] = float("nan")
    q = torch.randn(B * T, H, D, generator=g, device=DEV).to(DTYPE)
    cu = (torch.arange(B + 1, device=DEV) * T).to(torch.int32)
    kv = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, pool, bt, cu, kv


def old_path(q, pool, bt, cu, kv, bits=None):
    return KA.paged_attention(q, pool, pool, bt, cu, kv, scale=SCALE, tree_bits=bits)[..., :R]


def new_path(q, pool, bt, cu, kv, bits=None, **kw):
    return KM.mla_attention(q, pool, bt, cu, kv, rank=R, scale=SCALE, tree_bits=bits, **kw)


# ---------------------------------------------------------------------------- 1. correctness
def check() -> None:
    lens = CHECK_LENS
    tree = torch.tensor([[1, 3, 5, 9]] * len(lens), dtype=torch.int32, device=DEV)   # 0 <- 1, 0 <- 2, 0 <- 3
    for name, T, bits in (("decode", 1, None), ("verify T=4", 4, None), ("tree 4 nodes", 4, tree)):
        T_lens = [max(L, T) for L in lens]
        q, pool, bt, cu, kv = make(len(lens), T_lens, T, seed=1, poison=True)
        ref = M.mla_attention(q.double(), pool.double(), bt, cu, kv, rank=R, scale=SCALE, tree_bits=bits, check=True)
        out = torch.full((q.shape[0], H, R), float("nan"), dtype=q.dtype, device=DEV)
        errs = {}
        for S in (None, 1, 7):
            out.fill_(float("nan"))
            got = new_path(q, pool, bt, cu, kv, bits, out=out, num_splits=S)
            errs[f"new S={S or 'auto'}"] = float((got.double() - ref).abs().max())
        errs["old"] = attempt(lambda: float((old_path(q, pool, bt, cu, kv, bits).double() - ref).abs().max()),
                              f"old path, {name}")
        RESULTS["check"][name] = errs
        print(f"check {name:13s} max|err| vs fp64: " + "  ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert all(v < 2e-2 for k, v in errs.items() if k != "old"), errs   # bf16 inputs and p


# ---------------------------------------------------------------------------- 2. kernel timing
def timing(copy_bw: float) -> None:
    print(f"\n{'B':>4} {'ctx':>5} {'old µs':>9} {'new µs':>9} {'speed-up':>8} {'new TB/s':>9} {'% copy':>7} "
          f"{'old %':>6} {'S':>3}")
    for ctx in CONTEXTS:
        for B in BATCHES:
            q, pool, bt, cu, kv = make(B, [ctx] * B, seed=2)
            t_old = attempt(lambda: bench(lambda: old_path(q, pool, bt, cu, kv)), f"old path B={B} ctx={ctx}")
            t_new = bench(lambda: new_path(q, pool, bt, cu, kv))
            nbytes = B * ctx * D * 2
            tbs = nbytes / (t_new * 1e-6) / 1e12
            BM, HG, QT, BN, warps = KM.mla_tiles(B, B, H, R)
            S = KA.default_splits(B * (-(-H // HG)), q.device)
            old_pct = 100 * nbytes / (t_old * 1e-6) / 1e12 / copy_bw
            row = dict(B=B, ctx=ctx, old_us=t_old, new_us=t_new, speedup=t_old / t_new, new_tbs=tbs,
                       pct_copy=100 * tbs / copy_bw, old_pct_copy=old_pct, splits=S, latent_mb=nbytes / 1e6)
            RESULTS["kernel"].append(row)
            print(f"{B:4d} {ctx:5d} {t_old:9.1f} {t_new:9.1f} {t_old / t_new:7.2f}x {tbs:9.2f} "
                  f"{row['pct_copy']:6.1f}% {old_pct:5.1f}% {S:3d}")


# ---------------------------------------------------------------------------- 3. sweep
def sweep() -> None:
    print("\nsweep (µs; default first; bn keys per step, w warps, st stages, S splits)")
    short = {"block_n": "bn", "num_warps": "w", "num_stages": "st", "num_splits": "S"}
    for B, ctx, configs in SWEEP_SHAPES:
        q, pool, bt, cu, kv = make(B, [ctx] * B, seed=3)
        line = []
        for cfg in [dict()] + configs:
            t = attempt(lambda: bench(lambda: new_path(q, pool, bt, cu, kv, **cfg)), f"sweep B={B} ctx={ctx} {cfg}")
            RESULTS["sweep"].append(dict(B=B, ctx=ctx, **cfg, us=t))
            line.append(f"{','.join(f'{short[k]}{v}' for k, v in cfg.items()) or 'default'} {t:.1f}")
        print(f"B={B} ctx={ctx}: " + "  ".join(line))


# ---------------------------------------------------------------------------- 5. prefill
def prefill() -> None:
    """Prefill stays on the generic kernel in the layer; this times the MLA kernel on the same
    packed prompts (causal, from position 0) to decide whether it should take prefill too."""
    print(f"\n{'prefill B×T':>12} {'old µs':>9} {'new µs':>9} {'speed-up':>8} {'old err':>8} {'new err':>8}")
    for B, T in PREFILL_SHAPES:
        q, pool, bt, cu, kv = make(B, [T] * B, T, seed=5)
        ref = M.mla_attention(q.double(), pool.double(), bt, cu, kv, rank=R, scale=SCALE)
        e_old = attempt(lambda: float((old_path(q, pool, bt, cu, kv).double() - ref).abs().max()),
                        f"old prefill {B}x{T}")
        e_new = float((new_path(q, pool, bt, cu, kv).double() - ref).abs().max())
        t_old = attempt(lambda: bench(lambda: old_path(q, pool, bt, cu, kv)), f"old prefill {B}x{T}")
        t_new = bench(lambda: new_path(q, pool, bt, cu, kv))
        RESULTS["prefill"].append(dict(B=B, T=T, old_us=t_old, new_us=t_new, old_err=e_old, new_err=e_new))
        print(f"{f'{B}×{T}':>12} {t_old:9.1f} {t_new:9.1f} {t_old / t_new:7.2f}x {e_old:8.1e} {e_new:8.1e}")


# ---------------------------------------------------------------------------- 4. layer step
def layer_step() -> None:
    torch.manual_seed(0)
    with torch.device(DEV):
        layer = MLAttention(HID, H, None, R, DN, DR, DV)
    for n, p in layer.named_parameters():
        p.data = (torch.ones_like(p) if "layernorm" in n else 0.02 * torch.randn_like(p)).to(DEV, DTYPE)
    layer = layer.to(DEV, DTYPE)

    def old_forward(x, ctx):   # the decode step before the MLA kernel
        B = x.shape[0]
        q, k, v, _ = layer._qkv(x, ctx.positions)
        o = Attention._paged(layer, q, k, v, ctx).view(B, 1, H, D)[..., :R]
        o = torch.einsum("bthr,hvr->bthv", o, layer._up()[1]).reshape(B, 1, H * DV)
        return layer.o_proj(o)

    print(f"\n{'layer decode B':>14} {'ctx':>5} {'old µs':>9} {'new µs':>9} {'speed-up':>8} {'max|diff|':>9}")
    for B in LAYER_BATCHES:
        ctx_len = LAYER_CTX
        _, pool, bt, _, kv = make(B, [ctx_len] * B, seed=4)
        seq = kv.long() - 1
        cache = SimpleNamespace(layers={0: {"k": pool, "v": pool}})
        ctx = StepContext(kind="decode", T=1, positions=seq[:, None], cache=cache,
                          slots=torch.arange(1, B + 1, device=DEV), seq_len=seq, attn_table=bt)
        x = torch.randn(B, 1, HID, device=DEV).to(DTYPE)
        with torch.no_grad():
            diff = attempt(lambda: float((old_forward(x, ctx).float() - layer(x, ctx).float()).abs().max()),
                           f"old layer step B={B}")
            t_old = attempt(lambda: bench(lambda: old_forward(x, ctx)), f"old layer step B={B}")
            t_new = bench(lambda: layer(x, ctx))
        RESULTS["layer"].append(dict(B=B, ctx=ctx_len, old_us=t_old, new_us=t_new, max_diff=diff))
        print(f"{B:14d} {ctx_len:5d} {t_old:9.1f} {t_new:9.1f} {t_old / t_new:7.2f}x {diff:9.1e}")


def main() -> int:
    t0 = time.time()
    RESULTS["device"] = torch.cuda.get_device_name()
    print(f"{RESULTS['device']}, torch {torch.__version__}")
    bw = copy_tbs()
    RESULTS["copy_tbs"] = bw
    print(f"copy bandwidth (1 GiB copy_, read+write): {bw:.2f} TB/s")
    check()
    timing(bw)
    sweep()
    layer_step()
    prefill()
    RESULTS["seconds"] = time.time() - t0
    print(f"\n{RESULTS['seconds']:.0f} s")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_mla.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
