"""KDA (Kimi Delta Attention) reference ops: the convention pinned against transformers'
``kimi_linear`` torch functions, then every form against ``recurrent_scan`` in float64.

Schedules (decode / verify / tree steps over several flush cycles and ring wrap-arounds,
rows at different fill levels, random accepted counts and paths) are checked token by token
against ``recurrent_scan`` on each row's accepted token stream alone, and the rebuilt states
(checkpoint + ring) against the recurrence's state.  Caches are poisoned with NaN so any read
of an invalid entry shows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from replayssm.cache.buffers import GDNBuffers, KDABuffers
from replayssm.cache.paged import KDAPagedBuffers, PagedIndex
from replayssm.cache.paged import gather_path as kv_gather_path
from replayssm.cache.ring import NULL_SLOT, RingIndex
from replayssm.cache.tree import gather_path, path_to
from replayssm.ops.gdn import naive as gdn
from replayssm.ops.kda import naive as kda

F64, F32 = torch.float64, torch.float32
TOL = {F64: dict(rtol=1e-10, atol=1e-10), F32: dict(rtol=2e-5, atol=2e-5)}


# ---------------------------------------------------------------------------- helpers
def inputs(Bt, T, H, HV, K, V, dtype=F64, seed=0, time=True, decay=1.0):
    """Raw projections: q, k ~ N(0,1); g = -decay·softplus(N) <= 0 per channel; beta = sigmoid(N)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (Bt, T) if time else (Bt,)

    def r(*s):
        return torch.randn(*lead, *s, generator=gen, dtype=F64)

    q, k, v = r(H, K), r(H, K), r(HV, V)
    g = -decay * F.softplus(r(HV, K))
    beta = torch.sigmoid(r(HV))
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def rand_state(n, HV, K, V, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(n, HV, K, V, generator=gen, dtype=F64).to(dtype)


def close(a, b, dtype=F64, **kw):
    tol = dict(TOL[dtype])
    tol.update(kw)
    torch.testing.assert_close(a.to(F64), b.to(F64), **tol)


def snapshot(buf, ring=None):
    ts = [buf.state, buf.u, buf.k, buf.g] + ([ring.start, ring.length] if ring is not None else [])
    return [t.clone() for t in ts]


def assert_unchanged(before, buf, ring=None):
    for a, b in zip(before, snapshot(buf, ring)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def tok(x, r, idx):
    return tuple(t[r, idx] for t in x)


def chain_of(parents, node):
    chain = [node]
    while parents[chain[-1]] != -1:
        chain.append(parents[chain[-1]])
    return chain[::-1]


def random_tree(N, gen):
    return [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, N)]


class Oracle:
    """Per-row ground truth: the recurrence on that row's accepted token stream alone (fp64)."""

    def __init__(self, states):
        self.S = {r: s.to(F64).clone() for r, s in states.items()}

    def outputs(self, r, toks):
        y, _ = kda.recurrent_scan(*(t.to(F64)[None] for t in toks), initial_state=self.S[r][None])
        return y[0]

    def commit(self, r, toks):
        if toks[0].shape[0]:
            _, S = kda.recurrent_scan(*(t.to(F64)[None] for t in toks), initial_state=self.S[r][None])
            self.S[r] = S[0]


class Harness:
    """A batch of rows (real slots and null-slot padding) run through a step schedule."""

    def __init__(self, H, HV, K, V, L, dtype=F64, route="state", slots=(1, 2, 3), pad_rows=0, seed=0):
        self.dims, self.dtype, self.route, self.L = (H, HV, K, V), dtype, route, L
        self.slots = torch.tensor(list(slots) + [NULL_SLOT] * pad_rows)
        self.real = [i for i, s in enumerate(self.slots.tolist()) if s != NULL_SLOT]
        P = max(slots) + 1
        self.ring = RingIndex(P, L)
        self.buf = KDABuffers.allocate(P, L, H, HV, K, V, dtype=dtype, state_dtype=dtype, poison=True)
        S0 = rand_state(len(self.slots), HV, K, V, seed, dtype)
        for i in self.real:
            self.buf.state[self.slots[i]] = S0[i]
        self.oracle = Oracle({i: S0[i] for i in self.real})
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.ring.start[1:] = torch.randint(0, L, (P,), generator=self.gen)  # wrap from anywhere
        self.seed, self.flushed = seed, 0

    def _x(self, T, time=True):
        self.seed += 1
        return inputs(len(self.slots), T, *self.dims, dtype=self.dtype, seed=self.seed, time=time)

    def check_states(self):
        Sh = kda.rebuild_state(self.buf, self.ring.plan_decode(self.slots))
        for i in self.real:
            close(Sh[i], self.oracle.S[i], self.dtype)

    def warm(self, counts):
        """Row i alone decodes counts[i] tokens: rows end at different fills (flush on different steps)."""
        for i, c in zip(self.real, counts):
            for _ in range(c):
                self.seed += 1
                x = inputs(1, 1, *self.dims, dtype=self.dtype, seed=self.seed, time=False)
                plan = self.ring.plan_decode(self.slots[i:i + 1])
                y = kda.replay_decode(self.buf, plan, *x, route=self.route)
                toks = tuple(t[0][None] for t in x)
                close(y[0], self.oracle.outputs(i, toks)[0], self.dtype)
                self.oracle.commit(i, toks)
                self.ring.commit(plan)

    def decode(self):
        x = self._x(1, time=False)
        plan = self.ring.plan_decode(self.slots)
        self.flushed += int(plan.flush[self.real].sum())
        y = kda.replay_decode(self.buf, plan, *x, route=self.route)
        for i in self.real:
            toks = tuple(t[i][None] for t in x)
            close(y[i], self.oracle.outputs(i, toks)[0], self.dtype)
            self.oracle.commit(i, toks)
        self.ring.commit(plan)

    def verify(self, T, accepted=None):
        x = self._x(T)
        plan = self.ring.plan_verify(self.slots, T)
        self.flushed += int(plan.flush[self.real].sum())
        y = kda.replay_verify(self.buf, plan, *x, route=self.route)
        if accepted is None:
            accepted = torch.randint(0, T + 1, (len(self.slots),), generator=self.gen)
        accepted = torch.as_tensor(accepted).clone()
        accepted[self.slots == NULL_SLOT] = 0
        for i in self.real:
            close(y[i], self.oracle.outputs(i, tok(x, i, list(range(T)))), self.dtype)
            self.oracle.commit(i, tok(x, i, list(range(int(accepted[i])))))
        self.ring.commit(plan, accepted)

    def tree(self, N):
        x = self._x(N)
        Bt = len(self.slots)
        parents = [random_tree(N, self.gen) for _ in range(Bt)]
        parent = torch.tensor(parents)
        plan = self.ring.plan_verify(self.slots, N, kind="tree")
        self.flushed += int(plan.flush[self.real].sum())
        y = kda.tree_verify(self.buf, plan, parent, *x, route=self.route)
        path, length = path_to(parent, torch.randint(0, N, (Bt,), generator=self.gen))
        accepted = (torch.rand(Bt, generator=self.gen) * (length + 1)).long().clamp(max=length)
        accepted[self.slots == NULL_SLOT] = 0
        for i in self.real:
            for node in range(N):
                close(y[i, node], self.oracle.outputs(i, tok(x, i, chain_of(parents[i], node)))[-1], self.dtype)
            self.oracle.commit(i, tok(x, i, path[i, : int(accepted[i])].tolist()))
        gather_path(self.buf.ring_tensors(), plan, path, accepted)
        self.ring.commit(plan, accepted)


# ---------------------------------------------------------------------------- convention
def test_recurrent_step_matches_formula_per_head():
    """S ∈ R^{V×K} per value head: ``S_t = S_{t−1} diag(α) + u kᵀ``, ``u = β(v − S_{t−1}(α ⊙ k))``."""
    Bt, H, HV, K, V = 2, 2, 4, 5, 3
    q, k, v, g, b = inputs(Bt, 1, H, HV, K, V, time=False, seed=3)
    St = rand_state(Bt, HV, K, V, 3)
    y, St1 = kda.recurrent_step(St, q, k, v, g, b)
    for bi in range(Bt):
        for hv in range(HV):
            h = hv // (HV // H)
            qn = q[bi, h] / math.sqrt((q[bi, h] ** 2).sum() + 1e-6) * K ** -0.5
            kn = k[bi, h] / math.sqrt((k[bi, h] ** 2).sum() + 1e-6)
            S, a = St[bi, hv].T, torch.exp(g[bi, hv])
            u = b[bi, hv] * (v[bi, hv] - S @ (a * kn))
            S = S @ torch.diag(a) + torch.outer(u, kn)
            close(y[bi, hv], S @ qn)
            close(St1[bi, hv], S.T)


@pytest.mark.parametrize("fn", ["recurrent", "chunk"])
def test_matches_transformers_kimi_linear(fn):
    """transformers' ``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention`` (torch
    fallbacks; they compute in float32 whatever the input dtype) vs the fp64 reference."""
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    Bt, T, H, K, V = 2, 13, 3, 8, 6
    q, k, v, g, b = inputs(Bt, T, H, H, K, V, dtype=F32, seed=5)
    S0 = rand_state(Bt, H, K, V, 5, F32)
    y, S = kda.recurrent_scan(*(t.double() for t in (q, k, v, g, b)), initial_state=S0.double())
    if fn == "recurrent":
        yh, Sh = mod.recurrent_kimi_delta_attention(q, k, v, g, b, S0, True, use_qk_l2norm_in_kernel=True)
    else:
        yh, Sh = mod.chunk_kimi_delta_attention(q, k, v, g, b, chunk_size=4, initial_state=S0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(yh, y, F32, rtol=1e-5, atol=1e-5)
    close(Sh, S, F32, rtol=1e-5, atol=1e-5)


def test_scan_is_a_loop_of_steps_and_options():
    Bt, T, H, HV, K, V = 3, 6, 1, 3, 4, 2
    q, k, v, g, b = inputs(Bt, T, H, HV, K, V, seed=11)
    S = rand_state(Bt, HV, K, V, 11)
    for l2, scale in ((True, None), (False, 0.3)):
        y, Sf = kda.recurrent_scan(q, k, v, g, b, scale=scale, initial_state=S, use_qk_l2norm=l2)
        St = S
        for t in range(T):
            yt, St = kda.recurrent_step(St, q[:, t], k[:, t], v[:, t], g[:, t], b[:, t], scale=scale,
                                        use_qk_l2norm=l2)
            close(y[:, t], yt)
        close(Sf, St)


def test_reduces_to_gdn_when_decay_is_constant_over_channels():
    Bt, T, H, HV, K, V = 2, 9, 2, 4, 5, 3
    q, k, v, g, b = inputs(Bt, T, H, HV, K, V, seed=21)
    g1 = g[..., :1]
    S0 = rand_state(Bt, HV, K, V, 21)
    gk = g1.expand_as(g).contiguous()
    for fn_k, fn_g in ((kda.recurrent_scan, gdn.recurrent_scan), (kda.chunked_prefill, gdn.chunked_prefill)):
        ya, Sa = fn_k(q, k, v, gk, b, initial_state=S0)
        yb, Sb = fn_g(q, k, v, g1[..., 0], b, initial_state=S0)
        close(ya, yb)
        close(Sa, Sb)
    # a replay tree verify on the same buffers' contents agrees with GDN's
    L, N = 8, 4
    kb = KDABuffers.allocate(2, L, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    gb = GDNBuffers.allocate(2, L, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    kb.state[1:] = gb.state[1:] = S0
    ring = RingIndex(2, L)
    slots = torch.tensor([1, 2])
    for t in range(3):
        plan = ring.plan_decode(slots)
        ya = kda.replay_decode(kb, plan, *tok((q, k, v, gk, b), slice(None), t))
        yb = gdn.replay_decode(gb, plan, *tok((q, k, v, g1[..., 0], b), slice(None), t))
        close(ya, yb)
        ring.commit(plan)
    parent = torch.tensor([-1, 0, 0, 1])
    plan = ring.plan_verify(slots, N, kind="tree")
    sl = slice(3, 3 + N)
    ya = kda.tree_verify(kb, plan, parent, q[:, sl], k[:, sl], v[:, sl], gk[:, sl], b[:, sl])
    yb = gdn.tree_verify(gb, plan, parent, q[:, sl], k[:, sl], v[:, sl], g1[:, sl, :, 0], b[:, sl])
    close(ya, yb)


# ---------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("T,C", [(1, 1), (7, 3), (13, 4), (23, 64), (37, 8), (64, 16)])
def test_chunked_prefill_matches_scan(T, C):
    Bt, H, HV, K, V = 2, 2, 4, 5, 3
    x = inputs(Bt, T, H, HV, K, V, seed=T * 31 + C)
    S0 = rand_state(Bt, HV, K, V, T)
    y, S = kda.recurrent_scan(*x, initial_state=S0)
    yc, Sc = kda.chunked_prefill(*x, initial_state=S0, chunk_size=C)
    close(yc, y)
    close(Sc, S)
    yz, Sz = kda.chunked_prefill(*x, chunk_size=C)  # no initial state = zeros
    y0, S0z = kda.recurrent_scan(*x)
    close(yz, y0)
    close(Sz, S0z)


def test_chunked_prefill_strong_decay_stays_finite():
    """Log-decays down to -60 a token per channel: 64 such tokens underflow any cumulative
    product; segment sums keep every exponent <= 0."""
    x = list(inputs(1, 64, 1, 2, 4, 3, seed=40, decay=40.0))
    y, S = kda.chunked_prefill(*x, chunk_size=64)
    yr, Sr = kda.recurrent_scan(*x)
    assert torch.isfinite(y).all() and torch.isfinite(S).all()
    close(y, yr)
    close(S, Sr)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_chunked_prefill_varlen_pool_form_and_u(dtype):
    """Packed sequences of 5, 0, 9 and 1 tokens (one fresh, one on the null slot) from a
    NaN-poisoned pool: outputs, final states written back in place (other rows untouched),
    and ``u_t = β_t (v_t − S_{t−1}(α_t ⊙ k_t))`` against the recurrence token by token."""
    H, HV, K, V, P = 1, 3, 4, 5, 6
    lens, slots, fresh = [5, 0, 9, 1], [2, 0, 5, 1], [False, False, True, False]
    Nt = sum(lens)
    q, k, v, g, b = (t[0] for t in inputs(1, Nt, H, HV, K, V, dtype=dtype, seed=77))
    pool = rand_state(P, HV, K, V, 3, dtype=F32 if dtype == F32 else F64)
    pool[5] = float("nan")
    before = pool.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    y, final, u = kda.chunked_prefill_varlen(q, k, v, g, b, cu_seqlens=cu, chunk_size=4, return_u=True,
                                             state_pool=pool, slots=torch.tensor(slots), fresh=torch.tensor(fresh))
    assert final is None
    for (s, e), sl, fr in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), slots, fresh):
        if s == e:
            continue
        S = torch.zeros(1, HV, K, V, dtype=F64) if fr else before[sl:sl + 1].to(F64)
        for t in range(s, e):
            kn = kda.l2norm(k[t:t + 1].to(F64))
            a = torch.exp(g[t:t + 1].to(F64))
            u_t = b[t:t + 1, :, None].to(F64) * (v[t:t + 1].to(F64) - torch.einsum("bhkv,bhk->bhv", S, a * kn))
            close(u[t:t + 1], u_t, dtype)
            y_t, S = kda.recurrent_step(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], b[t:t + 1])
            close(y[t:t + 1], y_t, dtype)
        close(pool[sl:sl + 1], S, dtype)
    for r in (3, 4):   # rows outside the call
        assert torch.equal(pool[r], before[r])
    # initial_state form: the same outputs, the final states returned
    init = torch.where(torch.tensor(fresh)[:, None, None, None], torch.zeros(()), before[torch.tensor(slots)].to(F64))
    y2, f2 = kda.chunked_prefill_varlen(q, k, v, g, b, cu_seqlens=cu, initial_state=init, chunk_size=64)
    close(y2, y, dtype)
    close(f2[2], pool[5], dtype)


def test_chunked_prefill_varlen_bad_input():
    q, k, v, g, b = (t[0] for t in inputs(1, 4, 1, 2, 3, 3, seed=1))
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match=r"g must be \[Nt, HV, K\]"):
        kda.chunked_prefill_varlen(q, k, v, g[..., 0], b, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end"):
        kda.chunked_prefill_varlen(q, k, v, g, b, cu_seqlens=torch.tensor([0, 3]))
    pool = torch.zeros(3, 2, 3, 3, dtype=F64)
    with pytest.raises(ValueError, match="slots must be in"):
        kda.chunked_prefill_varlen(q, k, v, g, b, cu_seqlens=cu, state_pool=pool, slots=torch.tensor([3]))
    assert not pool.any()


def test_recurrent_update_in_place_on_pool_rows():
    H, HV, K, V = 2, 4, 3, 5
    q, k, v, g, b = inputs(2, 1, H, HV, K, V, seed=5, time=False)
    pool = rand_state(5, HV, K, V, 11)
    before = pool.clone()
    slot = torch.tensor([4, 1])
    y = kda.recurrent_update(pool, q, k, v, g, b, slot=slot)
    y_ref, S_ref = kda.recurrent_step(before[slot], q, k, v, g, b)
    close(y, y_ref)
    close(pool[slot], S_ref)
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])
    with pytest.raises(ValueError, match="slot"):
        kda.recurrent_update(pool, q, k, v, g, b, slot=torch.tensor([5, 1]))


# ---------------------------------------------------------------------------- replay
@pytest.mark.parametrize("route", ["state", "output"])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_replay_decode_flush_cycles_and_wraparound(route, dtype):
    h = Harness(2, 4, 5, 3, L=5, dtype=dtype, route=route, pad_rows=1, seed=100)
    h.warm([0, 2, 4])  # rows flush on different steps
    for _ in range(13):
        h.decode()
    assert h.flushed >= 6
    h.check_states()


@pytest.mark.parametrize("L,T", [(7, 3), (4, 2), (6, 1)])
@pytest.mark.parametrize("route", ["state", "output"])
def test_replay_verify_random_accepts_then_commit(L, T, route):
    h = Harness(1, 2, 4, 3, L=L, route=route, pad_rows=1, seed=110 + L)
    h.warm([1, 0, 3])
    for i in range(10):
        h.verify(T)
        if i % 3 == 2:
            h.decode()
    assert h.flushed > 0
    h.check_states()


def test_replay_verify_all_accept_and_all_reject():
    h = Harness(2, 2, 3, 4, L=8, seed=120)
    for i in range(6):
        h.verify(3, accepted=torch.full((3,), 3 * (i % 2)))
    h.check_states()


@pytest.mark.parametrize("route", ["state", "output"])
def test_tree_verify_random_trees_and_paths(route):
    h = Harness(1, 3, 4, 2, L=10, route=route, pad_rows=1, seed=130)
    h.warm([2, 0, 5])
    for N in (4, 5, 1, 3, 5, 2, 4):
        h.tree(N)
    assert h.flushed > 0
    h.check_states()


def test_mixed_schedule_fp32():
    h = Harness(2, 4, 6, 5, L=9, dtype=F32, seed=135)
    for i in range(12):
        (h.decode, lambda: h.verify(3), lambda: h.tree(4))[i % 3]()
    h.check_states()


def test_snapshot_baseline_matches_recurrence_and_commit():
    Bt, T, H, HV, K, V = 3, 4, 1, 2, 3, 4
    x = inputs(Bt, T, H, HV, K, V, seed=140)
    state = rand_state(5, HV, K, V, 140)
    slot = torch.tensor([3, 1, 4])
    y, snaps = kda.snapshot_verify(state, slot, *x)
    yr, _ = kda.recurrent_scan(*x, initial_state=state[slot])
    close(y, yr)
    acc = torch.tensor([2, 0, 4])
    before = state.clone()
    kda.snapshot_commit(state, slot, snaps, acc)
    for r in range(Bt):
        a = int(acc[r])
        want = before[slot[r]] if a == 0 else kda.recurrent_scan(
            *(t[r:r + 1, :a] for t in x), initial_state=before[slot[r]][None])[1][0]
        close(state[slot[r]], want)
    close(state[[0, 2]], before[[0, 2]])


# ---------------------------------------------------------------------------- KV-only (paged)
class KVHarness:
    """Rows in KV-only mode (``S0 = 0``) over a shared pool of blocks, checked like Harness."""

    def __init__(self, H, HV, K, V, bs, dtype=F64, slots=(1, 2), pad_rows=0, seed=0, num_blocks=40,
                 max_blocks=12):
        self.dims, self.dtype = (H, HV, K, V), dtype
        self.slots = torch.tensor(list(slots) + [NULL_SLOT] * pad_rows)
        self.real = [i for i, s in enumerate(self.slots.tolist()) if s != NULL_SLOT]
        self.pidx = PagedIndex(max(slots), bs, num_blocks, max_blocks)
        self.kv = KDAPagedBuffers.allocate(num_blocks, bs, H, HV, K, V, dtype=dtype, state_dtype=dtype,
                                           poison=True)
        self.oracle = Oracle({i: torch.zeros(HV, K, V, dtype=F64) for i in self.real})
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.seed = seed

    def step(self, T, tree=False, accepted=None):
        self.seed += 1
        Bt = len(self.slots)
        x = inputs(Bt, T, *self.dims, dtype=self.dtype, seed=self.seed)
        for i in self.real:
            s = int(self.slots[i])
            self.pidx.reserve(s, int(self.pidx.length[s]) + T)
        pplan = self.pidx.plan(self.slots, T)
        parents = [random_tree(T, self.gen) if tree else [-1] + list(range(T - 1)) for _ in range(Bt)]
        parent = torch.tensor(parents)
        if tree:
            y = kda.kv_tree_verify(self.kv, pplan, parent, *x)
            path, length = path_to(parent, torch.randint(0, T, (Bt,), generator=self.gen))
        else:
            y = kda.kv_verify(self.kv, pplan, *x)
            path, length = parent.new_tensor(range(T)).expand(Bt, T), torch.full((Bt,), T)
        if accepted is None:
            accepted = (torch.rand(Bt, generator=self.gen) * (length + 1)).long().clamp(max=length)
        accepted[self.slots == NULL_SLOT] = 0
        for i in self.real:
            for node in range(T):
                close(y[i, node], self.oracle.outputs(i, tok(x, i, chain_of(parents[i], node)))[-1], self.dtype)
            self.oracle.commit(i, tok(x, i, path[i, : int(accepted[i])].tolist()))
        if tree:
            kv_gather_path(self.kv.tensors(), pplan, path, accepted)
        self.pidx.commit(pplan, accepted)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_kv_verify_decode_and_verify_schedule(dtype):
    h = KVHarness(2, 4, 5, 3, bs=3, dtype=dtype, slots=(2, 1, 3), pad_rows=1, seed=150)
    for i in range(10):
        h.step(1, accepted=torch.ones(4, dtype=torch.long)) if i % 3 == 0 else h.step(3)
    assert h.pidx.length[1:].min() > 6  # spans several non-contiguous blocks


def test_kv_tree_verify_random_trees():
    h = KVHarness(1, 2, 4, 3, bs=2, slots=(1, 2), pad_rows=1, seed=160)
    for N in (3, 4, 1, 5, 2):
        h.step(N, tree=True)


def test_kv_long_prefill_uses_chunked_scan():
    """More than KV_CHUNK new tokens: history folded into a state, then the chunked scan."""
    T = kda.KV_CHUNK + 9
    h = KVHarness(1, 2, 3, 2, bs=16, slots=(1, 2), seed=165, num_blocks=16, max_blocks=7)
    h.step(5)
    h.step(T, accepted=torch.full((2,), T))


def test_kv_to_state_then_replay_continues():
    H, HV, K, V = 2, 4, 3, 5
    h = KVHarness(H, HV, K, V, bs=2, slots=(1, 3), seed=170)
    for _ in range(4):
        h.step(2)
    buf = KDABuffers.allocate(3, 4, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    ring = RingIndex(3, 4)
    for s in h.slots.tolist():
        h.pidx.reserve(s, int(h.pidx.length[s]) + 1)
    pplan = h.pidx.plan(h.slots, 1)
    state_slots = torch.tensor([2, 1])
    before = snapshot(buf)
    kda.kv_to_state(h.kv, pplan, buf, state_slots)
    for i in h.real:
        close(buf.state[state_slots[i]], h.oracle.S[i])
    torch.testing.assert_close(buf.state[3], before[0][3], equal_nan=True)  # others untouched
    Sf = kda.kv_fold(h.kv, pplan)
    for i in h.real:
        close(Sf[i], h.oracle.S[i])
    for t in range(7):
        x = inputs(2, 1, H, HV, K, V, seed=180 + t, time=False)
        plan = ring.plan_decode(state_slots)
        y = kda.replay_decode(buf, plan, *x)
        ring.commit(plan)
        for i in h.real:
            toks = tuple(a[i][None] for a in x)
            close(y[i], h.oracle.outputs(i, toks)[0])
            h.oracle.commit(i, toks)


# ---------------------------------------------------------------------------- bad input
def _setup():
    H, HV, K, V, L = 1, 2, 3, 4, 6
    buf = KDABuffers.allocate(2, L, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    ring = RingIndex(2, L)
    return buf, ring, (H, HV, K, V)


def _bad_calls():
    def gdn_shaped_g(buf, ring, d):
        q, k, v, g, b = inputs(2, 1, *d, time=False)
        kda.replay_decode(buf, ring.plan_decode(torch.tensor([1, 2])), q, k, v, g[..., 0], b)

    def gdn_buffers(buf, ring, d):
        gb = GDNBuffers.allocate(2, 6, *d, dtype=F64, state_dtype=F64)
        kda.replay_decode(gb, ring.plan_decode(torch.tensor([1, 2])), *inputs(2, 1, *d, time=False))

    def wrong_kind(buf, ring, d):
        kda.replay_verify(buf, ring.plan_decode(torch.tensor([1, 2])), *inputs(2, 1, *d))

    def too_many_drafts(buf, ring, d):
        kda.replay_verify(buf, ring.plan_verify(torch.tensor([1, 2]), 3), *inputs(2, 2, *d))

    def bad_tree(buf, ring, d):
        kda.tree_verify(buf, ring.plan_verify(torch.tensor([1, 2]), 3, kind="tree"),
                        torch.tensor([-1, 2, 0]), *inputs(2, 3, *d))

    def bad_route(buf, ring, d):
        kda.replay_decode(buf, ring.plan_decode(torch.tensor([1, 2])), *inputs(2, 1, *d, time=False),
                          route="fast")

    return [("gdn_shaped_g", gdn_shaped_g, "g must have shape"), ("gdn_buffers", gdn_buffers, "KDABuffers"),
            ("wrong_kind", wrong_kind, "plan kind"), ("too_many_drafts", too_many_drafts, "entries"),
            ("bad_tree", bad_tree, "tree"), ("bad_route", bad_route, "route")]


@pytest.mark.parametrize("name,fn,msg", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_before_any_write(name, fn, msg):
    buf, ring, d = _setup()
    before = snapshot(buf, ring)
    with pytest.raises(ValueError, match=msg):
        fn(buf, ring, d)
    assert_unchanged(before, buf, ring)


def test_kv_bad_input_raises_before_any_write():
    h = KVHarness(1, 2, 3, 4, bs=2, slots=(1, 2), seed=190)
    h.step(2)
    x = inputs(2, 2, 1, 2, 3, 4, seed=191)
    for s in (1, 2):
        h.pidx.reserve(s, int(h.pidx.length[s]) + 2)
    before = [t.clone() for t in h.kv.tensors()]
    pplan = h.pidx.plan(h.slots, 2)
    with pytest.raises(ValueError, match="g must have shape"):
        kda.kv_verify(h.kv, pplan, *x[:3], x[3][..., 0], x[4])
    with pytest.raises(ValueError, match="entries per row"):
        kda.kv_verify(h.kv, pplan, *(a[:, :1] for a in x))
    with pytest.raises(ValueError, match="KDAPagedBuffers"):
        kda.kv_to_state(h.kv.tensors(), pplan, KDABuffers.allocate(2, 4, 1, 2, 3, 4, dtype=F64, state_dtype=F64),
                        torch.tensor([1, 2]))
    for a, b in zip(before, h.kv.tensors()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
