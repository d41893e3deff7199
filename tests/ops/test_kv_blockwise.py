"""KV-only reference ops computed over the paged blocks a batch holds (both families).

Every output and every pool entry written is checked in float64 against the plain
recurrence run on each row's own token stream: odd block sizes, contexts that end
mid-block, rows of different lengths in one batch (0 included), NaN-poisoned pools (the
unused blocks, the null block and the tails of partly filled blocks), block tables far
wider than the context, both routes of ``kv_verify`` (attention over the history for a
few tokens, fold + chunked scan for many) and ``kv_tree_verify`` against the replay
``tree_verify`` on a temporary ring (what the layer did before it existed).  Then the
cost: a 5000-token KV-only prompt and decode steps after it run in bounded memory and
time, independent of the block table width.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from replayssm.cache.buffers import GDNBuffers, Mamba2Buffers
from replayssm.cache.paged import GDNPagedBuffers, Mamba2PagedBuffers, PagedIndex
from replayssm.cache.ring import StepPlan
from replayssm.cache.tree import ancestor_mask
from replayssm.ops import kv_blocks
from replayssm.ops.gdn import naive as gdn
from replayssm.ops.mamba2 import naive as m2

F64 = torch.float64
TOL = 1e-10
M2 = dict(H=6, G=3, d=5, n=7)           # odd sizes, head h uses group h // 2
GD = dict(H=2, HV=4, K=5, V=3)          # GVA: value head hv uses key head hv // 2


def gen(seed):
    return torch.Generator().manual_seed(seed)


def close(a, b, what=""):
    a, b = a.to(F64), b.to(F64)
    assert torch.isfinite(a).all(), f"non-finite values {what}"
    e = float((a - b).abs().max()) / max(1.0, float(b.abs().max())) if b.numel() else 0.0
    assert e <= TOL, f"{what}: error {e:.3g}"


# ---------------------------------------------------------------------------- Mamba-2 data
def m2_params(seed):
    g = gen(seed)
    A = -torch.exp(torch.randn(M2["H"], generator=g, dtype=F64) * 0.5)
    return A, torch.randn(M2["H"], generator=g, dtype=F64)


def m2_tokens(Bt, T, g):
    H, G, d, n = M2["H"], M2["G"], M2["d"], M2["n"]
    return (torch.randn(Bt, T, H, d, generator=g, dtype=F64),
            F.softplus(torch.randn(Bt, T, H, generator=g, dtype=F64)) * 0.3,
            torch.randn(Bt, T, G, n, generator=g, dtype=F64),
            torch.randn(Bt, T, G, n, generator=g, dtype=F64))


def m2_scan(S, tok, A, D):
    """fp64 recurrence of one row from S [H,d,n] over tok (x, dt, B, C) [T, ...]."""
    x, dt, B, C = tok
    if x.shape[0] == 0:
        return x.new_zeros(x.shape), S
    y, S = m2.recurrent_scan(x[None], dt[None], A, B[None], C[None], D, initial_state=S[None])
    return y[0], S[0]


def m2_zero():
    return torch.zeros(M2["H"], M2["d"], M2["n"], dtype=F64)


# ---------------------------------------------------------------------------- GDN data
def gdn_tokens(Bt, T, g):
    H, HV, K, V = GD["H"], GD["HV"], GD["K"], GD["V"]
    r = lambda *s: torch.randn(Bt, T, *s, generator=g, dtype=F64)  # noqa: E731
    return r(H, K), r(H, K), r(HV, V), -F.softplus(r(HV)) * 0.5, torch.sigmoid(r(HV))


def gdn_step(S, q, k, v, g, b):
    """One fp64 delta-rule step of one row; also returns the correction u and l2-normed k."""
    HV, K = S.shape[0], S.shape[1]
    qn, kn = gdn.l2norm(q) * K ** -0.5, gdn.l2norm(k)
    rep = HV // kn.shape[0]
    ke, qe = kn.repeat_interleave(rep, 0), qn.repeat_interleave(rep, 0)
    S = torch.exp(g)[:, None, None] * S
    u = b[:, None] * (v - torch.einsum("hkv,hk->hv", S, ke))
    S = S + ke[:, :, None] * u[:, None, :]
    return torch.einsum("hkv,hk->hv", S, qe), S, u, kn


def gdn_scan(S, tok):
    """fp64 recurrence of one row over tok (q, k, v, g, beta) [T, ...]: (y, S, u, kn)."""
    ys, us, ks = [], [], []
    for t in range(tok[0].shape[0]):
        y, S, u, kn = gdn_step(S, *(a[t] for a in tok))
        ys.append(y)
        us.append(u)
        ks.append(kn)
    st = lambda xs, like: torch.stack(xs) if xs else like.new_zeros((0,) + tuple(like.shape[1:]))  # noqa: E731
    return st(ys, tok[2]), S, st(us, tok[2]), st(ks, tok[1])


def gdn_zero():
    return torch.zeros(GD["HV"], GD["K"], GD["V"], dtype=F64)


# ---------------------------------------------------------------------------- harness
class Paged:
    """A paged index + NaN-poisoned pools of one family, rows filled with a known history.

    ``lens[i]`` committed entries for row ``i`` (slot ``slots[i]``), written straight into
    the pool (entries as the recurrence defines them), and each row's fp64 reference state.
    """

    def __init__(self, family, lens, bs, T, seed, width=None):
        self.family, self.bs, self.g = family, bs, gen(seed)
        Bt = len(lens)
        NB = 2 + sum(-(-(n + T) // bs) for n in lens)
        width = width or -(-(max(lens) + T) // bs)
        self.pidx = PagedIndex(num_slots=Bt + 2, block_size=bs, num_blocks=NB, max_blocks_per_seq=width)
        if family == "m2":
            self.kv = Mamba2PagedBuffers.allocate(NB, bs, M2["H"], M2["d"], M2["n"], M2["G"], dtype=F64,
                                                  state_dtype=F64, poison=True)
            self.A, self.D = m2_params(seed)
        else:
            self.kv = GDNPagedBuffers.allocate(NB, bs, GD["H"], GD["HV"], GD["K"], GD["V"], dtype=F64,
                                               state_dtype=F64, poison=True)
        self.slots = (torch.randperm(Bt + 2, generator=self.g)[:Bt] + 1).tolist()  # 1 .. Bt+2, shuffled
        self.S = []
        for s, n in zip(self.slots, lens):
            self.pidx.reserve(s, n + T)
            self._fill(s, n)

    def _fill(self, s, n):
        toks = m2_tokens(1, n, self.g) if self.family == "m2" else gdn_tokens(1, n, self.g)
        toks = tuple(t[0] for t in toks)
        if self.family == "m2":
            _, S = m2_scan(m2_zero(), toks, self.A, self.D)
            entries = (toks[0], toks[2], toks[1])                      # x, B, dt
        else:
            _, S, u, kn = gdn_scan(gdn_zero(), toks)
            entries = (u, kn, toks[3])                                 # u, k, g
        self.S.append(S)
        if n:
            pos = self.pidx.plan(torch.tensor([s]), 1).positions(torch.arange(n)[None])[0]
            for pool, e in zip(self.kv.tensors(), entries):
                pool[pos] = e.to(pool.dtype)
        self.pidx.length[s] = n

    def plan(self, T, pad=False):
        slots = self.slots + ([0] if pad else [])
        return self.pidx.plan(torch.tensor(slots), T)

    def tokens(self, Bt, T):
        return m2_tokens(Bt, T, self.g) if self.family == "m2" else gdn_tokens(Bt, T, self.g)

    def entries(self, pplan, i, T):
        """The T entries row i holds at logical ``length .. length+T-1``."""
        j = pplan.length[i] + torch.arange(T)
        pos = pplan.positions(j[None].expand(pplan.batch, -1))[i]
        return [pool[pos] for pool in self.kv.tensors()]


def m2_call(p: Paged, name, pplan, tok, **kw):
    x, dt, B, C = tok
    return getattr(m2, name)(p.kv, pplan, *kw.pop("prefix", ()), x, dt, p.A, B, C, p.D, **kw)


def gdn_call(p: Paged, name, pplan, tok, **kw):
    return getattr(gdn, name)(p.kv, pplan, *kw.pop("prefix", ()), *tok, **kw)


def call(p, name, pplan, tok, **kw):
    return (m2_call if p.family == "m2" else gdn_call)(p, name, pplan, tok, **kw)


def row_reference(p: Paged, i, tok_i):
    """(y, entries) of the recurrence for row i's new tokens after its history."""
    if p.family == "m2":
        y, _ = m2_scan(p.S[i], tok_i, p.A, p.D)
        return y, (tok_i[0], tok_i[2], tok_i[1])
    y, _, u, kn = gdn_scan(p.S[i], tok_i)
    return y, (u, kn, tok_i[3])


def other_entries_unchanged(before, p: Paged, pplan, T):
    """Pool entries other than each row's T new positions are bit-identical (NaN included)."""
    changed = torch.zeros(before[0].shape[0], dtype=torch.bool)
    new = pplan.positions(pplan.length[:, None] + torch.arange(T)[None])
    changed[new.reshape(-1)] = True
    for a, b in zip(before, p.kv.tensors()):
        assert torch.equal(torch.nan_to_num(a[~changed], nan=7.5), torch.nan_to_num(b[~changed], nan=7.5))


# ---------------------------------------------------------------------------- chains
@pytest.mark.parametrize("family", ["m2", "gdn"])
@pytest.mark.parametrize("bs,lens,T", [
    (1, [0, 4, 9], 1),
    (3, [7, 0, 11, 3], 1),        # contexts ending mid-block, an empty row
    (5, [13, 2], 3),
    (4, [0, 0], 2),               # no history at all
    (3, [10, 0, 4], 70),          # > KV_CHUNK new tokens: fold + chunked scan route
])
def test_kv_verify_matches_recurrence(family, bs, lens, T):
    p = Paged(family, lens, bs, T, seed=len(lens) * 31 + bs + T)
    pplan = p.plan(T, pad=True)   # a padding row on the null slot rides along
    tok = p.tokens(len(lens) + 1, T)
    before = [t.clone() for t in p.kv.tensors()]
    y = call(p, "kv_verify", pplan, tok)
    for i in range(len(lens)):
        tok_i = tuple(t[i] for t in tok)
        yr, er = row_reference(p, i, tok_i)
        close(y[i], yr, f"row {i} outputs")
        for got, want in zip(p.entries(pplan, i, T), er):
            close(got, want, f"row {i} pool entries")
    other_entries_unchanged(before, p, pplan, T)


@pytest.mark.parametrize("family", ["m2", "gdn"])
def test_kv_to_state_matches_recurrence(family):
    p = Paged(family, [11, 0, 5, 1], bs=3, T=1, seed=5)
    buf_cls, dims = (Mamba2Buffers, (M2["H"], M2["d"], M2["n"], M2["G"])) if family == "m2" else \
        (GDNBuffers, (GD["H"], GD["HV"], GD["K"], GD["V"]))
    buf = buf_cls.allocate(8, 4, *dims, dtype=F64, state_dtype=F64, poison=True)
    pplan = p.plan(1)
    st = torch.tensor([3, 7, 1, 5])
    if family == "m2":
        m2.kv_to_state(p.kv, pplan, buf, st, p.A)
    else:
        gdn.kv_to_state(p.kv, pplan, buf, st)
    for i, s in enumerate(st.tolist()):
        close(buf.state[s], p.S[i], f"state of row {i}")


@pytest.mark.parametrize("family", ["m2", "gdn"])
def test_cost_follows_the_held_context_not_the_table_width(family, monkeypatch):
    """A table 4000 blocks wide and one just wide enough give the same numbers, and the
    ops read only the held block columns."""
    lens, bs, T = [9, 4], 3, 2
    narrow, wide = Paged(family, lens, bs, T, seed=9), Paged(family, lens, bs, T, seed=9, width=4000)
    tok = narrow.tokens(2, T)
    seen = []
    real = kv_blocks.runs

    def spy(pplan, *a, **kw):
        for pos, valid in real(pplan, *a, **kw):
            seen.append(pos.shape[1])
            yield pos, valid

    monkeypatch.setattr(kv_blocks, "runs", spy)
    y0 = call(narrow, "kv_verify", narrow.plan(T), tok)
    y1 = call(wide, "kv_verify", wide.plan(T), tok)
    assert torch.equal(y0, y1)
    assert seen and max(seen) <= -(-max(lens) // bs) * bs  # never past the held blocks


# ---------------------------------------------------------------------------- trees
def _tree_reference(p: Paged, i, tok_i, parent):
    """Per-node recurrence along each node's root path from row i's history state."""
    N = len(parent)
    states, ys, es = [], [], []
    for j in range(N):
        S = p.S[i] if parent[j] < 0 else states[parent[j]]
        one = tuple(t[j:j + 1] for t in tok_i)
        if p.family == "m2":
            y, S2 = m2_scan(S, one, p.A, p.D)
            e = (one[0], one[2], one[1])
        else:
            y, S2, u, kn = gdn_scan(S, one)
            e = (u, kn, one[3])
        states.append(S2)
        ys.append(y[0])
        es.append(e)
    return torch.stack(ys), [torch.cat([e[k] for e in es]) for k in range(3)]


def _kv_tree_via_temp_ring(p: Paged, pplan, parent, tok):
    """What ``SSMLayer._kv_tree`` computed before ``kv_tree_verify``: copy every row's pages
    into a temporary ring with a zero checkpoint and run the replay ``tree_verify``."""
    from replayssm.cache import paged

    Bt, N = parent.shape
    Lt = pplan.max_len + N
    if p.family == "m2":
        tmp = Mamba2Buffers.allocate(Bt, Lt, M2["H"], M2["d"], M2["n"], M2["G"], dtype=F64, state_dtype=F64)
    else:
        tmp = GDNBuffers.allocate(Bt, Lt, GD["H"], GD["HV"], GD["K"], GD["V"], dtype=F64, state_dtype=F64)
    tmp.state.zero_()
    for rt, pool in zip(tmp.ring_tensors(), p.kv.tensors()):
        rt[1:, : pplan.max_len] = paged.gather_kv(pool, pplan)
    rows = torch.arange(1, Bt + 1)
    zero = torch.zeros(Bt, dtype=torch.long)
    plan = StepPlan(rows, zero, pplan.length, torch.zeros(Bt, dtype=torch.bool), N, "tree", Lt)
    if p.family == "m2":
        x, dt, B, C = tok
        y = m2.tree_verify(tmp, plan, parent, x, dt, p.A, B, C, p.D)
    else:
        y = gdn.tree_verify(tmp, plan, parent, *tok)
    pos = pplan.length[:, None] + torch.arange(N)[None, :]
    return y, [rt[rows[:, None], pos] for rt in tmp.ring_tensors()]


@pytest.mark.parametrize("family", ["m2", "gdn"])
@pytest.mark.parametrize("bs,lens", [(3, [7, 0, 5]), (1, [2, 6]), (4, [0])])
def test_kv_tree_verify_matches_path_recurrence_and_temp_ring(family, bs, lens):
    g = gen(bs * 7 + len(lens))
    N = 7
    p = Paged(family, lens, bs, N, seed=bs + 13 * len(lens))
    Bt = len(lens)
    parent = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, j, (1,), generator=g))
                                               for j in range(1, N)]) for _ in range(Bt)])
    tok = p.tokens(Bt, N)
    pplan = p.plan(N)
    snapshot = [t.clone() for t in p.kv.tensors()]
    y = call(p, "kv_tree_verify", pplan, tok, prefix=(parent,))
    written = [p.entries(pplan, i, N) for i in range(Bt)]
    for i in range(Bt):
        yr, er = _tree_reference(p, i, tuple(t[i] for t in tok), parent[i].tolist())
        close(y[i], yr, f"row {i} tree outputs")
        for got, want in zip(written[i], er):
            close(got, want, f"row {i} node entries")
    other_entries_unchanged(snapshot, p, pplan, N)
    # the layer's former route (temporary ring) gives the same outputs and node entries
    for pool, s in zip(p.kv.tensors(), snapshot):
        pool.copy_(s)
    y_ring, e_ring = _kv_tree_via_temp_ring(p, pplan, parent, tok)
    close(y, y_ring, "vs temp ring")
    for i in range(Bt):
        for got, want in zip(written[i], e_ring):
            close(got, want[i], "entries vs temp ring")


def test_gdn_kv_verify_parent_is_kv_tree_verify():
    p = Paged("gdn", [5, 2], 3, 4, seed=3)
    tok = p.tokens(2, 4)
    parent = torch.tensor([-1, 0, 0, 1])
    snap = [t.clone() for t in p.kv.tensors()]
    y0 = gdn.kv_verify(p.kv, p.plan(4), *tok, parent=parent)
    for pool, s in zip(p.kv.tensors(), snap):
        pool.copy_(s)
    y1 = gdn.kv_tree_verify(p.kv, p.plan(4), parent, *tok)
    assert torch.equal(y0, y1)


@pytest.mark.parametrize("family", ["m2", "gdn"])
def test_kv_tree_verify_bad_tree_leaves_pools_untouched(family):
    p = Paged(family, [3, 4], 2, 3, seed=1)
    tok = p.tokens(2, 3)
    snap = [t.clone() for t in p.kv.tensors()]
    for parent in (torch.tensor([-1, 2, 0]), torch.tensor([-1, 0]), torch.tensor([-1.0, 0, 0])):
        with pytest.raises(ValueError, match="tree"):
            call(p, "kv_tree_verify", p.plan(3), tok, prefix=(parent,))
    for a, b in zip(snap, p.kv.tensors()):
        assert torch.equal(torch.nan_to_num(a, nan=3.0), torch.nan_to_num(b, nan=3.0))


def test_path_logs_sums_along_the_path():
    parent = torch.tensor([[-1, 0, 1, 0, 3]])
    M = ancestor_mask(parent)
    l = -torch.rand(1, 5, 2, dtype=F64)
    E, cum = kv_blocks.path_logs(M, l)
    # node 4's path: 0 -> 3 -> 4
    close(cum[0, 4], l[0, [0, 3, 4]].sum(0))
    close(E[0, 4, 0], l[0, [3, 4]].sum(0))
    close(E[0, 4, 4], torch.zeros(2, dtype=F64))
    close(kv_blocks.suffix_after(l)[0, 1], l[0, 2:].sum(0))


# ---------------------------------------------------------------------------- cost
def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
@pytest.mark.parametrize("family", ["m2", "gdn"])
def test_5000_token_kv_prompt_runs_in_bounded_memory_and_time(family):
    """Prefill 5000 tokens into the pages, then decode and verify over them.  The old dense
    form needed ``[Bt, T, W, W]`` masks (a 5000-token prompt: ~1 TB).  Peak extra memory is
    bounded by a few copies of the 5000 entries, independent of the table width."""
    ctx, bs = 5000, 16
    torch.manual_seed(0)
    if family == "m2":
        H, G, d, n = 4, 1, 16, 16
        dims = (H, d, n, G)
        NB = ctx // bs + 4
        kv = Mamba2PagedBuffers.allocate(NB, bs, *dims, dtype=torch.float32)
        A, D = -torch.rand(H), torch.rand(H)

        def toks(T):
            return (torch.randn(1, T, H, d), torch.rand(1, T, H) * 0.1, torch.randn(1, T, G, n),
                    torch.randn(1, T, G, n))

        def run(pp, t):
            return m2.kv_verify(kv, pp, t[0], t[1], A, t[2], t[3], D)
    else:
        H, HV, K, V = 2, 4, 16, 16
        NB = ctx // bs + 4
        kv = GDNPagedBuffers.allocate(NB, bs, H, HV, K, V, dtype=torch.float32)

        def toks(T):
            return (torch.randn(1, T, H, K), torch.randn(1, T, H, K), torch.randn(1, T, HV, V),
                    -torch.rand(1, T, HV) * 0.1, torch.rand(1, T, HV))

        def run(pp, t):
            return gdn.kv_verify(kv, pp, *t)
    pidx = PagedIndex(2, bs, NB, max_blocks_per_seq=50_000)   # a table far wider than needed
    pidx.reserve(1, ctx + 8)
    slot = torch.tensor([1])
    prompt, steps = toks(ctx), [toks(1) for _ in range(3)] + [toks(4)]
    entry_bytes = sum(t[0, 0].numel() for t in prompt) * 4 * ctx  # the prompt's entries, fp32
    assert _peak_rss_reset()
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    pp = pidx.plan(slot, ctx)
    y = run(pp, prompt)
    pidx.commit(pp)
    for t in steps:
        pp = pidx.plan(slot, t[0].shape[1])
        assert torch.isfinite(run(pp, t)).all()
        pidx.commit(pp)
    elapsed = time.perf_counter() - t0
    peak = (_rss_kib("VmHWM") - base) * 1024
    assert torch.isfinite(y).all()
    assert int(pidx.length[1]) == ctx + 7
    assert peak < 40 * entry_bytes + (64 << 20), f"peak extra memory {peak / 2**20:.0f} MiB"
    assert elapsed < 60, f"{elapsed:.1f} s"
