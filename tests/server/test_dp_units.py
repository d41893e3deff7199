"""Data parallelism without processes: the router, the step wire format, the configuration."""

from __future__ import annotations

import math
import random

import pytest

from replayssm.engine.outputs import RequestOutput
from replayssm.server.dp import DataParallelConfig
from replayssm.server.dp_replica import StepAssembler, StepDeltas, replica_device
from replayssm.server.dp_router import PrefixRouter, RouterConfig, block_hashes

B = 4


def _router(n=3, **kw):
    return PrefixRouter(n, RouterConfig(block_tokens=B, **kw))


def test_block_hashes_name_whole_prefixes_only():
    a = block_hashes(list(range(11)), B)          # 2 whole blocks, 3 tokens left over
    assert len(a) == 2
    assert block_hashes(list(range(8)) + [99, 98], B) == a   # same prefix blocks, other tail
    b = block_hashes([0, 1, 2, 3, 9, 5, 6, 7], B)
    assert b[0] == a[0] and b[1] != a[1]           # chained: block 2 names the whole prefix
    assert block_hashes([1, 2, 3], B) == []


def test_same_prefix_goes_where_it_went_and_new_prefixes_spread():
    r = _router(3)
    idle, up = [0, 0, 0], [True] * 3
    first, why = r.route(list(range(10)), idle, up)
    assert why == "load"
    for tail in ([50], [60, 61, 62, 63, 64], []):
        assert r.route(list(range(8)) + tail, idle, up) == (first, "affinity")
    seen = {first}
    for k in range(2):   # unseen prefixes at equal load: round robin over the replicas
        seen.add(r.route([100 + k] * 9, idle, up)[0])
    assert seen == {0, 1, 2}
    assert r.route([7, 7, 7], idle, up)[1] == "load"   # shorter than a block: nothing to match


def test_the_deepest_remembered_prefix_wins():
    r = _router(2)
    up = [True, True]
    shallow = [1, 1, 1, 1] + [2] * 4
    deep = [1, 1, 1, 1] + [3] * 4 + [4] * 4
    assert r.route(shallow, [0, 0], up)[0] == 0
    assert r.route(deep, [1, 0], up) == (0, "affinity")   # its first block went to 0, within the bound
    assert r.route(deep, [2, 0], up) == (1, "load")       # 0 is over the bound: least loaded
    # a prompt extending `deep` matches replica 1 (3 blocks, the last routing) over replica 0
    assert r.route(deep + [5] * 4, [0, 0], up) == (1, "affinity")
    # and one extending only the first block goes to where that block went last (replica 1)
    assert r.route([1, 1, 1, 1, 9, 9, 9, 9], [0, 0], up) == (1, "affinity")


def test_load_bound_and_unusable_replicas():
    r = _router(2, load_factor=1.25)
    p = list(range(8))
    up = [True, True]
    assert r.route(p, [0, 0], up)[0] == 0
    assert r.bound([1, 0]) == 2 and r.route(p, [1, 0], up) == (0, "affinity")
    assert r.bound([2, 0]) == 2 and r.route(p, [2, 0], up) == (1, "load")   # over its share
    # now both hold the prefix (the last one wins); a full or down replica is never chosen
    assert r.route(p, [0, 0], [False, True]) == (1, "affinity")
    assert r.route(p, [0, 5], [True, False]) == (0, "load")
    with pytest.raises(ValueError, match="no replica is usable"):
        r.route(p, [0, 0], [False, False])
    with pytest.raises(ValueError, match="2 loads"):
        r.route(p, [0], [True])


def test_load_stays_within_the_bound_for_one_hot_prefix():
    """Consistent routing with bounded loads: 200 arrivals of one prefix on 4 replicas (with
    random departures) never put more than ceil(c * (m + 1) / n) on one replica."""
    rng = random.Random(0)
    r = _router(4, load_factor=1.25)
    loads = [0, 0, 0, 0]
    for _ in range(200):
        bound = r.bound(loads)
        i, _ = r.route(list(range(12)), loads, [True] * 4)
        assert loads[i] < bound
        loads[i] += 1
        if rng.random() < 0.4:
            j = rng.choice([k for k in range(4) if loads[k]])
            loads[j] -= 1
    assert max(loads) <= math.ceil(1.25 * sum(loads) / 4) + 1


def test_forget_and_table_size():
    r = _router(2, table_size=3)
    r.route(list(range(8)), [0, 0], [True, True])
    r.route([9] * 8, [1, 0], [True, True])
    assert len(r) == 3   # 4 block hashes, the oldest evicted
    r.forget(1)
    assert len(r) == 1   # only the first prompt's second block (replica 0) is left
    assert r.route(list(range(8)), [0, 0], [True, True]) == (0, "affinity")
    r.forget(0)
    assert len(r) == 0


@pytest.mark.parametrize("bad, match", [
    (dict(block_tokens=0), "block_tokens"), (dict(block_tokens=True), "block_tokens"),
    (dict(load_factor=0.9), "load_factor"), (dict(load_factor=float("nan")), "load_factor"),
    (dict(table_size=0), "table_size"),
])
def test_router_config_refuses_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**bad)


def test_dp_config_and_devices():
    for bad, match in ((dict(size=0), "data_parallel_size"), (dict(size=2, max_restarts=-1), "max_restarts"),
                       (dict(size=2, start_timeout_s=0), "start_timeout_s")):
        with pytest.raises(ValueError, match=match):
            DataParallelConfig(**bad)
    with pytest.raises(ValueError, match="num_replicas"):
        PrefixRouter(0)
    assert [replica_device(i, 2, None, True) for i in range(3)] == ["cuda:0", "cuda:2", "cuda:4"]
    assert replica_device(1, 4, "cuda", True) == "cuda:4"
    assert replica_device(3, 2, None, False) == replica_device(3, 2, "cpu", True) == "cpu"
    with pytest.raises(ValueError, match="names one GPU"):
        replica_device(0, 1, "cuda:1", True)
    assert replica_device(0, 2, "cuda:1", True, single=True) == "cuda:1"   # one engine process: kept
    assert replica_device(0, 1, "cpu", True, single=True) == "cpu"
    with pytest.raises(ValueError, match="cpu or cuda"):
        replica_device(0, 1, "mps", True)


def _out(rid, idx, ids, text, lps=None, reason=None, **kw):
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1, 2], text=text, token_ids=list(ids),
                         finish_reason=reason, logprobs=lps, index=idx, **kw)


def test_step_deltas_rebuild_every_cumulative_output():
    """The replica sends only what is new (tokens, text, logprobs); the API side rebuilds
    each step's cumulative output exactly -- also when the text is rewritten (a stop string
    cut) and for two samples of one request."""
    lp = lambda t: (-0.5 * t, [(t, -0.5 * t)])  # noqa: E731
    steps = [
        [_out("a", 0, [5], "x", [lp(5)]), _out("a", 1, [6], "y", [lp(6)])],
        [_out("a", 0, [5, 7, 8], "xzz", [lp(5), lp(7), lp(8)])],
        [_out("a", 1, [6, 9], "yw", [lp(6), lp(9)]), _out("b", 0, [3], "q")],
        [_out("a", 0, [5, 7, 8, 4], "xz", [lp(5), lp(7), lp(8), lp(4)], reason="stop",
              accepted_lengths=[1, 2], num_verify_steps=2, num_drafted=4, num_accepted=1)],
        [_out("a", 1, [6, 9, 2], "yw!", [lp(6), lp(9), lp(2)], reason="length"),
         _out("b", 0, [3, 3], "qq", reason="error", error="boom")],
    ]
    send, recv = StepDeltas(), StepAssembler()
    sent_tokens = 0
    for step in steps:
        for o in step:
            e = send.entry(o)
            sent_tokens += len(e[2])
            got = recv.add(e, [1, 2])
            assert (got.request_id, got.index, got.token_ids, got.text, got.logprobs, got.finish_reason,
                    got.error) == (o.request_id, o.index, o.token_ids, o.text, o.logprobs, o.finish_reason, o.error)
            assert got.prompt_token_ids == [1, 2]
            if o.finish_reason is not None:
                assert (got.accepted_lengths, got.num_verify_steps, got.num_drafted, got.num_accepted) == \
                       (o.accepted_lengths, o.num_verify_steps, o.num_drafted, o.num_accepted)
    assert sent_tokens == 4 + 3 + 2   # every token once
    assert len(recv) == 0 and send._sent == {}   # finished requests leave no state


def test_step_deltas_forget_an_aborted_request():
    send, recv = StepDeltas(), StepAssembler()
    recv.add(send.entry(_out("a", 0, [1], "x")), [])
    recv.add(send.entry(_out("a", 1, [1], "x")), [])
    send.forget("a")
    recv.forget("a", 2)
    assert send._sent == {} and len(recv) == 0
    again = recv.add(send.entry(_out("a", 0, [4, 5], "uv")), [])   # a new request of the same id starts over
    assert again.token_ids == [4, 5] and again.text == "uv"


def test_bench_serve_passes_the_data_parallel_flags_to_its_servers():
    from replayssm.bench.serve import build_parser, engine_flags

    args = build_parser().parse_args(["--data-parallel-size", "2", "--data-parallel-max-restarts", "0"])
    flags = engine_flags(args, "replay", False)
    assert flags[flags.index("--data-parallel-size") + 1] == "2"
    assert flags[flags.index("--data-parallel-max-restarts") + 1] == "0"
    assert "--data-parallel-size" not in engine_flags(build_parser().parse_args([]), "replay", False)


def test_a_wake_set_while_it_is_cleared_is_never_lost():
    """A ``set`` from another thread during ``clear``'s drain (forced here from inside the
    drain) must leave the wake able to wake the next wait: either its byte stays, or the
    flag is down so that the next ``set`` sends one."""
    from multiprocessing import connection

    from replayssm.server.dp_client import _SocketWake

    w = _SocketWake()
    try:
        w.set()
        real, calls = w._r, []

        class Racing:   # the socket, with a set() from "another thread" at the first recv
            def recv(self, n):
                if not calls:
                    calls.append(1)
                    w.set()
                return real.recv(n)

        w._r = Racing()
        w.clear()
        w._r = real
        w.set()   # a later command's wake-up
        assert connection.wait([real], 0.5) == [real]
        w.clear()
        assert connection.wait([real], 0.05) == []   # drained and disarmed: a wait sleeps
        w.set()
        assert connection.wait([real], 0.5) == [real] and w.wait(0) is True
    finally:
        w.close()
