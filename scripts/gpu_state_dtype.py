"""16-bit SSM checkpoint states on the GPU (``ssm_state_dtype``): correctness against the float32
path, and what they buy in replay decode.  One run, a few minutes on one H100:

1. correctness: every Triton kernel that writes states (Mamba-2 and GDN replay decode with
   flush rows, replay verify with flush rows, recurrent update, chunked prefill into a state
   pool) run twice from the same state values, once on float32 states and once on bf16
   states: outputs must agree (the kernels read the same values and compute in fp32) and
   every written bf16 state must be the float32 path's state rounded to bf16 (at most one
   ulp apart; the GPU rounds to nearest, so almost all are bitwise equal); unwritten slots
   unchanged.
2. kernel: the Mamba-2 replay decode kernel alone on one layer of the 2.7B preset (H=80,
   d=64, n=128, ring L=16 at a steady fill) at B=64 and 256, float32 vs bf16 states: time per
   call, bytes it must move (checkpoint states + committed ring entries + flush writes), and
   that as a fraction of the measured device copy bandwidth (the copy ceiling).
3. engine: replay decode tokens/s of ``LLM`` on the random-weight 2.7B Mamba-2 (bench e2e's
   ``2.7b`` preset, built on the device; bf16 weights and activations, CUDA graphs) at B=64
   and 256, float32 vs bf16 states; per decode step, the bytes a replay step moves (weights +
   every sequence's states, ring entries, conv windows, flush writes) / step time as a
   fraction of the copy bandwidth.

Prints a short table and writes ``$OUT/gpu_state_dtype.json`` when ``$OUT`` is set.

    PYTHONPATH=. python scripts/gpu_state_dtype.py            # GPU
    PYTHONPATH=. python scripts/gpu_state_dtype.py --cpu-check # CPU dry run: interpreter, tiny shapes
"""

from __future__ import annotations

import os
import sys

if "--cpu-check" in sys.argv:   # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from replayssm.bench.e2e import mamba2_preset_config  # noqa: E402
from replayssm.cache.buffers import GDNBuffers, Mamba2Buffers  # noqa: E402
from replayssm.cache.ring import RingIndex  # noqa: E402
from replayssm.kernels import gdn as KG  # noqa: E402
from replayssm.kernels import gdn_prefill as KGP  # noqa: E402
from replayssm.kernels import mamba2 as K2  # noqa: E402
from replayssm.kernels import mamba2_prefill as K2P  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
RESULTS: dict = {"correctness": [], "kernel": [], "engine": []}


# ------------------------------------------------------------------------------ helpers
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, iters: int, warm: int = 3) -> float:
    """Mean seconds per call of ``fn`` (CUDA events on the GPU)."""
    for _ in range(warm):
        fn()
    sync(dev)
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def copy_bandwidth(dev, nbytes: int) -> float:
    """Device copy bandwidth, bytes read + written per second (``dst.copy_(src)``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), dev, iters=20 if dev.type == "cuda" else 2)
    return 2 * nbytes / s


def ulps(got16: torch.Tensor, want32: torch.Tensor) -> float:
    """Largest distance of ``got16`` from ``want32`` in units of the 16-bit format's ulp at
    ``want32`` (0: the rounded value; <= 1: one rounding)."""
    w = want32.float()
    mant = 7 if got16.dtype == BF16 else 10
    e = torch.floor(torch.log2(w.abs().clamp(min=1e-30)))
    ulp = torch.exp2(e - mant)
    return ((got16.float() - w).abs() / ulp).max().item() if w.numel() else 0.0


def record(name: str, y32, y16, written32, written16, untouched_ok: bool):
    yd = ((y16.float() - y32.float()).abs().max() / y32.float().abs().max().clamp(min=1e-30)).item()
    u = max((ulps(a, b) for a, b in zip(written16, written32)), default=0.0)
    exact = all(torch.equal(a, b.to(a.dtype)) for a, b in zip(written16, written32))
    ok = yd <= 1e-4 and u <= 1.0 and untouched_ok
    RESULTS["correctness"].append(dict(case=name, y_max_rel_diff=yd, state_max_ulps=u, states_bitwise=exact,
                                       untouched_unchanged=untouched_ok, ok=ok))
    print(f"  {name:34s} y rel diff {yd:.1e}  state max {u:.2f} ulp  bitwise {str(exact):5s}  "
          f"others unchanged {untouched_ok}  {'OK' if ok else 'FAIL'}", flush=True)
    return ok


# ------------------------------------------------------------------------------ 1. correctness
def _ring(B: int, L: int, dev, g, kind: str, T: int = 1):
    ring = RingIndex(B, L, dev)
    hmax = L - 1 if kind == "decode" else L - T
    ring.length[1:] = torch.randint(0, hmax + 1, (B,), generator=g).to(dev)
    ring.start[1:] = torch.randint(0, L, (B,), generator=g).to(dev)
    ring.length[1: 1 + max(1, B // 4)] = hmax            # a quarter of the rows flush
    return ring, torch.arange(1, B + 1, device=dev)


def _pair(buf):
    """(float32-state copy, bf16-state copy) of ``buf`` whose states are bf16-representable."""
    names = list(vars(buf))
    f = {n: getattr(buf, n).clone() for n in names}
    f["state"] = f["state"].to(BF16).float()
    h = dict(f, state=f["state"].to(BF16))
    return type(buf)(**f), type(buf)(**{n: t.clone() for n, t in h.items()})


def _check_states(name, plan_slots, flush, b32, b16, before16, y32, y16):
    w = plan_slots[flush]
    others = torch.ones(b16.state.shape[0], dtype=torch.bool, device=b16.state.device)
    others[w] = False
    others[0] = False
    untouched = torch.equal(b16.state[others], before16[others])
    return record(name, y32, y16, [b32.state[w]], [b16.state[w]], untouched)


def correctness(dev, small: bool) -> bool:
    g = torch.Generator().manual_seed(0)
    adt = F32 if small else BF16
    ok = True
    # Mamba-2: one layer of the 2.7B preset (CPU: small odd shapes)
    B, H, d, n, G, L = (5, 4, 20, 19, 2, 8) if small else (64, 80, 64, 128, 1, 16)
    m2 = Mamba2Buffers.allocate(B, L, H, d, n, G, dtype=adt, device=dev)
    for t in (m2.state, m2.x, m2.B):
        t.normal_()
    m2.dt.uniform_(0.05, 0.5)
    A = -(torch.rand(H, device=dev) + 0.3)
    D = torch.randn(H, device=dev)

    def m2_in(T=None):
        lead = (B,) if T is None else (B, T)
        return (torch.randn(*lead, H, d, device=dev).to(adt), torch.rand(*lead, H, device=dev) * 0.5 + 0.05, A,
                torch.randn(*lead, G, n, device=dev).to(adt), torch.randn(*lead, G, n, device=dev).to(adt), D)

    ring, slots = _ring(B, L, dev, g, "decode")
    cur = m2
    for step in range(3):   # decode steps, flush rows on different steps
        b32, b16 = _pair(cur)   # both from the same (bf16-representable) states
        plan = ring.plan_decode(slots)
        args = m2_in()
        before = b16.state.clone()
        y32 = K2.replay_decode(b32, plan, *args)
        y16 = K2.replay_decode(b16, plan, *args)
        ok &= _check_states(f"mamba2 replay_decode step {step}", plan.slot, plan.flush, b32, b16, before, y32, y16)
        ring.commit(plan)
        cur = b32
    for T in (2, 4):
        ring, slots = _ring(B, L, dev, g, "verify", T)
        b32, b16 = _pair(m2)
        plan = ring.plan_verify(slots, T)
        args = m2_in(T)
        before = b16.state.clone()
        y32 = K2.replay_verify(b32, plan, *args)
        y16 = K2.replay_verify(b16, plan, *args)
        ok &= _check_states(f"mamba2 replay_verify T={T}", plan.slot, plan.flush, b32, b16, before, y32, y16)
    b32, b16 = _pair(m2)
    args = m2_in()
    before = b16.state.clone()
    y32 = K2.recurrent_update(b32.state, *args, slot=slots)
    y16 = K2.recurrent_update(b16.state, *args, slot=slots)
    ok &= _check_states("mamba2 recurrent_update", slots, torch.ones_like(slots, dtype=torch.bool), b32, b16,
                        before, y32, y16)
    lens = [7, 0, 33, 70][: B] if small else [300, 0, 513] + [64] * (B - 3)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev)
    Nt = int(cu[-1])
    x = torch.randn(Nt, H, d, device=dev).to(adt)
    dtp = torch.rand(Nt, H, device=dev) * 0.1 + 0.01
    Bp, Cp = (torch.randn(Nt, G, n, device=dev).to(adt) for _ in range(2))
    sl = slots[: len(lens)]
    fresh = torch.zeros(len(lens), dtype=torch.bool, device=dev)
    fresh[-1] = True
    b32, b16 = _pair(m2)
    before = b16.state.clone()
    y32, _ = K2P.chunked_prefill_varlen(x, dtp, A, Bp, Cp, D, cu_seqlens=cu, state_pool=b32.state, slots=sl,
                                        fresh=fresh)
    y16, _ = K2P.chunked_prefill_varlen(x, dtp, A, Bp, Cp, D, cu_seqlens=cu, state_pool=b16.state, slots=sl,
                                        fresh=fresh)
    written = torch.tensor([n_ > 0 for n_ in lens], device=dev)
    ok &= _check_states("mamba2 chunked_prefill (pool)", sl, written, b32, b16, before, y32, y16)

    # GDN: Qwen3-Next-like layer (CPU: small odd shapes)
    B, HK, HV, K, V, L = (5, 2, 4, 7, 20, 8) if small else (64, 16, 32, 128, 128, 16)
    gb = GDNBuffers.allocate(B, L, HK, HV, K, V, dtype=adt, device=dev)
    gb.state.normal_()
    gb.u.normal_()
    gb.k.copy_(torch.nn.functional.normalize(torch.randn(gb.k.shape, device=dev), dim=-1))
    gb.g.uniform_(-0.7, 0.0)

    def g_in(T=None):
        lead = (B,) if T is None else (B, T)
        return (torch.randn(*lead, HK, K, device=dev).to(adt), torch.randn(*lead, HK, K, device=dev).to(adt),
                torch.randn(*lead, HV, V, device=dev).to(adt), -torch.rand(*lead, HV, device=dev) * 0.7,
                torch.rand(*lead, HV, device=dev))

    ring, slots = _ring(B, L, dev, g, "decode")
    cur = gb
    for step in range(3):
        b32, b16 = _pair(cur)
        plan = ring.plan_decode(slots)
        args = g_in()
        before = b16.state.clone()
        y32 = KG.replay_decode(b32, plan, *args)
        y16 = KG.replay_decode(b16, plan, *args)
        ok &= _check_states(f"gdn replay_decode step {step}", plan.slot, plan.flush, b32, b16, before, y32, y16)
        ring.commit(plan)
        cur = b32
    ring, slots = _ring(B, L, dev, g, "verify", 4)
    b32, b16 = _pair(gb)
    plan = ring.plan_verify(slots, 4)
    args = g_in(4)
    before = b16.state.clone()
    y32 = KG.replay_verify(b32, plan, *args)
    y16 = KG.replay_verify(b16, plan, *args)
    ok &= _check_states("gdn replay_verify T=4", plan.slot, plan.flush, b32, b16, before, y32, y16)
    b32, b16 = _pair(gb)
    args = g_in()
    before = b16.state.clone()
    y32 = KG.recurrent_update(b32.state, *args, slot=slots)
    y16 = KG.recurrent_update(b16.state, *args, slot=slots)
    ok &= _check_states("gdn recurrent_update", slots, torch.ones_like(slots, dtype=torch.bool), b32, b16,
                        before, y32, y16)
    lens = [7, 0, 33, 70][: B] if small else [300, 0, 513] + [64] * (B - 3)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev)
    Nt = int(cu[-1])
    q, k = (torch.randn(Nt, HK, K, device=dev).to(adt) for _ in range(2))
    v = torch.randn(Nt, HV, V, device=dev).to(adt)
    gg, beta = -torch.rand(Nt, HV, device=dev) * 0.7, torch.rand(Nt, HV, device=dev)
    sl = slots[: len(lens)]
    fresh = torch.zeros(len(lens), dtype=torch.bool, device=dev)
    b32, b16 = _pair(gb)
    before = b16.state.clone()
    y32 = KGP.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, state_pool=b32.state, slots=sl, fresh=fresh)[0]
    y16 = KGP.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, state_pool=b16.state, slots=sl, fresh=fresh)[0]
    written = torch.tensor([n_ > 0 for n_ in lens], device=dev)
    ok &= _check_states("gdn chunked_prefill (pool)", sl, written, b32, b16, before, y32, y16)
    return ok


# ------------------------------------------------------------------------------ 2. kernel timing
def kernel_timing(dev, small: bool, bw: float) -> None:
    H, d, n, G, L = (8, 16, 16, 1, 8) if small else (80, 64, 128, 1, 16)
    adt = F32 if small else BF16
    for B in ((4,) if small else (64, 256)):
        row = {"batch": B}
        for sdt in (F32, BF16):
            buf = Mamba2Buffers.allocate(B, L, H, d, n, G, dtype=adt, state_dtype=sdt, device=dev)
            buf.state.normal_()
            buf.x.normal_()
            buf.B.normal_()
            buf.dt.uniform_(0.05, 0.5)
            ring = RingIndex(B, L, dev)
            slots = torch.arange(1, B + 1, device=dev)
            ring.length[1:] = torch.arange(B, device=dev) % L   # every fill level: one row in L flushes
            plan = ring.plan_decode(slots)
            x = torch.randn(B, H, d, device=dev).to(adt)
            dt = torch.rand(B, H, device=dev) * 0.5 + 0.05
            A, D = -(torch.rand(H, device=dev) + 0.3), torch.ones(H, device=dev)
            Bm, Cm = (torch.randn(B, G, n, device=dev).to(adt) for _ in range(2))
            # the plan never commits, so each call re-runs the same step (flush rows rewrite their state)
            s = timed(lambda: K2.replay_decode(buf, plan, x, dt, A, Bm, Cm, D), dev, iters=50 if not small else 2)
            h = ring.length[1:].double()
            ent = buf.x[0, 0].nbytes + buf.B[0, 0].nbytes + buf.dt[0, 0].nbytes
            st = buf.state[0].nbytes
            moved = B * st + h.sum().item() * ent + int(plan.flush.sum()) * st + B * ent
            key = "fp32" if sdt == F32 else "bf16"
            row[f"{key}_us"] = s * 1e6
            row[f"{key}_bytes"] = moved
            row[f"{key}_copy_fraction"] = moved / s / bw
        row["speedup"] = row["fp32_us"] / row["bf16_us"]
        RESULTS["kernel"].append(row)
        print(f"  kernel B={B:3d}: fp32 states {row['fp32_us']:8.1f} us ({row['fp32_copy_fraction']:.0%} of copy), "
              f"bf16 states {row['bf16_us']:8.1f} us ({row['bf16_copy_fraction']:.0%} of copy), "
              f"speedup {row['speedup']:.2f}x", flush=True)


# ------------------------------------------------------------------------------ 3. engine
def step_bytes(llm, batch: int) -> float:
    """Bytes one replay decode step moves at ``batch`` rows: every weight once, and per row
    its checkpoint states, the committed ring entries (on average (L-1)/2 of L), its flush
    (one state write every L steps), the new entries and the conv windows (read + write)."""
    cache = llm.cache
    weights = sum(p.nbytes for p in llm.model.parameters())
    bufs = [st["buf"] for st in cache.layers.values() if "buf" in st]
    wins = [st["conv"].window for st in cache.layers.values() if "conv" in st]
    state = sum(b.state[0].nbytes for b in bufs)
    entry = sum(t[0, 0].nbytes for b in bufs for t in b.ring_tensors())
    conv = sum(w[0].nbytes for w in wins)
    L = cache.spec.buffer_size
    per_row = state * (1 + 1 / L) + entry * ((L - 1) / 2 + 1) + 2 * conv
    return weights + batch * per_row


def random_mamba2(cfg: dict, dev, dtype, seed: int = 0):
    """The random-weight Mamba-2 of bench e2e's recipe (``bench.e2e._write_random_mamba2``:
    unit embeddings, a permuted embedding as the LM head, the usual ``A_log`` / ``dt_bias``
    ranges), built directly on ``dev`` (no checkpoint on disk)."""
    from torch import nn

    from replayssm.models.registry import model_class, parse_config

    parsed = parse_config(dict(cfg), "preset")
    with torch.device("meta"):
        model = model_class(parsed)(parsed, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    D, nl = cfg["hidden_size"], cfg["num_hidden_layers"]
    emb = None
    for name, p in list(model.named_parameters()):
        leaf = name.rpartition(".")[2]
        shape = tuple(p.shape)
        rnd = lambda scale: torch.randn(shape, device=dev, generator=g) * scale  # noqa: E731
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
            t = torch.ones(shape, device=dev)
        elif leaf == "A_log":
            t = torch.log(torch.empty(shape, device=dev).uniform_(1, 16, generator=g))
        elif leaf == "dt_bias":
            t = torch.log(torch.expm1(torch.empty(shape, device=dev).uniform_(1e-3, 1e-1, generator=g)))
        elif "embed" in name:
            t = emb = rnd(1.0)
        elif name == "lm_head.weight":
            continue
        elif "conv1d" in name:
            t = rnd(0.3 if leaf == "weight" else 0.1)
        elif "out_proj" in name:
            t = rnd(0.02 / nl ** 0.5)
        else:
            t = rnd(0.02)
        keep32 = leaf in ("A_log", "dt_bias", "D")
        mod = model.get_submodule(name.rpartition(".")[0])
        mod._parameters[leaf] = nn.Parameter(t.to(F32 if keep32 else dtype), requires_grad=False)
    perm = torch.randperm(emb.shape[0], device=dev, generator=g)
    head = model.get_submodule("lm_head")
    head._parameters["weight"] = nn.Parameter((emb[perm] / D ** 0.5).to(dtype), requires_grad=False)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"parameters left on meta: {left[:5]}")
    return model.eval()


def engine(dev, small: bool, bw: float, args) -> None:
    from replayssm import LLM, SamplingParams

    cfg = mamba2_preset_config("tiny" if small else "2.7b")
    model = random_mamba2(cfg, dev, F32 if small else BF16)
    batches = (2, 4) if small else (64, 256)
    gen, plen = (6, 8) if small else (args.tokens, 64)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab_size"], (plen,), generator=rng).tolist() for _ in range(max(batches))]
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    rows = {B: {"batch": B} for B in batches}
    for sdt in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        llm = LLM(model, device=str(dev), decode_mode="replay", max_num_seqs=max(batches), max_seq_len=plen + gen + 8,
                  cuda_graphs=dev.type == "cuda", ssm_state_dtype=sdt)
        built = time.perf_counter() - t0
        key = "fp32" if sdt == "float32" else "bf16"
        for B in batches:
            ps = prompts[:B]
            llm.generate(ps, SamplingParams(max_tokens=3, ignore_eos=True))   # warm
            for k in llm.stats:
                llm.stats[k] = 0 if isinstance(llm.stats[k], int) else 0.0
            sync(dev)
            outs = llm.generate(ps, params)
            sync(dev)
            dec_tokens = sum(len(o.token_ids) for o in outs) - len(outs)
            dec_s = llm.stats["decode_s"]
            steps = gen - 1
            tps = dec_tokens / max(dec_s, 1e-9)
            byt = step_bytes(llm, B)
            frac = byt / (dec_s / steps) / bw
            rows[B].update({f"{key}_decode_tok_s": tps, f"{key}_step_ms": dec_s / steps * 1e3,
                            f"{key}_bytes_per_step": byt, f"{key}_copy_fraction": frac,
                            f"{key}_slots": llm.num_slots, f"{key}_build_s": built})
            print(f"  engine {key} states B={B:3d}: {tps:9.0f} decode tok/s, step {dec_s / steps * 1e3:7.2f} ms, "
                  f"{byt / 1e9:6.2f} GB/step = {frac:.0%} of copy bandwidth (engine built in {built:.0f} s)",
                  flush=True)
        llm.close()
        del llm
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for B, r in rows.items():
        r["speedup"] = r["bf16_decode_tok_s"] / r["fp32_decode_tok_s"]
        RESULTS["engine"].append(r)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-check", action="store_true", help="dry run on the CPU (interpreter, tiny shapes)")
    p.add_argument("--tokens", type=int, default=65, help="generated tokens per sequence in the engine runs")
    p.add_argument("--skip", default="", help="comma list of parts to skip: correctness,kernel,engine")
    args = p.parse_args()
    small = args.cpu_check
    if not small and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-check for a dry run", file=sys.stderr)
        return 2
    dev = torch.device("cpu") if small else torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))
    bw = copy_bandwidth(dev, (1 << 24) if small else (4 << 30))
    RESULTS["copy_bandwidth_GBps"] = bw / 1e9
    RESULTS["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    print(f"device {RESULTS['device']}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    ok = True
    if "correctness" not in skip:
        print("1. bf16 states vs the float32 path (same state values):", flush=True)
        ok = correctness(dev, small)
    if "kernel" not in skip:
        print("2. Mamba-2 replay decode kernel, one 2.7B layer:", flush=True)
        kernel_timing(dev, small, bw)
    if "engine" not in skip:
        print("3. engine replay decode, random 2.7B Mamba-2 (bf16 weights, CUDA graphs):", flush=True)
        engine(dev, small, bw, args)
    print("\n| part | B | fp32 states | bf16 states | speedup | copy fraction fp32 / bf16 |")
    print("|---|---|---|---|---|---|")
    for r in RESULTS["kernel"]:
        print(f"| kernel (1 layer) | {r['batch']} | {r['fp32_us']:.1f} us | {r['bf16_us']:.1f} us | "
              f"{r['speedup']:.2f}x | {r['fp32_copy_fraction']:.0%} / {r['bf16_copy_fraction']:.0%} |")
    for r in RESULTS["engine"]:
        print(f"| engine decode | {r['batch']} | {r['fp32_decode_tok_s']:.0f} tok/s | "
              f"{r['bf16_decode_tok_s']:.0f} tok/s | {r['speedup']:.2f}x | "
              f"{r['fp32_copy_fraction']:.0%} / {r['bf16_copy_fraction']:.0%} |")
    RESULTS["correct"] = ok
    RESULTS["wall_s"] = time.perf_counter() - t0
    print(f"correctness {'OK' if ok else 'FAILED'}; {RESULTS['wall_s']:.0f} s", flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_state_dtype.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
