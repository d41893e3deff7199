"""Mamba-2 reference ops (``replayssm.ops.mamba2.naive``): every form against the recurrence.

Ground truth is ``recurrent_scan`` in float64 run on each row's *accepted* token stream
alone.  Schedules of decode / verify / tree / KV steps run through several flush cycles
and ring wrap-arounds, with rows at different fill levels and ring offsets, random
accepted counts and paths, padding rows on the null slot, and NaN-poisoned caches so any
read of an unwritten entry shows up.  Bad input must raise ``ValueError`` and leave every
cache tensor untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayssm.cache.buffers import Mamba2Buffers
from replayssm.cache.paged import Mamba2PagedBuffers, PagedIndex
from replayssm.cache.ring import NULL_SLOT, RingIndex, StepPlan
from replayssm.cache.tree import ancestor_mask, gather_path, path_to
from replayssm.ops.mamba2 import naive as m2

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
# error bound: max|y - ref| <= tol * max(1, max|ref|)
TOL = {F64: 1e-10, F32: 2e-5, BF16: 1e-2}  # bf16: y is rounded to bf16 on return
HYP = dict(deadline=None, suppress_health_check=list(HealthCheck))

# odd sizes, ngroups > 1 (head h uses group h // 2)
H, G, D_, N_ = 6, 3, 5, 7


# ============================================================================ helpers
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def params(H=H, dtype=F64, seed=0, decay=1.0):
    """A [H] < 0 (``-exp(A_log)``) and D [H]."""
    g = gen(seed + 101)
    A = -torch.exp(torch.randn(H, generator=g, dtype=F64) * 0.5) * decay
    D = torch.randn(H, generator=g, dtype=F64)
    return A.to(dtype), D.to(dtype)


def tokens(lead, H=H, G=G, d=D_, n=N_, act=F64, sdt=F64, g=None, dt_scale=1.0):
    """x [*lead,H,d], dt = softplus(randn) [*lead,H], B/C [*lead,G,n] (act dtype; dt in sdt)."""
    lead = tuple(lead)
    x = torch.randn(*lead, H, d, generator=g, dtype=F64).to(act)
    dt = (F.softplus(torch.randn(*lead, H, generator=g, dtype=F64)) * dt_scale).to(sdt)
    B = torch.randn(*lead, G, n, generator=g, dtype=F64).to(act)
    C = torch.randn(*lead, G, n, generator=g, dtype=F64).to(act)
    return x, dt, B, C


def err(y, ref) -> float:
    y, ref = y.to(F64), ref.to(F64)
    return float((y - ref).abs().max()) / max(1.0, float(ref.abs().max())) if ref.numel() else 0.0


def assert_close(y, ref, dtype=F64, what=""):
    assert torch.isfinite(y.to(F64)).all(), f"non-finite output {what}"
    e = err(y, ref)
    assert e <= TOL[dtype], f"{what}: error {e:.3g} > {TOL[dtype]:.1g}"


def ref_scan(S, x, dt, A, B, C, D):
    """fp64 recurrence on one row from state S [H,d,n]; tokens [T,...] -> (y [T,H,d], S)."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape).to(F64), S
    y, S2 = m2.recurrent_scan(x[None].to(F64), dt[None].to(F64), A.to(F64), B[None].to(F64),
                              C[None].to(F64), D.to(F64), initial_state=S[None].to(F64))
    return y[0], S2[0]


def cache_tensors(*objs):
    out = []
    for o in objs:
        if isinstance(o, Mamba2Buffers):
            out += [o.state, o.x, o.B, o.dt]
        elif isinstance(o, RingIndex):
            out += [o.start, o.length]
        elif isinstance(o, Mamba2PagedBuffers):
            out += [o.x, o.B, o.dt]
        elif isinstance(o, PagedIndex):
            out += [o.length, o.block_table]
        elif isinstance(o, torch.Tensor):
            out.append(o)
    return out


def assert_unchanged(before, after):
    for i, (a, b) in enumerate(zip(before, after)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(torch.nan_to_num(a, nan=1234.5), torch.nan_to_num(b, nan=1234.5)) if \
            a.is_floating_point() else torch.equal(a, b), f"cache tensor {i} was modified"


def random_tree(N, g) -> torch.Tensor:
    p = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, N)]
    return torch.tensor(p)


# ============================================================================ schedule harness
class Sim:
    """Replay caches for a batch of rows plus a float64 reference state per row.

    Rows live in distinct, non-contiguous slots; each starts at a random ring offset
    with a random checkpoint state (as after a prefill).  Padding rows (slot 0, NaN or
    random inputs) are mixed into every batch.
    """

    def __init__(self, L, rows=3, act=F64, sdt=F64, seed=0, pad=1, route="output",
                 H=H, G=G, d=D_, n=N_, decay=1.0):
        self.g = gen(seed)
        self.L, self.act, self.sdt, self.route = L, act, sdt, route
        self.H, self.G, self.d, self.n = H, G, d, n
        self.A, self.D = params(H, sdt, seed, decay)
        num_slots = 2 * rows + 1
        self.ring = RingIndex(num_slots, L)
        self.buf = Mamba2Buffers.allocate(num_slots, L, H, d, n, G, dtype=act, state_dtype=sdt,
                                          poison=True)
        self.slots = (torch.randperm(num_slots, generator=self.g)[:rows] + 1).tolist()
        self.pad = pad
        self.ref = {}
        for s in self.slots:
            S0 = torch.randn(H, d, n, generator=self.g, dtype=F64).to(sdt)
            self.buf.state[s] = S0
            self.ref[s] = S0.to(F64)
            self.ring.start[s] = int(torch.randint(0, L, (1,), generator=self.g))
        self.flushes = 0
        self.entries = {s: 0 for s in self.slots}  # entries ever appended (wrap-around count)
        self.y_tol = act if act == BF16 else sdt  # outputs come back in the activation dtype

    # -------------------------------------------------------------- batch composition
    def batch(self, all_rows=False):
        rows = [s for s in self.slots if all_rows or bool(torch.rand(1, generator=self.g) < 0.8)]
        rows = rows or [self.slots[0]]
        order = rows + [NULL_SLOT] * self.pad
        perm = torch.randperm(len(order), generator=self.g).tolist()
        return [order[i] for i in perm]

    def toks(self, Bt, T):
        x, dt, B, C = tokens((Bt, T), self.H, self.G, self.d, self.n, self.act, self.sdt, self.g)
        return x, dt, B, C

    def row_ref(self, s, x, dt, B, C):
        return ref_scan(self.ref[s], x, dt, self.A, B, C, self.D)

    def check(self, y, ref, what):
        assert_close(y, ref, self.y_tol if y.dtype == self.act else self.sdt, what)

    # -------------------------------------------------------------- steps
    def decode(self, route=None, all_rows=False):
        rows = self.batch(all_rows)
        slots = torch.tensor(rows)
        x, dt, B, C = self.toks(len(rows), 1)
        plan = self.ring.plan_decode(slots)
        y = m2.replay_decode(self.buf, plan, x[:, 0], dt[:, 0], self.A, B[:, 0], C[:, 0], self.D,
                             route=route or self.route)
        self.ring.commit(plan)
        for i, s in enumerate(rows):
            if s == NULL_SLOT:
                continue
            yr, S = self.row_ref(s, x[i], dt[i], B[i], C[i])
            self.check(y[i], yr[0], f"decode slot {s}")
            self.ref[s] = S
            self.entries[s] += 1
            if bool(plan.flush[i]):
                self.flushes += 1
                self.check(self.buf.state[s], S, f"decode flush state slot {s}")
        return y

    def verify(self, T, accept=None, route=None):
        rows = self.batch()
        slots = torch.tensor(rows)
        x, dt, B, C = self.toks(len(rows), T)
        plan = self.ring.plan_verify(slots, T)
        y = m2.replay_verify(self.buf, plan, x, dt, self.A, B, C, self.D, route=route or self.route)
        acc = torch.randint(0, T + 1, (len(rows),), generator=self.g) if accept is None else \
            torch.full((len(rows),), accept)
        for i, s in enumerate(rows):
            if s == NULL_SLOT:
                continue
            yr, _ = self.row_ref(s, x[i], dt[i], B[i], C[i])  # every draft, from S_h
            self.check(y[i], yr, f"verify slot {s}")
            if bool(plan.flush[i]):
                self.flushes += 1
                self.check(self.buf.state[s], self.ref[s], f"verify flush state slot {s}")
            a = int(acc[i])
            _, self.ref[s] = self.row_ref(s, x[i, :a], dt[i, :a], B[i, :a], C[i, :a])
            self.entries[s] += a
        self.ring.commit(plan, acc)
        return y

    def tree(self, N, route=None):
        rows = self.batch()
        slots = torch.tensor(rows)
        x, dt, B, C = self.toks(len(rows), N)
        parent = torch.stack([random_tree(N, self.g) for _ in rows])
        plan = self.ring.plan_verify(slots, N, kind="tree")
        y = m2.tree_verify(self.buf, plan, parent, x, dt, self.A, B, C, self.D,
                           route=route or self.route)
        M = ancestor_mask(parent)
        leaf = torch.randint(0, N, (len(rows),), generator=self.g)
        path, plen = path_to(parent, leaf)
        acc = (torch.rand(len(rows), generator=self.g) * (plen + 1)).long().clamp(max=plen)
        for i, s in enumerate(rows):
            if s == NULL_SLOT:
                continue
            for node in range(N):
                anc = M[i, node].nonzero()[:, 0]  # root-to-node chain, topological order
                yr, _ = self.row_ref(s, x[i, anc], dt[i, anc], B[i, anc], C[i, anc])
                self.check(y[i, node], yr[-1], f"tree slot {s} node {node}")
            if bool(plan.flush[i]):
                self.flushes += 1
                self.check(self.buf.state[s], self.ref[s], f"tree flush state slot {s}")
            p = path[i, : int(acc[i])]
            _, self.ref[s] = self.row_ref(s, x[i, p], dt[i, p], B[i, p], C[i, p])
            self.entries[s] += int(acc[i])
        gather_path(self.buf.ring_tensors(), plan, path, acc)
        self.ring.commit(plan, acc)
        return y

    def final_check(self):
        slots = torch.tensor(self.slots)
        S = m2.rebuild_state(self.buf, self.ring.plan_decode(slots), self.A)
        for i, s in enumerate(self.slots):
            self.check(S[i], self.ref[s], f"final state slot {s}")


# ============================================================================ recurrence & prefill
@pytest.mark.parametrize("Hh,Gg", [(6, 3), (4, 2), (6, 1), (3, 3)])
def test_recurrent_step_matches_explicit_per_head_loop(Hh, Gg):
    g = gen(1)
    Bt = 2
    A, D = params(Hh, seed=1)
    S = torch.randn(Bt, Hh, D_, N_, generator=g, dtype=F64)
    x, dt, B, C = tokens((Bt,), Hh, Gg, g=g)
    y, S1 = m2.recurrent_step(S, x, dt, A, B, C, D)
    for b in range(Bt):
        for h in range(Hh):
            grp = h // (Hh // Gg)  # contiguous blocks of heads share a group
            Sr = torch.exp(A[h] * dt[b, h]) * S[b, h] + dt[b, h] * torch.outer(x[b, h], B[b, grp])
            assert torch.allclose(S1[b, h], Sr, rtol=1e-13, atol=1e-13)
            assert torch.allclose(y[b, h], Sr @ C[b, grp] + D[h] * x[b, h], rtol=1e-13, atol=1e-13)
    assert not torch.equal(S1, S)  # returns a new tensor; input untouched


def test_recurrent_scan_is_loop_of_steps_and_dtypes():
    g = gen(2)
    A, D = params(seed=2)
    x, dt, B, C = tokens((2, 5), g=g)
    y, S = m2.recurrent_scan(x, dt, A, B, C, D)
    St = torch.zeros(2, H, D_, N_, dtype=F64)
    for t in range(5):
        yt, St = m2.recurrent_step(St, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        assert torch.equal(yt, y[:, t])
    assert torch.equal(St, S)
    # bf16 activations, fp32 state: math in fp32, y back in bf16
    yb, Sb = m2.recurrent_scan(x.to(BF16), dt.float(), A.float(), B.to(BF16), C.to(BF16), D.float(),
                               initial_state=torch.zeros(2, H, D_, N_))
    assert yb.dtype == BF16 and Sb.dtype == F32


@settings(max_examples=25, **HYP)
@given(
    Bt=st.integers(1, 3), T=st.integers(0, 19), hg=st.sampled_from([(1, 1), (4, 2), (6, 3), (6, 1), (3, 3)]),
    d=st.integers(1, 6), n=st.integers(1, 8), chunk=st.integers(1, 8), use_D=st.booleans(),
    init=st.booleans(), dtype=st.sampled_from([F64, F32]), seed=st.integers(0, 2**16),
)
def test_chunked_prefill_matches_scan(Bt, T, hg, d, n, chunk, use_D, init, dtype, seed):
    Hh, Gg = hg
    g = gen(seed)
    A, D = params(Hh, dtype, seed)
    D = D if use_D else None
    x, dt, B, C = tokens((Bt, T), Hh, Gg, d, n, dtype, dtype, g)
    S0 = torch.randn(Bt, Hh, d, n, generator=g, dtype=F64).to(dtype) if init else None
    y, S = m2.chunked_prefill(x, dt, A, B, C, D, initial_state=S0, chunk_size=chunk)
    S0r = S0.to(F64) if init else None
    yr, Sr = m2.recurrent_scan(x.to(F64), dt.to(F64), A.to(F64), B.to(F64), C.to(F64),
                               None if D is None else D.to(F64), initial_state=S0r)
    assert y.shape == x.shape and y.dtype == dtype and S.dtype == dtype
    assert_close(y, yr, dtype, "y")
    assert_close(S, Sr, dtype, "final state")


def test_chunked_prefill_dt_zero_padding_is_identity_and_extreme_decay_is_finite():
    g = gen(3)
    A, D = params(seed=3)
    x, dt, B, C = tokens((2, 9), g=g)
    S0 = torch.randn(2, H, D_, N_, generator=g, dtype=F64)
    _, S_ref = m2.chunked_prefill(x, dt, A, B, C, D, S0, chunk_size=4)
    # interleave dt = 0 padding tokens with garbage x/B/C: the state is unchanged by them
    xp, dtp, Bp, Cp = tokens((2, 14), g=g)
    keep = torch.tensor([0, 1, 3, 4, 5, 8, 9, 10, 12])
    xp[:, keep], dtp[:, keep], Bp[:, keep], Cp[:, keep] = x, dt, B, C
    pad = torch.ones(14, dtype=torch.bool)
    pad[keep] = False
    dtp[:, pad] = 0.0
    yp, Sp = m2.chunked_prefill(xp, dtp, A, Bp, Cp, D, S0, chunk_size=4)
    assert_close(Sp, S_ref, F64, "padded final state")
    # extreme decays (A·Δ ~ -400 per token): products would underflow/overflow, segment sums do not
    Ax = A * 200.0
    dtx = dt * 2.0
    for dtype in (F64, F32):
        yx, Sx = m2.chunked_prefill(x.to(dtype), dtx.to(dtype), Ax.to(dtype), B.to(dtype), C.to(dtype),
                                    D.to(dtype), S0.to(dtype), chunk_size=5)
        yr, Sr = m2.recurrent_scan(x, dtx, Ax, B, C, D, S0)
        assert torch.isfinite(yx).all() and torch.isfinite(Sx).all()
        assert_close(yx, yr, dtype, "extreme y")
        assert_close(Sx, Sr, dtype, "extreme state")


def test_segsum():
    l = -torch.rand(2, 6, dtype=F64)
    s = m2.segsum(l)
    for i in range(6):
        for j in range(6):
            if j > i:
                assert s[0, i, j] == float("-inf")
            else:
                assert torch.allclose(s[:, i, j], l[:, j + 1: i + 1].sum(-1))


# ============================================================================ single steps from random rings
def random_ring(Bt, L, seed, T=1, act=F64, sdt=F64, Hh=H, Gg=G, d=D_, n=N_, hmax=None):
    """Buffers with each row at a random ring offset and fill level h in [0, hmax].

    Returns (buf, ring, slots, A, D, S_h per row (fp64 reference), g)."""
    g = gen(seed)
    A, D = params(Hh, sdt, seed)
    ring = RingIndex(Bt + 2, L)
    buf = Mamba2Buffers.allocate(Bt + 2, L, Hh, d, n, Gg, dtype=act, state_dtype=sdt, poison=True)
    slots = torch.randperm(Bt + 2, generator=g)[:Bt] + 1
    hmax = L - 1 if hmax is None else hmax
    Sh = []
    for s in slots.tolist():
        h = int(torch.randint(0, hmax + 1, (1,), generator=g))
        start = int(torch.randint(0, L, (1,), generator=g))
        S0 = torch.randn(Hh, d, n, generator=g, dtype=F64).to(sdt)
        x, dt, B, C = tokens((h,), Hh, Gg, d, n, act, sdt, g)
        pos = (start + torch.arange(h)) % L
        buf.x[s, pos], buf.B[s, pos], buf.dt[s, pos] = x, B, dt
        buf.state[s] = S0
        ring.start[s], ring.length[s] = start, h
        Sh.append(ref_scan(S0.to(F64), x, dt, A, B, C, D)[1])
    return buf, ring, slots, A, D, Sh, g


@settings(max_examples=20, **HYP)
@given(Bt=st.integers(1, 4), L=st.integers(1, 9), route=st.sampled_from(["output", "state"]),
       dtype=st.sampled_from([F64, F32]), use_D=st.booleans(), seed=st.integers(0, 2**16))
def test_replay_decode_one_step(Bt, L, route, dtype, use_D, seed):
    buf, ring, slots, A, D, Sh, g = random_ring(Bt, L, seed, act=dtype, sdt=dtype)
    D = D if use_D else None
    Dr = torch.zeros(H, dtype=F64) if D is None else D
    x, dt, B, C = tokens((Bt,), act=dtype, sdt=dtype, g=g)
    plan = ring.plan_decode(slots)
    state_before = buf.state.clone()
    y = m2.replay_decode(buf, plan, x, dt, A, B, C, D, route=route)
    for i, s in enumerate(slots.tolist()):
        yr, S1 = ref_scan(Sh[i], x[i, None], dt[i, None], A, B[i, None], C[i, None], Dr)
        assert_close(y[i], yr[0], dtype, "y")
        if bool(plan.flush[i]):
            assert_close(buf.state[s], S1, dtype, "flushed S_{h+1}")
        else:
            assert torch.equal(buf.state[s], state_before[s])
        pos = (int(plan.start[i]) + int(plan.hist[i])) % L  # the new entry landed at h
        assert torch.equal(buf.x[s, pos], x[i]) and torch.equal(buf.dt[s, pos], dt[i])
    ring.commit(plan)
    S = m2.rebuild_state(buf, ring.plan_decode(slots), A)
    for i in range(Bt):
        yr, S1 = ref_scan(Sh[i], x[i, None], dt[i, None], A, B[i, None], C[i, None], Dr)
        assert_close(S[i], S1, dtype, "state after commit")


@settings(max_examples=20, **HYP)
@given(Bt=st.integers(1, 3), LT=st.sampled_from([(7, 3), (9, 2), (4, 2), (2, 1), (8, 4)]),
       route=st.sampled_from(["output", "state"]), dtype=st.sampled_from([F64, F32]),
       seed=st.integers(0, 2**16))
def test_replay_verify_one_step(Bt, LT, route, dtype, seed):
    L, T = LT
    # fill levels up to L-1: rows past L-T (possible after decode steps) flush and wrap
    buf, ring, slots, A, D, Sh, g = random_ring(Bt, L, seed, act=dtype, sdt=dtype)
    x, dt, B, C = tokens((Bt, T), act=dtype, sdt=dtype, g=g)
    plan = ring.plan_verify(slots, T)
    y = m2.replay_verify(buf, plan, x, dt, A, B, C, D, route=route)
    for i, s in enumerate(slots.tolist()):
        yr, _ = ref_scan(Sh[i], x[i], dt[i], A, B[i], C[i], D)
        assert_close(y[i], yr, dtype, "drafts")
        if bool(plan.flush[i]):
            assert_close(buf.state[s], Sh[i], dtype, "flushed S_h")
    acc = torch.randint(0, T + 1, (Bt,), generator=g)
    ring.commit(plan, acc)
    S = m2.rebuild_state(buf, ring.plan_decode(slots), A)
    for i in range(Bt):
        a = int(acc[i])
        _, Sa = ref_scan(Sh[i], x[i, :a], dt[i, :a], A, B[i, :a], C[i, :a], D)
        assert_close(S[i], Sa, dtype, "state after commit")


@settings(max_examples=15, **HYP)
@given(Bt=st.integers(1, 3), N=st.integers(1, 5), route=st.sampled_from(["output", "state"]),
       shared=st.booleans(), seed=st.integers(0, 2**16))
def test_tree_verify_one_step(Bt, N, route, shared, seed):
    L = 2 * N + 1
    buf, ring, slots, A, D, Sh, g = random_ring(Bt, L, seed)
    x, dt, B, C = tokens((Bt, N), g=g)
    parent = random_tree(N, g) if shared else torch.stack([random_tree(N, g) for _ in range(Bt)])
    plan = ring.plan_verify(slots, N, kind="tree")
    y = m2.tree_verify(buf, plan, parent, x, dt, A, B, C, D, route=route)
    par = parent.expand(Bt, N) if shared else parent
    M = ancestor_mask(par)
    for i in range(Bt):
        for node in range(N):
            anc = M[i, node].nonzero()[:, 0]
            yr, _ = ref_scan(Sh[i], x[i, anc], dt[i, anc], A, B[i, anc], C[i, anc], D)
            assert_close(y[i, node], yr[-1], F64, f"node {node}")
    # a chain-shaped tree is exactly replay_verify
    if N > 1:
        buf2, ring2, slots2, *_ = random_ring(Bt, L, seed)
        chain = torch.arange(N) - 1
        y_tree = m2.tree_verify(buf2, ring2.plan_verify(slots2, N, kind="tree"), chain, x, dt, A, B, C, D)
        buf3, ring3, slots3, *_ = random_ring(Bt, L, seed)
        y_chain = m2.replay_verify(buf3, ring3.plan_verify(slots3, N), x, dt, A, B, C, D)
        assert err(y_tree, y_chain) < 1e-12


@settings(max_examples=10, **HYP)
@given(Bt=st.integers(1, 3), T=st.integers(1, 4), dtype=st.sampled_from([F64, F32]), seed=st.integers(0, 2**16))
def test_snapshot_verify_and_commit(Bt, T, dtype, seed):
    g = gen(seed)
    A, D = params(H, dtype, seed)
    P = Bt + 3
    state = torch.randn(P, H, D_, N_, generator=g, dtype=F64).to(dtype)
    slot = torch.randperm(P - 1, generator=g)[:Bt] + 1
    x, dt, B, C = tokens((Bt, T), act=dtype, sdt=dtype, g=g)
    before = state.clone()
    y, snaps = m2.snapshot_verify(state, slot, x, dt, A, B, C, D)
    assert torch.equal(state, before)  # read only
    assert snaps.shape == (Bt, T, H, D_, N_) and snaps.dtype == dtype
    acc = torch.randint(0, T + 1, (Bt,), generator=g)
    m2.snapshot_commit(state, slot, snaps, acc)
    for i, s in enumerate(slot.tolist()):
        yr, _ = ref_scan(before[s].to(F64), x[i], dt[i], A, B[i], C[i], D)
        assert_close(y[i], yr, dtype, "snapshot y")
        for t in range(T):
            _, St = ref_scan(before[s].to(F64), x[i, : t + 1], dt[i, : t + 1], A, B[i, : t + 1],
                             C[i, : t + 1], D)
            assert_close(snaps[i, t], St, dtype, "snapshot state")
        a = int(acc[i])
        expect = before[s] if a == 0 else snaps[i, a - 1]
        assert torch.equal(state[s], expect)
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[slot] = False
    assert torch.equal(state[untouched], before[untouched])


def test_replay_verify_equals_snapshot_baseline():
    buf, ring, slots, A, D, Sh, g = random_ring(3, 9, seed=5, hmax=0)  # h = 0: state is S0
    x, dt, B, C = tokens((3, 4), g=g)
    y_snap, _ = m2.snapshot_verify(buf.state.clone(), slots, x, dt, A, B, C, D)
    y_rep = m2.replay_verify(buf, ring.plan_verify(slots, 4), x, dt, A, B, C, D)
    assert err(y_rep, y_snap) < 1e-12


# ============================================================================ schedules
@pytest.mark.parametrize("route", ["output", "state"])
def test_decode_schedule_many_flush_cycles(route):
    sim = Sim(L=5, rows=3, seed=11, pad=1, route=route)
    # rows start at different fill levels: warm each up alone
    for k, s in enumerate(sim.slots):
        for _ in range(k + 1):
            saved, sim.slots = sim.slots, [s]
            sim.pad = 0
            sim.decode(all_rows=True)
            sim.slots, sim.pad = saved, 1
    for _ in range(24):
        sim.decode()
    sim.final_check()
    assert sim.flushes >= 8
    assert min(sim.entries.values()) > 2 * sim.L  # several ring wrap-arounds


@pytest.mark.parametrize("L,T", [(7, 3), (9, 2)])
def test_verify_schedule_random_accepts(L, T):
    sim = Sim(L=L, rows=3, seed=20 + L, pad=1)
    for _ in range(18):
        sim.verify(T)
    sim.final_check()
    assert sim.flushes >= 4
    assert min(sim.entries.values()) > L


def test_verify_schedule_all_accept_and_all_reject():
    sim = Sim(L=8, rows=2, seed=31, pad=1, route="state")
    for k in range(10):
        sim.verify(4, accept=[4, 0][k % 2])
    sim.verify(4, accept=4)
    sim.final_check()
    assert sim.flushes >= 2


def test_tree_schedule_random_shapes_and_paths():
    sim = Sim(L=8, rows=3, seed=41, pad=1)
    for k in range(16):
        sim.tree(N=[4, 3, 2][k % 3])
    sim.final_check()
    assert sim.flushes >= 3


@pytest.mark.parametrize("seed", [51, 52])
def test_mixed_decode_verify_tree_schedule(seed):
    sim = Sim(L=8, rows=3, seed=seed, pad=2, route="output" if seed % 2 else "state")
    g = gen(seed)
    for _ in range(30):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        if kind == 0:
            sim.decode(route=["output", "state"][int(torch.randint(0, 2, (1,), generator=g))])
        elif kind == 1:
            sim.verify(int(torch.randint(1, 4, (1,), generator=g)))
        else:
            sim.tree(int(torch.randint(1, 5, (1,), generator=g)))
    sim.final_check()
    assert sim.flushes >= 5


def test_mixed_schedule_float32():
    sim = Sim(L=7, rows=3, act=F32, sdt=F32, seed=61, pad=1)
    for k in range(24):
        [sim.decode, lambda: sim.verify(3), lambda: sim.tree(3)][k % 3]()
    sim.final_check()
    assert sim.flushes >= 4


def test_schedule_bf16_activations_fp32_state():
    sim = Sim(L=6, rows=2, act=BF16, sdt=F32, seed=71, pad=1)
    for k in range(15):
        sim.decode() if k % 2 else sim.verify(2)
    sim.final_check()
    assert sim.buf.x.dtype == BF16 and sim.buf.state.dtype == F32


def test_schedule_strong_decay_stays_finite():
    sim = Sim(L=6, rows=2, seed=81, decay=60.0)
    for k in range(12):
        sim.decode() if k % 2 else sim.tree(3)
    sim.final_check()


def test_check_false_gives_identical_results():
    a, b = Sim(L=6, rows=2, seed=141, pad=1), None
    for k in range(3):
        a.decode() if k % 2 else a.verify(2)
    b = copy.deepcopy(a)
    slots = torch.tensor(a.slots + [NULL_SLOT])
    x, dt, B, C = a.toks(3, 2)
    par = torch.tensor([-1, -1])
    for s, chk in ((a, None), (b, False)):
        s.y = [
            m2.replay_decode(s.buf, pl := s.ring.plan_decode(slots), x[:, 0], dt[:, 0], s.A, B[:, 0],
                             C[:, 0], s.D, check=chk),
            s.ring.commit(pl),
            m2.tree_verify(s.buf, s.ring.plan_verify(slots, 2, kind="tree"), par, x, dt, s.A, B, C, s.D,
                           check=chk),
        ]
    assert torch.equal(a.y[0][:2], b.y[0][:2]) and torch.equal(a.y[2][:2], b.y[2][:2])  # row 2 pads
    for u, v in zip(cache_tensors(a.buf, a.ring), cache_tensors(b.buf, b.ring)):
        assert torch.equal(torch.nan_to_num(u), torch.nan_to_num(v))


# ============================================================================ batch independence
def _clone_sim(sim):
    return copy.deepcopy(sim)


@pytest.mark.parametrize("kind", ["decode", "verify", "tree"])
def test_batch_rows_equal_rows_run_alone(kind):
    sim = Sim(L=7, rows=4, seed=91, pad=0)
    for k in range(9):  # diverge fill levels / offsets
        [sim.decode, lambda: sim.verify(2), lambda: sim.tree(3)][k % 3]()
    T = {"decode": 1, "verify": 3, "tree": 3}[kind]
    slots = torch.tensor(sim.slots)
    Bt = len(sim.slots)
    x, dt, B, C = sim.toks(Bt, T)
    parent = torch.stack([random_tree(T, sim.g) for _ in range(Bt)])

    def run(s: Sim, rows):
        sl = slots[rows]
        if kind == "decode":
            return m2.replay_decode(s.buf, s.ring.plan_decode(sl), x[rows, 0], dt[rows, 0], s.A,
                                    B[rows, 0], C[rows, 0], s.D)
        if kind == "verify":
            return m2.replay_verify(s.buf, s.ring.plan_verify(sl, T), x[rows], dt[rows], s.A,
                                    B[rows], C[rows], s.D)
        return m2.tree_verify(s.buf, s.ring.plan_verify(sl, T, kind="tree"), parent[rows], x[rows],
                              dt[rows], s.A, B[rows], C[rows], s.D)

    alone = _clone_sim(sim)
    y_batch = run(sim, list(range(Bt)))
    for i in range(Bt):
        y_i = run(alone, [i])
        assert err(y_i[0], y_batch[i]) < 1e-13
    for a, b in zip(cache_tensors(sim.buf), cache_tensors(alone.buf)):
        assert torch.allclose(a[slots], b[slots], rtol=1e-13, atol=1e-13, equal_nan=True)


def test_padding_rows_on_null_slot_do_not_disturb_real_rows():
    base = Sim(L=6, rows=3, seed=101, pad=0)
    for k in range(6):
        base.decode() if k % 2 else base.verify(2)
    slots = torch.tensor(base.slots)
    x, dt, B, C = base.toks(3, 3)
    parent = torch.stack([random_tree(3, base.g) for _ in range(3)])
    with_pad = _clone_sim(base)
    # padded batch: NaN / huge inputs on null-slot rows, interleaved with the real rows
    order = [NULL_SLOT, slots[0], NULL_SLOT, slots[1], slots[2], NULL_SLOT]
    real = [1, 3, 4]
    xp, dtp, Bp, Cp = tokens((6, 3), g=gen(5))
    xp[0] = float("nan")
    Cp[2] = 1e30
    xp[real], dtp[real], Bp[real], Cp[real] = x, dt, B, C
    pp = torch.stack([random_tree(3, gen(6))] * 6)
    pp[real] = parent
    ps = torch.tensor([int(s) for s in order])
    for op in ("decode", "verify", "tree"):
        if op == "decode":
            y0 = m2.replay_decode(base.buf, pl := base.ring.plan_decode(slots), x[:, 0], dt[:, 0], base.A,
                                  B[:, 0], C[:, 0], base.D)
            base.ring.commit(pl)
            y1 = m2.replay_decode(with_pad.buf, pl := with_pad.ring.plan_decode(ps), xp[:, 0], dtp[:, 0],
                                  base.A, Bp[:, 0], Cp[:, 0], base.D)[real]
            with_pad.ring.commit(pl)
        elif op == "verify":
            y0 = m2.replay_verify(base.buf, pl := base.ring.plan_verify(slots, 3), x, dt, base.A, B, C, base.D)
            base.ring.commit(pl, torch.tensor([1, 3, 0]))
            y1 = m2.replay_verify(with_pad.buf, pl := with_pad.ring.plan_verify(ps, 3), xp, dtp, base.A,
                                  Bp, Cp, base.D)[real]
            with_pad.ring.commit(pl, torch.tensor([2, 1, 0, 3, 0, 1]))
        else:
            y0 = m2.tree_verify(base.buf, base.ring.plan_verify(slots, 3, kind="tree"), parent, x, dt,
                                base.A, B, C, base.D)
            y1 = m2.tree_verify(with_pad.buf, with_pad.ring.plan_verify(ps, 3, kind="tree"), pp, xp, dtp,
                                base.A, Bp, Cp, base.D)[real]
        assert torch.isfinite(y0).all()
        assert torch.equal(y0, y1), op
    for a, b in zip(cache_tensors(base.buf, base.ring), cache_tensors(with_pad.buf, with_pad.ring)):
        assert torch.equal(torch.nan_to_num(a[slots]), torch.nan_to_num(b[slots]))


# ============================================================================ KV-only (paged)
def test_kv_schedule_then_compress_and_continue_in_replay():
    g = gen(111)
    A, D = params(seed=111)
    bs, NB = 3, 24
    pidx = PagedIndex(num_slots=5, block_size=bs, num_blocks=NB, max_blocks_per_seq=7)
    kv = Mamba2PagedBuffers.allocate(NB, bs, H, D_, N_, G, dtype=F64, state_dtype=F64, poison=True)
    slots = [4, 2, 5]
    ref = {s: torch.zeros(H, D_, N_, dtype=F64) for s in slots}
    for step in range(10):
        T = [1, 3, 2][step % 3]
        for s in slots:
            pidx.reserve(s, int(pidx.length[s]) + T)
        order = slots + [NULL_SLOT]
        pplan = pidx.plan(torch.tensor(order), T)
        x, dt, B, C = tokens((4, T), g=g)
        y = m2.kv_verify(kv, pplan, x, dt, A, B, C, D)
        acc = torch.randint(0, T + 1, (4,), generator=g) if T > 1 else None
        for i, s in enumerate(slots):
            yr, _ = ref_scan(ref[s], x[i], dt[i], A, B[i], C[i], D)
            assert_close(y[i], yr, F64, f"kv step {step}")
            a = T if acc is None else int(acc[i])
            _, ref[s] = ref_scan(ref[s], x[i, :a], dt[i, :a], A, B[i, :a], C[i, :a], D)
        pidx.commit(pplan, acc)
    assert min(int(pidx.length[s]) for s in slots) > bs  # spans several blocks
    # compress into replay checkpoints (one flush), then keep decoding in replay form
    L = 5
    ring = RingIndex(5, L)
    buf = Mamba2Buffers.allocate(5, L, H, D_, N_, G, dtype=F64, state_dtype=F64, poison=True)
    st_slots = torch.tensor(slots)
    m2.kv_to_state(kv, pidx.plan(st_slots, 1), buf, st_slots, A)
    for s in slots:
        assert_close(buf.state[s], ref[s], F64, "kv_to_state")
    ring.reset(st_slots)
    for s in slots:
        pidx.release(s)
    for _ in range(7):
        x, dt, B, C = tokens((3,), g=g)
        plan = ring.plan_decode(st_slots)
        y = m2.replay_decode(buf, plan, x, dt, A, B, C, D)
        ring.commit(plan)
        for i, s in enumerate(slots):
            yr, ref[s] = ref_scan(ref[s], x[i, None], dt[i, None], A, B[i, None], C[i, None], D)
            assert_close(y[i], yr[0], F64, "replay after kv")


@settings(max_examples=10, **HYP)
@given(lens=st.lists(st.integers(0, 11), min_size=1, max_size=3), T=st.integers(1, 3),
       bs=st.integers(1, 4), dtype=st.sampled_from([F64, F32]), seed=st.integers(0, 2**16))
def test_kv_verify_random_lengths(lens, T, bs, dtype, seed):
    g = gen(seed)
    A, D = params(H, dtype, seed)
    Bt = len(lens)
    NB = 1 + sum(-(-(n + T) // bs) for n in lens)
    pidx = PagedIndex(num_slots=Bt + 1, block_size=bs, num_blocks=NB, max_blocks_per_seq=-(-(11 + T) // bs))
    kv = Mamba2PagedBuffers.allocate(NB, bs, H, D_, N_, G, dtype=dtype, state_dtype=dtype, poison=True)
    slots = (torch.randperm(Bt + 1, generator=g)[:Bt] + 1)
    S = []
    for i, s in enumerate(slots.tolist()):  # fill each row's history with a KV step of its own
        pidx.reserve(s, lens[i] + T)
        xh, dth, Bh, Ch = tokens((1, lens[i]), act=dtype, sdt=dtype, g=g)
        if lens[i]:
            m2.kv_verify(kv, pidx.plan(torch.tensor([s]), lens[i]), xh, dth, A, Bh, Ch, D)
            pidx.commit(pidx.plan(torch.tensor([s]), lens[i]))
        S.append(ref_scan(torch.zeros(H, D_, N_, dtype=F64), xh[0], dth[0], A, Bh[0], Ch[0], D)[1])
    x, dt, B, C = tokens((Bt, T), act=dtype, sdt=dtype, g=g)
    y = m2.kv_verify(kv, pidx.plan(slots, T), x, dt, A, B, C, D)
    for i in range(Bt):
        yr, _ = ref_scan(S[i], x[i], dt[i], A, B[i], C[i], D)
        assert_close(y[i], yr, dtype, "kv drafts")


# ============================================================================ validation
def _setup_bad():
    sim = Sim(L=6, rows=2, seed=121, pad=0)
    for k in range(4):
        sim.decode() if k % 2 else sim.verify(2)
    return sim


def _bad_calls(sim: Sim):
    """(name, callable) pairs that must raise ValueError without touching any cache."""
    buf, ring, A, D = sim.buf, sim.ring, sim.A, sim.D
    slots = torch.tensor(sim.slots)
    x, dt, B, C = sim.toks(2, 2)
    x1, dt1, B1, C1 = x[:, 0], dt[:, 0], B[:, 0], C[:, 0]
    pd, pv, pt = ring.plan_decode(slots), ring.plan_verify(slots, 2), ring.plan_verify(slots, 2, kind="tree")
    par = torch.tensor([-1, 0])
    bad_hist = StepPlan(pv.slot, pv.start, torch.tensor([5, 1]), torch.tensor([False, False]), 2, "verify", 6)
    dup = ring.plan_decode(torch.tensor([slots[0], slots[0]]))
    buf_int = Mamba2Buffers(buf.state.int(), buf.x, buf.B, buf.dt)   # bf16 / fp16 states are valid
    return [
        ("decode: verify plan", lambda: m2.replay_decode(buf, pv, x1, dt1, A, B1, C1, D)),
        ("decode: bad route", lambda: m2.replay_decode(buf, pd, x1, dt1, A, B1, C1, D, route="both")),
        ("decode: x shape", lambda: m2.replay_decode(buf, pd, x1[:, :, :-1], dt1, A, B1, C1, D)),
        ("decode: B/C mismatch", lambda: m2.replay_decode(buf, pd, x1, dt1, A, B1, C1[:, :2], D)),
        ("decode: groups do not divide heads", lambda: m2.replay_decode(
            buf, pd, x1, dt1, A, torch.randn(2, 4, N_, dtype=F64), torch.randn(2, 4, N_, dtype=F64), D)),
        ("decode: dtype mismatch with ring", lambda: m2.replay_decode(
            buf, pd, x1.float(), dt1, A, B1.float(), C1.float(), D)),
        ("decode: x/B dtype mismatch", lambda: m2.replay_decode(buf, pd, x1, dt1, A, B1.float(), C1, D)),
        ("decode: A positive", lambda: m2.replay_decode(buf, pd, x1, dt1, -A, B1, C1, D)),
        ("decode: dt negative", lambda: m2.replay_decode(buf, pd, x1, -dt1, A, B1, C1, D)),
        ("decode: D shape", lambda: m2.replay_decode(buf, pd, x1, dt1, A, B1, C1, D[:3])),
        ("decode: A shape", lambda: m2.replay_decode(buf, pd, x1, dt1, A[None], B1, C1, D)),
        ("decode: batch mismatch", lambda: m2.replay_decode(buf, pd, x1[:1], dt1[:1], A, B1[:1], C1[:1], D)),
        ("decode: state int32", lambda: m2.replay_decode(buf_int, pd, x1, dt1, A, B1, C1, D)),
        ("decode: duplicate slot", lambda: m2.replay_decode(buf, dup, x1, dt1, A, B1, C1, D)),
        ("decode: int x", lambda: m2.replay_decode(buf, pd, x1.long(), dt1, A, B1, C1, D)),
        ("verify: tree plan", lambda: m2.replay_verify(buf, pt, x, dt, A, B, C, D)),
        ("verify: T mismatch", lambda: m2.replay_verify(buf, pv, x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D)),
        ("verify: plan does not fit", lambda: m2.replay_verify(buf, bad_hist, x, dt, A, B, C, D)),
        ("verify: bad route", lambda: m2.replay_verify(buf, pv, x, dt, A, B, C, D, route="x")),
        ("tree: not topological", lambda: m2.tree_verify(buf, pt, torch.tensor([-1, 1]), x, dt, A, B, C, D)),
        ("tree: parent shape", lambda: m2.tree_verify(buf, pt, torch.tensor([-1, 0, 1]), x, dt, A, B, C, D)),
        ("tree: float parent", lambda: m2.tree_verify(buf, pt, par.double(), x, dt, A, B, C, D)),
        ("tree: verify plan", lambda: m2.tree_verify(buf, pv, par, x, dt, A, B, C, D)),
        ("snapshot_commit: accepted > T", lambda: m2.snapshot_commit(
            buf.state, slots, torch.zeros(2, 2, H, D_, N_, dtype=F64), torch.tensor([3, 0]))),
        ("snapshot_commit: accepted shape", lambda: m2.snapshot_commit(
            buf.state, slots, torch.zeros(2, 2, H, D_, N_, dtype=F64), torch.tensor([1]))),
        ("snapshot_commit: snapshot dims", lambda: m2.snapshot_commit(
            buf.state, slots, torch.zeros(2, 2, H, D_, 4, dtype=F64), torch.tensor([1, 1]))),
        ("snapshot_verify: slot range", lambda: m2.snapshot_verify(
            buf.state, torch.tensor([1, 99]), x, dt, A, B, C, D)),
        ("kv_verify: not paged buffers", lambda: m2.kv_verify(
            buf, PagedIndex(2, 2, 4, 2).plan(torch.tensor([0, 0]), 2), x, dt, A, B, C, D)),
    ]


def test_bad_inputs_raise_and_leave_caches_untouched():
    sim = _setup_bad()
    before = [t.clone() for t in cache_tensors(sim.buf, sim.ring)]
    calls = _bad_calls(sim)
    assert len(calls) >= 25
    for name, call in calls:
        with pytest.raises(ValueError):
            call()
        assert_unchanged(before, cache_tensors(sim.buf, sim.ring))
    # and the caches still work afterwards
    sim.decode()
    sim.verify(2)
    sim.final_check()


def test_bad_error_messages_name_the_problem():
    sim = _setup_bad()
    slots = torch.tensor(sim.slots)
    x, dt, B, C = sim.toks(2, 2)
    pv = sim.ring.plan_verify(slots, 2)
    with pytest.raises(ValueError, match="plan kind"):
        m2.replay_decode(sim.buf, pv, x[:, 0], dt[:, 0], sim.A, B[:, 0], C[:, 0])
    with pytest.raises(ValueError, match="route"):
        m2.replay_decode(sim.buf, sim.ring.plan_decode(slots), x[:, 0], dt[:, 0], sim.A, B[:, 0], C[:, 0],
                         route="nope")
    with pytest.raises(ValueError, match="topological"):
        m2.tree_verify(sim.buf, sim.ring.plan_verify(slots, 2, kind="tree"), torch.tensor([-1, 1]),
                       x, dt, sim.A, B, C)
    with pytest.raises(ValueError, match="dtype"):
        m2.replay_verify(sim.buf, pv, x.float(), dt, sim.A, B.float(), C.float())
    with pytest.raises(ValueError, match="multiple of ngroups"):
        m2.recurrent_scan(x, dt, sim.A, torch.randn(2, 2, 4, N_, dtype=F64), torch.randn(2, 2, 4, N_, dtype=F64))
    with pytest.raises(ValueError, match="chunk_size"):
        m2.chunked_prefill(x, dt, sim.A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="state"):
        m2.recurrent_step(torch.zeros(2, H, D_, 3, dtype=F64), x[:, 0], dt[:, 0], sim.A, B[:, 0], C[:, 0])


def test_bad_kv_inputs_leave_pools_untouched():
    A, D = params(seed=131)
    pidx = PagedIndex(num_slots=3, block_size=2, num_blocks=8, max_blocks_per_seq=3)
    kv = Mamba2PagedBuffers.allocate(8, 2, H, D_, N_, G, dtype=F64, state_dtype=F64, poison=True)
    buf = Mamba2Buffers.allocate(3, 4, H, D_, N_, G, dtype=F64, state_dtype=F64, poison=True)
    slots = torch.tensor([1, 3])
    for s in (1, 3):
        pidx.reserve(s, 4)
    x, dt, B, C = tokens((2, 2), g=gen(7))
    m2.kv_verify(kv, pp := pidx.plan(slots, 2), x, dt, A, B, C, D)
    pidx.commit(pp)
    pplan = pidx.plan(slots, 2)
    before = [t.clone() for t in cache_tensors(kv, pidx, buf)]
    bad = [
        lambda: m2.kv_verify(kv, pplan, x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D),  # T mismatch
        lambda: m2.kv_verify(kv, pplan, x.float(), dt, A, B.float(), C.float(), D),  # dtype
        lambda: m2.kv_verify(kv, pplan, x, dt, A, B[..., :3], C[..., :3], D),  # n mismatch
        lambda: m2.kv_verify(kv, pplan, x, -dt, A, B, C, D),
        lambda: m2.kv_to_state(kv, pplan, buf, slots, A[:2]),
        lambda: m2.kv_to_state(kv, pplan, buf, torch.tensor([1, 9]), A),
        lambda: m2.kv_to_state(kv, pplan, buf, torch.tensor([1, 1]), A),
        lambda: m2.kv_to_state(kv, pplan, "buf", slots, A),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
        assert_unchanged(before, cache_tensors(kv, pidx, buf))


def test_recurrent_update_in_place_on_a_pool_touches_only_its_slots():
    g = gen(77)
    P, Bt = 7, 3
    A, D = params()
    pool = torch.randn(P, H, D_, N_, generator=g, dtype=F64)
    slot = torch.tensor([5, 1, 3])
    x, dt, B, C = tokens((Bt,), g=g)
    y_ref, S_ref = m2.recurrent_step(pool[slot].clone(), x, dt, A, B, C, D)
    before = pool.clone()
    y = m2.recurrent_update(pool, x, dt, A, B, C, D, slot=slot)
    assert_close(y, y_ref)
    assert torch.equal(pool[slot], S_ref)
    others = torch.tensor([i for i in range(P) if i not in slot.tolist()])
    assert torch.equal(pool[others], before[others])
