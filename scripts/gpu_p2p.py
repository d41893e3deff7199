"""Peer-to-peer bandwidth of Triton kernels over symmetric memory on two GPUs (NVLink, no
multicast): which access pattern moves a tensor-parallel partial at NVLink speed.

Each rank holds a bf16 partial ``[R, N]`` in a symmetric buffer (allocated as the fused TP
finish allocates it: ``symm_mem.empty`` + ``rendezvous``), R in 1, 64, 256, 1024, N in 2560,
8192.  Variants (µs per call in CUDA graphs, 16 calls a graph, 10 replays, both ranks at
once; GB/s counts the bytes that cross NVLink per rank, ``(W-1)·R·N·2``):

* ``pull``: read every rank's partial (peers' over NVLink), sum in rank order in fp32, store
  the bf16 sum locally.  Layouts: ``row`` (one program per row, the fused finish's today),
  ``2d Bk`` (one program per row x column chunk of k), ``persist Gx Bk`` (a fixed grid of
  G programs striding over the chunks).  Loads: ``.cg`` / default / ``.cv``; address
  hints: ``v0`` none, ``v1`` the peer address cast to a pointer after ``multiple_of(.., 16)``
  (today's kernel), ``v2`` a known-aligned local pointer plus an element offset that is a
  multiple of 8 (16-byte vectors are then provable).  ``local`` rows read only this rank's
  buffer (the same bytes without NVLink).
* ``push``: store the local partial into each peer's receive slot (remote stores only).
* ``push+reduce``: one kernel: push, one flag per program to each peer (release, system
  scope), wait for the peers' flags, then reduce locally (the candidate PUSH finish).
* ``barrier Gn``: that kernel's flags alone, n programs.
* references: torch ``copy_`` from / to a peer's buffer view, ``torch.ops.symm_mem``
  one-shot / two-shot all-reduce (when this torch has them), NCCL ``all_reduce``.

Every pull and push+reduce output is checked bitwise against the fp32 rank-order sum, every
push against the peer's partial.

``PYTHONPATH=. python scripts/gpu_p2p.py`` (two GPUs); prints a table and writes
``gpu_p2p.json`` under ``$OUT``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_tp_fused import _time_graph  # noqa: E402  (the same graph timer)

from replayssm.kernels.tp_push import _epoch_done, _flag_and_wait  # noqa: E402  (the push kernels' flags)

ROWS = (1, 64, 256, 1024)
DIMS = (2560, 8192)
MAXE = max(ROWS) * max(DIMS)          # elements of one slot
MAXT = 8192                           # flags per source rank
K, REPS = 16, 10


@triton.jit
def _addr(ptrs, k, base, VEC: tl.constexpr):
    """Rank ``k``'s buffer as a bf16 pointer (see the module docstring's v0/v1/v2)."""
    a = tl.load(ptrs + k)
    if VEC == 2:
        d = tl.multiple_of((a - base.to(tl.int64)) // 2, 8)
        return base + d
    elif VEC == 1:
        return tl.multiple_of(a, 16).to(tl.pointer_type(tl.bfloat16))
    else:
        return a.to(tl.pointer_type(tl.bfloat16))


@triton.jit(do_not_specialize=["R"])
def _pull(ptrs, base, out, R, N, W: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr, VEC: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    nch = tl.cdiv(N, BLOCK)
    cols = tl.arange(0, BLOCK)
    for t in range(pid, R * nch, G):
        row = t // nch
        j = (t % nch) * BLOCK + cols
        m = j < N
        off = row.to(tl.int64) * N + j
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(W):
            src = _addr(ptrs, k, base, VEC)
            acc += tl.load(src + off, mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32)
        tl.store(out + off, acc.to(tl.bfloat16), mask=m)


@triton.jit(do_not_specialize=["R", "rank"])
def _push(src, ptrs, base, R, N, rank, MAXE, W: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr,
          VEC: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    nch = tl.cdiv(N, BLOCK)
    cols = tl.arange(0, BLOCK)
    for t in range(pid, R * nch, G):
        row = t // nch
        j = (t % nch) * BLOCK + cols
        m = j < N
        off = row.to(tl.int64) * N + j
        x = tl.load(src + off, mask=m)
        for p in tl.static_range(W):
            if p != rank:
                dst = _addr(ptrs, p, base, VEC)
                tl.store(dst + rank.to(tl.int64) * MAXE + off, x, mask=m, cache_modifier=CACHE)


@triton.jit(do_not_specialize=["R", "rank"])
def _push_reduce(src, ptrs, base, flag_ptrs, ctl, out, R, N, rank, MAXE, MAXT, W: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One tile (row x chunk) a program: push to the peers' slots of parity ``epoch & 1``,
    flag, wait, reduce in rank order from the local slots."""
    pid = tl.program_id(0)
    e = tl.atomic_add(ctl, 0, sem="acquire", scope="gpu")
    par = (e & 1).to(tl.int64)
    nch = tl.cdiv(N, BLOCK)
    row = pid // nch
    j = (pid % nch) * BLOCK + tl.arange(0, BLOCK)
    m = j < N
    off = row.to(tl.int64) * N + j
    x = tl.load(src + off, mask=m, other=0.0)
    for p in tl.static_range(W):
        if p != rank:
            dst = _addr(ptrs, p, base, 2)
            tl.store(dst + (par * W + rank) * MAXE + off, x, mask=m)
    _flag_and_wait(flag_ptrs, 0, e, rank, tl.program_id(0), MAXT, W)
    own = _addr(ptrs, rank, base, 2)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(W):
        if k == rank:
            acc += x.to(tl.float32)
        else:
            acc += tl.load(own + (par * W + k) * MAXE + off, mask=m, other=0.0).to(tl.float32)
    tl.store(out + off, acc.to(tl.bfloat16), mask=m)
    _epoch_done(ctl)


@triton.jit(do_not_specialize=["rank"])
def _barrier_only(flag_ptrs, ctl, rank, MAXT, W: tl.constexpr):
    e = tl.atomic_add(ctl, 0, sem="acquire", scope="gpu")
    _flag_and_wait(flag_ptrs, 0, e, rank, tl.program_id(0), MAXT, W)
    _epoch_done(ctl)


def _time(fn) -> float:
    """µs per call of ``fn`` (K calls a graph, REPS replays, every rank aligned by a barrier)."""
    return _time_graph(fn, K, REPS)


def _variants(sms: int):
    """(name, kind, BLOCK (None: the row's), grid programs (None: one a tile), cache, vec)."""
    v = [("pull row .cg v1", "pull", None, None, ".cg", 1),
         ("pull row .cg v0", "pull", None, None, ".cg", 0),
         ("pull row .cg v2", "pull", None, None, ".cg", 2),
         ("pull row def v2", "pull", None, None, "", 2),
         ("pull row .cv v2", "pull", None, None, ".cv", 2)]
    v += [(f"pull 2d B{b} .cg v2", "pull", b, None, ".cg", 2) for b in (256, 512, 1024, 2048)]
    v += [("pull 2d B1024 .cg v1", "pull", 1024, None, ".cg", 1),
          ("pull 2d B1024 def v2", "pull", 1024, None, "", 2),
          ("pull 2d B1024 .cv v2", "pull", 1024, None, ".cv", 2),
          (f"pull persist G{sms} B2048 v2", "pull", 2048, sms, ".cg", 2),
          (f"pull persist G{2 * sms} B1024 v2", "pull", 1024, 2 * sms, ".cg", 2),
          (f"pull persist G{4 * sms} B512 v2", "pull", 512, 4 * sms, ".cg", 2),
          ("local row .cg v1", "local", None, None, ".cg", 1),
          ("local 2d B1024 v2", "local", 1024, None, ".cg", 2),
          ("push row v1", "push", None, None, "", 1),
          ("push row v2", "push", None, None, "", 2),
          ("push 2d B1024 v2", "push", 1024, None, "", 2),
          ("push 2d B2048 v2", "push", 2048, None, "", 2),
          ("push 2d B1024 .wt v2", "push", 1024, None, ".wt", 2),
          (f"push persist G{2 * sms} B1024 v2", "push", 1024, 2 * sms, "", 2),
          ("push+reduce row", "push_reduce", None, None, "", 2),
          ("push+reduce 2d B1024", "push_reduce", 1024, None, "", 2),
          ("push+reduce 2d B2048", "push_reduce", 2048, None, "", 2)]
    return v


def _worker(rank: int, W: int, port: int, q) -> None:
    sys.path.insert(0, os.getcwd())
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, W, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=W, device_id=dev)
    res: dict = {"rows": []}
    try:
        _run(rank, W, dev, res)
    except Exception:  # noqa: BLE001 - reported
        import traceback

        res["error"] = f"rank {rank}: {traceback.format_exc()}"
    if rank == 0 or "error" in res:
        q.put(res)
    dist.destroy_process_group()


def _run(rank: int, W: int, dev, res: dict) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    bf = torch.bfloat16
    grp = dist.group.WORLD.group_name
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # one symmetric allocation: [src | 2 parities x W receive slots], then int32 flags [W, MAXT] + ctl
    n_el = MAXE * (1 + 2 * W)
    buf = symm_mem.empty(n_el * 2 + W * MAXT * 4 + 256, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(buf, grp)
    data = buf[: n_el * 2].view(bf)
    src, recv = data[:MAXE], data[MAXE:]
    flags = buf[n_el * 2: n_el * 2 + W * MAXT * 4].view(torch.int32)
    ctl = buf[n_el * 2 + W * MAXT * 4:].view(torch.int32)
    flags.zero_()
    ctl.zero_()
    i64 = dict(dtype=torch.int64, device=dev)
    src_ptrs = torch.tensor(list(hdl.buffer_ptrs), **i64)
    recv_ptrs = src_ptrs + MAXE * 2
    own_ptrs = torch.full((W,), int(hdl.buffer_ptrs[rank]), **i64)
    flag_ptrs = torch.tensor([a + n_el * 2 for a in hdl.buffer_ptrs], **i64)
    out = torch.empty(MAXE, dtype=bf, device=dev)
    res["aligned"] = all(a % 16 == 0 for a in hdl.buffer_ptrs)
    # torch references' buffers
    ref_in = symm_mem.empty(MAXE, dtype=bf, device=dev)
    symm_mem.rendezvous(ref_in, grp)
    ref_in.zero_()
    nccl_buf = torch.zeros(MAXE, dtype=bf, device=dev)
    ops = torch.ops.symm_mem
    torch.cuda.synchronize()
    dist.barrier()

    for N in DIMS:
        for R in ROWS:
            M = R * N
            g = torch.Generator(device=dev).manual_seed(17 * rank + M)
            mine = torch.randn(M, generator=g, device=dev).to(bf)
            src[:M].copy_(mine)
            allp = [torch.empty_like(mine) for _ in range(W)]
            dist.all_gather(allp, mine)
            want = sum(p.float() for p in allp).to(bf)     # fp32 in rank order
            torch.cuda.synchronize()
            dist.barrier()
            row = {"R": R, "N": N, "bytes": (W - 1) * M * 2}
            bad = []
            for name, kind, block, grid, cache, vec in _variants(sms):
                B = block or triton.next_power_of_2(N)
                nw = max(1, min(8, B // 256))
                T = R * triton.cdiv(N, B)
                G = min(grid, T) if grid else T
                if kind in ("pull", "local"):
                    ptrs = src_ptrs if kind == "pull" else own_ptrs

                    def fn(ptrs=ptrs, B=B, G=G, cache=cache, vec=vec, nw=nw):
                        _pull[(G,)](ptrs, src, out, R, N, W=W, BLOCK=B, CACHE=cache, VEC=vec, num_warps=nw)
                elif kind == "push":
                    def fn(B=B, G=G, cache=cache, vec=vec, nw=nw):
                        _push[(G,)](src, recv_ptrs, recv, R, N, rank, MAXE, W=W, BLOCK=B, CACHE=cache, VEC=vec,
                                    num_warps=nw)
                else:
                    if T > MAXT:
                        continue

                    def fn(B=B, T=T, nw=nw):
                        _push_reduce[(T,)](src, recv_ptrs, recv, flag_ptrs, ctl, out, R, N, rank, MAXE, MAXT, W=W,
                                           BLOCK=B, num_warps=nw)
                out[:M].fill_(float("nan"))
                try:
                    row[name] = _time(fn)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile (same on every rank)
                    row[name + " error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    continue
                torch.cuda.synchronize()
                dist.barrier()
                if kind == "pull" or kind == "push_reduce":
                    ok = torch.equal(out[:M], want)
                elif kind == "local":
                    ok = torch.equal(out[:M], (mine.float() * W).to(bf))
                else:
                    ok = all(torch.equal(recv[p * MAXE: p * MAXE + M], allp[p]) for p in range(W) if p != rank)
                if not ok:
                    bad.append(name)
            # references
            loc = out[:M]
            peer = (rank + 1) % W
            pv = hdl.get_buffer(peer, (M,), bf, 0)
            row["torch copy_ from peer"] = _time(lambda: loc.copy_(pv))
            pv_to = hdl.get_buffer(peer, (M,), bf, MAXE)
            row["torch copy_ to peer"] = _time(lambda: pv_to.copy_(mine))
            if hasattr(ops, "one_shot_all_reduce"):
                row["symm one_shot_all_reduce"] = _time(lambda: ops.one_shot_all_reduce(ref_in[:M], "sum", grp))
            if hasattr(ops, "two_shot_all_reduce_") and M % (W * 8) == 0:
                try:
                    row["symm two_shot_all_reduce_"] = _time(lambda: ops.two_shot_all_reduce_(ref_in[:M], "sum", grp))
                except Exception as e:  # noqa: BLE001
                    row["symm two_shot_all_reduce_ error"] = str(e)[:200]
            try:
                row["nccl all_reduce"] = _time(lambda: dist.all_reduce(nccl_buf[:M]))
            except Exception as e:  # noqa: BLE001
                row["nccl all_reduce error"] = str(e)[:200]
            for G in (1, 64, 256, 1024):
                row[f"barrier G{G}"] = _time(lambda G=G: _barrier_only[(G,)](flag_ptrs, ctl, rank, MAXT, W=W))
            row["wrong"] = bad
            res["rows"].append(row)
            torch.cuda.synchronize()
            dist.barrier()


def main() -> int:
    t0 = time.perf_counter()
    W = 2
    if torch.cuda.device_count() < W:
        print("needs two GPUs")
        return 2
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    ps = [ctx.Process(target=_worker, args=(r, W, port, q)) for r in range(W)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(max(1.0, 175 - (time.perf_counter() - t0)))
    for p in ps:
        if p.is_alive():
            p.kill()
    out = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(), "W": W,
           "exitcodes": [p.exitcode for p in ps], "rows": []}
    while not q.empty():
        r = q.get()
        if "error" in r:
            out.setdefault("errors", []).append(r["error"])
        if r.get("rows"):
            out["rows"], out["aligned"] = r["rows"], r.get("aligned")
    for e in out.get("errors", []):
        print(e)
    rows = out["rows"]
    if rows:
        names = list(dict.fromkeys(k for r in rows for k in r if k not in ("R", "N", "bytes", "wrong")))
        errs = [n for n in names if n.endswith("error")]
        names = [n for n in names if n not in errs]
        print(f"µs per call | GB/s over NVLink per rank ((W-1)·R·N·2 bytes); {out['device']}, W={W}, "
              f"buffers 16B-aligned: {out.get('aligned')}")
        hdr = "".join(f"{r['N']}x{r['R']:<5}".rjust(15) for r in rows)
        print(f"{'variant':<30}{hdr}")
        for n in names:
            cells = []
            for r in rows:
                v = r.get(n)
                cells.append("-".rjust(15) if not isinstance(v, float) else
                             f"{v:7.1f}|{r['bytes'] / v / 1e3:6.0f}".rjust(15))
            print(f"{n:<30}{''.join(cells)}")
        for n in errs:
            print(n, next(r[n] for r in rows if n in r))
        wrong = sorted({w for r in rows for w in r["wrong"]})
        print("wrong results:", wrong or "none")
        out["wrong"] = wrong
    out["total_s"] = time.perf_counter() - t0
    print(f"total {out['total_s']:.0f} s")
    od = os.environ.get("OUT")
    if od:
        os.makedirs(od, exist_ok=True)
        with open(os.path.join(od, "gpu_p2p.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0 if rows and not out.get("errors") and not out.get("wrong") else 1


if __name__ == "__main__":
    sys.exit(main())
