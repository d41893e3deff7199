"""The one delta-rule reference (``replayssm.ops.delta_rule``) serves GDN and KDA: with a
per-channel decay constant over K, every KDA form equals the GDN scalar-decay form in float64
(outputs, returned states, and every ring / page / state entry written), on odd shapes with
GVA (HV = 2H), NaN-poisoned caches, flush rows, both readout routes, chains and trees, short
and long (chunked) KV-only calls.  Also: each family rejects the other's decay layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayssm.cache.buffers import GDNBuffers, KDABuffers
from replayssm.cache.paged import GDNPagedBuffers, KDAPagedBuffers, PagedIndex
from replayssm.cache.ring import RingIndex
from replayssm.ops import delta_rule
from replayssm.ops.gdn import naive as gdn
from replayssm.ops.kda import naive as kda

F64 = torch.float64
H, HV, K, V = 2, 4, 5, 3


def same(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


def inputs(Bt, T, seed, time=True):
    """GDN inputs ``(q, k, v, g [..,HV], beta)`` and KDA's with ``g`` repeated over K."""
    gen = torch.Generator().manual_seed(seed)
    lead = (Bt, T) if time else (Bt,)

    def r(*s):
        return torch.randn(*lead, *s, generator=gen, dtype=F64)

    q, k, v = r(H, K), r(H, K), r(HV, V)
    g = -F.softplus(r(HV))
    b = torch.sigmoid(r(HV))
    return (q, k, v, g, b), (q, k, v, g[..., None].expand(*g.shape, K).contiguous(), b)


def chan(g):
    return g[..., None].expand(*g.shape, K)


def pair_buffers(P, L, seed):
    gb = GDNBuffers.allocate(P - 1, L, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    kb = KDABuffers.allocate(P - 1, L, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    gen = torch.Generator().manual_seed(seed)
    S0 = torch.randn(P, HV, K, V, generator=gen, dtype=F64)
    gb.state.copy_(S0)
    kb.state.copy_(S0)
    return gb, kb


def same_buffers(gb, kb):
    same(kb.state, gb.state)
    same(kb.u, gb.u)
    same(kb.k, gb.k)
    same(kb.g, chan(gb.g))


def test_recurrent_forms_and_chunked_prefill():
    (xg, xk), S0 = inputs(3, 11, 1), torch.randn(3, HV, K, V, dtype=F64)
    for fg, fk in ((gdn.recurrent_scan, kda.recurrent_scan), (gdn.chunked_prefill, kda.chunked_prefill)):
        ya, Sa = fg(*xg, initial_state=S0)
        yb, Sb = fk(*xk, initial_state=S0)
        same(ya, yb)
        same(Sa, Sb)
    ya, Sa = gdn.chunked_prefill(*xg, initial_state=S0, chunk_size=4)
    yb, Sb = kda.chunked_prefill(*xk, initial_state=S0, chunk_size=4)
    same(ya, yb)
    same(Sa, Sb)
    xg1, xk1 = inputs(3, 1, 2, time=False)
    ya, Sa = gdn.recurrent_step(S0, *xg1)
    yb, Sb = kda.recurrent_step(S0, *xk1)
    same(ya, yb)
    same(Sa, Sb)
    pa = torch.randn(5, HV, K, V, dtype=F64)
    pb = pa.clone()
    slot = torch.tensor([4, 0, 2])
    same(gdn.recurrent_update(pa, *xg1, slot=slot), kda.recurrent_update(pb, *xk1, slot=slot))
    same(pa, pb)
    # snapshot verify / commit
    pool = torch.randn(5, HV, K, V, dtype=F64)
    ya, sa = gdn.snapshot_verify(pool, slot, *xg)
    yb, sb = kda.snapshot_verify(pool, slot, *xk)
    same(ya, yb)
    same(sa, sb)


def test_chunked_prefill_varlen_pool_form():
    (xg, xk) = inputs(1, 13, 3)
    xg, xk = tuple(t[0] for t in xg), tuple(t[0] for t in xk)
    cu = torch.tensor([0, 5, 5, 13])
    pa = torch.randn(6, HV, K, V, dtype=F64)
    pb = pa.clone()
    kw = dict(cu_seqlens=cu, chunk_size=3, return_u=True, slots=torch.tensor([1, 4, 2]),
              fresh=torch.tensor([False, True, False]))
    ya, _, ua = gdn.chunked_prefill_varlen(*xg, state_pool=pa, **kw)
    yb, _, ub = kda.chunked_prefill_varlen(*xk, state_pool=pb, **kw)
    same(ya, yb)
    same(ua, ub)
    same(pa, pb)


@pytest.mark.parametrize("route", ["state", "output"])
def test_replay_decode_verify_tree(route):
    P, L = 4, 7
    gb, kb = pair_buffers(P, L, 4)
    ring = RingIndex(P - 1, L)
    ring.start[1:] = torch.tensor([5, 0, 3])
    slots = torch.tensor([3, 1, 2])
    seed, flushed = 10, 0
    for step in range(6):
        seed += 1
        kind = ("decode", "verify", "tree")[step % 3]
        if kind == "decode":
            plan = ring.plan_decode(slots)
            xg, xk = inputs(3, 1, seed, time=False)
            same(gdn.replay_decode(gb, plan, *xg, route=route), kda.replay_decode(kb, plan, *xk, route=route))
            accepted = None
        else:
            T = 3
            plan = ring.plan_verify(slots, T, kind=kind)
            xg, xk = inputs(3, T, seed)
            if kind == "verify":
                ya = gdn.replay_verify(gb, plan, *xg, route=route)
                yb = kda.replay_verify(kb, plan, *xk, route=route)
                accepted = torch.tensor([3, 1, 2])
            else:
                parent = torch.tensor([-1, 0, 0])
                ya = gdn.tree_verify(gb, plan, parent, *xg, route=route)
                yb = kda.tree_verify(kb, plan, parent, *xk, route=route)
                accepted = torch.tensor([1, 1, 1])  # the root alone: no path gather needed
            same(ya, yb)
        same_buffers(gb, kb)
        flushed += int(plan.flush.sum())
        same(gdn.rebuild_state(gb, plan), kda.rebuild_state(kb, plan))
        ring.commit(plan, accepted)
    assert flushed > 0  # checkpoints were written from both families' ops


def test_kv_only_forms():
    bs, nb = 3, 64
    pidx = PagedIndex(3, bs, nb, 30)
    gkv = GDNPagedBuffers.allocate(nb, bs, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    kkv = KDAPagedBuffers.allocate(nb, bs, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    slots = torch.tensor([2, 1])
    for step, T in enumerate((4, 1, 3, gdn.KV_CHUNK + 5, 2)):
        for s in slots.tolist():
            pidx.reserve(s, int(pidx.length[s]) + T)
        pplan = pidx.plan(slots, T)
        xg, xk = inputs(2, T, 30 + step)
        if T == 3:
            parent = torch.tensor([-1, 0, 0])
            ya = gdn.kv_tree_verify(gkv, pplan, parent, *xg)
            yb = kda.kv_tree_verify(kkv, pplan, parent, *xk)
            accepted = torch.tensor([1, 1])
        else:
            ya, yb = gdn.kv_verify(gkv, pplan, *xg), kda.kv_verify(kkv, pplan, *xk)
            accepted = torch.full((2,), T)
        same(ya, yb)
        same(kkv.u, gkv.u)
        same(kkv.k, gkv.k)
        same(kkv.g, chan(gkv.g))
        pidx.commit(pplan, accepted)
    pplan = pidx.plan(slots, 1)
    S0 = torch.randn(2, HV, K, V, dtype=F64)
    same(gdn.kv_fold(gkv, pplan, S0), kda.kv_fold(kkv, pplan, S0))
    gb, kb = pair_buffers(3, 4, 40)
    gdn.kv_to_state(gkv, pplan, gb, torch.tensor([1, 2]))
    kda.kv_to_state(kkv, pplan, kb, torch.tensor([1, 2]))
    same_buffers(gb, kb)


def test_scalar_chunk_step_helpers_match_chunked_prefill():
    """GDN's scalar-form block helpers (undecayed readouts, cumulative G) compose to its prefill."""
    (q, k, v, g, b), _ = inputs(2, 6, 50)
    S0 = torch.randn(2, HV, K, V, dtype=F64)
    qn, kn = delta_rule._prep_qk(q, k, F64, None, True)
    G = g.cumsum(1)
    hk, hq = delta_rule._state_readout(S0, kn), delta_rule._state_readout(S0, qn)
    U, y = gdn._delta_block(hk, hq, qn, kn, v, G, b, delta_rule._chain_mask(2, 6, q.device))
    S = torch.exp(G[:, -1])[..., None, None] * S0 + gdn._sum_history_state(U, kn, torch.exp(G[:, -1:] - G))
    yr, Sr = gdn.chunked_prefill(q, k, v, g, b, initial_state=S0)
    same(y, yr)
    same(S, Sr)


def test_each_family_rejects_the_others_decay_layout():
    xg, xk = inputs(2, 3, 60)
    with pytest.raises(ValueError, match=r"g must have shape \(2, 3, 4\)"):
        gdn.recurrent_scan(*xk)
    with pytest.raises(ValueError, match=r"g must have shape \(2, 3, 4, 5\)"):
        kda.recurrent_scan(*xg)
    gb, kb = pair_buffers(3, 4, 61)
    plan = RingIndex(2, 4).plan_decode(torch.tensor([1, 2]))
    before = [t.clone() for t in (kb.state, kb.u, kb.k, kb.g)]
    x1g, _ = inputs(2, 1, 62, time=False)
    with pytest.raises(ValueError, match="g must have shape"):
        kda.replay_decode(kb, plan, *x1g)
    with pytest.raises(ValueError, match="buf must be KDABuffers"):
        kda.replay_decode(gb, plan, *inputs(2, 1, 62, time=False)[1])
    for a, b in zip(before, (kb.state, kb.u, kb.k, kb.g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
