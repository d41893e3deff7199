"""The data-parallel pool in-process, against fake replicas that speak the replica protocol
over pipes (no engine, no process): routing, streaming, aborts, a replica whose connection
closes, a replica that hangs (the step timeout), and the server's state through all of it."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from replayssm import SamplingParams
from replayssm.engine.outputs import RequestOutput
from replayssm.server.dp import DataParallelConfig, DataParallelPool
from replayssm.server.dp_replica import StepDeltas
from replayssm.server.dp_router import RouterConfig
from replayssm.server.engine_loop import EngineError, QueueFull

V = 50


def token(ids, k):
    """The fake replica's k-th generated token for prompt ``ids``."""
    return (sum(ids) * 7 + 3 * k) % V


class FakeReplica(threading.Thread):
    """Replica ``index``: one token per step for every request, ``delay`` seconds a step;
    ``die`` closes its connection, ``hang`` stops it answering (until ``release``)."""

    def __init__(self, conn, index, delay=0.005):
        super().__init__(daemon=True)
        self.conn, self.index, self.delay = conn, index, delay
        self.die, self.hang, self.release = threading.Event(), threading.Event(), threading.Event()
        self.seen: list = []     # commands received, in order

    def run(self):
        c = self.conn
        c.send(("ready", {"pid": 1000 + self.index, "device": "cpu", "num_slots": 4, "token_limit": 64,
                          "vocab_size": V, "summary": "fake"}))
        deltas, live = StepDeltas(), {}
        while True:
            if self.die.is_set():
                c.close()
                return
            if self.hang.is_set():
                self.release.wait()
                c.close()
                return
            try:
                while c.poll(0 if live else 0.01):
                    cmd = c.recv()
                    self.seen.append(cmd[:2])
                    if cmd[0] == "add":
                        live[cmd[1]] = (cmd[2], cmd[3], [])
                    elif cmd[0] == "abort":
                        live.pop(cmd[1], None)
                        deltas.forget(cmd[1])
                    elif cmd[0] == "stop":
                        c.close()
                        return
            except (EOFError, OSError):
                return
            if not live:
                continue
            time.sleep(self.delay)
            entries = []
            for rid, (ids, params, out) in list(live.items()):
                out.append(token(ids, len(out)))
                done = len(out) >= params.max_tokens
                o = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=ids, text="".join(chr(97 + t % 26)
                                  for t in out), token_ids=list(out), finish_reason="length" if done else None)
                entries.append(deltas.entry(o))
                if done:
                    del live[rid]
            occ = {"running": len(live), "waiting": 0, "free_slots": 4 - len(live), "total_slots": 4,
                   "free_kv_blocks": -1, "total_kv_blocks": 0}
            try:
                c.send(("step", self.delay, entries, [], occ, 0))
            except OSError:
                return


@pytest.fixture
def pool():
    ends = [Pipe(duplex=True) for _ in range(2)]
    fakes = [FakeReplica(ends[i][1], i) for i in range(2)]
    for f in fakes:
        f.start()
    cfg = DataParallelConfig(2, max_restarts=0, step_timeout_s=1.0, router=RouterConfig(block_tokens=4))
    args = SimpleNamespace(tensor_parallel_size=1, device="cpu", seed=0)
    p = DataParallelPool("unused", args, cfg, "fake", max_queue=2, connected={0: ends[0][0], 1: ends[1][0]})
    infos = p.launch(None)
    assert [i["pid"] for i in infos] == [1000, 1001]
    p.start()
    p.fakes = fakes
    yield p
    for f in fakes:
        f.release.set()
    p.shutdown(2.0)


def _req(rid, ids, n=5):
    return [(rid, list(ids), SamplingParams(max_tokens=n))]


async def _collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_routes_streams_and_aborts(pool):
    async def main():
        a = pool.submit(_req("a", [1, 2, 3, 4, 5]))
        b = pool.submit(_req("b", [9, 9, 9, 9, 1]))
        assert {a.replica, b.replica} == {0, 1}   # unseen prefixes: least loaded
        outs = await asyncio.gather(_collect(a), _collect(b))
        for out, ids in zip(outs, ([1, 2, 3, 4, 5], [9, 9, 9, 9, 1])):
            assert out.token_ids == [token(ids, k) for k in range(5)] and out.finish_reason == "length"
            assert out.text == "".join(chr(97 + t % 26) for t in out.token_ids)
            assert out.prompt_token_ids == ids
        # the same first block goes where it went, within the load bound
        c = pool.submit(_req("c", [1, 2, 3, 4, 7, 7]))
        assert c.replica == a.replica
        await _collect(c)
        # an abort reaches the replica holding the request and ends the stream
        d = pool.submit(_req("d", [5, 5, 5, 5], n=10_000))
        first = await d.__anext__()
        assert len(first.token_ids) >= 1
        pool.abort(d)
        with pytest.raises(StopAsyncIteration):
            while True:
                await d.__anext__()
        for _ in range(200):
            if pool.in_flight == 0 and ("abort", "d") in pool.fakes[d.replica].seen:
                break
            await asyncio.sleep(0.01)
        assert pool.in_flight == 0 and ("abort", "d") in pool.fakes[d.replica].seen
        # capacity: 4 slots + 2 queued per replica
        streams = [pool.submit(_req(f"q{i}", [i + 20] * 3, n=10_000)) for i in range(12)]
        assert sorted(s.replica for s in streams).count(0) == 6
        with pytest.raises(QueueFull, match="at capacity"):
            pool.submit(_req("x", [1]))
        for s in streams:
            pool.abort(s)
        code, body = pool.health()
        assert code == 200 and body["status"] == "ok" and [r["state"] for r in body["replicas"]] == ["up", "up"]

    asyncio.run(main())
    assert pool.metrics.r_routed.labels("fake", "0", "affinity")._value.get() == 1


def test_a_closed_connection_and_a_hung_replica(pool):
    async def main():
        r1 = pool.submit(_req("long1", [3, 3, 3, 3], n=10_000))
        r0 = pool.submit(_req("long0", [4, 4, 4, 4], n=10_000))
        assert (r0.replica, r1.replica) == (1, 0) or (r0.replica, r1.replica) == (0, 1)
        dying = r1 if r1.replica == 1 else r0
        await dying.__anext__()
        pool.fakes[1].die.set()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"engine replica 1 \(pid 1001\) closed its connection"):
            await _collect(dying)
        assert time.monotonic() - t0 < 5
        code, body = pool.health()
        assert code == 200 and body["status"] == "degraded"
        assert body["replicas"][1]["state"] == "failed"   # not ours to restart
        # replica 0 serves everything now
        s = pool.submit(_req("after", [8, 8, 8, 8, 8]))
        assert s.replica == 0
        assert (await _collect(s)).token_ids == [token([8] * 5, k) for k in range(5)]
        # replica 0 hangs with a request in flight: after the step timeout (1 s) the request
        # ends with the reason and no replica is left
        other = r0 if dying is r1 else r1
        pool.fakes[0].hang.set()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"engine replica 0 \(pid 1000\) failed: stopped answering: no step "
                                              r"for \d+ s with 1 sequences in flight \(step timeout 1 s\)"):
            await _collect(other)
        assert 0.5 < time.monotonic() - t0 < 10
        code, body = pool.health()
        assert code == 503 and body["status"] == "unavailable"
        with pytest.raises(QueueFull, match="no engine replica is up"):
            pool.submit(_req("late", [1]))
        assert pool.in_flight == 0

    asyncio.run(main())
