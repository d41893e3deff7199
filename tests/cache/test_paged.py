"""Paged KV buffers: block allocation, gather/write against a dense reference, commit."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from replayssm.cache.paged import (NULL_BLOCK, GDNPagedBuffers, Mamba2PagedBuffers, PagedIndex,
                                   PagedPlan, PoolExhausted, gather_kv, gather_path,
                                   write_kv_new)
from replayssm.cache.tree import path_to


def _state(p):
    return (p.block_table.clone(), p.length.clone(), p.free_blocks,
            [p.blocks_of(s) for s in range(p.num_slots + 1)])


def _same(p, snap):
    bt, ln, free, blocks = snap
    return (torch.equal(p.block_table, bt) and torch.equal(p.length, ln)
            and p.free_blocks == free and [p.blocks_of(s) for s in range(p.num_slots + 1)] == blocks)


def _check_tables(p):
    held = [b for s in range(p.num_slots + 1) for b in p.blocks_of(s)]
    assert NULL_BLOCK not in held and len(held) == len(set(held))
    assert len(held) + p.free_blocks == p.num_blocks - 1
    for s in range(p.num_slots + 1):
        blocks = p.blocks_of(s)
        row = p.block_table[s].tolist()
        assert row[:len(blocks)] == blocks and set(row[len(blocks):]) <= {NULL_BLOCK}


def test_reserve_release_exhaustion():
    p = PagedIndex(num_slots=3, block_size=3, num_blocks=7, max_blocks_per_seq=4)
    assert p.free_blocks == 6 and p.max_len == 12
    p.reserve(1, 7)                       # 3 blocks
    assert p.num_allocated(1) == 3 and p.capacity(1) == 9 and p.free_blocks == 3
    p.reserve(1, 5)                       # never shrinks
    p.reserve(1, 9)                       # fits already
    assert p.num_allocated(1) == 3
    p.reserve(2, 0)
    assert p.num_allocated(2) == 0
    p.reserve(2, 4)
    _check_tables(p)
    snap = _state(p)
    assert not p.can_reserve(3, 7)
    with pytest.raises(PoolExhausted):
        p.reserve(3, 7)                   # needs 3, 1 free
    assert _same(p, snap)
    p.reserve(1, 12)                      # 1 more block: the last free one
    assert p.num_allocated(1) == 4 and p.free_blocks == 0
    snap = _state(p)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        p.reserve(3, 13)                  # 5 blocks > max_blocks_per_seq
    with pytest.raises(ValueError):
        p.reserve(0, 1)                   # null slot
    for bad in [(4, 1), (-1, 1), (1, -1), (1, 2.0), (1.0, 2)]:
        with pytest.raises(ValueError):
            p.reserve(*bad)
    assert _same(p, snap)
    assert isinstance(PoolExhausted("x"), ValueError)
    p.length[2] = 3
    p.release(2)
    assert p.num_allocated(2) == 0 and int(p.length[2]) == 0 and p.free_blocks == 2
    assert p.block_table[2].tolist() == [0] * 4
    p.reserve(3, 6)
    _check_tables(p)
    p.release(0)                          # no-op
    for s in (1, 3):
        p.release(s)
    assert p.free_blocks == 6
    _check_tables(p)


def test_exhaustion_exact():
    p = PagedIndex(2, 2, 5, 8)
    p.reserve(1, 5)           # 3 blocks, 1 left
    with pytest.raises(PoolExhausted):
        p.reserve(1, 9)       # 5 blocks: 2 more
    p.reserve(1, 8)           # 4 blocks: exactly the last one
    assert p.free_blocks == 0
    snap = _state(p)
    with pytest.raises(PoolExhausted):
        p.reserve(2, 1)
    assert _same(p, snap)


def test_bad_construction():
    for args in [(0, 2, 4, 2), (2, 0, 4, 2), (2, 2, 1, 2), (2, 2, 4, 0), (2, 2.0, 4, 2)]:
        with pytest.raises(ValueError):
            PagedIndex(*args)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), bs=st.sampled_from([1, 2, 3, 5, 7, 8]),
       max_blocks=st.integers(2, 6))
def test_random_schedule_vs_dense(seed, bs, max_blocks):
    rng = random.Random(seed)
    S = 4
    max_len = bs * max_blocks
    num_blocks = 1 + S * max_blocks - rng.randint(0, max_blocks)  # sometimes too few blocks
    p = PagedIndex(S, bs, num_blocks, max_blocks)
    x = torch.full((num_blocks * bs, 2, 3), float("nan"), dtype=torch.float64)
    g = torch.full((num_blocks * bs,), float("nan"), dtype=torch.float32)
    dense = {s: [] for s in range(S + 1)}   # committed entries per slot, as lists of tensors
    for step in range(25):
        T = rng.randint(1, min(4, max_len))
        live = [s for s in range(1, S + 1)
                if int(p.length[s]) + T <= max_len]
        if not live:
            break
        rows = rng.sample(live, rng.randint(1, len(live)))
        ok_rows = []
        for s in rows:
            snap = _state(p)
            try:
                p.reserve(s, int(p.length[s]) + T)
                ok_rows.append(s)
            except PoolExhausted:
                assert _same(p, snap)
                if rng.random() < 0.5:       # preempt: free the slot
                    p.release(s)
                    dense[s] = []
        if not ok_rows:
            continue
        _check_tables(p)
        rows = ok_rows + [0] * rng.randint(0, 1)
        rng.shuffle(rows)
        pplan = p.plan(torch.tensor(rows), T)
        # before writing: committed entries only
        for pool, attr in ((x, 0), (g, 1)):
            got = gather_kv(pool, pplan)
            for b, s in enumerate(rows):
                if s:
                    n = int(pplan.length[b])
                    assert n == len(dense[s])
                    if n:
                        ref = torch.stack([e[attr] for e in dense[s]])
                        assert torch.equal(got[b, :n], ref)
        nx = torch.randn(len(rows), T, 2, 3, dtype=torch.float64)
        ng = torch.randn(len(rows), T)
        write_kv_new(x, pplan, nx)
        write_kv_new(g, pplan, ng)
        gx = gather_kv(x, pplan)
        for b, s in enumerate(rows):
            if s:
                n = int(pplan.length[b])
                assert torch.equal(gx[b, n:n + T], nx[b])
        if rng.random() < 0.5:
            acc = torch.tensor([rng.randint(0, T) for _ in rows])
            taken = [list(range(int(a))) for a in acc]
        else:                                   # tree commit
            parent = torch.tensor([[-1] + [rng.randrange(-1, i) for i in range(1, T)]
                                   for _ in rows])
            path, depth = path_to(parent, torch.tensor([rng.randrange(T) for _ in rows]))
            acc = torch.tensor([rng.randint(0, int(d)) for d in depth])
            gather_path([x, g], pplan, path, acc)
            taken = [path[b, :int(acc[b])].tolist() for b in range(len(rows))]
        p.commit(pplan, acc)
        assert int(p.length[0]) == 0
        for b, s in enumerate(rows):
            if s:
                dense[s].extend((nx[b, i], ng[b, i]) for i in taken[b])
                assert int(p.length[s]) == len(dense[s])
    # final check through a fresh plan
    slots = [s for s in range(1, S + 1)]
    pplan = PagedPlan(torch.tensor(slots), p.length[slots], p.block_table[slots], 1, bs)
    got = gather_kv(x, pplan)
    for b, s in enumerate(slots):
        n = len(dense[s])
        if n:
            assert torch.equal(got[b, :n], torch.stack([e[0] for e in dense[s]]))


def test_positions_and_masks():
    p = PagedIndex(2, 3, 6, 3)
    p.reserve(1, 7)
    p.reserve(2, 2)
    p.length[1] = 4
    pplan = p.plan(torch.tensor([1, 0, 2]), 2)
    b1 = p.blocks_of(1)
    b2 = p.blocks_of(2)
    assert pplan.new_positions().tolist() == [[b1[1] * 3 + 1, b1[1] * 3 + 2],
                                              [0, 1], [b2[0] * 3, b2[0] * 3 + 1]]
    assert pplan.max_len == 9
    assert pplan.hist_mask().sum(1).tolist() == [4, 0, 0]
    j = torch.arange(pplan.max_len)
    assert (j[None, :] < (pplan.length + pplan.num_new)[:, None]).sum(1).tolist() == [6, 2, 2]
    allpos = pplan.all_positions()
    assert allpos[0].tolist() == [b * 3 + o for b in b1 for o in range(3)]
    assert allpos[1].tolist() == [0, 1, 2] * 3     # null slot: null block
    assert allpos[2, 3:].tolist() == [0, 1, 2] * 2  # unused entries: null block
    # out-of-range logical entries (unchecked plans) go to the null block, never out of range
    j = torch.tensor([[9, 100, -1], [0, 1, 2], [8, 9, 10]])
    pos = pplan.positions(j)
    assert pos[0].tolist() == [0, 0, 0] and pos[2, 1:].tolist() == [0, 0]


def test_plan_checks():
    p = PagedIndex(3, 2, 8, 3)
    p.reserve(1, 4)
    p.length[1] = 3
    with pytest.raises(ValueError, match="reserve"):
        p.plan(torch.tensor([1]), 2)          # 3 + 2 > 4
    p.plan(torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="reserve"):
        p.plan(torch.tensor([2]), 1)          # nothing reserved
    p.plan(torch.tensor([0, 0]), 6)           # null rows need no blocks
    for bad_slots in [torch.tensor([4]), torch.tensor([-1]), torch.tensor([1, 1]),
                      torch.tensor([[1]]), torch.tensor([1.0]), [1]]:
        with pytest.raises(ValueError):
            p.plan(bad_slots, 1)
    for bad_T in [0, -2, 7, 1.0]:
        with pytest.raises(ValueError):
            p.plan(torch.tensor([0]), bad_T)
    p.plan(torch.tensor([2]), 1, check=False)  # caller's responsibility


def test_commit_validation_and_null_slot():
    p = PagedIndex(3, 2, 10, 3)
    for s in (1, 2):
        p.reserve(s, 6)
    p.length[1], p.length[2] = 2, 1
    pplan = p.plan(torch.tensor([2, 0, 1]), 3)
    snap = _state(p)
    for acc in [torch.tensor([4, 0, 0]), torch.tensor([-1, 0, 0]), torch.tensor([1, 1]),
                torch.tensor([1.0, 1.0, 1.0]), torch.tensor([[1, 1, 1]])]:
        with pytest.raises(ValueError):
            p.commit(pplan, acc)
        assert _same(p, snap)
    p.commit(pplan, torch.tensor([3, 2, 1]))
    assert p.length.tolist() == [0, 3, 4, 0]
    pplan = p.plan(torch.tensor([1]), 1)
    p.commit(pplan)                            # decode: everything accepted
    assert p.length.tolist() == [0, 4, 4, 0]
    p.reset(torch.tensor([1]))
    assert p.length.tolist() == [0, 0, 4, 0] and p.num_allocated(1) == 3


def test_write_and_gather_validation():
    p = PagedIndex(2, 3, 4, 2)
    p.reserve(1, 3)
    pplan = p.plan(torch.tensor([1, 0]), 2)
    pool = torch.zeros(12, 4)
    for bad in [torch.zeros(2, 3, 4), torch.zeros(2, 2, 5), torch.zeros(1, 2, 4)]:
        with pytest.raises(ValueError):
            write_kv_new(pool, pplan, bad)
    with pytest.raises(ValueError):
        gather_kv(torch.zeros(10, 4), pplan)   # not a multiple of block_size
    with pytest.raises(ValueError):
        gather_path([pool], pplan, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert not pool.any()
    write_kv_new(pool, pplan, torch.ones(2, 2, 4, dtype=torch.float64))  # cast to pool dtype
    assert pool.dtype == torch.float32 and int(pool.sum()) == 16


def test_buffers_allocate():
    m = Mamba2PagedBuffers.allocate(5, 3, nheads=4, head_dim=2, d_state=6, ngroups=2,
                                    dtype=torch.float16, state_dtype=torch.float64, poison=True)
    assert m.x.shape == (15, 4, 2) and m.B.shape == (15, 2, 6) and m.dt.shape == (15, 4)
    assert m.x.dtype == torch.float16 and m.dt.dtype == torch.float64
    assert all(torch.isnan(t).all() for t in m.tensors())
    with pytest.raises(ValueError):
        Mamba2PagedBuffers.allocate(5, 3, 4, 2, 6, 3)
    gd = GDNPagedBuffers.allocate(4, 2, num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=5)
    assert gd.u.shape == (8, 4, 5) and gd.k.shape == (8, 2, 3) and gd.g.shape == (8, 4)
    assert [t.data_ptr() for t in gd.tensors()] == [gd.u.data_ptr(), gd.k.data_ptr(), gd.g.data_ptr()]
    assert not any(t.any() for t in gd.tensors())
    with pytest.raises(ValueError):
        GDNPagedBuffers.allocate(4, 2, 3, 4, 3, 5)


def test_shared_blocks_are_reference_counted():
    """share / retain / drop / release: a block returns to the free list only when its last
    holder lets go, and bad calls change nothing."""
    idx = PagedIndex(num_slots=3, block_size=4, num_blocks=8, max_blocks_per_seq=4)
    idx.reserve(1, 10)                                  # 3 blocks, one reference each
    held = idx.blocks_of(1)
    assert [idx.refcount(b) for b in held] == [1, 1, 1] and idx.free_blocks == 4
    idx.retain(held[:2])                                # an outside holder (the prefix index)
    idx.share(2, held[:2])                              # slot 2 starts with them
    assert idx.blocks_of(2) == held[:2] and idx.block_table[2, :2].tolist() == held[:2]
    assert [idx.refcount(b) for b in held] == [3, 3, 1]
    idx.reserve(2, 9)                                   # grows past the shared blocks with its own
    assert idx.blocks_of(2)[:2] == held[:2] and idx.num_allocated(2) == 3 and idx.free_blocks == 3
    idx.release(1)
    assert idx.free_blocks == 4 and [idx.refcount(b) for b in held[:2]] == [2, 2]
    idx.release(2)
    assert idx.free_blocks == 5 and [idx.refcount(b) for b in held[:2]] == [1, 1]
    idx.drop(held[:2])
    assert idx.free_blocks == 7 and sorted(idx._free) == list(range(1, 8))
    free = idx._free[-1]
    before = (list(idx._free), idx.block_table.clone())
    for bad in (lambda: idx.retain([free]), lambda: idx.drop([free]), lambda: idx.share(3, [free]),
                lambda: idx.share(3, [0]), lambda: idx.retain([99])):
        with pytest.raises(ValueError):
            bad()
        assert idx._free == before[0] and torch.equal(idx.block_table, before[1])
    idx.reserve(1, 4)
    with pytest.raises(ValueError, match="empty slot"):
        idx.share(1, idx.blocks_of(1))


def test_deferred_reservations_write_one_table_update():
    """``reserve(defer=True)`` books blocks on the host at once and writes the block table
    only in :meth:`write_pending` (one scatter for the step); the result equals immediate
    reservations, and a release (or a plan) writes what is pending first."""
    now = PagedIndex(num_slots=5, block_size=4, num_blocks=40, max_blocks_per_seq=6)
    later = PagedIndex(num_slots=5, block_size=4, num_blocks=40, max_blocks_per_seq=6)
    steps = [[(1, 3), (2, 9), (4, 1)], [(1, 8), (2, 9), (3, 17), (4, 5)], [(1, 13), (3, 24)]]
    for step in steps:
        before = later.block_table.clone()
        for slot, n in step:
            now.reserve(slot, n)
            later.reserve(slot, n, defer=True)
        assert [later.blocks_of(s) for s in range(6)] == [now.blocks_of(s) for s in range(6)]
        if any(now.blocks_needed(n) > len(before[s][before[s] != 0]) for s, n in step):
            assert not torch.equal(later.block_table, now.block_table)   # not written yet
            assert torch.equal(later.block_table, before)
        later.write_pending()
        assert torch.equal(later.block_table, now.block_table)
    later.reserve(2, 20, defer=True)
    now.reserve(2, 20)
    later.release(2)
    now.release(2)
    assert torch.equal(later.block_table, now.block_table) and later.free_blocks == now.free_blocks
    later.reserve(5, 6, defer=True)
    now.reserve(5, 6)
    later.plan(torch.tensor([5]), 1)
    assert torch.equal(later.block_table, now.block_table)
