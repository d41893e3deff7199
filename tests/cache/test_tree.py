"""Draft trees: ancestor masks vs a brute-force definition, paths, path checks, gather_path."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from replayssm.cache.ring import RingIndex, gather_history, write_new
from replayssm.cache.tree import (ancestor_mask, check_parents, check_path, gather_path,
                                  path_to)


def _random_tree(rng, n):
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def _chain(par, i):
    """Brute force: node i and its ancestors, root first."""
    out = []
    while i >= 0:
        out.append(i)
        i = par[i]
    return out[::-1]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), B=st.integers(1, 4))
def test_ancestor_mask_matches_brute_force(seed, n, B):
    rng = random.Random(seed)
    pars = [_random_tree(rng, n) for _ in range(B)]
    p = torch.tensor(pars)
    M = ancestor_mask(p)
    depth = ancestor_mask(p).sum(-1)
    assert M.shape == (B, n, n) and M.dtype == torch.bool
    for b in range(B):
        for i in range(n):
            anc = set(_chain(pars[b], i))
            assert [bool(M[b, i, j]) for j in range(n)] == [j in anc for j in range(n)]
            assert int(depth[b, i]) == len(anc)
    # a shared [N] tree gives one row
    assert torch.equal(ancestor_mask(p[0]), M[:1])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), B=st.integers(1, 4))
def test_path_to(seed, n, B):
    rng = random.Random(seed)
    pars = [_random_tree(rng, n) for _ in range(B)]
    leaves = [rng.randrange(n) for _ in range(B)]
    path, length = path_to(torch.tensor(pars), torch.tensor(leaves))
    assert path.shape == (B, n) and length.shape == (B,)
    for b in range(B):
        want = _chain(pars[b], leaves[b])
        a = int(length[b])
        assert a == len(want)
        assert path[b, :a].tolist() == want
        assert path[b, a:].tolist() == [leaves[b]] * (n - a)  # padded with the last node
    check_path(torch.tensor(pars), path, length)
    # shared [N] tree, batch of leaves
    path1, length1 = path_to(torch.tensor(pars[0]), torch.tensor(leaves))
    for b in range(B):
        assert path1[b, :int(length1[b])].tolist() == _chain(pars[0], leaves[b])


def test_check_parents():
    assert check_parents(torch.tensor([-1, 0, 0, 1])).shape == (1, 4)
    assert check_parents(torch.tensor([-1, 0]), batch=3).shape == (3, 2)
    for bad in [torch.tensor([0, 0]),            # root's parent is itself
                torch.tensor([-1, 1]),           # self loop
                torch.tensor([-1, 2, 0]),        # parent after child
                torch.tensor([-1, -2]),          # below -1
                torch.tensor([-1.0, 0.0]),       # float
                torch.tensor([[[-1]]]),          # 3-D
                torch.zeros(1, 0, dtype=torch.long),  # no nodes
                [-1, 0]]:
        with pytest.raises(ValueError):
            check_parents(bad)
    with pytest.raises(ValueError, match="row 1 node 2"):
        check_parents(torch.tensor([[-1, 0, 1], [-1, 0, 2]]))
    with pytest.raises(ValueError):
        check_parents(torch.tensor([[-1, 0], [-1, 0]]), batch=3)


def test_check_path_rejects_non_chains():
    #      0      3          (roots: parent -1)
    #     / \     |
    #    1   2    4
    #    |
    #    5
    par = torch.tensor([[-1, 0, 0, -1, 3, 1]])
    ok = [([0, 1, 5], 3), ([0, 2], 2), ([3, 4], 2), ([0, 1, 5], 2), ([4], 0), ([3], 1)]
    for nodes, a in ok:
        path = torch.tensor([nodes + [nodes[-1]] * (6 - len(nodes))])
        check_path(par, path, torch.tensor([a]))
    bad = [([1, 5], 2),        # does not start at a root
           ([0, 5], 2),        # skips node 1
           ([0, 1, 2], 3),     # siblings
           ([0, 3], 2),        # two roots
           ([0, 4], 2),        # jumps to another subtree
           ([5, 1, 0], 3)]     # upside down
    for nodes, a in bad:
        path = torch.tensor([nodes + [nodes[-1]] * (6 - len(nodes))])
        with pytest.raises(ValueError):
            check_path(par, path, torch.tensor([a]))
    path = torch.tensor([[0, 1, 5, 5, 5, 5]])
    for acc in [torch.tensor([7]), torch.tensor([-1]), torch.tensor([1, 1])]:
        with pytest.raises(ValueError):
            check_path(par, path, acc)
    with pytest.raises(ValueError):
        check_path(par, torch.tensor([[0, 1, 6, 5, 5, 5]]), torch.tensor([2]))  # id out of range
    with pytest.raises(ValueError):
        check_path(par, torch.tensor([[0, 1, 5]]), torch.tensor([2]))  # wrong shape


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 6), extra=st.integers(0, 5))
def test_gather_path_on_poisoned_ring(seed, n, extra):
    rng = random.Random(seed)
    L, P = 2 * n + extra, 4
    ring = RingIndex(P - 1, L)
    ring.start[1:] = torch.tensor([rng.randrange(L) for _ in range(P - 1)])
    ring.length[1:] = torch.tensor([rng.randint(0, L - n) for _ in range(P - 1)])
    # committed entries hold ids, everything else NaN
    x = torch.full((P, L, 2), float("nan"), dtype=torch.float64)
    for s in range(1, P):
        for j in range(int(ring.length[s])):
            x[s, (int(ring.start[s]) + j) % L] = torch.tensor([100.0 * s + j, -1.0])
    dt = torch.full((P, L), float("nan"), dtype=torch.float64)
    slots = torch.tensor([2, 0, 3, 1])
    plan = ring.plan_verify(slots, n, kind="tree")
    before_x = gather_history(x, plan).clone()
    new_x = torch.randn(4, n, 2, dtype=torch.float64)
    new_dt = torch.randn(4, n, dtype=torch.float64)
    write_new(x, plan, new_x)
    write_new(dt, plan, new_dt)
    pars = [_random_tree(rng, n) for _ in range(4)]
    leaves = torch.tensor([rng.randrange(n) for _ in range(4)])
    path, depth = path_to(torch.tensor(pars), leaves)
    acc = torch.tensor([rng.randint(0, int(d)) for d in depth])
    check_path(torch.tensor(pars), path, acc)
    gather_path([x, dt], plan, path, acc)
    ring.commit(plan, acc)
    after = ring.plan_decode(slots)
    hx, hdt = gather_history(x, after), gather_history(dt, after)
    for b, s in enumerate(slots.tolist()):
        if s == 0:
            continue
        h, a = int(plan.hist[b]), int(acc[b])
        keep = 0 if bool(plan.flush[b]) else h
        assert int(after.hist[b]) == keep + a
        assert torch.equal(hx[b, :keep], before_x[b, :keep])  # committed entries untouched
        nodes = path[b, :a]
        assert torch.equal(hx[b, keep:keep + a], new_x[b, nodes])
        assert torch.equal(hdt[b, keep:keep + a], new_dt[b, nodes])
        assert not torch.isnan(hx[b, :keep + a]).any()
