"""Every Triton kernel against its naive op.

CPU: the Triton interpreter (``TRITON_INTERPRET=1``, set in ``conftest.py`` before triton is
imported) with small odd shapes.  CUDA (when present): the compiled kernels with realistic
shapes.  Each case uses poisoned ring buffers (NaN past every row's valid entries), random
fill levels and starts per row, flush rows mixed with non-flush rows, and padding rows on
the null slot 0; outputs, states and ring buffers are compared (slot 0 holds garbage and
padding rows' outputs are not compared).
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.cache.buffers import GDNBuffers, Mamba2Buffers  # noqa: E402
from replayssm.cache.ring import RingIndex  # noqa: E402
from replayssm.kernels import _triton, dispatch  # noqa: E402

N2 = pytest.importorskip("replayssm.ops.mamba2.naive")
NG = pytest.importorskip("replayssm.ops.gdn.naive")

from replayssm.kernels import gdn as KG  # noqa: E402
from replayssm.kernels import mamba2 as K2  # noqa: E402

DEVICES = [kernel_device()]


def shapes(device):
    """Small odd shapes on CPU (interpreter), realistic ones on CUDA."""
    if device == "cpu":
        return dict(Bt=5, H=4, d=5, G=2, n=7, HK=2, HV=4, K=7, V=5, P=8, L=8, dtype=torch.float32)
    return dict(Bt=24, H=16, d=64, G=2, n=128, HK=4, HV=8, K=128, V=128, P=40, L=16, dtype=torch.bfloat16)


def tol(dtype):
    return (2e-5, 2e-4) if dtype == torch.float32 else (2e-2, 2e-2)


def close(a, b, dtype, what):
    atol, rtol = tol(dtype)
    a, b = a.float(), b.float()
    assert not torch.isnan(b).any(), f"{what}: NaN in kernel result"
    torch.testing.assert_close(b, a, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def close_buffers(ref, out, dtype, names):
    """Compare every non-null slot of each tensor (NaN where the reference has NaN)."""
    for name in names:
        a, b = getattr(ref, name)[1:].float(), getattr(out, name)[1:].float()
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"buf.{name}: NaN pattern differs"
        atol, rtol = tol(dtype if name not in ("state",) else torch.float32)
        if name == "state" and dtype != torch.float32:
            atol, rtol = 1e-3, 1e-3
        torch.testing.assert_close(torch.nan_to_num(b), torch.nan_to_num(a), atol=atol, rtol=rtol,
                                   msg=lambda m: f"buf.{name}: {m}")


def make_ring(s, device, T, seed, kind="decode"):
    """A ring with random starts and fill levels; returns (ring, slots) with padding rows."""
    g = torch.Generator().manual_seed(seed)
    P, L, Bt = s["P"], s["L"], s["Bt"]
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    ring = RingIndex(P - 1, L, dev)
    maxh = L - 1 if kind == "decode" else L - T
    ring.length[1:] = torch.randint(0, maxh + 1, (P - 1,), generator=g).to(device)
    ring.start[1:] = torch.randint(0, L, (P - 1,), generator=g).to(device)
    perm = torch.randperm(P - 1, generator=g)[: Bt - 1] + 1
    slots = torch.cat([perm[:2], torch.zeros(1, dtype=torch.long), perm[2:]]).to(device)  # row 2 pads
    # make sure at least one row flushes and one does not
    if kind == "decode":
        ring.length[slots[0]] = L - 1
        ring.length[slots[1]] = 0
    else:
        ring.length[slots[0]] = L - T  # h + 2T > L
        ring.length[slots[1]] = 0
    return ring, slots


def random_parents(Bt, T, seed, device):
    """Random topologically ordered forests: node i hangs off a node < i, or is a root."""
    g = torch.Generator().manual_seed(seed)
    parent = torch.stack([torch.randint(-1, max(i, 1) if i else 0, (Bt,), generator=g) if i else
                          torch.full((Bt,), -1) for i in range(T)], 1)
    parent[0] = torch.arange(-1, T - 1)  # one row is a chain
    return parent.to(device)


def fill_m2(s, device, seed):
    torch.manual_seed(seed)
    buf = Mamba2Buffers.allocate(s["P"] - 1, s["L"], s["H"], s["d"], s["n"], s["G"], dtype=s["dtype"],
                                 device=device, poison=True)
    buf.state.normal_()
    return buf


def valid_ring(ring, slots, buf_tensors, init):
    """Fill the committed entries of every slot with random data (the rest stays NaN)."""
    L = ring.capacity
    P = ring.start.shape[0]
    for sl in range(1, P):
        st, ln = int(ring.start[sl]), int(ring.length[sl])
        for j in range(ln):
            pos = (st + j) % L
            for t, f in zip(buf_tensors, init):
                t[sl, pos] = f(t[sl, pos])


def m2_inputs(s, device, T=None):
    Bt, H, d, G, n, dt_ = s["Bt"], s["H"], s["d"], s["G"], s["n"], s["dtype"]
    lead = (Bt,) if T is None else (Bt, T)
    x = torch.randn(*lead, H, d, device=device).to(dt_)
    dt = torch.rand(*lead, H, device=device) * 0.5 + 0.05
    A = -(torch.rand(H, device=device) + 0.3)
    B = torch.randn(*lead, G, n, device=device).to(dt_)
    C = torch.randn(*lead, G, n, device=device).to(dt_)
    D = torch.randn(H, device=device)
    return x, dt, A, B, C, D


def clone_m2(buf):
    return Mamba2Buffers(*(t.clone() for t in (buf.state, buf.x, buf.B, buf.dt)))


def prep_m2(s, device, seed, T=1, kind="decode"):
    ring, slots = make_ring(s, device, T, seed, kind)
    buf = fill_m2(s, device, seed)
    valid_ring(ring, slots, [buf.x, buf.B, buf.dt],
               [lambda t: torch.randn_like(t), lambda t: torch.randn_like(t),
                lambda t: torch.rand_like(t) * 0.5 + 0.05])
    return ring, slots, buf


M2_BUF = ("state", "x", "B", "dt")
GDN_BUF = ("state", "u", "k", "g")


# ============================================================================ Mamba-2
@pytest.mark.parametrize("device", DEVICES)
def test_mamba2_recurrent(device):
    s = shapes(device)
    torch.manual_seed(1)
    x, dt, A, B, C, D = m2_inputs(s, device)
    state = torch.randn(s["Bt"], s["H"], s["d"], s["n"], device=device)
    y0, S0 = N2.recurrent_step(state, x, dt, A, B, C, D)
    y1, S1 = K2.recurrent_step(state, x, dt, A, B, C, D)
    close(y0, y1, s["dtype"], "y")
    close(S0, S1, torch.float32, "state")
    # in-place on a pool with slot indirection; x, B, C as views of one packed tensor (read in place)
    x, B, C = (t[:, 0] for t in packed_views(x[:, None], B[:, None], C[:, None]))
    pool = torch.randn(s["P"], s["H"], s["d"], s["n"], device=device)
    slot = torch.randperm(s["P"] - 1)[: s["Bt"]].to(device) + 1
    ref = pool.clone()
    y2, S2 = N2.recurrent_step(ref[slot], x, dt, A, B, C, D)
    y3 = K2.recurrent_update(pool, x, dt, A, B, C, D, slot=slot)
    close(y2, y3, s["dtype"], "y(pool)")
    close(S2, pool[slot], torch.float32, "pool state")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre_scores", [False, True])
def test_mamba2_replay_decode_cycle(device, pre_scores):
    """Several decode steps in a row (fills, flushes of different rows on different steps,
    ring wrap), kernel vs naive each step; flush rows fold in the decode kernel.  With the
    scores kernel, ``x``, ``B``, ``C`` come as views of one packed tensor (read in place)."""
    s = shapes(device)
    if device == "cpu":  # two d-blocks and two d_state chunks, both partly masked
        s = dict(s, d=20, n=19)
    ring, slots, buf = prep_m2(s, device, seed=2)
    ref = clone_m2(buf)
    steps = 3 if device == "cpu" else s["L"] + 2
    flushed = set()
    for step in range(steps):
        x, dt, A, B, C, D = m2_inputs(s, device)
        if pre_scores:
            x, B, C = (t[:, 0] for t in packed_views(x[:, None], B[:, None], C[:, None]))
        plan = ring.plan_decode(slots)
        y_ref = N2.replay_decode(ref, plan, x, dt, A, B, C, D)
        y = K2.replay_decode(buf, plan, x, dt, A, B, C, D, pre_scores=pre_scores, block_n=16,
                             block_d=16 if device == "cpu" else 32)
        real = slots != 0
        close(y_ref[real], y[real], s["dtype"], f"y step {step}")
        close_buffers(ref, buf, s["dtype"], M2_BUF)
        flushed.add(tuple((plan.flush & real).nonzero().flatten().tolist()))
        ring.commit(plan)
    assert len(flushed - {()}) >= 2, f"want flush rows on two different steps, got {flushed}"


#: the verify kernel's forms: the defaults (small grids: scores in every program), the
#: large-grid form (scores precomputed per (row, group), the state as the left operand, 1 warp)
#: and the split forms (checkpoint readout and fold in a kernel of their own, then the
#: combine), with the scores saved or computed in the combine, and two chunk / tile sizes
M2_VERIFY_FORMS = {"default": {}, "lean": dict(pre_scores=True, state_left=True, num_warps=1, split=False),
                   "split": dict(pre_scores=True, split=True, num_warps=1, block_d=16),
                   "split_own_scores": dict(split=True, pre_scores=False,
                                            readout=dict(block_d=16, num_warps=1, block_n=32))}


def packed_views(*ts):
    """``ts`` (each ``[Bt, T, ...]``) as strided views of one ``[Bt, T, width + 3]`` tensor, as
    the layers pass the split of a projection's output (the kernels read them in place)."""
    Bt, T = ts[0].shape[:2]
    widths = [t[0, 0].numel() for t in ts]
    buf = torch.full((Bt, T, sum(widths) + 3), float("nan"), dtype=ts[0].dtype, device=ts[0].device)
    out, o = [], 1
    for t, w in zip(ts, widths):
        buf[:, :, o:o + w] = t.reshape(Bt, T, w)
        out.append(buf[:, :, o:o + w].view(t.shape))
        o += w
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["verify", "tree"])
@pytest.mark.parametrize("T", [3, 4])
@pytest.mark.parametrize("fused_fold", [True, False])
@pytest.mark.parametrize("form", sorted(M2_VERIFY_FORMS))
def test_mamba2_verify(device, kind, T, fused_fold, form):
    """The verify kernel with the flush rows' fold fused or separate, in each form: outputs
    and every buffer (state after the fold, ring entries) against the naive op.  On CPU
    ``d_state`` spans three 32-wide chunks and ``d`` three 16-wide blocks (the last ones
    partial)."""
    kw = dict(fused_fold=fused_fold, **M2_VERIFY_FORMS[form])
    s = shapes(device)
    if device == "cpu":
        s.update(n=70, d=37)
    ring, slots, buf = prep_m2(s, device, seed=3, T=T, kind=kind)
    ref = clone_m2(buf)
    plan = ring.plan_verify(slots, T, kind)
    x, dt, A, B, C, D = m2_inputs(s, device, T)
    if form != "default":   # x, B, C read in place from one packed tensor
        x, B, C = packed_views(x, B, C)
    if kind == "verify":
        y_ref = N2.replay_verify(ref, plan, x, dt, A, B, C, D)
        y = K2.replay_verify(buf, plan, x, dt, A, B, C, D, **kw)
    else:
        parent = random_parents(s["Bt"], T, seed=T, device=device)
        y_ref = N2.tree_verify(ref, plan, parent, x, dt, A, B, C, D)
        y = K2.tree_verify(buf, plan, parent, x, dt, A, B, C, D, **kw)
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    close_buffers(ref, buf, s["dtype"], M2_BUF)


@pytest.mark.parametrize("device", DEVICES)
def test_mamba2_snapshot_verify(device):
    s = shapes(device)
    torch.manual_seed(4)
    T = 3
    x, dt, A, B, C, D = m2_inputs(s, device, T)
    state = torch.randn(s["P"], s["H"], s["d"], s["n"], device=device)
    slot = (torch.randperm(s["P"] - 1)[: s["Bt"]] + 1).to(device)
    y0, S0 = N2.snapshot_verify(state, slot, x, dt, A, B, C, D)
    y1, S1 = K2.snapshot_verify(state, slot, x, dt, A, B, C, D)
    close(y0, y1, s["dtype"], "y")
    close(S0, S1, torch.float32, "snapshots")


def _paged(device, s, family, T, seed):
    paged = pytest.importorskip("replayssm.cache.paged")
    g = torch.Generator().manual_seed(seed)
    bs, maxb = 4, 4
    nb = 4 * s["Bt"] + 2
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    pidx = paged.PagedIndex(s["P"] - 1, bs, nb, maxb, dev)
    slots = torch.tensor([1, 2, 0] + list(range(3, s["Bt"])), device=device)
    lens = {}
    for sl in slots.tolist():
        if sl == 0 or sl in lens:
            continue
        n_c = int(torch.randint(0, maxb * bs - T + 1, (1,), generator=g))
        pidx.reserve(sl, n_c + T)
        lens[sl] = n_c
    if family == "mamba2":
        kv = paged.Mamba2PagedBuffers.allocate(nb, bs, s["H"], s["d"], s["n"], s["G"], dtype=s["dtype"],
                                               device=device, poison=True)
        fills = [lambda t: torch.randn_like(t), lambda t: torch.randn_like(t),
                 lambda t: torch.rand_like(t) * 0.5 + 0.05]
        tensors = [kv.x, kv.B, kv.dt]
    else:
        kv = paged.GDNPagedBuffers.allocate(nb, bs, s["HK"], s["HV"], s["K"], s["V"], dtype=s["dtype"],
                                            device=device, poison=True)
        fills = [lambda t: torch.randn_like(t), lambda t: torch.nn.functional.normalize(torch.randn_like(t), dim=-1),
                 lambda t: -torch.rand_like(t) * 0.5]
        tensors = [kv.u, kv.k, kv.g]
    # fill committed entries and set lengths
    for sl, n_c in lens.items():
        blocks = pidx.blocks_of(sl)
        for j in range(n_c):
            p = blocks[j // bs] * bs + j % bs
            for t, f in zip(tensors, fills):
                t[p] = f(t[p])
        pidx.length[sl] = n_c
    return pidx, kv, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre_scores", [False, True])
def test_mamba2_kv_verify(device, pre_scores):
    s = shapes(device)
    T = 2
    pidx, kv, slots = _paged(device, s, "mamba2", T, seed=5)
    import copy

    kv_ref = copy.deepcopy(kv)
    pplan = pidx.plan(slots, T)
    x, dt, A, B, C, D = m2_inputs(s, device, T)
    if pre_scores:
        x, B, C = packed_views(x, B, C)
    y_ref = N2.kv_verify(kv_ref, pplan, x, dt, A, B, C, D)
    y = K2.kv_verify(kv, pplan, x, dt, A, B, C, D, pre_scores=pre_scores)
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    for name in ("x", "B", "dt"):
        a, b = getattr(kv_ref, name)[s["L"]:], getattr(kv, name)[s["L"]:]  # skip the null block
        assert torch.equal(torch.isnan(a), torch.isnan(b))


# ============================================================================ GDN
def gdn_inputs(s, device, T=None):
    Bt, HK, HV, K, V, dt_ = s["Bt"], s["HK"], s["HV"], s["K"], s["V"], s["dtype"]
    lead = (Bt,) if T is None else (Bt, T)
    q = torch.randn(*lead, HK, K, device=device).to(dt_)
    k = torch.randn(*lead, HK, K, device=device).to(dt_)
    v = torch.randn(*lead, HV, V, device=device).to(dt_)
    g = -torch.rand(*lead, HV, device=device) * 0.7
    beta = torch.rand(*lead, HV, device=device)
    return q, k, v, g, beta


def prep_gdn(s, device, seed, T=1, kind="decode"):
    ring, slots = make_ring(s, device, T, seed, kind)
    torch.manual_seed(seed)
    buf = GDNBuffers.allocate(s["P"] - 1, s["L"], s["HK"], s["HV"], s["K"], s["V"], dtype=s["dtype"],
                              device=device, poison=True)
    buf.state.normal_()
    valid_ring(ring, slots, [buf.u, buf.k, buf.g],
               [lambda t: torch.randn_like(t), lambda t: torch.nn.functional.normalize(torch.randn_like(t), dim=-1),
                lambda t: -torch.rand_like(t) * 0.7])
    return ring, slots, buf


def clone_gdn(buf):
    return GDNBuffers(*(t.clone() for t in (buf.state, buf.u, buf.k, buf.g)))


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_recurrent_and_snapshot(device):
    s = shapes(device)
    torch.manual_seed(6)
    q, k, v, g, beta = gdn_inputs(s, device)
    state = torch.randn(s["Bt"], s["HV"], s["K"], s["V"], device=device)
    y0, S0 = NG.recurrent_step(state, q, k, v, g, beta)
    y1, S1 = KG.recurrent_step(state, q, k, v, g, beta)
    close(y0, y1, s["dtype"], "y")
    close(S0, S1, torch.float32, "state")
    T = 3
    q, k, v, g, beta = gdn_inputs(s, device, T)
    pool = torch.randn(s["P"], s["HV"], s["K"], s["V"], device=device)
    slot = (torch.randperm(s["P"] - 1)[: s["Bt"]] + 1).to(device)
    y0, S0 = NG.snapshot_verify(pool, slot, q, k, v, g, beta)
    y1, S1 = KG.snapshot_verify(pool, slot, q, k, v, g, beta)
    close(y0, y1, s["dtype"], "y snapshot")
    close(S0, S1, torch.float32, "snapshots")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route,pre_scores,flush_mode", [("state", False, "split")] + [
    ("output", p, m) for p in (False, True) for m in KG.FLUSH_MODES])
def test_gdn_replay_decode_cycle(device, route, pre_scores, flush_mode):
    """Decode steps in a row (flush rows on different steps), every route / flush form."""
    s = shapes(device)
    if device == "cpu":  # two V-blocks, the second partly masked
        s = dict(s, V=20)
    ring, slots, buf = prep_gdn(s, device, seed=7)
    ref = clone_gdn(buf)
    steps = 3 if device == "cpu" else s["L"] + 2
    flushed = set()
    for step in range(steps):
        q, k, v, g, beta = gdn_inputs(s, device)
        plan = ring.plan_decode(slots)
        y_ref = NG.replay_decode(ref, plan, q, k, v, g, beta)
        y = KG.replay_decode(buf, plan, q, k, v, g, beta, route=route, pre_scores=pre_scores,
                             flush_mode=flush_mode, block_v=16 if device == "cpu" else None)
        real = slots != 0
        close(y_ref[real], y[real], s["dtype"], f"y step {step}")
        close_buffers(ref, buf, s["dtype"], GDN_BUF)
        flushed.add(tuple((plan.flush & real).nonzero().flatten().tolist()))
        ring.commit(plan)
    assert len(flushed - {()}) >= 2, f"want flush rows on two different steps, got {flushed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,route,T", [
    ("verify", "state", 3), ("verify", "output", 3), ("verify", "output", 4),
    ("tree", "state", 3), ("tree", "output", 4), ("tree", "output", 3)])
@pytest.mark.parametrize("impl", ["rows", "dot", "dot-unfused"])
def test_gdn_verify(device, kind, route, T, impl):
    """Every verify kernel variant: outputs and every buffer (state after the flush rows'
    fold, ring entries) against the naive op."""
    kw = dict(impl=impl.split("-")[0], fused_fold=not impl.endswith("-unfused"))
    s = shapes(device)
    ring, slots, buf = prep_gdn(s, device, seed=8, T=T, kind=kind)
    ref = clone_gdn(buf)
    plan = ring.plan_verify(slots, T, kind)
    q, k, v, g, beta = gdn_inputs(s, device, T)
    if kind == "verify":
        y_ref = NG.replay_verify(ref, plan, q, k, v, g, beta)
        y = KG.replay_verify(buf, plan, q, k, v, g, beta, route=route, **kw)
    else:
        parent = random_parents(s["Bt"], T, seed=10 + T, device=device)
        y_ref = NG.tree_verify(ref, plan, parent, q, k, v, g, beta)
        y = KG.tree_verify(buf, plan, parent, q, k, v, g, beta, route=route, **kw)
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    close_buffers(ref, buf, s["dtype"], GDN_BUF)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["rows", "dot"])
def test_gdn_kv_verify(device, impl):
    s = shapes(device)
    T = 2
    pidx, kv, slots = _paged(device, s, "gdn", T, seed=9)
    import copy

    kv_ref = copy.deepcopy(kv)
    pplan = pidx.plan(slots, T)
    q, k, v, g, beta = gdn_inputs(s, device, T)
    y_ref = NG.kv_verify(kv_ref, pplan, q, k, v, g, beta)
    y = KG.kv_verify(kv, pplan, q, k, v, g, beta, impl=impl)
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    bs = pplan.block_size
    for name in ("u", "k", "g"):
        a, b = getattr(kv_ref, name)[bs:], getattr(kv, name)[bs:]
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        torch.testing.assert_close(torch.nan_to_num(b).float(), torch.nan_to_num(a).float(),
                                   atol=tol(s["dtype"])[0] * 10, rtol=tol(s["dtype"])[1])


# ============================================================================ dispatch
def test_dispatch_backend_choice(kernels_env):
    x = torch.zeros(2)
    assert dispatch.use_triton(x, backend="naive") is False
    if not _triton.interpreting():
        assert dispatch.use_triton(x) is False  # CPU tensors -> naive by default
    kernels_env("naive")
    assert dispatch.use_triton(x) is False
    with pytest.raises(ValueError):
        dispatch.use_triton(x, backend="bogus")


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_matches(device):
    s = shapes(device)
    ring, slots, buf = prep_m2(s, device, seed=10)
    ref = clone_m2(buf)
    plan = ring.plan_decode(slots)
    x, dt, A, B, C, D = m2_inputs(s, device)
    y0 = dispatch.KernelOps("mamba2", backend="naive").replay_decode(ref, plan, x, dt, A, B, C, D, pre_scores=True)
    y1 = dispatch.KernelOps("mamba2", backend="triton").replay_decode(buf, plan, x, dt, A, B, C, D)
    real = slots != 0
    close(y0[real], y1[real], s["dtype"], "y")


# ============================================================================ device-side compaction
if _triton.HAVE_TRITON:
    tl = triton.language

    @triton.jit
    def _flags_probe(flag_ptr, out_ptr, Bt, BT: tl.constexpr):
        n = _triton.count_flags(flag_ptr, Bt, BT)
        tl.store(out_ptr, n)
        for i in range(0, n):
            tl.store(out_ptr + 1 + i, _triton.nth_flag(flag_ptr, Bt, i, BT))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Bt,BT", [(37, 16), (5, 16), (64, 16)])
def test_flush_row_compaction(device, Bt, BT):
    """count_flags / nth_flag (the persistent flush kernels' row list) over several chunks."""
    g = torch.Generator().manual_seed(Bt)
    flags = (torch.rand(Bt, generator=g) < 0.3).to(device)
    flags[-1] = True
    out = torch.full((Bt + 1,), -1, dtype=torch.int32, device=device)
    _flags_probe[(1,)](flags, out, Bt, BT=BT)
    rows = flags.nonzero().flatten().to(torch.int32)
    assert int(out[0]) == rows.numel()
    assert torch.equal(out[1:1 + rows.numel()], rows)


def test_verify_forms():
    """The verify kernels' default forms: tf32 output products for 16-bit activations only
    (fp32 keeps fp32-level products), the GDN dot kernel for 16-bit activations from T = 5 by
    the rule and from T = 3 by the measured table (calls that give their pairs), and explicit
    arguments win."""
    from replayssm.kernels._triton import verify_precision

    assert verify_precision(torch.bfloat16) == verify_precision(torch.float16) == "tf32"
    assert verify_precision(torch.float32) == "tf32x3"
    assert verify_precision(torch.bfloat16, "ieee") == "ieee"
    assert KG.verify_form(torch.bfloat16, 5, None, None) == ("dot", "tf32")
    assert KG.verify_form(torch.bfloat16, 4, None, None) == ("rows", "tf32")
    assert KG.verify_form(torch.bfloat16, 4, None, None, pairs=1) == ("dot", "tf32")
    assert KG.verify_form(torch.bfloat16, 3, None, None, pairs=8192) == ("dot", "tf32")
    assert KG.verify_form(torch.bfloat16, 2, None, None, pairs=8192) == ("rows", "tf32")
    assert KG.verify_form(torch.float32, 4, None, None, pairs=8192) == ("rows", "tf32x3")
    assert KG.verify_form(torch.float32, 5, None, None) == ("rows", "tf32x3")
    assert KG.verify_form(torch.bfloat16, 5, "rows", "tf32x3") == ("rows", "tf32x3")
    for bad in (dict(precision="fp64"), dict(fold_precision="tf16")):
        with pytest.raises(ValueError, match="precision"):
            verify_precision(torch.bfloat16, **bad)


class _Launches:
    """Stands in for a Triton kernel in the module and counts its launches."""

    def __init__(self, kernel, seen, name):
        self.kernel, self.seen, self.name = kernel, seen, name

    def __getitem__(self, grid):
        self.seen.append(self.name)
        return self.kernel[grid]


def test_verify_table_routes_default_calls(monkeypatch):
    """A ``VERIFY_TABLE`` row routes default calls (16-bit activations) from its bounds on
    (T and row × value-head pairs); other calls keep the rule (dot from T = 5); explicit
    arguments win.  The routed call gives the explicit call's numbers bit for bit; a removed
    or unknown impl raises before any write."""
    monkeypatch.setattr(KG, "VERIFY_TABLE", [(5, 20, "rows")])
    assert KG.verify_form(torch.bfloat16, 5, None, None, pairs=24) == ("rows", "tf32")
    assert KG.verify_form(torch.bfloat16, 5, None, None, pairs=12) == ("dot", "tf32")
    assert KG.verify_form(torch.bfloat16, 4, None, None, pairs=24) == ("rows", "tf32")
    assert KG.verify_form(torch.float32, 5, None, None, pairs=24) == ("rows", "tf32x3")
    assert KG.verify_form(torch.bfloat16, 5, "dot", None, pairs=24) == ("dot", "tf32")
    assert KG.VERIFY_IMPLS == ("rows", "dot")

    device = DEVICES[0]
    s, T = dict(shapes(device), dtype=torch.bfloat16, L=12), 5  # L >= 2T
    pairs = s["Bt"] * s["HV"]
    seen = []
    for name in ("_gdn_verify_rows_kernel", "_gdn_verify_dot_kernel"):
        monkeypatch.setattr(KG, name, _Launches(getattr(KG, name), seen, name.split("_")[-2]))
    ring, slots, buf = prep_gdn(s, device, seed=60, T=T, kind="verify")
    plan = ring.plan_verify(slots, T, "verify")
    q, k, v, g, beta = gdn_inputs(s, device, T)
    for bound, form in ((pairs, "rows"), (pairs + 1, "dot")):
        monkeypatch.setattr(KG, "VERIFY_TABLE", [(T, bound, "rows")])
        want, got = clone_gdn(buf), clone_gdn(buf)
        seen.clear()
        y0 = KG.replay_verify(want, plan, q, k, v, g, beta, impl=form)
        y1 = KG.replay_verify(got, plan, q, k, v, g, beta)
        assert seen == [form, form], (bound, seen)
        assert torch.equal(y0, y1), form
        for name in GDN_BUF:
            assert torch.equal(getattr(want, name).nan_to_num(), getattr(got, name).nan_to_num()), (form, name)
    before = clone_gdn(buf)
    for bad in ("split", "nope"):
        with pytest.raises(ValueError, match="verify impl"):
            KG.replay_verify(buf, plan, q, k, v, g, beta, impl=bad)
    for name in GDN_BUF:
        assert torch.equal(getattr(before, name).nan_to_num(), getattr(buf, name).nan_to_num()), name
