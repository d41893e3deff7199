"""The shared-memory control ring: order, wrap-around, flow control, oversize fallback, a
gone peer, and a tensor-parallel group driven through it (CPU, gloo data group)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from replayssm.distributed.shm_channel import ChannelClosed, ShmChannel


@pytest.fixture
def ring():
    w = ShmChannel.create(readers=2, slots=4, slot_bytes=256)
    rs = [ShmChannel.attach(w.name, r, 2, slots=4, slot_bytes=256) for r in (1, 2)]
    yield w, rs
    for r in rs:
        r.close()
    w.close()


def test_messages_arrive_in_order_through_wrap_around_and_oversize_fallback(ring):
    w, rs = ring
    msgs = [("call", i, list(range(i % 7)), "x" * (300 if i % 5 == 3 else i)) for i in range(23)]
    got = {1: [], 2: []}

    def read(r):
        for _ in msgs:
            got[r.rank].append(r.recv())

    ts = [threading.Thread(target=read, args=(r,)) for r in rs]
    for t in ts:
        t.start()
    fits = [w.send(m) for m in msgs]           # 23 messages through 4 slots: the writer waits for readers
    for t in ts:
        t.join(10)
    assert fits == [len(m[3]) < 200 for m in msgs]
    for r in (1, 2):   # an oversize message arrives as None: its payload is on the fallback channel
        assert got[r] == [m if f else None for m, f in zip(msgs, fits)]


def test_writer_waits_for_the_slowest_reader(ring):
    w, (r1, r2) = ring
    for i in range(4):
        w.send(i)
    for _ in range(4):
        r1.recv()
    done = threading.Event()

    def fifth():
        w.send(4)
        done.set()

    t = threading.Thread(target=fifth)
    t.start()
    time.sleep(0.1)
    assert not done.is_set()       # slot 0 still unread by reader 2
    assert r2.recv() == 0
    t.join(5)
    assert done.is_set() and r1.recv() == 4


def test_a_gone_peer_raises_instead_of_waiting_forever(ring):
    w, (r1, _) = ring
    r1.alive = lambda: False
    with pytest.raises(ChannelClosed):
        r1.recv()
    for i in range(4):
        w.send(i)
    w.alive = lambda: False
    with pytest.raises(ChannelClosed):
        w.send(4)


def test_group_over_the_shared_memory_ring_matches_one_process(tmp_path):
    """Greedy tokens of a TP=2 model driven through the ring equal TP=1's; a killed worker
    turns into ``WorkerFailed`` (the polling driver notices), not a hang."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "models"))
    import hf_utils as H

    from replayssm import LLM, SamplingParams
    from replayssm.distributed import TensorParallelGroup, WorkerFailed
    from replayssm.models import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = H.save_tiny(H.tiny_mamba2(seed=3, num_heads=6, head_dim=5, hidden_size=15), str(tmp_path / "m"))
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(max_tokens=6)
    with LLM(load_model(path, dtype="float64"), max_seq_len=32) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with TensorParallelGroup(2, "cpu", worker_threads=1, control="shm") as g:
        torch.set_num_threads(n)
        assert g.comm.channel is not None
        model = g.load_model(path, dtype="float64")
        with LLM(model, max_seq_len=32) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
            g._procs[0].kill()
            t0 = time.monotonic()
            with pytest.raises(WorkerFailed, match="rank 1"):
                for _ in range(20):
                    llm.generate(prompts, params)
            assert time.monotonic() - t0 < 30


def test_bad_control_name_is_refused():
    from replayssm.distributed import TensorParallelGroup

    with pytest.raises(ValueError, match="control"):
        TensorParallelGroup(2, "cpu", control="tcp")


def test_reader_spin_window_follows_the_gap_between_messages():
    w = ShmChannel.create(readers=1, slots=4, slot_bytes=256)
    r = ShmChannel.attach(w.name, 1, 1, slots=4, slot_bytes=256)
    try:
        assert r.spin_window() == r.spin_s                    # no traffic yet: the floor
        for i in range(6):                                    # a loop of ~12 ms steps
            w.send(i)
            assert r.recv() == i
            time.sleep(0.012)
        assert 0.010 <= r.gap_s <= 0.05 and 0.02 <= r.spin_window() <= r.spin_max_s
        for i in range(3):                                    # idle gaps count as the cap
            w.send(i)
            assert r.recv() == i
            time.sleep(0.08)
        assert r.gap_s <= r.spin_max_s and r.spin_window() == r.spin_max_s
    finally:
        r.close()
        w.close()
    with pytest.raises(ValueError, match="spin_s"):
        ShmChannel(w.shm, 1, 0, 4, 256, owner=False, spin_s=0.1, spin_max_s=0.05)
