"""The fused tensor-parallel finish on two (or ``--ranks`` 4) GPUs: correctness under CUDA graphs, then its cost.

(a) Correctness: :class:`replayssm.distributed.fused.FusedFinish` on 2 ranks (``--ranks``), B in 1, 7,
    64, 256, 1000 rows of D = 2560: a sequence of finishes as a model step makes them (with
    the deferred gated-norm scale, without it, the last one a plain residual add with the
    trailing barrier) captured in one CUDA graph and replayed 200 times, one rank or the other
    delayed by a sleep kernel before some calls (a barrier race would read a stale or half-written
    buffer).  Every replay's outputs must equal the eager run's bitwise, every output and
    the residual written must match the float64 reference
    (:func:`replayssm.ops.tp_reduce.reduce_add_norm`), and all ranks must hold
    bitwise-identical outputs.  With 4 ranks the second scaled finish uses two norm groups
    of two ranks (the first: one group over all).  All of it for each
    ``REPLAYSSM_TP_FUSED_METHOD`` (``pull``, ``pull-b16``, ``push``, ``twoshot``; 1000 rows exceed
    the push kernels' 256 programs, so programs stride), and every method's outputs must equal
    the pull method's bitwise.
(b) Microbench (µs per call, 32 calls a graph, 20 replays), B = 1, 64, 256, D = 2560 and 8192:
    ``finish``: today's ``one_shot_all_reduce_copy`` + ``rmsnorm(residual=)`` vs the fused
    kernel (partial already in the buffer, as Mamba-2's ``out_proj`` leaves it) and the fused
    kernel with the copy in (other mixers); ``mamba tail``: today's ``gated_sumsq`` +
    all-reduce of the sums + ``gated_rmsnorm`` + ``out_proj`` + all-reduce + add/norm vs
    ``gated_sumsq(w, out=)`` + ``out_proj`` into the buffer + the fused kernel; each fused
    column for each method, and the push methods with their grid capped at 64 programs
    and at the SM count (``P64``, ``P132``: ``REPLAYSSM_TP_FUSED_PROGRAMS``).

(c) End to end (``--skip-e2e`` to leave out): the ``small`` random Mamba-2 preset (one norm
    group: the gated norm deferred across ranks), bf16, CUDA graphs, replay decode: TP=1,
    TP=2 (``--ranks``) with ``REPLAYSSM_TP_FUSED=0``, with ``=1`` and with ``=1`` and each other
    method: full-forward logits against TP=1
    and greedy tokens of 8 prompts (the preset's logit margins are far above bf16 rounding,
    so every path must give the same tokens).

(d) ``--diagnose``: the pull kernel alone with and without its barrier, reading the peers' or
    only local partials, with its former 2-byte loads (``b16``) and its 16-byte vectors
    (``v16``), the latter at 1-16 warps: where its time goes (2026-11-27 on two H200s: 48.7 µs at 256
    rows of 2560 against 19.1 for the one-shot all-reduce + add/RMSNorm, growing with rows x
    width at ~140 GB/s).

``PYTHONPATH=. python scripts/gpu_tp_fused.py`` (two GPUs; NVLink multicast off); prints
tables and writes ``gpu_tp_fused.json`` under ``$OUT``.  Four ranks (the barrier and the
sums over four GPUs, groups of two; ``gpu_tp_fused_4.json``)::

    PYTHONPATH=. python scripts/gpu_tp_fused.py --ranks 4 --skip-bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BATCHES_CHECK = (1, 7, 64, 256, 1000)
METHODS = ("pull", "pull-b16", "push", "twoshot")     # REPLAYSSM_TP_FUSED_METHOD
BATCHES_BENCH = (1, 64, 256)
DIMS_BENCH = (2560, 8192)
REPLAYS = 200
DIAGNOSE = os.environ.get("GPU_TP_FUSED_DIAGNOSE") == "1"   # set by --diagnose for the spawned ranks
EPS, GATE_EPS = 1e-5, 1e-5
_KEEP: list = []


def _gen(seed: int, *shape, dev, scale=1.0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev) * scale


def _inputs(r: int, c: int, B: int, D: int, dev):
    """Rank ``r``'s call-``c`` partial (bf16) and sums of squares (fp32)."""
    p = _gen(1000 * c + 10 * r + B, B, D, dev=dev, scale=0.5).to(torch.bfloat16)
    q = _gen(7 + 1000 * c + 10 * r + B, B, dev=dev).abs() * 900 + 50
    return p, q


def _groups(c: int, size: int) -> int:
    """Norm groups of call ``c``'s deferred scale: two groups (of ``size / 2`` ranks) in
    call 2 when there are four ranks or more, else one over all ranks."""
    return 2 if c == 2 and size >= 4 and size % 2 == 0 else 1


def _check(rank: int, size: int, dev, res: dict) -> None:
    from replayssm.distributed.fused import FusedFinish
    from replayssm.layers.norms import RMSNorm

    D, gsize = 2560, 2 * 2560
    norm = RMSNorm(D, EPS)
    norm.weight.data = (1 + 0.2 * _gen(5, D, dev=dev)).to(torch.bfloat16)
    rows = []
    first: dict = {}       # B -> the pull method's eager outputs (every method must equal them bitwise)
    for method in METHODS:
        fin = FusedFinish(None, dev, torch.bfloat16, D, 1000 * D * 2, rank, size, None, method=method)
        if not fin.ok:
            res.setdefault("check_error", {})[method] = fin.why_not
            continue
        _check_method(rank, size, dev, fin, method, norm, gsize, first, rows)
        _KEEP.append(fin)      # symmetric buffers live until the group ends
    res["check"] = rows


def _check_method(rank, size, dev, fin, method, norm, gsize, first, rows) -> None:
    from replayssm.distributed.fused import GroupScale
    from replayssm.ops.tp_reduce import reduce_add_norm

    D = fin.D
    for B in BATCHES_CHECK:
        ncalls = 5                      # scaled, plain, scaled, plain, last add (trailing)
        h0 = _gen(99 + B, B, D, dev=dev).float()
        srcs = [_inputs(rank, c, B, D, dev) for c in range(ncalls)]
        outs = {}

        def step():
            h = h0
            for c in range(ncalls):
                p, q = srcs[c]
                fin.part_out(B).copy_(p)
                scaled = c % 2 == 0 and c < ncalls - 1
                scale = None
                if scaled:
                    fin.sums_out(B).copy_(q)
                    G = _groups(c, size)
                    scale = GroupScale(fin.sums_out(B), rank // (size // G), G, gsize, GATE_EPS)
                if (rank == 1 and c % 2 == 1) or (rank == 0 and c == 2):
                    torch.cuda._sleep(20000)    # a slow peer (either way)
                if c < ncalls - 1:
                    y, h, _ = fin.run(fin.part_out(B), scale, h, torch.float32, norm)
                    outs[f"y{c}"], outs[f"s{c}"] = y, h
                else:
                    _, h, _ = fin.run(fin.part_out(B), None, h, torch.float32, trailing=True)
                    outs[f"s{c}"] = h
            return outs

        eager = {k: v.clone() for k, v in step().items()}
        torch.cuda.synchronize()
        # float64 reference from every rank's inputs
        allsrc = [[_inputs(r, c, B, D, dev) for c in range(ncalls)] for r in range(size)]
        h = h0.double()
        err = {}
        for c in range(ncalls):
            scaled = c % 2 == 0 and c < ncalls - 1
            last = c == ncalls - 1
            y, s, _ = reduce_add_norm([allsrc[r][c][0] for r in range(size)],
                                      [allsrc[r][c][1] for r in range(size)] if scaled else None,
                                      ranks_per_group=size // _groups(c, size), group_size=gsize,
                                      gate_eps=GATE_EPS, residual=h,
                                      weight=None if last else norm.weight, eps=EPS, dtype=torch.float64)
            err[f"s{c}"] = float((eager[f"s{c}"].double() - s).abs().max() / s.abs().max().clamp(min=1))
            if not last:
                err[f"y{c}"] = float((eager[f"y{c}"].double() - y).abs().max() / y.abs().max().clamp(min=1))
            h = eager[f"s{c}"].double()     # continue from the kernel's stream (errors per call)
        # both ranks bitwise the same
        same = True
        for k, v in eager.items():
            got = [torch.empty_like(v) for _ in range(size)]
            dist.all_gather(got, v.contiguous())
            same &= all(torch.equal(got[0], x) for x in got[1:])
        # CUDA graph: replay REPLAYS times, bitwise equal to the eager run every time
        s_ = torch.cuda.Stream()
        s_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s_):
            step()
        torch.cuda.current_stream().wait_stream(s_)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gouts = step()
        bad = 0
        dist.barrier()
        for i in range(REPLAYS):
            for k in gouts:
                gouts[k].fill_(float("nan"))
            graph.replay()
            bad += int(sum(not torch.equal(gouts[k], eager[k]) for k in gouts))
        torch.cuda.synchronize()
        as_pull = True
        if method == "pull":
            first[B] = eager
        elif B in first:
            as_pull = all(torch.equal(first[B][k], v) for k, v in eager.items())
        ok = same and as_pull and bad == 0 and max(v for k, v in err.items() if k[0] == "y") < 0.03 and \
            max(v for k, v in err.items() if k[0] == "s") < 0.01
        rows.append({"method": method, "B": B, "ranks_bitwise_equal": same, "bitwise_as_pull": as_pull,
                     "graph_replays": REPLAYS, "replays_differing": bad,
                     "max_rel_err_y": max(v for k, v in err.items() if k[0] == "y"),
                     "max_rel_err_s": max(v for k, v in err.items() if k[0] == "s"), "ok": ok})
        del graph


def _time_graph(fn, K: int = 32, reps: int = 20) -> float:
    """µs per call of ``fn``: two warm-up calls on a side stream, ``K`` calls captured in one
    CUDA graph, ``reps`` replays timed by events; every rank synchronised and aligned by a
    barrier before the capture and before the timing (the calls wait on peers)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(K):
            fn()
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t[0].record()
    for _ in range(reps):
        g.replay()
    t[1].record()
    torch.cuda.synchronize()
    del g
    return t[0].elapsed_time(t[1]) * 1e3 / (reps * K)


def _bench(rank: int, size: int, dev, res: dict) -> None:
    from replayssm.distributed.allreduce import AllReduce
    from replayssm.distributed.fused import FusedFinish, GroupScale
    from replayssm.kernels.norm import gated_rmsnorm, gated_sumsq, rmsnorm
    from replayssm.layers.norms import RMSNorm

    bf = torch.bfloat16
    ar = AllReduce(None, dev, "symm", dtypes=(bf, torch.float32))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows, keep = [], []
    for D in DIMS_BENCH:
        fins = {m: FusedFinish(None, dev, bf, D, 4 << 20, rank, size, ar, method=m) for m in METHODS}
        norm = RMSNorm(D, EPS)
        norm.weight.data = torch.ones(D, dtype=bf, device=dev)
        inter = D            # the local channels of a 2x-expanded mixer on 2 ranks
        Wout = (_gen(3, D, inter, dev=dev) * inter ** -0.5).to(bf)
        wg = torch.ones(inter, dtype=bf, device=dev)
        for B in BATCHES_BENCH:
            p = _gen(rank, B, D, dev=dev).to(bf)
            h = _gen(9, B, D, dev=dev).float()
            x = _gen(11 + rank, B, inter, dev=dev).to(bf)
            z = _gen(12 + rank, B, inter, dev=dev).to(bf)
            q = torch.rand(B, device=dev) * 100 + 1
            st = {"D": D, "B": B}

            def old_finish():
                o = ar(p)
                rmsnorm(h, norm.weight, EPS, False, residual=o, sum_dtype=torch.float32)

            def old_tail():
                ss = ar(gated_sumsq(x, z))
                y = gated_rmsnorm(x, z, wg, GATE_EPS, inter, True, sumsq=ss, total=2 * inter)
                o = ar(torch.nn.functional.linear(y, Wout))
                rmsnorm(h, norm.weight, EPS, False, residual=o, sum_dtype=torch.float32)

            st["old_finish"] = _time_graph(old_finish)
            st["old_mamba_tail"] = _time_graph(old_tail)
            for m, fin in fins.items():
                if not fin.ok:
                    st[f"error_{m}"] = fin.why_not
                    continue
                for par in range(2):     # both parities hold the inputs (calls alternate between them)
                    fin.parts[par][:B].copy_(p)
                    fin.sums[par][:B].copy_(q)

                def scale(fin=fin):
                    return GroupScale(fin.sums_out(B), 0, 1, 2 * inter, GATE_EPS)

                def fused_finish(fin=fin):
                    fin.run(fin.part_out(B), scale(), h, torch.float32, norm)

                def fused_copy(fin=fin):
                    fin.run(p, scale(), h, torch.float32, norm)

                def new_tail(fin=fin):
                    u, _ = gated_sumsq(x, z, wg, out=fin.sums_out(B))
                    torch.mm(u, Wout.t(), out=fin.part_out(B))
                    fin.run(fin.part_out(B), scale(), h, torch.float32, norm)

                st[f"fused_{m}"] = _time_graph(fused_finish)
                st[f"fused_copy_in_{m}"] = _time_graph(fused_copy)
                st[f"new_tail_{m}"] = _time_graph(new_tail)
                if m in ("push", "twoshot"):          # the grid cap (default 256 programs)
                    for P in (64, sms):
                        fin.programs = P
                        st[f"fused_{m}_P{P}"] = _time_graph(fused_finish)
                    fin.programs = fin.push.max_programs
            rows.append(st)
        keep.append(fins)      # symmetric buffers live until the group ends
    res["bench"] = rows
    if DIAGNOSE:
        res["diagnose"] = _diagnose(rank, size, dev, ar)


def _diagnose(rank: int, size: int, dev, ar) -> list:
    """Where the fused kernel's time goes (``--diagnose``): the kernel alone (finish of a
    residual add + RMSNorm, no deferred scale) with and without its barrier, reading the
    peers' partials or only its own (the same bytes from local memory), at several warp
    counts; µs per call in CUDA graphs.  Without the barrier the buffers are complete
    before the graph runs (nothing writes them in it)."""
    from replayssm.distributed.fused import FusedFinish
    from replayssm.kernels.tp_reduce import tp_reduce

    bf = torch.bfloat16
    rows = []
    for D in DIMS_BENCH:
        fin = FusedFinish(None, dev, bf, D, 4 << 20, rank, size, ar)
        if not fin.ok:
            continue
        w = torch.ones(D, dtype=bf, device=dev)
        local = [torch.tensor([int(fin.part_ptrs[par][rank])] * size, dtype=torch.int64, device=dev)
                 for par in range(2)]
        for B in BATCHES_BENCH:
            for par in range(2):
                fin.parts[par][:B].copy_(_gen(rank, B, D, dev=dev).to(bf))
            h = _gen(9, B, D, dev=dev).float()
            torch.cuda.synchronize()
            dist.barrier()
            row = {"D": D, "B": B}
            for aligned in (False, True):      # the former 2-byte loads, the 16-byte vectors (default now)
                for peers in (True, False):
                    for barrier in (True, False):
                        for nw in (None, 1, 2, 4, 16):
                            if nw is not None and not (peers and barrier and aligned):
                                continue
                            ptrs = fin.part_ptrs[0] if peers else local[0]

                            def call():
                                tp_reduce(ptrs, fin.parts[0], B, rank=rank, residual=h, sum_dtype=torch.float32,
                                          weight=w, eps=EPS, pad_ptrs=fin.pad_ptrs if barrier else None,
                                          num_warps=nw, aligned=aligned)

                            key = (f"{'v16' if aligned else 'b16'} {'peers' if peers else 'local'}"
                                   f"{'+barrier' if barrier else ''}" + (f" w{nw}" if nw else ""))
                            row[key] = _time_graph(call)
            rows.append(row)
    return rows


def _worker(rank: int, size: int, port: int, q, bench: bool = True) -> None:
    sys.path.insert(0, os.getcwd())
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=dev)
    res: dict = {}
    t = time.perf_counter()
    try:
        _check(rank, size, dev, res)
        res["check_s"] = time.perf_counter() - t
        if bench:
            t = time.perf_counter()
            _bench(rank, size, dev, res)
            res["bench_s"] = time.perf_counter() - t
    except Exception:  # noqa: BLE001 - reported
        import traceback

        res["error"] = f"rank {rank}: {traceback.format_exc()}"
    if rank == 0 or "error" in res:
        q.put(res)
    dist.destroy_process_group()


def _e2e_one(path: str, tp: int, fused: str, method: str) -> dict:
    """One end-to-end config in a fresh process (a TP group whose teardown was given up
    leaves ``torch.distributed`` initialised there): logits of two prompts and greedy tokens."""
    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.distributed import TensorParallelGroup
    from replayssm.engine.loading import load

    dev = "cuda:0"
    os.environ["REPLAYSSM_TP_FUSED"] = fused     # the workers inherit it at spawn
    os.environ["REPLAYSSM_TP_FUSED_METHOD"] = method
    t = time.perf_counter()
    if tp == 1:
        model = load(path, torch.device(dev), torch.bfloat16, 1)[0]
        state = "-"
    else:
        model = TensorParallelGroup(tp, dev).load_model(path, "bfloat16")
        model.owns_group = True
        fin = model.local.tp_fused
        state = "off" if fin is None else ("on" if fin.ok else f"unavailable: {fin.why_not}")
    V = int(model.config.vocab_size)
    prompts = e2e._prompts(8, 16, V, seed=1)
    ids = torch.tensor(prompts[:2], device=dev)
    logits = model(ids).float().cpu()
    with LLM(model, device=dev, decode_mode="replay", max_num_seqs=8, cuda_graphs=True, max_seq_len=128) as llm:
        toks = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    row = {"fused_finish": state, "logits": logits, "tokens": toks, "s": time.perf_counter() - t}
    if tp > 1:
        model.close()
    return row


def _e2e(out: dict, size: int = 2) -> None:
    from replayssm.bench import e2e
    from replayssm.bench.isolated import run_isolated

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir("small", tmp)
        for name, tp, fused, method in (("TP=1", 1, "1", "pull"), (f"TP={size} fused=0", size, "0", "pull"),
                                        (f"TP={size} fused=1", size, "1", "pull"),
                                        (f"TP={size} pull-b16", size, "1", "pull-b16"),
                                        (f"TP={size} push", size, "1", "push"),
                                        (f"TP={size} twoshot", size, "1", "twoshot")):
            r = run_isolated(_e2e_one, path, tp, fused, method, timeout_s=300)
            if "error" in r:
                print(f"{name}: {r['error']}", flush=True)
                out.setdefault("e2e_errors", []).append({"config": name, "error": r["error"]})
                continue
            rows[name] = r
    ref = rows.get("TP=1")
    out["e2e"] = [{"config": k, "fused_finish": r["fused_finish"], "seconds": r["s"],
                   "max_logit_diff_vs_tp1": float((r["logits"] - ref["logits"]).abs().max()),
                   "tokens_equal_tp1": r["tokens"] == ref["tokens"]} for k, r in rows.items()] if ref else []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--ranks", type=int, default=2, choices=(2, 4), help="GPUs (ranks) of the check and e2e")
    ap.add_argument("--skip-bench", action="store_true", help="leave out (b), the microbenchmark")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time the kernel alone with/without barrier, peer/local reads, warp counts")
    args = ap.parse_args()
    if args.diagnose:
        os.environ["GPU_TP_FUSED_DIAGNOSE"] = "1"     # the spawned ranks read it at import
    t0 = time.perf_counter()
    size = args.ranks
    if torch.cuda.device_count() < size:
        print(f"needs {size} GPUs")
        return 2
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    ps = [ctx.Process(target=_worker, args=(r, size, port, q, not args.skip_bench)) for r in range(size)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(max(1.0, 190 - (time.perf_counter() - t0)))
    for p in ps:
        if p.is_alive():
            p.kill()
    out = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(), "ranks": size,
           "exitcodes": [p.exitcode for p in ps]}
    while not q.empty():
        r = q.get()
        if "error" in r:
            out.setdefault("errors", []).append(r["error"])
        else:
            out.update(r)
    for e in out.get("errors", []):
        print(e)
    if "check_error" in out:
        print("fused finish unavailable:", out["check_error"])
    print(f"(a) correctness on {size} ranks: 5 finishes per step, CUDA graph replayed", REPLAYS,
          "times, a rank delayed" + (", call 2 in two norm groups" if size >= 4 else ""))
    print(f"{'method':>8}{'B':>6}{'ranks equal':>13}{'= pull':>8}{'bad replays':>13}{'max rel y':>12}"
          f"{'max rel s':>11}{'ok':>5}")
    for r in out.get("check", []):
        print(f"{r['method']:>8}{r['B']:>6}{str(r['ranks_bitwise_equal']):>13}{str(r['bitwise_as_pull']):>8}"
              f"{r['replays_differing']:>13}{r['max_rel_err_y']:>12.2e}{r['max_rel_err_s']:>11.2e}{str(r['ok']):>5}")
    print("(b) µs per call (32 a graph, 20 replays): finish = the kernel alone (partial already in place), "
          "+copy = a mixer's output copied in, tail = gated sums + out_proj + finish")
    cols = ["old_finish"] + [f"fused_{m}" for m in METHODS] + [f"fused_copy_in_{m}" for m in METHODS] + \
        ["old_mamba_tail"] + [f"new_tail_{m}" for m in METHODS]
    extra = sorted({k for r in out.get("bench", []) for k in r if k.startswith("fused_") and k.split("_")[-1][0] == "P"})
    cols += extra
    bench = out.get("bench", [])
    print(f"{'variant (D x B)':<22}" + "".join(f"{r['D']}x{r['B']}".rjust(11) for r in bench))
    for c in cols:
        print(f"{c:<22}" + "".join((f"{r[c]:.1f}" if c in r else "-").rjust(11) for r in bench))
    for r in bench:
        for k, v in r.items():
            if k.startswith("error_"):
                print("  ", r["D"], r["B"], k, v)
    if out.get("diagnose"):
        print("(diagnose) the kernel alone, µs per call: peers' or only local partials, with or without "
              "the barrier, warp counts (default: by width)")
        for r in out["diagnose"]:
            print(f"  D={r['D']} B={r['B']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k not in ("D", "B")))
    if not args.skip_e2e:
        try:
            _e2e(out, size)
        except Exception:  # noqa: BLE001 - reported
            import traceback

            out.setdefault("errors", []).append(f"e2e: {traceback.format_exc()}")
            print(out["errors"][-1])
        print("(c) small Mamba-2 preset, bf16, CUDA graphs, replay decode, 8 prompts x 24 tokens")
        print(f"{'config':<15}{'fused finish':>14}{'max|logit-TP1|':>16}{'tokens = TP1':>14}{'s':>6}")
        for r in out.get("e2e", []):
            print(f"{r['config']:<15}{r['fused_finish']:>14.14}{r['max_logit_diff_vs_tp1']:>16.4f}"
                  f"{str(r['tokens_equal_tp1']):>14}{r['seconds']:>6.0f}")
    out["total_s"] = time.perf_counter() - t0
    print(f"total {out['total_s']:.0f} s")
    od = os.environ.get("OUT")
    if od:
        os.makedirs(od, exist_ok=True)
        with open(os.path.join(od, "gpu_tp_fused.json" if size == 2 else f"gpu_tp_fused_{size}.json"), "w") as f:
            json.dump(out, f, indent=1)
    ok = "errors" not in out and all(r["ok"] for r in out.get("check", [])) and out.get("check") and \
        all(r["tokens_equal_tp1"] for r in out.get("e2e", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
