"""Gated DeltaNet reference ops: every form against the plain recurrence.

Each schedule (decode / verify / tree steps over several flush cycles and ring
wrap-arounds, rows at different fill levels, random accepted counts and paths) is
checked token by token against ``recurrent_scan`` run on each row's accepted token
stream alone, and the rebuilt states (checkpoint + ring) against the recurrence's state.
Caches are poisoned with NaN so any read of an invalid entry shows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayssm.cache.buffers import GDNBuffers
from replayssm.cache.ring import NULL_SLOT, RingIndex
from replayssm.cache.tree import gather_path, path_to
from replayssm.ops.gdn import naive as gdn

F64, F32 = torch.float64, torch.float32
TOL = {F64: dict(rtol=1e-10, atol=1e-10), F32: dict(rtol=2e-5, atol=2e-5)}
HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------- helpers
def inputs(Bt, T, H, HV, K, V, dtype=F64, seed=0, time=True, decay=1.0):
    """Raw projections: q, k ~ N(0,1); g = -decay·softplus(N) <= 0; beta = sigmoid(N)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (Bt, T) if time else (Bt,)

    def r(*s):
        return torch.randn(*lead, *s, generator=gen, dtype=F64)

    q, k, v = r(H, K), r(H, K), r(HV, V)
    g = -decay * F.softplus(r(HV))
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
    ts = [buf.state, buf.u, buf.k, buf.g]
    if ring is not None:
        ts += [ring.start, ring.length]
    return [t.clone() for t in ts]


def assert_unchanged(before, buf, ring=None):
    after = snapshot(buf, ring)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def tok(x, r, idx):
    """Row r of every tensor in x, at token indices idx (list)."""
    return tuple(t[r, idx] for t in x)


class Oracle:
    """Per-row ground truth: the recurrence on that row's accepted token stream alone (fp64)."""

    def __init__(self, states):
        self.S = {r: s.to(F64).clone() for r, s in states.items()}

    def outputs(self, r, toks):
        q, k, v, g, b = (t.to(F64)[None] for t in toks)
        y, _ = gdn.recurrent_scan(q, k, v, g, b, initial_state=self.S[r][None])
        return y[0]

    def commit(self, r, toks):
        if toks[0].shape[0] == 0:
            return
        q, k, v, g, b = (t.to(F64)[None] for t in toks)
        _, S = gdn.recurrent_scan(q, k, v, g, b, initial_state=self.S[r][None])
        self.S[r] = S[0]


def random_tree(N, gen):
    par = [-1]
    for i in range(1, N):
        par.append(int(torch.randint(-1, i, (1,), generator=gen)))
    return par


class Harness:
    """A batch of rows (real slots and null-slot padding) run through a step schedule."""

    def __init__(self, H, HV, K, V, L, dtype=F64, route="state", slots=(1, 2, 3), pad_rows=0,
                 num_slots=None, seed=0):
        self.dims = (H, HV, K, V)
        self.dtype, self.route, self.L = dtype, route, L
        self.slots = torch.tensor(list(slots) + [NULL_SLOT] * pad_rows)
        self.real = [i for i, s in enumerate(self.slots.tolist()) if s != NULL_SLOT]
        P = num_slots or (max(slots) + 1)
        self.ring = RingIndex(P, L)
        self.buf = GDNBuffers.allocate(P, L, H, HV, K, V, dtype=dtype, state_dtype=dtype, poison=True)
        S0 = rand_state(len(self.slots), HV, K, V, seed, dtype)
        for i in self.real:
            self.buf.state[self.slots[i]] = S0[i]
        self.oracle = Oracle({i: S0[i] for i in self.real})
        self.gen = torch.Generator().manual_seed(seed + 1)
        # empty rings may start anywhere: entries wrap around the ring end from the start
        self.ring.start[1:] = torch.randint(0, L, (P,), generator=self.gen)
        self.seed = seed
        self.flushed = 0

    def _x(self, T, time=True):
        self.seed += 1
        return inputs(len(self.slots), T, *self.dims, dtype=self.dtype, seed=self.seed, time=time)

    def check_states(self, rows=None):
        plan = self.ring.plan_decode(self.slots)
        Sh = gdn.rebuild_state(self.buf, plan)
        for i in rows if rows is not None else self.real:
            close(Sh[i], self.oracle.S[i], self.dtype)

    def warm(self, counts):
        """Row i alone (batch of one) decodes counts[i] tokens: rows end at different fills."""
        for i, c in zip(self.real, counts):
            for _ in range(c):
                self.seed += 1
                x = inputs(1, 1, *self.dims, dtype=self.dtype, seed=self.seed, time=False)
                plan = self.ring.plan_decode(self.slots[i:i + 1])
                y = gdn.replay_decode(self.buf, plan, *x, route=self.route)
                close(y[0], self.oracle.outputs(i, tuple(t[0][None] for t in x))[0], self.dtype)
                self.oracle.commit(i, tuple(t[0][None] for t in x))
                self.ring.commit(plan)

    def decode(self):
        x = self._x(1, time=False)
        plan = self.ring.plan_decode(self.slots)
        self.flushed += int(plan.flush[self.real].sum())
        y = gdn.replay_decode(self.buf, plan, *x, route=self.route)
        for i in self.real:
            toks = tuple(t[i][None] for t in x)
            close(y[i], self.oracle.outputs(i, toks)[0], self.dtype)
            self.oracle.commit(i, toks)
        self.ring.commit(plan)
        return y

    def verify(self, T, accepted=None):
        x = self._x(T)
        plan = self.ring.plan_verify(self.slots, T)
        self.flushed += int(plan.flush[self.real].sum())
        y = gdn.replay_verify(self.buf, plan, *x, route=self.route)
        if accepted is None:
            accepted = torch.randint(0, T + 1, (len(self.slots),), generator=self.gen)
        accepted = torch.as_tensor(accepted).clone()
        accepted[self.slots == NULL_SLOT] = 0
        for i in self.real:
            close(y[i], self.oracle.outputs(i, tok(x, i, list(range(T)))), self.dtype)
            self.oracle.commit(i, tok(x, i, list(range(int(accepted[i])))))
        self.ring.commit(plan, accepted)
        return y

    def tree(self, N, parents=None):
        x = self._x(N)
        Bt = len(self.slots)
        if parents is None:
            parents = [random_tree(N, self.gen) for _ in range(Bt)]
        parent = torch.tensor(parents)
        plan = self.ring.plan_verify(self.slots, N, kind="tree")
        self.flushed += int(plan.flush[self.real].sum())
        y = gdn.tree_verify(self.buf, plan, parent, *x, route=self.route)
        leaf = torch.randint(0, N, (Bt,), generator=self.gen)
        path, length = path_to(parent, leaf)
        accepted = (torch.rand(Bt, generator=self.gen) * (length + 1)).long().clamp(max=length)
        accepted[self.slots == NULL_SLOT] = 0
        for i in self.real:
            for node in range(N):
                chain = [node]
                while parents[i][chain[-1]] != -1:
                    chain.append(parents[i][chain[-1]])
                chain.reverse()
                close(y[i, node], self.oracle.outputs(i, tok(x, i, chain))[-1], self.dtype)
            self.oracle.commit(i, tok(x, i, path[i, : int(accepted[i])].tolist()))
        gather_path(self.buf.ring_tensors(), plan, path, accepted)
        self.ring.commit(plan, accepted)
        return y


dims_st = st.tuples(
    st.integers(1, 3),  # H
    st.integers(1, 3),  # HV // H
    st.integers(1, 6),  # K
    st.integers(1, 7),  # V
)


# ---------------------------------------------------------------------------- recurrence
def test_recurrent_step_matches_design_formula_per_head():
    """S ∈ R^{V×K} per value head (the layout of docs/MATH.md) vs the [HV, K, V] state; GVA head map."""
    Bt, H, HV, K, V = 2, 3, 6, 5, 7
    q, k, v, g, b = inputs(Bt, 1, H, HV, K, V, time=False, seed=3)
    St = rand_state(Bt, HV, K, V, 3)
    y, St1 = gdn.recurrent_step(St, q, k, v, g, b)
    for bi in range(Bt):
        for hv in range(HV):
            h = hv // (HV // H)
            qn = q[bi, h] / math.sqrt((q[bi, h] ** 2).sum() + 1e-6) * K ** -0.5
            kn = k[bi, h] / math.sqrt((k[bi, h] ** 2).sum() + 1e-6)
            S = St[bi, hv].T  # V × K
            a = math.exp(g[bi, hv])
            u = b[bi, hv] * (v[bi, hv] - a * S @ kn)
            S = a * S + torch.outer(u, kn)
            close(y[bi, hv], S @ qn)
            close(St1[bi, hv], S.T)


def test_matches_transformers_torch_recurrent_rule():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    Bt, T, H, HV, K, V = 2, 9, 2, 4, 8, 6
    q, k, v, g, b = inputs(Bt, T, H, HV, K, V, dtype=F32, seed=5)
    S0 = rand_state(Bt, HV, K, V, 5, F32)
    y, S = gdn.recurrent_scan(q, k, v, g, b, initial_state=S0)
    rep = HV // H
    yh, Sh = mod.torch_recurrent_gated_delta_rule(
        q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, b, initial_state=S0,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(y, yh, F32)
    close(S, Sh, F32)


def test_scan_is_a_loop_of_steps_and_options():
    Bt, T, H, HV, K, V = 3, 6, 1, 3, 4, 2
    q, k, v, g, b = inputs(Bt, T, H, HV, K, V, seed=11)
    S = rand_state(Bt, HV, K, V, 11)
    for l2, scale in ((True, None), (False, 0.3), (True, 2.0)):
        y, Sf = gdn.recurrent_scan(q, k, v, g, b, scale=scale, initial_state=S, use_qk_l2norm=l2)
        St = S
        for t in range(T):
            yt, St = gdn.recurrent_step(St, q[:, t], k[:, t], v[:, t], g[:, t], b[:, t],
                                        scale=scale, use_qk_l2norm=l2)
            close(y[:, t], yt)
        close(Sf, St)
    # no l2norm: q·scale enters linearly, k unnormalised
    y1, _ = gdn.recurrent_scan(q, k, v, g, b, scale=1.0, initial_state=S, use_qk_l2norm=False)
    y2, _ = gdn.recurrent_scan(2 * q, k, v, g, b, scale=0.5, initial_state=S, use_qk_l2norm=False)
    close(y1, y2)
    # no initial state = zeros
    ya, Sa = gdn.recurrent_scan(q, k, v, g, b)
    yb, Sb = gdn.recurrent_scan(q, k, v, g, b, initial_state=torch.zeros_like(S))
    close(ya, yb)
    close(Sa, Sb)


@settings(max_examples=25, **HYP)
@given(dims=dims_st, Bt=st.integers(1, 3), T=st.integers(1, 23), C=st.integers(1, 9),
       f32=st.booleans(), seed=st.integers(0, 10_000))
def test_chunked_prefill_matches_scan(dims, Bt, T, C, f32, seed):
    H, rep, K, V = dims
    dt = F32 if f32 else F64
    x = inputs(Bt, T, H, H * rep, K, V, dtype=dt, seed=seed)
    S0 = rand_state(Bt, H * rep, K, V, seed, dt)
    y, S = gdn.recurrent_scan(*x, initial_state=S0)
    y2, S2 = gdn.chunked_prefill(*x, initial_state=S0, chunk_size=C)
    close(y2, y, dt)
    close(S2, S, dt)
    assert y2.dtype == dt and S2.dtype == dt


def test_chunked_prefill_default_chunk_and_odd_length():
    x = inputs(2, 131, 3, 6, 5, 7, seed=1)  # 131 = 2·64 + 3
    y, S = gdn.recurrent_scan(*x)
    y2, S2 = gdn.chunked_prefill(*x)
    close(y2, y)
    close(S2, S)


def test_chunked_prefill_strong_decay_stays_finite():
    """Cumulative log-decay ~ -6000 in a chunk: exp of segment sums, never a ratio."""
    x = list(inputs(1, 40, 2, 2, 4, 3, seed=2, decay=150.0))
    x[3][:, 20:] = -1e-3  # mild decay after a very strong one
    S0 = rand_state(1, 2, 4, 3, 2)
    y, S = gdn.recurrent_scan(*x, initial_state=S0)
    y2, S2 = gdn.chunked_prefill(*x, initial_state=S0, chunk_size=40)
    assert torch.isfinite(y2).all() and torch.isfinite(S2).all()
    close(y2, y)
    close(S2, S)


def test_padding_tokens_leave_state_unchanged():
    """A token with g = 0, beta = 0 is the identity on the state (prefill padding is data)."""
    q, k, v, g, b = inputs(2, 8, 2, 4, 3, 5, seed=4)
    g[:, 3:5] = 0
    b[:, 3:5] = 0
    S0 = rand_state(2, 4, 3, 5, 4)
    keep = [0, 1, 2, 5, 6, 7]
    _, S = gdn.chunked_prefill(q, k, v, g, b, initial_state=S0, chunk_size=3)
    _, Sref = gdn.recurrent_scan(*(t[:, keep] for t in (q, k, v, g, b)), initial_state=S0)
    close(S, Sref)


def test_low_precision_activations_are_upcast():
    """bf16/fp16 activations, fp32 state: math in fp32, y in the activation dtype."""
    x64 = inputs(2, 10, 2, 4, 8, 8, seed=6)
    for adt in (torch.bfloat16, torch.float16):
        xl = tuple(t.to(adt) for t in x64)
        S0 = rand_state(2, 4, 8, 8, 6, F32)
        y, S = gdn.chunked_prefill(*xl, initial_state=S0, chunk_size=4)
        assert y.dtype == adt and S.dtype == F32
        yr, Sr = gdn.recurrent_scan(*(t.to(F64) for t in xl), initial_state=S0.to(F64))
        close(S, Sr, F32, rtol=1e-4, atol=1e-4)
        close(y.float(), yr.float(), F32, rtol=2e-2, atol=2e-2)
        # replay with fp32 buffers matches too
        h = Harness(2, 4, 8, 8, L=4, dtype=F32, slots=(1, 2))
        h.buf.state[1:3] = S0
        ys = []
        for t in range(10):
            plan = h.ring.plan_decode(h.slots)
            ys.append(gdn.replay_decode(h.buf, plan, *(a[:, t] for a in xl)))
            h.ring.commit(plan)
        close(torch.stack(ys, 1).float(), yr.float(), F32, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------- replay decode
@pytest.mark.parametrize("route", ["state", "output"])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_replay_decode_flush_cycles_and_wraparound(route, dtype):
    """Rows at different fill levels decode through several flushes (L=4, 19 steps)."""
    h = Harness(3, 6, 5, 7, L=4, dtype=dtype, route=route, slots=(2, 1, 4), pad_rows=1,
                num_slots=5, seed=10)
    h.warm([0, 1, 3])
    for _ in range(19):
        h.decode()
        h.check_states()
    assert h.flushed >= 12
    assert (h.ring.start[h.slots[h.real]] != 0).any()  # rings wrap around


@pytest.mark.parametrize("L", [1, 2])
def test_replay_decode_tiny_rings_flush_often(L):
    h = Harness(2, 2, 4, 3, L=L, route="output", slots=(1, 2), seed=15 + L)
    h.warm([0, L - 1])
    for _ in range(5):
        h.decode()
        h.check_states()
    assert h.flushed >= 4


def test_bf16_ring_fp32_state_is_close():
    """The production layout: bf16 ring entries (u, k), fp32 state and g."""
    H, HV, K, V, L = 2, 4, 16, 16, 6
    ring = RingIndex(2, L)
    buf = GDNBuffers.allocate(2, L, H, HV, K, V, dtype=torch.bfloat16, state_dtype=F32, poison=True)
    assert buf.g.dtype == F32
    slots = torch.tensor([2, 1])
    S0 = rand_state(2, HV, K, V, 16, F32)
    buf.state[slots] = S0
    x = inputs(2, 15, H, HV, K, V, dtype=torch.bfloat16, seed=17)
    y_ref, S_ref = gdn.recurrent_scan(*(a.to(F64) for a in x), initial_state=S0.to(F64))
    ys, t = [], 0
    while t < 15:
        if t % 5 == 2:
            plan = ring.plan_verify(slots, 3)
            ys.append(gdn.replay_verify(buf, plan, *(a[:, t:t + 3] for a in x)))
            ring.commit(plan, torch.tensor([3, 3]))
            t += 3
        else:
            plan = ring.plan_decode(slots)
            ys.append(gdn.replay_decode(buf, plan, *(a[:, t] for a in x))[:, None])
            ring.commit(plan)
            t += 1
    y = torch.cat(ys, 1)
    assert y.dtype == torch.bfloat16
    close(y.float(), y_ref.float(), F32, rtol=5e-2, atol=5e-2)
    close(gdn.rebuild_state(buf, ring.plan_decode(slots)), S_ref.float(), F32, rtol=3e-2, atol=3e-2)


def test_replay_decode_routes_agree():
    outs = {}
    for route in ("state", "output"):
        h = Harness(2, 4, 3, 5, L=3, route=route, seed=20)
        h.warm([2, 0, 1])
        outs[route] = torch.stack([h.decode() for _ in range(7)])
        outs[route + "_state"] = h.buf.state.clone()
    close(outs["state"], outs["output"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs["state_state"], outs["output_state"], equal_nan=True,
                               rtol=1e-12, atol=1e-12)


def test_decode_flush_writes_state_including_new_entry_and_others_untouched():
    h = Harness(1, 2, 3, 4, L=3, seed=30, slots=(1, 2))
    h.warm([2, 0])  # slot 1 has h = 2 = L - 1: flushes next; slot 2 does not
    state2 = h.buf.state[2].clone()
    plan = h.ring.plan_decode(h.slots)
    assert plan.flush.tolist() == [True, False]
    h.decode()
    close(h.buf.state[1], h.oracle.S[0])  # S_{h+1}, new entry included
    assert h.ring.length[1] == 0 and h.ring.length[2] == 1
    torch.testing.assert_close(h.buf.state[2], state2, rtol=0, atol=0)  # no store


def test_ring_stores_normalised_k_corrected_u_and_g():
    H, HV, K, V = 2, 4, 3, 5
    h = Harness(H, HV, K, V, L=8, slots=(1,), seed=40)
    x = inputs(1, 1, H, HV, K, V, seed=41, time=False)
    S_before = h.oracle.S[0].clone()
    plan = h.ring.plan_decode(h.slots)
    gdn.replay_decode(h.buf, plan, *x)
    q, k, v, g, b = x
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    close(h.buf.k[1, 0], kn[0])
    close(h.buf.g[1, 0], g[0])
    a = torch.exp(g[0])[:, None]
    Sk = torch.einsum("hkv,hk->hv", a[..., None] * S_before, kn[0].repeat_interleave(HV // H, 0))
    close(h.buf.u[1, 0], b[0][:, None] * (v[0] - Sk))


def test_batch_rows_equal_each_sequence_alone():
    H, HV, K, V = 2, 6, 3, 4
    seqs = [inputs(1, 9, H, HV, K, V, seed=50 + i) for i in range(3)]
    S0 = rand_state(3, HV, K, V, 50)
    x = tuple(torch.cat([s[j] for s in seqs]) for j in range(5))

    def run(slots, xs, S):
        ring = RingIndex(4, 4)
        buf = GDNBuffers.allocate(4, 4, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
        buf.state[slots] = S
        ys = []
        for t in range(9):
            if t in (3, 4):  # two verify steps, all accepted, in the middle
                continue
            if t == 5:
                plan = ring.plan_verify(slots, 2)
                ys.append(gdn.replay_verify(buf, plan, *(a[:, 3:5] for a in xs)))
                ring.commit(plan, torch.full((len(slots),), 2))
            plan = ring.plan_decode(slots)
            ys.append(gdn.replay_decode(buf, plan, *(a[:, t] for a in xs))[:, None])
            ring.commit(plan)
        return torch.cat(ys, 1)

    y_batch = run(torch.tensor([3, 1, 2]), x, S0)
    for i in range(3):
        y_alone = run(torch.tensor([1]), seqs[i], S0[i:i + 1])
        close(y_batch[i], y_alone[0], rtol=1e-13, atol=1e-13)
    y_ref, _ = gdn.recurrent_scan(*x, initial_state=S0)
    close(y_batch, y_ref)


def test_padding_rows_on_null_slot_do_not_disturb_others():
    h = Harness(1, 3, 4, 2, L=4, slots=(1, 2), pad_rows=3, seed=60)
    h.warm([1, 3])
    for step in range(6):
        y = h.verify(2) if step % 2 else h.decode()
        assert torch.isfinite(y[h.real]).all()
    assert h.ring.length[NULL_SLOT] == 0 and h.ring.start[NULL_SLOT] == 0
    h.check_states()


# ---------------------------------------------------------------------------- speculative
@pytest.mark.parametrize("L,T", [(7, 3), (9, 2), (4, 2), (6, 1)])
@pytest.mark.parametrize("route", ["state", "output"])
def test_replay_verify_random_accepts(L, T, route):
    h = Harness(3, 6, 5, 7, L=L, route=route, slots=(1, 3, 2), pad_rows=1, seed=70 + L)
    h.warm([0, 2, L - T])
    for _ in range(9):
        h.verify(T)
        h.check_states()
    assert h.flushed >= 2


@pytest.mark.parametrize("dtype", [F64, F32])
def test_replay_verify_all_accept_and_all_reject(dtype):
    h = Harness(2, 2, 6, 3, L=6, dtype=dtype, seed=80)
    for acc in (3, 0, 3, 3, 0, 3, 3, 3):
        h.verify(3, accepted=torch.full((3,), acc))
        h.check_states()


def test_verify_flush_writes_committed_state_only():
    h = Harness(1, 2, 3, 4, L=5, slots=(1, 2), seed=90)
    h.warm([3, 0])  # slot 1: h = 3, 3 + 2·2 > 5 -> flush; slot 2: h = 0, no flush
    S_h = h.oracle.S[0].clone()
    state2 = h.buf.state[2].clone()
    plan = h.ring.plan_verify(h.slots, 2)
    assert plan.flush.tolist() == [True, False]
    h.verify(2, accepted=torch.tensor([1, 2]))
    close(h.buf.state[1], S_h)  # drafts are not summarised
    torch.testing.assert_close(h.buf.state[2], state2, rtol=0, atol=0)
    assert h.ring.length.tolist()[1:3] == [1, 2]
    h.check_states()


@pytest.mark.parametrize("kind", ["verify", "tree"])
def test_verify_after_decode_overwrites_oldest_committed_entries(kind):
    """h = L-1 after decodes, then T = 3 drafts: the step flushes and its new entries wrap
    onto the oldest committed ones; history must be read before the write."""
    h = Harness(2, 4, 3, 5, L=6, slots=(1, 2), seed=95)
    h.warm([5, 4])
    plan = h.ring.plan_verify(h.slots, 3)
    assert plan.flush.all() and (plan.hist + 3 > 6).all()
    if kind == "verify":
        h.verify(3)
    else:
        h.tree(3)
    h.check_states()
    h.decode()
    h.check_states()


def test_snapshot_baseline_matches_oracle_and_replay():
    H, HV, K, V, T = 2, 4, 3, 5, 4
    P = 4
    state = rand_state(P, HV, K, V, 100)
    slot = torch.tensor([2, 0, 3])
    x = inputs(3, T, H, HV, K, V, seed=101)
    y, snaps = gdn.snapshot_verify(state, slot, *x)
    yr, Sr = gdn.recurrent_scan(*x, initial_state=state[slot])
    close(y, yr)
    close(snaps[:, -1], Sr)
    # replay verify from the same checkpoint gives the same outputs
    ring = RingIndex(P - 1, 2 * T)
    buf = GDNBuffers.allocate(P - 1, 2 * T, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    buf.state.copy_(state)
    close(gdn.replay_verify(buf, ring.plan_verify(slot, T), *x), y)
    accepted = torch.tensor([2, 1, 0])
    before = state.clone()
    gdn.snapshot_commit(state, slot, snaps, accepted)
    _, S2 = gdn.recurrent_scan(*(t[:1, :2] for t in x), initial_state=before[2:3])
    close(state[2], S2[0])
    close(state[3], before[3])  # a = 0: unchanged
    close(state[1], before[1])


def test_tree_chain_equals_linear_verify():
    H, HV, K, V, T = 1, 2, 4, 3, 3
    x = inputs(2, T, H, HV, K, V, seed=110)
    ys = {}
    for kind in ("verify", "tree"):
        h = Harness(H, HV, K, V, L=6, slots=(1, 2), seed=111)
        h.warm([1, 4])
        plan = h.ring.plan_verify(h.slots, T, kind=kind)
        if kind == "tree":
            ys[kind] = gdn.tree_verify(h.buf, plan, torch.tensor([-1, 0, 1]), *x)
        else:
            ys[kind] = gdn.replay_verify(h.buf, plan, *x)
        ys[kind + "_u"] = h.buf.u.clone()
    close(ys["tree"], ys["verify"], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ys["tree_u"], ys["verify_u"], equal_nan=True)


@pytest.mark.parametrize("route", ["state", "output"])
def test_tree_fixed_shapes_with_several_roots(route):
    h = Harness(2, 4, 3, 5, L=13, route=route, slots=(1, 2, 3), seed=120)
    h.warm([0, 3, 5])
    trees = [[-1, 0, 0, 1, 1, 2], [-1, -1, 0, 1, 2, 3], [-1, 0, 1, 2, 3, 4]]
    for _ in range(4):
        h.tree(6, parents=trees)
        h.check_states()


@settings(max_examples=25, **HYP)
@given(dims=dims_st, N=st.integers(1, 5), extra=st.integers(0, 3), steps=st.integers(2, 5),
       seed=st.integers(0, 10_000), route=st.sampled_from(["state", "output"]))
def test_tree_random_shapes_and_paths(dims, N, extra, steps, seed, route):
    H, rep, K, V = dims
    L = 2 * N + extra
    h = Harness(H, H * rep, K, V, L=L, route=route, slots=(2, 1), pad_rows=1, seed=seed)
    h.warm([seed % (L - N + 1), 0])
    for _ in range(steps):
        h.tree(N)
        h.check_states()


# ---------------------------------------------------------------------------- mixed schedules
@settings(max_examples=30, **HYP)
@given(dims=dims_st, T=st.integers(1, 3), extra=st.integers(0, 4),
       ops=st.lists(st.sampled_from(["decode", "verify", "tree"]), min_size=3, max_size=9),
       seed=st.integers(0, 10_000), route=st.sampled_from(["state", "output"]),
       f32=st.booleans())
def test_mixed_schedules_match_recurrence(dims, T, extra, ops, seed, route, f32):
    H, rep, K, V = dims
    L = 2 * T + extra
    h = Harness(H, H * rep, K, V, L=L, dtype=F32 if f32 else F64, route=route, slots=(3, 1, 2),
                pad_rows=seed % 2, num_slots=4, seed=seed)
    h.warm([0, (seed // 3) % L, (seed // 7) % L])
    for op in ops:
        {"decode": h.decode, "verify": lambda: h.verify(T), "tree": lambda: h.tree(T)}[op]()
    h.check_states()


def test_long_mixed_schedule_fp32_stays_accurate():
    h = Harness(2, 4, 8, 8, L=8, dtype=F32, route="output", slots=(1, 2, 3, 4), seed=130)
    h.warm([1, 3, 5, 7])
    for i in range(24):
        [h.decode, lambda: h.verify(3), lambda: h.tree(4)][i % 3]()
    h.check_states()
    assert h.flushed >= 8


# ---------------------------------------------------------------------------- validation
def _setup(poison=False):
    H, HV, K, V = 2, 4, 3, 5
    ring = RingIndex(3, 6)
    buf = GDNBuffers.allocate(3, 6, H, HV, K, V, dtype=F64, state_dtype=F64, poison=poison)
    buf.state.normal_()
    buf.u.normal_()
    buf.k.normal_()
    buf.g.uniform_(-1, 0)
    ring.length[1:] = torch.tensor([2, 0, 1])
    ring.start[1:] = torch.tensor([5, 0, 3])
    return ring, buf, (H, HV, K, V)


def _bad_calls():
    """(name, fn(ring, buf, dims)) pairs that must raise ValueError and touch nothing."""
    slots = torch.tensor([1, 2, 0])

    def dec(**over):
        def f(ring, buf, d):
            x = dict(zip("qkvgb", inputs(3, 1, *d, time=False)))
            plan = ring.plan_decode(slots)
            for key in [key for key in over if key in x]:
                x[key] = over.pop(key)(x[key])
            gdn.replay_decode(buf, plan, x["q"], x["k"], x["v"], x["g"], x["b"], **over)
        return f

    def ver(T=2, kind="verify", parent=None, **over):
        def f(ring, buf, d):
            x = dict(zip("qkvgb", inputs(3, T, *d)))
            for key in [key for key in over if key in x]:
                x[key] = over.pop(key)(x[key])
            plan = ring.plan_verify(slots, T, kind=kind)
            args = (x["q"], x["k"], x["v"], x["g"], x["b"])
            if parent is None:
                gdn.replay_verify(buf, plan, *args, **over)
            else:
                gdn.tree_verify(buf, plan, parent, *args, **over)
        return f

    def tree_with_verify_plan(ring, buf, d):
        x = inputs(3, 2, *d)
        gdn.tree_verify(buf, ring.plan_verify(slots, 2), torch.tensor([-1, 0]), *x)

    def verify_plan_to_decode(ring, buf, d):
        gdn.replay_decode(buf, ring.plan_verify(slots, 1), *inputs(3, 1, *d, time=False))

    def decode_plan_to_verify(ring, buf, d):
        x = inputs(3, 1, *d)
        gdn.replay_verify(buf, ring.plan_decode(slots), *x)

    def verify_t_mismatch(ring, buf, d):
        x = inputs(3, 3, *d)
        gdn.replay_verify(buf, ring.plan_verify(slots, 2), *x)

    def plan_batch_mismatch(ring, buf, d):
        x = inputs(2, 1, *d, time=False)
        gdn.replay_decode(buf, ring.plan_decode(slots), *x)

    def hv_not_multiple(ring, buf, d):
        H, HV, K, V = d
        x = inputs(3, 1, 3, HV, K, V, time=False)  # H=3 does not divide HV=4
        gdn.replay_decode(buf, ring.plan_decode(slots), *x)

    def buf_k_dim_mismatch(ring, buf, d):
        H, HV, K, V = d
        x = inputs(3, 1, H, HV, K + 1, V, time=False)
        gdn.replay_decode(buf, ring.plan_decode(slots), *x)

    def state_dtype_int(ring, buf, d):   # bf16 / fp16 states are valid (stored rounded, math in fp32)
        buf2 = GDNBuffers(buf.state.to(torch.int32), buf.u, buf.k, buf.g)
        try:
            gdn.replay_decode(buf2, ring.plan_decode(slots), *inputs(3, 1, *d, time=False))
        finally:
            assert buf2.state.dtype == torch.int32

    def bad_plan_hist(ring, buf, d):
        plan = ring.plan_decode(slots)
        plan = type(plan)(plan.slot, plan.start, torch.tensor([6, 0, 0]), torch.zeros(3, dtype=torch.bool),
                          1, "decode", plan.capacity)
        gdn.replay_decode(buf, plan, *inputs(3, 1, *d, time=False))

    def snap_commit_bad_accept(ring, buf, d):
        y, snaps = gdn.snapshot_verify(buf.state, slots, *inputs(3, 2, *d))
        gdn.snapshot_commit(buf.state, slots, snaps, torch.tensor([0, 3, 1]))

    def snap_verify_bad_slot(ring, buf, d):
        gdn.snapshot_verify(buf.state, torch.tensor([1, 9, 0]), *inputs(3, 2, *d))

    def snap_commit_float_accept(ring, buf, d):
        y, snaps = gdn.snapshot_verify(buf.state, slots, *inputs(3, 2, *d))
        gdn.snapshot_commit(buf.state, slots, snaps, torch.tensor([0.0, 1.0, 1.0]))

    return [
        ("bad route", dec(route="both")),
        ("wrong plan kind: verify plan to decode", verify_plan_to_decode),
        ("wrong plan kind: decode plan to verify", decode_plan_to_verify),
        ("wrong plan kind: verify plan to tree", tree_with_verify_plan),
        ("wrong plan kind: tree plan to verify", ver(kind="tree")),
        ("T mismatch", verify_t_mismatch),
        ("plan batch mismatch", plan_batch_mismatch),
        ("HV not multiple of H", hv_not_multiple),
        ("K mismatch with buffer", buf_k_dim_mismatch),
        ("q/k shape mismatch", dec(k=lambda t: t[..., :-1])),
        ("q/k dtype mismatch", dec(k=lambda t: t.float())),
        ("v batch mismatch", dec(v=lambda t: t[:2])),
        ("g shape", dec(g=lambda t: t[:, :1])),
        ("beta shape", ver(b=lambda t: t[:, :1])),
        ("integer g", dec(g=lambda t: t.long())),
        ("bad scale", dec(scale=-1.0)),
        ("state dtype int32", state_dtype_int),
        ("inconsistent plan", bad_plan_hist),
        ("bad tree: not topological", ver(parent=torch.tensor([-1, 1]), kind="tree")),
        ("bad tree: parent < -1", ver(parent=torch.tensor([[-1, 0], [-1, -2], [-1, 0]]), kind="tree")),
        ("bad tree: wrong shape", ver(parent=torch.tensor([-1, 0, 1]), kind="tree")),
        ("bad tree: float parent", ver(parent=torch.tensor([-1.0, 0.0]), kind="tree")),
        ("tree route", ver(parent=torch.tensor([-1, 0]), kind="tree", route="x")),
        ("snapshot commit accepted > T", snap_commit_bad_accept),
        ("snapshot commit float accepted", snap_commit_float_accept),
        ("snapshot verify bad slot", snap_verify_bad_slot),
    ]


@pytest.mark.parametrize("name,fn", _bad_calls(), ids=[n for n, _ in _bad_calls()])
def test_bad_input_raises_before_any_write(name, fn):
    ring, buf, d = _setup(poison=True)
    before = snapshot(buf, ring)
    with pytest.raises(ValueError):
        fn(ring, buf, d)
    assert_unchanged(before, buf, ring)


def test_bad_input_messages_name_the_problem():
    ring, buf, d = _setup()
    slots = torch.tensor([1, 2, 0])
    with pytest.raises(ValueError, match="route"):
        gdn.replay_decode(buf, ring.plan_decode(slots), *inputs(3, 1, *d, time=False), route="x")
    with pytest.raises(ValueError, match="plan kind"):
        gdn.replay_verify(buf, ring.plan_verify(slots, 2, kind="tree"), *inputs(3, 2, *d))
    with pytest.raises(ValueError, match="multiple"):
        gdn.recurrent_scan(*inputs(1, 2, 3, 4, 2, 2))
    with pytest.raises(ValueError, match="topological"):
        gdn.tree_verify(buf, ring.plan_verify(slots, 2, kind="tree"), torch.tensor([-1, 1]),
                        *inputs(3, 2, *d))
    with pytest.raises(ValueError, match="chunk_size"):
        gdn.chunked_prefill(*inputs(1, 2, *d), chunk_size=0)
    with pytest.raises(ValueError, match="initial_state"):
        gdn.recurrent_scan(*inputs(1, 2, *d), initial_state=torch.zeros(1, 4, 3, 6, dtype=F64))


# ---------------------------------------------------------------------------- KV-only (paged)
class KVHarness:
    """Rows in KV-only mode (``S0 = 0``) over a shared pool of blocks, checked like Harness."""

    def __init__(self, H, HV, K, V, bs, dtype=F64, slots=(1, 2), pad_rows=0, seed=0,
                 num_blocks=40, max_blocks=12):
        from replayssm.cache.paged import GDNPagedBuffers, PagedIndex

        self.dims, self.dtype = (H, HV, K, V), dtype
        self.slots = torch.tensor(list(slots) + [NULL_SLOT] * pad_rows)
        self.real = [i for i, s in enumerate(self.slots.tolist()) if s != NULL_SLOT]
        self.pidx = PagedIndex(max(slots), bs, num_blocks, max_blocks)
        self.kv = GDNPagedBuffers.allocate(num_blocks, bs, H, HV, K, V, dtype=dtype,
                                           state_dtype=dtype, poison=True)
        self.oracle = Oracle({i: torch.zeros(HV, K, V, dtype=F64) for i in self.real})
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.seed = seed

    def step(self, T, tree=False, accepted=None):
        from replayssm.cache.paged import gather_path as kv_gather_path

        self.seed += 1
        Bt = len(self.slots)
        x = inputs(Bt, T, *self.dims, dtype=self.dtype, seed=self.seed)
        for i in self.real:
            s = int(self.slots[i])
            self.pidx.reserve(s, int(self.pidx.length[s]) + T)
        pplan = self.pidx.plan(self.slots, T)
        parents = [random_tree(T, self.gen) if tree else [-1] + list(range(T - 1))
                   for _ in range(Bt)]
        parent = torch.tensor(parents)
        y = gdn.kv_verify(self.kv, pplan, *x, parent=parent if tree else None)
        if tree:
            path, length = path_to(parent, torch.randint(0, T, (Bt,), generator=self.gen))
        else:
            path, length = parent.new_tensor(range(T)).expand(Bt, T), torch.full((Bt,), T)
        if accepted is None:
            accepted = (torch.rand(Bt, generator=self.gen) * (length + 1)).long().clamp(max=length)
        accepted[self.slots == NULL_SLOT] = 0
        for i in self.real:
            for node in range(T):
                chain = [node]
                while parents[i][chain[-1]] != -1:
                    chain.append(parents[i][chain[-1]])
                close(y[i, node], self.oracle.outputs(i, tok(x, i, chain[::-1]))[-1], self.dtype)
            self.oracle.commit(i, tok(x, i, path[i, : int(accepted[i])].tolist()))
        if tree:
            kv_gather_path(self.kv.tensors(), pplan, path, accepted)
        self.pidx.commit(pplan, accepted)
        return y


@pytest.mark.parametrize("dtype", [F64, F32])
def test_kv_verify_decode_and_verify_schedule(dtype):
    h = KVHarness(3, 6, 5, 7, bs=3, dtype=dtype, slots=(2, 1, 3), pad_rows=1, seed=140)
    for i in range(10):
        h.step(1, accepted=torch.ones(4, dtype=torch.long)) if i % 3 == 0 else h.step(3)
    assert h.pidx.length[1:].min() > 6  # spans several non-contiguous blocks


@settings(max_examples=15, **HYP)
@given(dims=dims_st, bs=st.integers(1, 5), T=st.integers(1, 4), steps=st.integers(1, 5),
       seed=st.integers(0, 10_000), tree=st.booleans())
def test_kv_verify_random_shapes_and_trees(dims, bs, T, steps, seed, tree):
    H, rep, K, V = dims
    h = KVHarness(H, H * rep, K, V, bs=bs, slots=(1, 2), pad_rows=1, seed=seed,
                  num_blocks=2 + 2 * -(-(steps * T) // bs), max_blocks=-(-(steps * T) // bs))
    for _ in range(steps):
        h.step(T, tree=tree)


@pytest.mark.parametrize("route", ["state", "output"])
def test_kv_to_state_then_replay_continues(route):
    """Short context in KV form, one compression into a checkpoint, then replay decode."""
    H, HV, K, V = 2, 4, 3, 5
    h = KVHarness(H, HV, K, V, bs=2, slots=(1, 3), seed=150)
    for _ in range(4):
        h.step(2)
    buf = GDNBuffers.allocate(3, 4, H, HV, K, V, dtype=F64, state_dtype=F64, poison=True)
    ring = RingIndex(3, 4)
    pplan = h.pidx.plan(h.slots, 1)
    state_slots = torch.tensor([2, 1])
    before = snapshot(buf)
    gdn.kv_to_state(h.kv, pplan, buf, state_slots)
    for i in h.real:
        close(buf.state[state_slots[i]], h.oracle.S[i])
    torch.testing.assert_close(buf.state[3], before[0][3], equal_nan=True)  # others untouched
    for t in range(7):
        x = inputs(2, 1, H, HV, K, V, seed=160 + t, time=False)
        plan = ring.plan_decode(state_slots)
        y = gdn.replay_decode(buf, plan, *x, route=route)
        ring.commit(plan)
        for i in h.real:
            toks = tuple(a[i][None] for a in x)
            close(y[i], h.oracle.outputs(i, toks)[0])
            h.oracle.commit(i, toks)


def test_kv_verify_equals_replay_from_zero_state():
    H, HV, K, V, T = 1, 3, 4, 4, 5
    x = inputs(2, T, H, HV, K, V, seed=170)
    h = KVHarness(H, HV, K, V, bs=4, slots=(1, 2), seed=171)
    for s in (1, 2):
        h.pidx.reserve(s, T)
    y_kv = gdn.kv_verify(h.kv, h.pidx.plan(h.slots, T), *x)
    y_ref, _ = gdn.recurrent_scan(*x)
    close(y_kv, y_ref)


def _kv_bad_calls():
    def wrong_T(h, x, pplan):
        gdn.kv_verify(h.kv, pplan, *(a[:, :1] for a in x))

    def wrong_kv_type(h, x, pplan):
        gdn.kv_verify(GDNBuffers.allocate(2, 4, 2, 4, 3, 5, dtype=F64, state_dtype=F64), pplan, *x)

    def wrong_v_dim(h, x, pplan):
        q, k, v, g, b = x
        gdn.kv_verify(h.kv, pplan, q, k, v[..., :-1], g, b)

    def bad_tree(h, x, pplan):
        gdn.kv_verify(h.kv, pplan, *x, parent=torch.tensor([-1, 2, 0]))

    def kv_to_state_bad_slot(h, x, pplan):
        buf = GDNBuffers.allocate(2, 4, 2, 4, 3, 5, dtype=F64, state_dtype=F64)
        gdn.kv_to_state(h.kv, pplan, buf, torch.tensor([1, 7]))

    def kv_to_state_bad_buf(h, x, pplan):
        buf = GDNBuffers.allocate(2, 4, 2, 4, 3, 6, dtype=F64, state_dtype=F64)
        gdn.kv_to_state(h.kv, pplan, buf, torch.tensor([1, 2]))

    return [("T mismatch", wrong_T), ("wrong kv type", wrong_kv_type), ("V mismatch", wrong_v_dim),
            ("bad tree", bad_tree), ("kv_to_state bad slot", kv_to_state_bad_slot),
            ("kv_to_state shape mismatch", kv_to_state_bad_buf)]


@pytest.mark.parametrize("name,fn", _kv_bad_calls(), ids=[n for n, _ in _kv_bad_calls()])
def test_kv_bad_input_raises_before_any_write(name, fn):
    h = KVHarness(2, 4, 3, 5, bs=2, slots=(1, 2), seed=180)
    h.step(2)
    for s in (1, 2):
        h.pidx.reserve(s, int(h.pidx.length[s]) + 3)
    pplan = h.pidx.plan(h.slots, 3)
    x = inputs(2, 3, 2, 4, 3, 5, seed=181)
    before = [t.clone() for t in h.kv.tensors() + [h.pidx.length, h.pidx.block_table]]
    with pytest.raises(ValueError):
        fn(h, x, pplan)
    for a, b in zip(before, h.kv.tensors() + [h.pidx.length, h.pidx.block_table]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_recurrent_update_in_place_on_a_pool_touches_only_its_slots():
    P, Bt, H, HV, K, V = 6, 3, 2, 4, 5, 3
    pool = rand_state(P, HV, K, V, seed=3)
    slot = torch.tensor([4, 0, 2])
    q, k, v, g, beta = inputs(Bt, 1, H, HV, K, V, seed=5, time=False)
    y_ref, S_ref = gdn.recurrent_step(pool[slot].clone(), q, k, v, g, beta)
    before = pool.clone()
    y = gdn.recurrent_update(pool, q, k, v, g, beta, slot=slot)
    close(y, y_ref)
    assert torch.equal(pool[slot], S_ref)
    others = torch.tensor([i for i in range(P) if i not in slot.tolist()])
    assert torch.equal(pool[others], before[others])
