"""GPU checks and timings of the hybrid models' non-SSM kernels (one script per device call).

Sections (``--sections``, comma separated; each is guarded and writes what it measured even
when a later one fails):

* ``check``: paged attention (decode, chain verify, tree verify, varlen prefill with
  continuation) at Nemotron-H and Qwen3-Next attention shapes in bf16 against the reference
  op, NaN in unused blocks; decode replayed from a CUDA graph after the context grew; fused
  MoE against the reference at the presets' and Qwen3-Next's expert shapes, and the MoE layer
  replayed from a CUDA graph.
* ``attn``: paged attention decode at contexts 1K/8K/32K for B=16/64, beside dense SDPA over
  contiguous K/V of exactly the context (same run, same data), plus the same context with a
  128K-wide block table (``max_seq_len`` must not matter); achieved TB/s of the K/V read.
* ``tune``: split count / key tile / warps sweeps of the decode kernel.
* ``moe``: fused experts vs the previous per-expert loop at the presets' and Qwen3-Next's shapes.
* ``profile``: per-layer-type GPU time of a decode and a verify step of both hybrid presets
  (``scripts/profile_decode.py``) with the current engine.

    PYTHONPATH=. python3 scripts/bench_hybrid.py --out $OUT --sections check,attn,moe
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile_decode as P  # noqa: E402  (scripts/, on the path above)
from replayssm.kernels import attention as KA  # noqa: E402
from replayssm.kernels import dispatch  # noqa: E402
from replayssm.kernels import moe as KM  # noqa: E402
from replayssm.layers.mlp import SoftmaxMoE  # noqa: E402
from replayssm.ops.attention import naive as A  # noqa: E402
from replayssm.ops.moe import naive as M  # noqa: E402

DEV = "cuda"
T0 = time.perf_counter()
ATTN_SHAPES = {"nemotron-h-4b": dict(H=40, Hkv=8, Dh=128), "qwen3-next-4b": dict(H=16, Hkv=2, Dh=256)}


def elapsed() -> float:
    return time.perf_counter() - T0


def bench(fn, rep=40) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


# ------------------------------------------------------------------------------ helpers
def paged_case(B, ctx, q_lens, H, Hkv, Dh, BS=16, dtype=torch.bfloat16, poison=True, seed=0, width=None):
    """Random K/V for ``B`` sequences of ``ctx[b]`` keys in shuffled blocks (unused blocks NaN)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    nb = [-(-c // BS) for c in ctx]
    NB = 1 + sum(nb) + 4
    perm = (torch.randperm(NB - 1, device=DEV, generator=g) + 1).int()
    MB = width or max(nb)
    bt = torch.zeros(B, MB, dtype=torch.int32, device=DEV)
    kc = torch.randn(NB, BS, Hkv, Dh, device=DEV, generator=g, dtype=torch.float32).to(dtype)
    vc = torch.randn(NB, BS, Hkv, Dh, device=DEV, generator=g, dtype=torch.float32).to(dtype)
    used = torch.zeros(NB, dtype=torch.bool, device=DEV)
    o = 0
    for b in range(B):
        ids = perm[o:o + nb[b]]
        o += nb[b]
        bt[b, :nb[b]] = ids
        used[ids.long()] = True
        tail = ctx[b] % BS
        if poison and tail:
            kc[ids[-1].long(), tail:] = float("nan")
            vc[ids[-1].long(), tail:] = float("nan")
    if poison:
        kc[~used] = float("nan")
        vc[~used] = float("nan")
    cu = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    q = torch.randn(int(sum(q_lens)), H, Dh, device=DEV, generator=g).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=bt, cu_seqlens_q=cu, kv_lens=lens)


def tree_bits(N, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(N, T, dtype=torch.int32)
    for b in range(N):
        masks = []
        for i in range(T):
            par = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            masks.append((1 << i) | (masks[par] if par >= 0 else 0))
        out[b] = torch.tensor(masks, dtype=torch.int32)
    return out.to(DEV)


def maxerr(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------------------ check
def check_attention(res):
    rows = []
    for name, s in ATTN_SHAPES.items():
        H, Hkv, Dh = s["H"], s["Hkv"], s["Dh"]
        scale = Dh ** -0.5
        cases = {
            "decode": ([1000, 37, 4097, 1, 2500, 16] * 3, [1] * 18, None),
            "verify5": ([900, 6, 3000, 17], [5] * 4, None),
            "tree6": ([800, 6, 2049, 33], [6] * 4, 6),
            "prefill": ([700, 300, 1, 1500, 9], [700, 100, 0, 513, 9], None),   # fresh, continuation, empty
        }
        for kind, (ctx, ql, T) in cases.items():
            c = paged_case(len(ctx), ctx, ql, H, Hkv, Dh, seed=len(ctx))
            tb = tree_bits(len(ctx), T) if T else None
            ref = A.paged_attention(**{k: (v.float() if v.is_floating_point() else v) for k, v in c.items()},
                                    scale=scale, tree_bits=tb)
            for S in (None, 1, 4):
                got = KA.paged_attention(**c, scale=scale, tree_bits=tb, num_splits=S)
                e = maxerr(got, ref)
                rows.append(dict(shape=name, kind=kind, splits=S, max_abs_err=e, finite=bool(torch.isfinite(got).all())))
        # decode from a CUDA graph: the context grows between replays (device data only)
        ctx = [1000, 37, 4097, 1]
        c = paged_case(4, [x + 8 for x in ctx], [1] * 4, H, Hkv, Dh, seed=7, poison=False)
        lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        out = torch.empty_like(c["q"])
        args = dict(c, kv_lens=lens)
        KA.paged_attention(**args, scale=scale, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            KA.paged_attention(**args, scale=scale, out=out)
        errs = []
        for step in range(3):
            lens += 2
            c["q"].normal_()
            g.replay()
            ref = A.paged_attention(**{k: (v.float() if v.is_floating_point() else v) for k, v in args.items()},
                                    scale=scale)
            errs.append(maxerr(out, ref))
        rows.append(dict(shape=name, kind="decode-graph", splits=None, max_abs_err=max(errs), finite=True))
    res["check_attention"] = rows
    bad = [r for r in rows if not r["finite"] or r["max_abs_err"] > 3e-2]
    print(f"[check] attention: {len(rows)} cases, worst err {max(r['max_abs_err'] for r in rows):.2e}, "
          f"{len(bad)} bad", flush=True)
    for r in bad:
        print("   BAD", r)


def check_moe(res):
    rows = []
    shapes = {"qwen3-next-4b": (2048, 256, 64, 8), "qwen3-next-80b": (2048, 512, 512, 10),
              "nemotron-relu2": (1024, 384, 32, 6)}
    for name, (D, I, E, k) in shapes.items():
        gated = not name.startswith("nemotron")
        for N in (1, 64, 1280):
            g = torch.Generator(device=DEV).manual_seed(N)
            x = torch.randn(N, D, device=DEV, generator=g).bfloat16()
            idx = torch.rand(N, E, device=DEV, generator=g).topk(k, -1).indices
            w = torch.rand(N, k, device=DEV, generator=g)
            w1 = (torch.randn(E, (2 if gated else 1) * I, D, device=DEV, generator=g) * 0.03).bfloat16()
            w2 = (torch.randn(E, D, I, device=DEV, generator=g) * 0.03).bfloat16()
            act = "silu" if gated else "relu2"
            ref = M.experts(x.float(), idx, w, w1.float(), w2.float(), act=act, gated=gated)
            got = KM.experts(x, idx, w, w1, w2, act=act, gated=gated)
            rows.append(dict(shape=name, N=N, rel_err=maxerr(got, ref) / max(float(ref.abs().max()), 1e-9)))
    # the layer in a CUDA graph (routing, sort, plan, both GEMMs, combine)
    D, I, E, k = 2048, 256, 64, 8
    moe = SoftmaxMoE(D, I, E, k, True, 512).to_empty(device=DEV)
    for p in moe.parameters():
        p.data = (torch.randn(p.shape, device=DEV) * 0.03).bfloat16()
    x = torch.randn(64, 1, D, device=DEV).bfloat16()
    moe(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = moe(x)
    errs = []
    for _ in range(3):
        x.normal_()
        g.replay()
        os.environ["REPLAYSSM_KERNELS"] = "naive"
        dispatch.reset()   # the backend is resolved once: re-read the variable
        ref = moe(x.float().bfloat16())
        os.environ.pop("REPLAYSSM_KERNELS")
        dispatch.reset()
        errs.append(maxerr(y, ref) / float(ref.abs().max()))
    rows.append(dict(shape="SoftmaxMoE layer graph", N=64, rel_err=max(errs)))
    res["check_moe"] = rows
    print(f"[check] moe: worst rel err {max(r['rel_err'] for r in rows):.2e}", flush=True)
    for r in rows:
        if r["rel_err"] > 2e-2:
            print("   BAD", r)


# ------------------------------------------------------------------------------ attention timing
def sdpa_decode(q, K, V):
    """Dense baseline: flash SDPA over contiguous ``[B, Hkv, ctx, Dh]`` (GQA by enable_gqa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
            return be.name, lambda: _sdpa(q, K, V, be)
        except Exception:
            continue
    raise RuntimeError("no SDPA backend")


def _sdpa(q, K, V, be):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, K, V, enable_gqa=True)


def dense_kv(c, Hkv: int, Dh: int, ctx: int | None = None):
    """The paged case's keys and values gathered contiguous per sequence: ``K, V [B, Hkv, ctx, Dh]``
    (the first ``ctx`` positions of each row's blocks; all of them when None)."""
    rows_idx = (c["block_table"].long()[:, :, None] * 16 + torch.arange(16, device=DEV)).flatten(1)[:, :ctx]
    K = c["k_cache"].view(-1, Hkv, Dh)[rows_idx].transpose(1, 2).contiguous()
    V = c["v_cache"].view(-1, Hkv, Dh)[rows_idx].transpose(1, 2).contiguous()
    return K, V


def time_attention(res, contexts=(1024, 8192, 32768), batches=(16, 64)):
    rows = []
    for name, s in ATTN_SHAPES.items():
        H, Hkv, Dh = s["H"], s["Hkv"], s["Dh"]
        scale = Dh ** -0.5
        for B in batches:
            for ctx in contexts:
                c = paged_case(B, [ctx] * B, [1] * B, H, Hkv, Dh, poison=False, seed=B + ctx)
                t_paged = bench(lambda: KA.paged_attention(**c, scale=scale))
                wide = dict(c, block_table=torch.zeros(B, 131072 // 16, dtype=torch.int32, device=DEV))
                wide["block_table"][:, :c["block_table"].shape[1]] = c["block_table"]
                t_wide = bench(lambda: KA.paged_attention(**wide, scale=scale))
                # dense: the same keys, contiguous per sequence
                K, V = dense_kv(c, Hkv, Dh, ctx)     # [B, Hkv, ctx, Dh]
                q4 = c["q"].view(B, H, 1, Dh)
                be, fn = sdpa_decode(q4, K, V)
                t_dense = bench(fn)
                err = maxerr(KA.paged_attention(**c, scale=scale).view(B, H, Dh), fn().view(B, H, Dh))
                byts = 2 * B * ctx * Hkv * Dh * 2
                row = dict(shape=name, B=B, context=ctx, paged_ms=t_paged, paged_128k_table_ms=t_wide,
                           dense_ms=t_dense, dense_backend=be, paged_TBps=byts / t_paged / 1e9,
                           dense_TBps=byts / t_dense / 1e9, paged_vs_dense=t_dense / t_paged, err_vs_dense=err)
                rows.append(row)
                print(f"[attn] {name:14s} B={B:3d} ctx={ctx:6d}: paged {t_paged:.3f} ms ({row['paged_TBps']:.2f} TB/s), "
                      f"128K table {t_wide:.3f} ms, dense {be} {t_dense:.3f} ms ({row['dense_TBps']:.2f} TB/s), "
                      f"err {err:.1e}", flush=True)
                c = wide = K = V = None
                torch.cuda.empty_cache()
    res["attention_decode"] = rows


def graph_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def time_attention_graph(res, contexts=(1024, 8192, 32768), batches=(16, 64)):
    """Decode, verify and prefill with both sides replayed from CUDA graphs."""
    rows = []
    for name, s in ATTN_SHAPES.items():
        H, Hkv, Dh = s["H"], s["Hkv"], s["Dh"]
        scale = Dh ** -0.5
        for B in batches:
            for ctx in contexts:
                c = paged_case(B, [ctx] * B, [1] * B, H, Hkv, Dh, poison=False, seed=B + ctx)
                out = torch.empty_like(c["q"])
                t_paged = graph_ms(lambda: KA.paged_attention(**c, scale=scale, out=out))
                K, V = dense_kv(c, Hkv, Dh, ctx)     # [B, Hkv, ctx, Dh]
                be, fn = sdpa_decode(c["q"].view(B, H, 1, Dh), K, V)
                t_dense = graph_ms(fn)
                byts = 2 * B * ctx * Hkv * Dh * 2
                row = dict(shape=name, kind="decode", B=B, context=ctx, paged_ms=t_paged, dense_ms=t_dense,
                           dense_backend=be, paged_TBps=byts / t_paged / 1e9, dense_TBps=byts / t_dense / 1e9,
                           paged_vs_dense=t_dense / t_paged)
                rows.append(row)
                print(f"[attn graph] {name:14s} decode B={B:3d} ctx={ctx:6d}: paged {t_paged:.3f} ms "
                      f"({row['paged_TBps']:.2f} TB/s), dense {be} {t_dense:.3f} ms ({row['dense_TBps']:.2f} TB/s), "
                      f"dense/paged {row['paged_vs_dense']:.2f}", flush=True)
                c = K = V = out = None
                torch.cuda.empty_cache()
        for ctx in (1024, 8192):
            for kind, T, bits in (("verify5", 5, None), ("tree16", 16, tree_bits(64, 16, 3))):
                c = paged_case(64, [ctx] * 64, [T] * 64, H, Hkv, Dh, poison=False, seed=ctx + T)
                out = torch.empty_like(c["q"])
                t = graph_ms(lambda: KA.paged_attention(**c, scale=scale, tree_bits=bits, out=out))
                byts = 2 * 64 * ctx * Hkv * Dh * 2
                rows.append(dict(shape=name, kind=kind, B=64, context=ctx, paged_ms=t, paged_TBps=byts / t / 1e9))
                print(f"[attn graph] {name:14s} {kind} B=64 ctx={ctx}: paged {t:.3f} ms ({byts / t / 1e9:.2f} TB/s)",
                      flush=True)
        c = paged_case(4, [2048] * 4, [2048] * 4, H, Hkv, Dh, poison=False)
        t = graph_ms(lambda: KA.paged_attention(**c, scale=scale))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = c["q"].view(4, 2048, H, Dh).transpose(1, 2)
        K, V = dense_kv(c, Hkv, Dh)     # [B, Hkv, ctx, Dh]

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True)

        td = graph_ms(flash)
        rows.append(dict(shape=name, kind="prefill", B=4, context=2048, paged_ms=t, dense_ms=td, dense_backend="FLASH",
                         paged_vs_dense=td / t))
        print(f"[attn graph] {name:14s} prefill 4x2048 causal: paged {t:.3f} ms, flash SDPA {td:.3f} ms", flush=True)
        c = K = V = q = None
        torch.cuda.empty_cache()
    res["attention_graph"] = rows


def tune_attention(res):
    rows = []
    for name, s in ATTN_SHAPES.items():
        H, Hkv, Dh = s["H"], s["Hkv"], s["Dh"]
        for B, ctx in ((16, 32768), (64, 8192), (256, 2048)):
            c = paged_case(B, [ctx] * B, [1] * B, H, Hkv, Dh, poison=False, seed=1)
            for S in (None, 1, 2, 4, 8, 16):
                for bn in (32, 64, 128) if S is None else (None,):
                    for nw in (2, 4, 8) if S is None else (None,):
                        try:
                            t = bench(lambda: KA.paged_attention(**c, scale=0.1, num_splits=S, block_n=bn, num_warps=nw),
                                      rep=25)
                        except Exception as e:  # a tile that does not fit
                            t = float("nan")
                            print("   tune fail", name, B, ctx, S, bn, nw, repr(e)[:120])
                        rows.append(dict(shape=name, B=B, context=ctx, splits=S, block_n=bn, num_warps=nw, ms=t))
            best = min((r for r in rows if r["shape"] == name and r["B"] == B), key=lambda r: r["ms"])
            print(f"[tune] {name} B={B} ctx={ctx}: best {best}", flush=True)
            c = None
            torch.cuda.empty_cache()
        # verify (T=5) and prefill tiles
        c = paged_case(64, [4096] * 64, [5] * 64, H, Hkv, Dh, poison=False)
        for bm in (16, 32, 64):
            rows.append(dict(shape=name, kind="verify5", B=64, context=4096, block_m=bm,
                             ms=bench(lambda: KA.paged_attention(**c, scale=0.1, block_m=bm), rep=25)))
        c = paged_case(4, [2048] * 4, [2048] * 4, H, Hkv, Dh, poison=False)
        for bm in (32, 64, 128):
            for nw in (4, 8):
                try:
                    t = bench(lambda: KA.paged_attention(**c, scale=0.1, block_m=bm, num_warps=nw), rep=25)
                except Exception:
                    t = float("nan")
                rows.append(dict(shape=name, kind="prefill", B=4, context=2048, block_m=bm, num_warps=nw, ms=t))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = c["q"].view(4, 2048, H, Dh).transpose(1, 2)
        K, V = dense_kv(c, Hkv, Dh)     # [B, Hkv, ctx, Dh]
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                t = bench(lambda: F.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True), rep=25)
        except Exception:
            t = float("nan")
        rows.append(dict(shape=name, kind="prefill-sdpa-flash", B=4, context=2048, ms=t))
        for r in rows[-8:]:
            print("[tune]", r, flush=True)
    res["tune_attention"] = rows


# ------------------------------------------------------------------------------ MoE timing
def old_experts(x, idx, w, w1, w2, act, gated):
    """The MoE expert compute this branch replaced (layers/mlp.py ``_dispatch`` before it):
    per-pair gathered weights when ``N·k <= E``, else every expert on every token (a Python
    loop over experts, weights zero for tokens that did not choose it)."""
    f = M.activation(act)
    E, I = w1.shape[0], w2.shape[2]
    if idx.numel() <= E:
        gu = w1[idx]
        hx = torch.einsum("nkod,nd->nko", gu, x)
        h = f(hx[..., :I]) * hx[..., I:] if gated else f(hx)
        y = torch.einsum("nkdi,nki->nkd", w2[idx], h)
        return (y.to(w.dtype) * w[..., None]).sum(1)
    out = None
    for e in range(E):
        we = torch.where(idx == e, w, torch.zeros_like(w)).sum(-1)
        hx = F.linear(x, w1[e])
        h = f(hx[:, :I]) * hx[:, I:] if gated else f(hx)
        term = F.linear(h, w2[e]).to(w.dtype) * we[:, None]
        out = term if out is None else out + term
    return out


def time_moe(res):
    rows = []
    shapes = {"qwen3-next-4b (E=64,k=8,I=256)": (2048, 256, 64, 8),
              "qwen3-next-80b (E=512,k=10,I=512)": (2048, 512, 512, 10)}
    for name, (D, I, E, k) in shapes.items():
        g = torch.Generator(device=DEV).manual_seed(0)
        w1 = (torch.randn(E, 2 * I, D, device=DEV, generator=g) * 0.03).bfloat16()
        w2 = (torch.randn(E, D, I, device=DEV, generator=g) * 0.03).bfloat16()
        for N in (1, 16, 64, 256, 1280):
            x = torch.randn(N, D, device=DEV, generator=g).bfloat16()
            idx = torch.rand(N, E, device=DEV, generator=g).topk(k, -1).indices
            w = torch.rand(N, k, device=DEV, generator=g).bfloat16()
            t_fused = bench(lambda: KM.experts(x, idx, w, w1, w2, act="silu", gated=True))
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2):
                KM.experts(x, idx, w, w1, w2, act="silu", gated=True)
            t_graph = bench(g2.replay)
            t_old = bench(lambda: old_experts(x, idx, w, w1, w2, "silu", True), rep=30) if E * N <= 512 * 1280 else None
            hit = int(torch.unique(idx).numel())
            byts = hit * 3 * I * D * 2
            row = dict(shape=name, N=N, fused_ms=t_fused, fused_graph_ms=t_graph, old_loop_ms=t_old,
                       speedup=(t_old / t_graph) if t_old else None, experts_hit=hit,
                       weight_TBps=byts / t_graph / 1e9)
            rows.append(row)
            print(f"[moe] {name} N={N}: fused {t_fused:.3f} ms eager / {t_graph:.3f} ms graph "
                  f"({row['weight_TBps']:.2f} TB/s of hit experts' weights), old loop "
                  f"{t_old if t_old is None else round(t_old, 3)} ms", flush=True)
        for N in (64, 1280):
            x = torch.randn(N, D, device=DEV, generator=g).bfloat16()
            idx = torch.rand(N, E, device=DEV, generator=g).topk(k, -1).indices
            w = torch.rand(N, k, device=DEV, generator=g).bfloat16()
            for bn, bk, nw in ((64, 128, 4), (128, 64, 4), (64, 64, 4), (128, 128, 8), (32, 128, 4)):
                try:
                    t = bench(lambda: KM.experts(x, idx, w, w1, w2, block_n=bn, block_k=bk, num_warps=nw), rep=25)
                except Exception:
                    t = float("nan")
                rows.append(dict(shape=name, N=N, tune=(bn, bk, nw), ms=t))
            print(f"[moe tune] {name} N={N}:", [(r['tune'], round(r['ms'], 3)) for r in rows[-5:]], flush=True)
    res["moe"] = rows


# ------------------------------------------------------------------------------ profiles
def profile_presets(res, batch, context, budget_s, extra=((256, 64),)):
    rows = []
    res["profile"] = rows
    for preset in ("qwen3-next-4b", "nemotron-h-4b"):
        if elapsed() > budget_s:
            print(f"[profile] skipped {preset}: {elapsed():.0f} s elapsed", flush=True)
            continue
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            model = P.build(preset, None, tmp)
        build_s = time.perf_counter() - t
        P.label_layers(model)
        for B, ctx in ((batch, context),) + tuple(extra):
            if elapsed() > budget_s + 40:
                continue
            r = P.profile_model(model, B, ctx, 5, ["recurrent", "replay"], steps=4, prefill_chunk=max(1, 1024 // B),
                                top=15)
            P.print_table(r, f"{preset} ({model.config.num_hidden_layers} layers), B={B}, context {ctx}")
            rows.append(dict(preset=preset, build_s=build_s, results=r))
        model = None
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/bench_hybrid")
    ap.add_argument("--sections", default="check,attn,moe,tune,profile")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--profile-context", type=int, default=512)
    ap.add_argument("--budget", type=float, default=330.0, help="seconds after which optional sections stop")
    ap.add_argument("--profile-extra", default="256x64", help="more BxCONTEXT profiles per preset ('' for none)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(f"device {res['device']}, torch {res['torch']}, triton {res['triton']}", flush=True)
    steps = {"check": lambda: (check_attention(res), check_moe(res)), "attn": lambda: time_attention(res),
             "attn_graph": lambda: time_attention_graph(res),
             "moe": lambda: time_moe(res), "tune": lambda: tune_attention(res),
             "profile": lambda: profile_presets(res, args.profile_batch, args.profile_context, args.budget,
                                               tuple(tuple(int(v) for v in e.split("x"))
                                                     for e in args.profile_extra.split(",") if e))}
    for name in args.sections.split(","):
        if name != "check" and elapsed() > args.budget:
            print(f"[{name}] skipped: {elapsed():.0f} s elapsed", flush=True)
            continue
        t = time.perf_counter()
        try:
            steps[name]()
        except Exception:
            res.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - t:.1f} s (total {elapsed():.0f} s)", flush=True)
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "bench_hybrid.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
