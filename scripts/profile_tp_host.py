"""Rank 0's and a worker's host work per tensor-parallel decode step, on CPU (no GPU needed).

1. The step's control message (``ShardedRunner.decode``'s call: the slot list, host tokens)
   at B = 1 / 64 / 256: rank 0's encode + pickle into the shared-memory ring, the worker's
   unpickle + resolve (``comm.fill``), with the slot list as a plain list (as before) and as
   ``comm.Plain`` (as sent now).  Medians of ``--rounds`` rounds of 1000 messages.
2. The worker's wake-up: a writer sends a call every GAP ms (a decode step's length) and a
   reader process notes arrival minus send time, with the ring's former fixed 5 ms spin
   window (``spin_max_s=0.005``) and the adaptive one (``2 x`` the recent gap, at most
   50 ms).  On a loaded machine the numbers are noisy: compare the two columns of one run.

3. Rank 0's host time per engine decode step, TP=1 vs TP=2 (``--engine``; CPU, gloo data
   group, the shared-memory control ring as on GPUs): the step's wall time less the time
   inside rank 0's own runner and cache calls (its model work, the same on both), the
   control messages per step and rank 0's encode+send time per step, for a tiny random
   model of ``--presets`` (``nemotron-h-tiny``: attention blocks reserved every step;
   ``tiny``: Mamba-2 only) at B = ``--batches``.  On a loaded machine compare within a run.

``PYTHONPATH=. python scripts/profile_tp_host.py`` (~1 min; ``--engine`` ~2 min more);
writes ``profile_tp_host.json`` under ``$OUT`` when set.
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


def _engine_host_row(model, B: int, steps: int, group=None) -> dict:
    """One model's decode steps at batch ``B`` (after the prefills): per step, the wall
    time, rank 0's time inside its runner and cache calls, the rest (host), and with a
    group the control messages and rank 0's encode+send time (call start -> local part)."""
    import collections

    from replayssm import LLM, SamplingParams
    from replayssm.bench.e2e import _prompts
    from replayssm.engine.model_runner import ModelRunner
    from replayssm.models.cache import ModelCache

    acc = collections.Counter()
    undo = []

    def wrap(owner, name, key):
        f = getattr(owner, name)

        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t

        setattr(owner, name, g)
        undo.append((owner, name, f))

    for n in ("decode", "prefill"):
        wrap(ModelRunner, n, "local")
    for n in ("reserve", "write_pending", "release", "reserve_step"):
        if hasattr(ModelCache, n):
            wrap(ModelCache, n, "local")
    V = int(model.config.vocab_size)
    llm = LLM(model, device="cpu", decode_mode="replay", max_num_seqs=B, max_seq_len=steps + 64)
    try:
        for p in _prompts(B, 8, V, seed=1):
            llm.add_request(p, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        for _ in range(3):
            llm.step()
        msgs = [0]
        if group is not None:
            orig = group.call

            def call(target, method, local, args=(), kwargs=None, result=None):
                t0 = time.perf_counter()

                def timed(*a, **k):
                    acc["send"] += time.perf_counter() - t0
                    return local(*a, **k)

                msgs[0] += 1
                return orig(target, method, timed, args, kwargs, result)

            group.call = call
            undo.append((group, "call", orig))
        acc.clear()
        t = time.perf_counter()
        for _ in range(steps):
            llm.step()
        wall = time.perf_counter() - t
    finally:
        for owner, name, f in reversed(undo):
            setattr(owner, name, f)
        llm.close()
    us = 1e6 / steps
    return {"B": B, "step_us": wall * us, "local_us": acc["local"] * us, "host_us": (wall - acc["local"]) * us,
            "messages_per_step": msgs[0] / steps, "rank0_encode_send_us": acc["send"] * us}


def engine_host(presets, batches, steps: int = 20) -> list[dict]:
    import tempfile

    import torch

    from replayssm.bench.e2e import _random_model_dir
    from replayssm.distributed import TensorParallelGroup
    from replayssm.models import load_model

    rows = []
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for preset in presets:
            with tempfile.TemporaryDirectory() as tmp:
                path = _random_model_dir(preset, tmp)
                one = load_model(path, device="cpu", dtype=torch.float32)
                g = TensorParallelGroup(2, "cpu", worker_threads=1, control="shm")
                try:
                    two = g.load_model(path, dtype="float32")
                    for B in batches:
                        for tp, m in ((1, one), (2, two)):
                            r = _engine_host_row(m, B, steps, g if tp == 2 else None)
                            rows.append({"preset": preset, "tp": tp, **r})
                            print(f"{preset:>16}{tp:>4}{B:>5}{r['step_us']:>10.0f}{r['host_us']:>10.0f}"
                                  f"{r['messages_per_step']:>8.1f}{r['rank0_encode_send_us']:>12.0f}", flush=True)
                finally:
                    g.close()
    finally:
        torch.set_num_threads(n)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--gaps-ms", default="3,6,12")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="(3): rank 0's host time per engine step, TP=1 vs TP=2")
    ap.add_argument("--engine-only", action="store_true", help="only (3)")
    ap.add_argument("--presets", default="nemotron-h-tiny,tiny")
    a = ap.parse_args()
    if a.engine_only:
        print("(3) rank 0's host µs per decode step (wall less its own runner/cache calls), CPU, shm control")
        print(f"{'preset':>16}{'TP':>4}{'B':>5}{'step µs':>10}{'host µs':>10}{'msgs':>8}{'encode+send':>12}")
        rows = engine_host(a.presets.split(","), [int(b) for b in a.batches.split(",")])
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            with open(os.path.join(os.environ["OUT"], "profile_tp_host.json"), "w") as f:
                json.dump({"engine": rows}, f, indent=1)
        return 0
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
    if a.engine:
        print("(3) rank 0's host µs per decode step (wall less its own runner/cache calls), CPU, shm control")
        print(f"{'preset':>16}{'TP':>4}{'B':>5}{'step µs':>10}{'host µs':>10}{'msgs':>8}{'encode+send':>12}")
        out["engine"] = engine_host(a.presets.split(","), [int(b) for b in a.batches.split(",")])
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "profile_tp_host.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
