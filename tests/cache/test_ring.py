"""RingIndex plan/commit invariants over long random schedules, against a stream model.

The reference model keeps, per slot, the committed token stream and how many of its tokens
are summarised in the checkpoint state (``s``); the ring must hold exactly
``stream[s : s + h]``.  Ring contents are token ids in a float64 buffer poisoned with NaN.
"""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from replayssm.cache.ring import NULL_SLOT, RingIndex, gather_history, write_new
from replayssm.cache.tree import gather_path, path_to


class StreamModel:
    def __init__(self, num_slots):
        self.stream = {s: [] for s in range(1, num_slots + 1)}
        self.flushed = {s: 0 for s in range(1, num_slots + 1)}
        self.next_id = 1

    def ids(self, n):
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out


def _random_tree(rng, n):
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def _check_ring(ring, buf, model, slots):
    plan = ring.plan_decode(torch.tensor(slots))  # side-effect free view
    hist = gather_history(buf, plan)
    for b, s in enumerate(slots):
        h = int(plan.hist[b])
        want = model.stream[s][model.flushed[s]:]
        assert h == len(want)
        assert hist[b, :h].tolist() == [float(v) for v in want]
        assert 0 <= int(ring.start[s]) < ring.capacity
        assert 0 <= h < ring.capacity
    assert int(ring.start[NULL_SLOT]) == 0 and int(ring.length[NULL_SLOT]) == 0


def _run_schedule(seed, L, num_slots, steps, kinds, Ts, strict_invariant):
    rng = random.Random(seed)
    ring = RingIndex(num_slots, L)
    buf = torch.full((num_slots + 1, L), float("nan"), dtype=torch.float64)
    model = StreamModel(num_slots)
    wrapped = False
    for _ in range(steps):
        real = rng.sample(range(1, num_slots + 1), rng.randint(1, num_slots))
        rows = real + [NULL_SLOT] * rng.randint(0, 2)
        rng.shuffle(rows)
        slots = torch.tensor(rows)
        kind = rng.choice(kinds)
        T = 1 if kind == "decode" else rng.choice(Ts)
        plan = ring.plan_decode(slots) if kind == "decode" else ring.plan_verify(slots, T, kind)
        assert plan.num_new == T and plan.kind == kind and plan.capacity == L
        hist = gather_history(buf, plan).clone()  # read before write (as layers do)
        for b, s in enumerate(rows):
            h = int(plan.hist[b])
            assert int(plan.start[b]) == int(ring.start[s]) and h == int(ring.length[s])
            if s == NULL_SLOT:
                assert h == 0 and int(plan.start[b]) == 0
                continue
            committed = model.stream[s][model.flushed[s]:]
            assert h == len(committed)
            assert hist[b, :h].tolist() == [float(v) for v in committed]
            if kind == "decode":
                assert h <= L - 1
                assert bool(plan.flush[b]) == (h + 1 == L)
            else:
                if strict_invariant:
                    assert h <= L - T
                assert bool(plan.flush[b]) == (h + 2 * T > L)
            if int(plan.start[b]) + h + T > L:
                wrapped = True
        new = torch.tensor([model.ids(T) for _ in rows], dtype=torch.float64)
        write_new(buf, plan, new)
        if kind != "decode" and strict_invariant:  # new entries sit right after the history
            win = gather_history(buf, plan)
            for b in range(len(rows)):
                h = int(plan.hist[b])
                if rows[b] != NULL_SLOT:
                    assert win[b, h:h + T].tolist() == new[b].tolist()
        if kind == "decode":
            ring.commit(plan)
            for b, s in enumerate(rows):
                if s == NULL_SLOT:
                    continue
                model.stream[s].append(int(new[b, 0]))
                if bool(plan.flush[b]):
                    model.flushed[s] = len(model.stream[s])
        else:
            if kind == "tree":
                parent = torch.tensor([_random_tree(rng, T) for _ in rows])
                leaf = torch.tensor([rng.randrange(T) for _ in rows])
                path, depth = path_to(parent, leaf)
                acc = torch.tensor([rng.randint(0, int(d)) for d in depth])
                gather_path([buf], plan, path, acc)
                taken = [[int(new[b, int(path[b, i])]) for i in range(int(acc[b]))]
                         for b in range(len(rows))]
            else:
                acc = torch.tensor([rng.randint(0, T) for _ in rows])
                taken = [[int(v) for v in new[b, :int(acc[b])]] for b in range(len(rows))]
            ring.commit(plan, acc)
            for b, s in enumerate(rows):
                if s == NULL_SLOT:
                    continue
                if bool(plan.flush[b]):
                    model.flushed[s] += int(plan.hist[b])
                model.stream[s].extend(taken[b])
        _check_ring(ring, buf, model, list(range(1, num_slots + 1)))
    return wrapped


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 4), extra=st.integers(0, 6),
       kinds=st.sampled_from([("verify",), ("tree",), ("verify", "tree")]))
def test_fixed_T_schedule_keeps_invariant(seed, T, extra, kinds):
    _run_schedule(seed, 2 * T + extra, 3, 40, kinds, [T], strict_invariant=True)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), L=st.integers(1, 9))
def test_decode_only_schedule(seed, L):
    _run_schedule(seed, L, 3, 40, ("decode",), [1], strict_invariant=True)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), L=st.integers(4, 11))
def test_mixed_schedule_stays_exact(seed, L):
    # decode steps and varying T can leave h > L - T: the step flushes and stays exact
    Ts = [t for t in (1, 2, 3, 4, 5) if 2 * t <= L]
    _run_schedule(seed, L, 4, 60, ("decode", "verify", "tree"), Ts, strict_invariant=False)


def test_long_schedule_wraps_around():
    assert _run_schedule(7, 7, 2, 300, ("decode", "verify", "tree"), [1, 2, 3], False)
    assert _run_schedule(8, 8, 3, 200, ("verify",), [3], True)


def test_decode_flush_at_full():
    ring = RingIndex(1, 3)
    slots = torch.tensor([1])
    flushes = []
    for _ in range(7):
        plan = ring.plan_decode(slots)
        flushes.append(bool(plan.flush[0]))
        ring.commit(plan)
    assert flushes == [False, False, True, False, False, True, False]
    assert int(ring.length[1]) == 1 and int(ring.start[1]) == 0  # 6 entries flushed, 1 left


def test_verify_flush_rule_and_pointers():
    ring = RingIndex(2, 8)
    s = torch.tensor([1, 2])
    ring.length[1], ring.start[1] = 5, 6   # h + 2T = 9 > 8: flush
    ring.length[2], ring.start[2] = 3, 5   # h + 2T = 7 <= 8: no flush
    plan = ring.plan_verify(s, 2)
    assert plan.flush.tolist() == [True, False]
    assert plan.new_positions().tolist() == [[3, 4], [0, 1]]
    ring.commit(plan, torch.tensor([1, 2]))
    assert ring.start.tolist() == [0, 3, 5] and ring.length.tolist() == [0, 1, 5]
    assert plan.hist_mask().tolist()[1] == [True] * 3 + [False] * 5


def test_null_slot_reset_each_commit():
    ring = RingIndex(2, 6)
    ring.start[0], ring.length[0] = 3, 2  # garbage from padding rows
    plan = ring.plan_verify(torch.tensor([0, 1, 0]), 3)
    ring.commit(plan, torch.tensor([3, 2, 1]))
    assert int(ring.start[0]) == 0 and int(ring.length[0]) == 0
    assert int(ring.length[1]) == 2
    plan = ring.plan_decode(torch.tensor([0, 0]))
    ring.commit(plan)
    assert int(ring.start[0]) == 0 and int(ring.length[0]) == 0


def test_reset():
    ring = RingIndex(3, 6)
    ring.start[:] = 2
    ring.length[:] = 3
    ring.reset(torch.tensor([1, 3]))
    assert ring.start.tolist() == [2, 0, 2, 0] and ring.length.tolist() == [3, 0, 3, 0]


def _snapshot(ring):
    return ring.start.clone(), ring.length.clone()


def _unchanged(ring, snap):
    return torch.equal(ring.start, snap[0]) and torch.equal(ring.length, snap[1])


def test_bad_construction():
    for args in [(0, 4), (2, 0), (1.5, 4), (2, "8")]:
        with pytest.raises(ValueError):
            RingIndex(*args)


def test_bad_plans():
    ring = RingIndex(3, 7)
    ring.length[1:] = torch.tensor([1, 2, 3])
    snap = _snapshot(ring)
    s = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="2 \\* 4"):
        ring.plan_verify(s, 4)                     # L < 2T
    for bad in [0, -1, 2.0]:
        with pytest.raises(ValueError):
            ring.plan_verify(s, bad)
    with pytest.raises(ValueError):
        ring.plan_verify(s, 2, kind="decode")
    for bad_slots in [torch.tensor([1, 4]), torch.tensor([-1]), torch.tensor([[1]]),
                      torch.tensor([1.0]), [1, 2]]:
        with pytest.raises(ValueError):
            ring.plan_decode(bad_slots)
        with pytest.raises(ValueError):
            ring.plan_verify(bad_slots, 2)
    assert _unchanged(ring, snap)


def test_bad_commits_leave_state_unchanged():
    ring = RingIndex(3, 8)
    ring.length[1:] = torch.tensor([1, 2, 3])
    ring.start[1:] = torch.tensor([5, 6, 7])
    snap = _snapshot(ring)
    plan = ring.plan_verify(torch.tensor([1, 3]), 3)
    for acc in [torch.tensor([4, 0]), torch.tensor([-1, 1]), torch.tensor([1]),
                torch.tensor([1.0, 1.0]), torch.tensor([[1, 1]]), None]:
        with pytest.raises(ValueError):
            ring.commit(plan, acc)
        assert _unchanged(ring, snap)
    dplan = ring.plan_decode(torch.tensor([1]))
    with pytest.raises(ValueError):
        ring.commit(dplan, torch.tensor([1]))
    assert _unchanged(ring, snap)
    buf = torch.zeros(4, 8, 2)
    with pytest.raises(ValueError):
        write_new(buf, plan, torch.zeros(2, 2, 2))  # T mismatch
    with pytest.raises(ValueError):
        write_new(buf, plan, torch.zeros(2, 3, 3))  # trailing shape mismatch
    assert not buf.any()
