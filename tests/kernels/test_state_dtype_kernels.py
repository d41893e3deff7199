"""16-bit checkpoint states (``CacheSpec.ssm_state_dtype``): every kernel and reference op that
reads or writes a state, with the state stored in bf16 / fp16.

The contract (``docs/MATH.md``, "State dtype"): a 16-bit state is upcast when read, all math
runs in fp32, and a state is rounded once per write (a flush, a recurrent step, a snapshot, a
prefill's final state, a KV-only -> state switch).  So each case runs the op on a float64
copy of the same inputs (the 16-bit state upcast exactly) and checks

* outputs: equal to the float64 result at fp32 accuracy (nothing was computed in 16 bits);
* every written state: within one unit in the last place of the float64 state
  (``|S - S64| <= 2^-(p-1) |S64|``, ``p`` the format's significant bits: 8 for bf16, 11 for
  fp16): one rounding, never an error accumulated over the entries of a flush.  One ulp, not
  half: the fp32 math may land a value across a rounding boundary, and the Triton interpreter
  casts fp32 -> bf16 by truncation where the GPU rounds to nearest;
* every slot not written: bit for bit unchanged; ring entries: as the float64 op writes them.

CPU: the Triton interpreter with small odd shapes (tests/kernels/conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402
from test_kernels import (gdn_inputs, m2_inputs, prep_gdn, prep_m2, random_parents,  # noqa: E402
                          shapes)

from replayssm.cache.paged import GDNPagedBuffers, Mamba2PagedBuffers, PagedIndex, PagedPlan  # noqa: E402
from replayssm.kernels import gdn as KG  # noqa: E402
from replayssm.kernels import mamba2 as K2  # noqa: E402
from replayssm.kernels import gdn_prefill as KGP  # noqa: E402
from replayssm.kernels import mamba2_prefill as K2P  # noqa: E402
from replayssm.ops.gdn import naive as NG  # noqa: E402
from replayssm.ops.mamba2 import naive as N2  # noqa: E402

DEVICE = kernel_device()
SDTS = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}   # one ulp, relative (upper bound)
F64 = torch.float64


def _small(s):
    return dict(s, Bt=4, P=6) if DEVICE == "cpu" else s


def with_state(buf, sdt):
    """``buf`` with its checkpoint states in ``sdt`` (ring tensors shared)."""
    f = {x.name: getattr(buf, x.name) for x in dataclasses.fields(buf)}
    f["state"] = f["state"].to(sdt)
    return type(buf)(**f)


def as64(buf):
    """A float64 copy of every tensor of ``buf`` (the 16-bit state upcast exactly)."""
    return type(buf)(**{x.name: getattr(buf, x.name).to(F64) for x in dataclasses.fields(buf)})


def c64(*ts):
    return [t.to(F64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ts]


def close_y(want64, got, what):
    torch.testing.assert_close(got.to(F64), want64, atol=1e-4, rtol=1e-3, msg=lambda m: f"{what}: {m}")


def one_rounding(want64, got, sdt, what):
    """``got`` (stored in ``sdt``) is ``want64`` rounded once: within one unit in the last place
    (the fp32 math may move a value across a rounding boundary) plus fp32 noise."""
    assert got.dtype == sdt, f"{what}: stored as {got.dtype}, want {sdt}"
    err = (got.to(F64) - want64).abs()
    bound = ULP[sdt] * want64.abs() + 1e-5 * (1 + want64.abs().max())
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} values off by more than one rounding, worst "
                           f"{(err - bound).max().item():.3g} over the bound")


def check_states(before, after, ref64, written, sdt, what):
    """Slots in ``written`` hold ``ref64`` rounded once; every other slot (but the null slot)
    is bit for bit ``before``."""
    written = set(int(s) for s in written) - {0}
    for s in range(1, before.shape[0]):
        if s in written:
            one_rounding(ref64[s], after[s], sdt, f"{what} slot {s}")
        else:
            assert torch.equal(after[s], before[s]), f"{what}: slot {s} was not to be written"


def check_ring(ref64, buf, names):
    for n in names:
        a, b = getattr(ref64, n)[1:], getattr(buf, n)[1:].to(F64)
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"ring {n}: NaN pattern differs"
        torch.testing.assert_close(b.nan_to_num(), a.nan_to_num(), atol=1e-6, rtol=1e-5)


# ============================================================================ recurrent form
@pytest.mark.parametrize("sdt", SDTS)
def test_mamba2_recurrent_update_rounds_each_step(sdt):
    s = _small(shapes(DEVICE))
    torch.manual_seed(11)
    x, dt, A, B, C, D = m2_inputs(s, DEVICE)
    pool = torch.randn(s["P"], s["H"], s["d"], s["n"], device=DEVICE).to(sdt)
    slot = (torch.randperm(s["P"] - 1)[: s["Bt"]] + 1).to(DEVICE)
    before = pool.clone()
    y64, S64 = N2.recurrent_step(pool[slot].to(F64), *c64(x, dt, A, B, C, D))
    ref = pool.to(F64)
    ref[slot] = S64
    y = K2.recurrent_update(pool, x, dt, A, B, C, D, slot=slot)
    close_y(y64, y, "kernel y")
    check_states(before, pool, ref, slot.tolist(), sdt, "kernel state")
    naive = before.clone()
    y2 = N2.recurrent_update(naive, x, dt, A, B, C, D, slot=slot)
    close_y(y64, y2, "naive y")
    check_states(before, naive, ref, slot.tolist(), sdt, "naive state")


@pytest.mark.parametrize("sdt", [torch.bfloat16])
def test_gdn_recurrent_and_snapshot_commit(sdt):
    s = _small(shapes(DEVICE))
    torch.manual_seed(12)
    q, k, v, g, beta = gdn_inputs(s, DEVICE)
    state = torch.randn(s["Bt"], s["HV"], s["K"], s["V"], device=DEVICE).to(sdt)
    y64, S64 = NG.recurrent_step(state.to(F64), *c64(q, k, v, g, beta))
    for name, op in (("kernel", KG.recurrent_step), ("naive", NG.recurrent_step)):
        y, S = op(state, q, k, v, g, beta)
        close_y(y64, y, f"{name} y")
        one_rounding(S64, S, sdt, f"{name} state")
    # snapshot verify (one rounded state per draft, the scan itself in fp32) and its commit
    T = 3
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    pool = torch.randn(s["P"], s["HV"], s["K"], s["V"], device=DEVICE).to(sdt)
    slot = (torch.randperm(s["P"] - 1)[: s["Bt"]] + 1).to(DEVICE)
    y64, snaps64 = NG.snapshot_verify(pool.to(F64), slot, *c64(q, k, v, g, beta))
    acc = torch.tensor([0, 1, 3, 2][: s["Bt"]] + [1] * max(0, s["Bt"] - 4), device=DEVICE)
    for name, op in (("kernel", KG.snapshot_verify), ("naive", NG.snapshot_verify)):
        y, snaps = op(pool, slot, q, k, v, g, beta)
        close_y(y64, y, f"{name} snapshot y")
        one_rounding(snaps64, snaps, sdt, f"{name} snapshots")
        after = pool.clone()
        NG.snapshot_commit(after, slot, snaps, acc)
        for b, sl in enumerate(slot.tolist()):
            want = pool[sl] if int(acc[b]) == 0 else snaps[b, int(acc[b]) - 1]
            assert torch.equal(after[sl], want), f"{name} commit row {b}"


@pytest.mark.parametrize("sdt", [torch.bfloat16])
def test_mamba2_snapshot_verify(sdt):
    s = _small(shapes(DEVICE))
    torch.manual_seed(13)
    T = 3
    x, dt, A, B, C, D = m2_inputs(s, DEVICE, T)
    pool = torch.randn(s["P"], s["H"], s["d"], s["n"], device=DEVICE).to(sdt)
    slot = (torch.randperm(s["P"] - 1)[: s["Bt"]] + 1).to(DEVICE)
    y64, snaps64 = N2.snapshot_verify(pool.to(F64), slot, *c64(x, dt, A, B, C, D))
    for name, op in (("kernel", K2.snapshot_verify), ("naive", N2.snapshot_verify)):
        y, snaps = op(pool, slot, x, dt, A, B, C, D)
        close_y(y64, y, f"{name} y")
        one_rounding(snaps64, snaps, sdt, f"{name} snapshots")


# ============================================================================ replay form
def _flush_slots(plan):
    return plan.slot[plan.flush].tolist()


@pytest.mark.parametrize("sdt", SDTS)
def test_mamba2_replay_decode_flush_rounds_once(sdt):
    """Decode steps in a row (flush rows on different steps); each step is checked against the
    float64 op started from the kernel's own buffers, so every flush is one rounding of the
    exact ``S_{h+1}``."""
    s = _small(shapes(DEVICE))
    ring, slots, buf = prep_m2(s, DEVICE, seed=14)
    buf = with_state(buf, sdt)
    naive = with_state(buf, sdt)
    naive = type(buf)(*(t.clone() for t in (naive.state, naive.x, naive.B, naive.dt)))
    flushed = 0
    for step in range(3):
        x, dt, A, B, C, D = m2_inputs(s, DEVICE)
        plan = ring.plan_decode(slots)
        real = slots != 0
        for name, b, op in (("kernel", buf, K2.replay_decode), ("naive", naive, N2.replay_decode)):
            ref = as64(b)
            y64 = N2.replay_decode(ref, plan, *c64(x, dt, A, B, C, D))
            before = b.state.clone()
            y = op(b, plan, x, dt, A, B, C, D)
            close_y(y64[real], y[real], f"{name} y step {step}")
            check_states(before, b.state, ref.state, _flush_slots(plan), sdt, f"{name} step {step}")
            check_ring(ref, b, ("x", "B", "dt"))
        flushed += int((plan.flush & real).sum())
        ring.commit(plan)
    assert flushed >= 2


@pytest.mark.parametrize("kind", ["verify", "tree"])
def test_mamba2_verify_flush_rounds_once(kind):
    sdt, T = torch.bfloat16, 3
    s = _small(shapes(DEVICE))
    if DEVICE == "cpu":
        s.update(n=40, d=20)   # two d_state chunks and two d-blocks, partly masked
    ring, slots, buf = prep_m2(s, DEVICE, seed=15, T=T, kind=kind)
    buf = with_state(buf, sdt)
    plan = ring.plan_verify(slots, T, kind)
    x, dt, A, B, C, D = m2_inputs(s, DEVICE, T)
    parent = random_parents(s["Bt"], T, seed=3, device=DEVICE) if kind == "tree" else None
    ref = as64(buf)
    args64 = c64(x, dt, A, B, C, D)
    y64 = N2.replay_verify(ref, plan, *args64) if parent is None else N2.tree_verify(ref, plan, parent, *args64)
    real = slots != 0
    forms = {"default": {}, "split": dict(split=True, pre_scores=True, num_warps=1, block_d=16)}
    for name, kw in list(forms.items()) + [("naive", None)]:
        b = type(buf)(*(t.clone() for t in (buf.state, buf.x, buf.B, buf.dt)))
        if kw is None:
            y = N2.replay_verify(b, plan, x, dt, A, B, C, D) if parent is None else \
                N2.tree_verify(b, plan, parent, x, dt, A, B, C, D)
        elif parent is None:
            y = K2.replay_verify(b, plan, x, dt, A, B, C, D, **kw)
        else:
            y = K2.tree_verify(b, plan, parent, x, dt, A, B, C, D, **kw)
        close_y(y64[real], y[real], f"{name} y")
        check_states(buf.state, b.state, ref.state, _flush_slots(plan), sdt, f"{name} S_h")
        check_ring(ref, b, ("x", "B", "dt"))


@pytest.mark.parametrize("sdt,flush_mode", [(torch.bfloat16, m) for m in KG.FLUSH_MODES] + [(torch.float16, None)])
def test_gdn_replay_decode_flush_rounds_once(sdt, flush_mode):
    """Every GDN flush form (the fold split from, fused into or apart from the decode kernel)."""
    s = _small(shapes(DEVICE))
    ring, slots, buf = prep_gdn(s, DEVICE, seed=2)
    buf = with_state(buf, sdt)
    naive = type(buf)(*(t.clone() for t in (buf.state, buf.u, buf.k, buf.g)))
    flushed = 0
    for step in range(3):
        q, k, v, g, beta = gdn_inputs(s, DEVICE)
        plan = ring.plan_decode(slots)
        real = slots != 0
        kern = lambda *a: KG.replay_decode(*a, flush_mode=flush_mode)   # noqa: E731
        for name, b, op in (("kernel", buf, kern), ("naive", naive, NG.replay_decode)):
            ref = as64(b)
            y64 = NG.replay_decode(ref, plan, *c64(q, k, v, g, beta))
            before = b.state.clone()
            y = op(b, plan, q, k, v, g, beta)
            close_y(y64[real], y[real], f"{name} y step {step}")
            check_states(before, b.state, ref.state, _flush_slots(plan), sdt, f"{name} step {step}")
            check_ring(ref, b, ("u", "k", "g"))
        flushed += int((plan.flush & real).sum())
        ring.commit(plan)
    assert flushed >= 2


@pytest.mark.parametrize("kind,impl", [("verify", "dot"), ("verify", "rows"), ("tree", "dot")])
def test_gdn_verify_flush_rounds_once(kind, impl):
    sdt, T = torch.bfloat16, 3
    s = _small(shapes(DEVICE))
    ring, slots, buf = prep_gdn(s, DEVICE, seed=17, T=T, kind=kind)
    buf = with_state(buf, sdt)
    plan = ring.plan_verify(slots, T, kind)
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    parent = random_parents(s["Bt"], T, seed=4, device=DEVICE) if kind == "tree" else None
    ref = as64(buf)
    a64 = c64(q, k, v, g, beta)
    y64 = NG.replay_verify(ref, plan, *a64) if parent is None else NG.tree_verify(ref, plan, parent, *a64)
    real = slots != 0
    for name in ("kernel", "naive"):
        b = type(buf)(*(t.clone() for t in (buf.state, buf.u, buf.k, buf.g)))
        if name == "naive":
            y = NG.replay_verify(b, plan, q, k, v, g, beta) if parent is None else \
                NG.tree_verify(b, plan, parent, q, k, v, g, beta)
        elif parent is None:
            y = KG.replay_verify(b, plan, q, k, v, g, beta, impl=impl)
        else:
            y = KG.tree_verify(b, plan, parent, q, k, v, g, beta, impl=impl)
        close_y(y64[real], y[real], f"{name} y")
        check_states(buf.state, b.state, ref.state, _flush_slots(plan), sdt, f"{name} S_h")
        check_ring(ref, b, ("u", "k", "g"))


def test_rebuild_state_is_not_rounded():
    """``rebuild_state`` (a prefill's starting ``S_h``) comes back in fp32, unrounded: the
    prefill that follows rounds the state once, when it stores its final state."""
    sdt = torch.bfloat16
    s = _small(shapes(DEVICE))
    ring, slots, buf = prep_m2(s, DEVICE, seed=18)
    buf = with_state(buf, sdt)
    plan = ring.plan_decode(slots)
    A = -(torch.rand(s["H"], device=DEVICE) + 0.3)
    want = N2.rebuild_state(as64(buf), plan, A.to(F64))
    for name, op in (("kernel", K2.rebuild_state), ("naive", N2.rebuild_state)):
        got = op(buf, plan, A)
        assert got.dtype == torch.float32, f"{name}: {got.dtype}"
        close_y(want, got, f"mamba2 {name} S_h")
    ring, slots, buf = prep_gdn(s, DEVICE, seed=19)
    buf = with_state(buf, sdt)
    plan = ring.plan_decode(slots)
    want = NG.rebuild_state(as64(buf), plan)
    for name, op in (("kernel", KG.rebuild_state), ("naive", NG.rebuild_state)):
        got = op(buf, plan)
        assert got.dtype == torch.float32, f"{name}: {got.dtype}"
        close_y(want, got, f"gdn {name} S_h")


# ============================================================================ KV-only -> state
def _pages(s, family, seed):
    """A paged pool with committed entries per slot (slot 0 pads)."""
    g = torch.Generator().manual_seed(seed)
    bs, maxb = 4, 4
    nb = maxb * s["P"] + 1
    pidx = PagedIndex(s["P"] - 1, bs, nb, maxb, torch.device(DEVICE))
    slots = torch.tensor([1, 0] + list(range(2, s["Bt"])), device=DEVICE)
    if family == "mamba2":
        kv = Mamba2PagedBuffers.allocate(nb, bs, s["H"], s["d"], s["n"], s["G"], dtype=s["dtype"], device=DEVICE)
        fills = (lambda t: t.normal_(), lambda t: t.normal_(), lambda t: t.uniform_(0.05, 0.55))
    else:
        kv = GDNPagedBuffers.allocate(nb, bs, s["HK"], s["HV"], s["K"], s["V"], dtype=s["dtype"], device=DEVICE)
        fills = (lambda t: t.normal_(), lambda t: t.copy_(torch.nn.functional.normalize(torch.randn_like(t), dim=-1)),
                 lambda t: t.uniform_(-0.6, 0.0))
    for t, f in zip(kv.tensors(), fills):
        f(t)
    for sl in slots.tolist():
        if sl:
            n = int(torch.randint(1, maxb * bs, (1,), generator=g))
            pidx.reserve(sl, n)
            pidx.length[sl] = n
    return pidx, kv, slots


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_kv_to_state_rounds_once(family):
    """The switch of ``mode="auto"``: the slots' KV-only entries folded into a zero state in
    fp32 and stored once in the state dtype."""
    sdt = torch.bfloat16
    s = _small(shapes(DEVICE))
    pidx, kv, slots = _pages(s, family, seed=20)
    pplan = pidx.plan(slots, 1, check=False)
    if family == "mamba2":
        buf = with_state(Mamba2Buffers_for(s), sdt)
        A = -(torch.rand(s["H"], device=DEVICE) + 0.3)
        ref = as64(buf)
        N2.kv_to_state(type(kv)(*(t.to(F64) for t in kv.tensors())), pplan, ref, slots, A.to(F64))
        before = buf.state.clone()
        N2.kv_to_state(kv, pplan, buf, slots, A)
        # the kernel fold the switch could use: same numbers in fp32
        close_y(ref.state[slots[slots != 0]], K2.kv_fold(kv, pplan, A)[slots != 0], "kernel kv_fold")
    else:
        buf = with_state(GDNBuffers_for(s), sdt)
        ref = as64(buf)
        NG.kv_to_state(type(kv)(*(t.to(F64) for t in kv.tensors())), pplan, ref, slots)
        before = buf.state.clone()
        NG.kv_to_state(kv, pplan, buf, slots)
        close_y(ref.state[slots[slots != 0]], KG.kv_fold(kv, pplan)[slots != 0], "kernel kv_fold")
    check_states(before, buf.state, ref.state, slots.tolist(), sdt, f"{family} kv_to_state")


def Mamba2Buffers_for(s):
    from replayssm.cache.buffers import Mamba2Buffers
    b = Mamba2Buffers.allocate(s["P"] - 1, 4, s["H"], s["d"], s["n"], s["G"], dtype=s["dtype"], device=DEVICE)
    b.state.normal_()
    return b


def GDNBuffers_for(s):
    from replayssm.cache.buffers import GDNBuffers
    b = GDNBuffers.allocate(s["P"] - 1, 4, s["HK"], s["HV"], s["K"], s["V"], dtype=s["dtype"], device=DEVICE)
    b.state.normal_()
    return b


# ============================================================================ chunked prefill
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_prefill_pool_rounds_once(family):
    """Chunked prefill in pool form on a bf16 pool: each sequence starts from its slot's state
    (zeros when fresh), scans in fp32 and stores its final state rounded once; an empty
    sequence's slot keeps its state (it is written back unchanged)."""
    sdt = torch.bfloat16
    s = _small(shapes(DEVICE))
    torch.manual_seed(21)
    lens = [5, 0, 19, 3]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEVICE)
    Nt = int(cu[-1])
    slots = torch.tensor([2, 4, 1, 5], device=DEVICE)
    fresh = torch.tensor([False, False, True, False], device=DEVICE)
    if family == "mamba2":
        H, d, n, G = s["H"], s["d"], s["n"], s["G"]
        x, B, C = (torch.randn(Nt, *sh, device=DEVICE) for sh in ((H, d), (G, n), (G, n)))
        dt = torch.rand(Nt, H, device=DEVICE) * 0.5 + 0.05
        A, D = -(torch.rand(H, device=DEVICE) + 0.3), torch.randn(H, device=DEVICE)
        args = (x, dt, A, B, C, D)
        pool = torch.randn(s["P"], H, d, n, device=DEVICE).to(sdt)
        naive, kern = N2.chunked_prefill_varlen, K2P.chunked_prefill_varlen
    else:
        HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]
        q, k = torch.randn(Nt, HK, K, device=DEVICE), torch.randn(Nt, HK, K, device=DEVICE)
        v = torch.randn(Nt, HV, V, device=DEVICE)
        g, beta = -torch.rand(Nt, HV, device=DEVICE) * 0.7, torch.rand(Nt, HV, device=DEVICE)
        args = (q, k, v, g, beta)
        pool = torch.randn(s["P"], HV, K, V, device=DEVICE).to(sdt)
        naive, kern = NG.chunked_prefill_varlen, KGP.chunked_prefill_varlen
    ref = pool.to(F64)
    y64, _ = naive(*c64(*args), cu_seqlens=cu, state_pool=ref, slots=slots, fresh=fresh, chunk_size=8)
    for name, op in (("kernel", kern), ("naive", naive)):
        p = pool.clone()
        y, fin = op(*args, cu_seqlens=cu, state_pool=p, slots=slots, fresh=fresh, chunk_size=8)
        assert fin is None
        close_y(y64, y, f"{family} {name} y")
        written = [sl for sl, n in zip(slots.tolist(), lens) if n]
        check_states(pool, p, ref, written, sdt, f"{family} {name} final state")
        for sl, n in zip(slots.tolist(), lens):
            if not n:   # an empty sequence: its state stays as it was (bits)
                assert torch.equal(p[sl], pool[sl])


def test_bad_state_dtypes_raise_before_writing():
    s = _small(shapes(DEVICE))
    ring, slots, buf = prep_m2(s, DEVICE, seed=22)
    bad = type(buf)(buf.state.to(torch.int32), buf.x, buf.B, buf.dt)
    x, dt, A, B, C, D = m2_inputs(s, DEVICE)
    with pytest.raises(ValueError, match="float32, float64, bfloat16 or float16"):
        N2.replay_decode(bad, ring.plan_decode(slots), x, dt, A, B, C, D)
    pool = torch.zeros(s["P"], s["H"], s["d"], s["n"], dtype=torch.float64, device=DEVICE)
    cu = torch.tensor([0, 3], device=DEVICE)
    with pytest.raises(ValueError, match="fp64 runs the reference op"):
        K2P.chunked_prefill_varlen(x[:3], dt[:3], A, B[:3], C[:3], D, cu_seqlens=cu, state_pool=pool,
                                   slots=torch.tensor([1], device=DEVICE))
    assert not pool.any()


# ============================================================================ prefix resume folds
def test_folds_read_a_16bit_checkpoint():
    """A prefix-cache resume folds stored entries into a bf16 checkpoint (``kv_fold`` /
    ``conv_fold`` with a bf16 ``initial_state``): the checkpoint is read exactly (upcast) and
    the fold is the float64 fold of the same values at fp32 accuracy, returned unrounded."""
    from test_fold_kernel import LENGTHS, fill_held, plan_of, to   # puts tests/ops on the path

    from test_conv_fold import _case

    g = torch.Generator().manual_seed(23)
    bs, sdt = 4, torch.bfloat16
    H, G, d, n = 4, 2, 20, 12
    NB, plan = plan_of(g, LENGTHS, bs)
    kv = Mamba2PagedBuffers.allocate(NB, bs, H, d, n, G)
    fill_held(g, kv.x, plan, lambda s: torch.randn(s, generator=g))
    fill_held(g, kv.B, plan, lambda s: torch.randn(s, generator=g))
    fill_held(g, kv.dt, plan, lambda s: torch.rand(s, generator=g) * 0.3)
    A = -torch.rand(H, generator=g) - 0.2
    S0 = torch.randn(len(LENGTHS), H, d, n, generator=g).to(sdt)
    want = N2.kv_fold(type(kv)(*(t.to(F64) for t in kv.tensors())), plan, A.to(F64), S0.to(F64))
    dev = lambda t: t.to(DEVICE)   # noqa: E731
    for name, got in (("kernel", K2.kv_fold(type(kv)(*map(dev, kv.tensors())), to(plan, DEVICE), dev(A), dev(S0))),
                      ("naive", N2.kv_fold(kv, plan, A, S0))):
        assert got.dtype == torch.float32, name
        close_y(want, got.cpu(), f"mamba2 {name} kv_fold")
    HV, K, V = 4, 12, 20
    kv = GDNPagedBuffers.allocate(NB, bs, 2, HV, K, V)
    fill_held(g, kv.u, plan, lambda s: torch.randn(s, generator=g))
    fill_held(g, kv.k, plan, lambda s: torch.nn.functional.normalize(torch.randn(s, generator=g), dim=-1))
    fill_held(g, kv.g, plan, lambda s: -torch.rand(s, generator=g) * 0.3)
    S0 = torch.randn(len(LENGTHS), HV, K, V, generator=g).to(sdt)
    want = NG.kv_fold(type(kv)(*(t.to(F64) for t in kv.tensors())), plan, S0.to(F64))
    for name, got in (("kernel", KG.kv_fold(type(kv)(*map(dev, kv.tensors())), to(plan, DEVICE), dev(S0))),
                      ("naive", NG.kv_fold(kv, plan, S0))):
        assert got.dtype == torch.float32, name
        close_y(want, got.cpu(), f"gdn {name} kv_fold")
    # the conv fold (Mamba-2's prefix store keeps conv inputs): from a bf16 checkpoint
    W, seqs, starts, counts = 4, [45, 9, 20], [4, 0, 9], [41, 9, 11]
    pre, dt, table, _ = _case(g, seqs, bs, H, d, G, n, W, dtype=torch.float32)
    w, b = torch.randn(pre.shape[1], W, generator=g) * 0.5, torch.randn(pre.shape[1], generator=g) * 0.5
    S0 = torch.randn(len(seqs), H, d, n, generator=g).to(sdt)
    cplan = PagedPlan(torch.zeros(len(seqs), dtype=torch.long), torch.tensor(counts), table, 1, bs)
    st = torch.tensor(starts)
    kw = dict(head_dim=d, ngroups=G, d_state=n)
    want = N2.conv_fold(*c64(pre, dt), cplan, st, *c64(w, b, A, S0), **kw)
    got = K2.conv_fold(dev(pre), dev(dt), to(cplan, DEVICE), dev(st), dev(w), dev(b), dev(A), dev(S0), **kw)
    assert got.dtype == torch.float32
    close_y(want, got.cpu(), "conv_fold")
