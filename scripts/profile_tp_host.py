"""Rank 0's and a worker's host work per tensor-parallel decode step, on CPU (no GPU needed).

1. The step's control message (``ShardedRunner.decode``'s call: the slot list, host tokens)
   at B = 1 / 64 / 256: rank 0's encode + pickle into the shared-memory ring, the worker's
   unpickle + resolve (``comm.fill``), with the slot list as a plain list (as before) and as
   ``comm.Plain`` (as sent now).  Medians of ``--rounds`` rounds of 1000 messages.
2. The worker's wake-up: a writer sends a call every GAP ms (a decode step's length) and a
   reader process notes arrival minus send time, with the ring's former fixed 5 ms spin
   window (``spin_max_s=0.005``) and the adaptive one (``2 x`` the recent gap, at most
   50 ms).  On a loaded machine the numbers are noisy: compare the two columns of one run.

``PYTHONPATH=. python scripts/profile_tp_host.py`` (~1 min); writes ``profile_tp_host.json``
under ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time


def message_costs(batches, rounds: int) -> list[dict]:
    import torch

    from replayssm.distributed.comm import Comm, Plain, fill
    from replayssm.distributed.group import TensorParallelGroup
    from replayssm.distributed.shm_channel import ShmChannel

    g = TensorParallelGroup.__new__(TensorParallelGroup)   # only its encoder: no processes
    g._frees, g._frees_lock = [], threading.RLock()
    g.comm = Comm(0, 2, torch.device("cuda"), None, None, None)   # host tensors travel in the message
    w = ShmChannel.create(1)
    r = ShmChannel.attach(w.name, 1, 1)
    rows = []
    try:
        for B in batches:
            slots, toks = list(range(B)), torch.randint(0, 50000, (B,))
            res: dict = {False: [], True: []}
            for _ in range(rounds):
                for wrap in (False, True):
                    t0 = t1 = 0.0
                    n = 1000
                    for _ in range(n):
                        a = time.perf_counter()
                        tensors: list = []
                        wire, _ = g._encode((Plain(list(slots)) if wrap else list(slots), toks), tensors)
                        kw, _ = g._encode({}, tensors)
                        w.send((("call", (3, "decode", wire, kw, None), g._take_frees()), []))
                        b = time.perf_counter()
                        msg, _ = r.recv()
                        fill(msg, [], {3: None})
                        c = time.perf_counter()
                        t0 += b - a
                        t1 += c - b
                    res[wrap].append((1e6 * t0 / n, 1e6 * t1 / n))
            for wrap in (False, True):
                rows.append({"B": B, "slots": "Plain" if wrap else "list",
                             "rank0_encode_send_us": statistics.median(x[0] for x in res[wrap]),
                             "worker_recv_fill_us": statistics.median(x[1] for x in res[wrap])})
    finally:
        r.close()
        w.close()
    return rows


def _reader(name: str, n: int, spin_max_s: float, q) -> None:
    from replayssm.distributed.shm_channel import ShmChannel

    r = ShmChannel.attach(name, 1, 1)
    r.spin_max_s = spin_max_s
    q.put("ready")
    lat = []
    for _ in range(n):
        sent = r.recv()
        lat.append(time.perf_counter() - sent)    # CLOCK_MONOTONIC: one clock for both processes
    q.put(lat)
    r.close()


def wake_latency(gap_ms: float, spin_max_s: float, n: int = 150) -> dict:
    from replayssm.distributed.shm_channel import ShmChannel

    ctx = mp.get_context("spawn")
    w = ShmChannel.create(1)
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_reader, args=(w.name, n, spin_max_s, q))
    p.start()
    try:
        assert q.get() == "ready"
        time.sleep(0.2)
        for _ in range(n):
            time.sleep(gap_ms / 1e3)              # rank 0 waiting for its step on the device
            w.send(time.perf_counter())
        lat = sorted(q.get()[20:])
    finally:
        p.join(30)
        w.close()
    return {"gap_ms": gap_ms, "spin_max_s": spin_max_s, "median_us": statistics.median(lat) * 1e6,
            "p90_us": lat[int(0.9 * len(lat))] * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--gaps-ms", default="3,6,12")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    out = {"messages": message_costs([int(b) for b in a.batches.split(",")], a.rounds), "wake": []}
    print("(1) a decode call's control message, µs (medians)")
    print(f"{'B':>5}{'slots':>7}{'rank 0 encode+send':>20}{'worker recv+fill':>18}")
    for r in out["messages"]:
        print(f"{r['B']:>5}{r['slots']:>7}{r['rank0_encode_send_us']:>20.1f}{r['worker_recv_fill_us']:>18.1f}")
    print("(2) worker wake-up after a call, µs: fixed 5 ms spin window vs adaptive (2x gap, <= 50 ms)")
    print(f"{'gap ms':>7}{'fixed med':>11}{'p90':>9}{'adaptive med':>14}{'p90':>9}")
    for gap in (float(x) for x in a.gaps_ms.split(",")):
        fixed, adaptive = wake_latency(gap, 0.005), wake_latency(gap, 0.05)
        out["wake"] += [fixed, adaptive]
        print(f"{gap:>7.0f}{fixed['median_us']:>11.1f}{fixed['p90_us']:>9.1f}{adaptive['median_us']:>14.1f}"
              f"{adaptive['p90_us']:>9.1f}", flush=True)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "profile_tp_host.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
