"""The paged fold kernel (``kernels/fold.py``: ``kv_fold`` of both SSM families, what a
prefix-cache resume and checkpoint run per layer) against the reference ``kv_fold`` in fp64.

Pools are NaN everywhere but the entries a row holds (the null block, the tails of last
blocks and unused blocks are poison: a masked load that reads them shows up as NaN); block
tables are random permutations, wider than needed; lengths cover 0, 1, bs-1, bs, a chunk
±1 and several chunks; heads share groups (Mamba-2 ``G < H``, GDN ``H < HV``); state rows
not a power of two and larger than one program's block; with and without an initial state.
The output allocation is poisoned too (every element must be written), and the pools are
unchanged afterwards.  (fp16 stands for the 16-bit case: the interpreter's bf16 ``tl.dot``
is unreliable.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "ops"))   # the reference test's case builder
from test_conv_fold import _case  # noqa: E402

from replayssm.cache.paged import GDNPagedBuffers, Mamba2PagedBuffers, PagedPlan  # noqa: E402
from replayssm.kernels import dispatch  # noqa: E402
from replayssm.kernels import gdn as KG  # noqa: E402
from replayssm.kernels import mamba2 as KM  # noqa: E402
from replayssm.ops.gdn import naive as NG  # noqa: E402
from replayssm.ops.mamba2 import naive as N2  # noqa: E402

DEVICE = kernel_device()
LENGTHS = [0, 1, 3, 4, 31, 33, 70, 5]                   # bs = 4; kernel chunk 32 in most cases


def plan_of(g, lengths, bs, width_extra=3):
    """A plan whose rows own random distinct blocks (block 0 = null, never owned)."""
    need = [-(-n // bs) for n in lengths]
    width = max(need + [1]) + width_extra
    NB = sum(need) + 5
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    k = 0
    for i, m in enumerate(need):
        table[i, :m] = torch.tensor(perm[k:k + m], dtype=torch.long)
        k += m
    plan = PagedPlan(torch.arange(1, len(lengths) + 1), torch.tensor(lengths), table, 1, bs)
    return NB, plan


def fill_held(g, pool: torch.Tensor, plan, make):
    """NaN everywhere, then ``make(shape)`` values at the rows the plan's rows hold."""
    pool.fill_(float("nan"))
    bs = plan.block_size
    for i, n in enumerate(plan.length.tolist()):
        for j in range(n):
            r = int(plan.block_table[i, j // bs]) * bs + j % bs
            pool[r] = make(pool.shape[1:])


def to(plan, device):
    return PagedPlan(plan.slot.to(device), plan.length.to(device), plan.block_table.to(device), plan.num_new,
                     plan.block_size)


def close(got, want, dtype):
    tol = dict(atol=3e-5, rtol=3e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("dims", [(4, 2, 24, 20), (2, 1, 80, 16)])       # H, G, d (> one block), n
def test_mamba2_fold_kernel(dtype, with_init, dims, nan_empty):
    g = torch.Generator().manual_seed(hash((str(dtype), with_init, dims)) % 2**31)
    H, G, d, n = dims
    bs = 4
    NB, plan = plan_of(g, LENGTHS, bs)
    kv = Mamba2PagedBuffers.allocate(NB, bs, H, d, n, G, dtype=dtype)
    fill_held(g, kv.x, plan, lambda s: torch.randn(s, generator=g))
    fill_held(g, kv.B, plan, lambda s: torch.randn(s, generator=g))
    fill_held(g, kv.dt, plan, lambda s: torch.rand(s, generator=g) * 0.3)
    A = -torch.rand(H, generator=g) - 0.2
    S0 = torch.randn(len(LENGTHS), H, d, n, generator=g) if with_init else None
    kv64 = Mamba2PagedBuffers(**{k: getattr(kv, k).double() for k in ("x", "B", "dt")})
    want = N2.kv_fold(kv64, plan, A.double(), None if S0 is None else S0.double())
    kd = Mamba2PagedBuffers(**{k: getattr(kv, k).to(DEVICE) for k in ("x", "B", "dt")})
    before = [t.clone() for t in kd.tensors()]
    got = KM.kv_fold(kd, to(plan, DEVICE), A.to(DEVICE), None if S0 is None else S0.to(DEVICE), block_d=16)
    assert got.dtype == torch.float32 and got.shape == want.shape
    close(got, want, dtype)
    for a, b in zip(before, kd.tensors()):
        assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))
    if not with_init:                                     # an empty row's state is exactly S0 = 0
        assert torch.equal(got[0].cpu(), torch.zeros_like(got[0].cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("dims", [(2, 4, 20, 24), (1, 1, 72, 16)])       # H, HV, K (> one block), V
def test_gdn_fold_kernel(dtype, with_init, dims, nan_empty):
    g = torch.Generator().manual_seed(hash((str(dtype), with_init, dims, "gdn")) % 2**31)
    H, HV, K, V = dims
    bs = 4
    NB, plan = plan_of(g, LENGTHS, bs)
    kv = GDNPagedBuffers.allocate(NB, bs, H, HV, K, V, dtype=dtype)
    fill_held(g, kv.u, plan, lambda s: torch.randn(s, generator=g))
    fill_held(g, kv.k, plan, lambda s: torch.nn.functional.normalize(torch.randn(s, generator=g), dim=-1))
    fill_held(g, kv.g, plan, lambda s: -torch.rand(s, generator=g) * 0.3)
    S0 = torch.randn(len(LENGTHS), HV, K, V, generator=g) if with_init else None
    kv64 = GDNPagedBuffers(**{k: getattr(kv, k).double() for k in ("u", "k", "g")})
    want = NG.kv_fold(kv64, plan, None if S0 is None else S0.double())
    kd = GDNPagedBuffers(**{k: getattr(kv, k).to(DEVICE) for k in ("u", "k", "g")})
    before = [t.clone() for t in kd.tensors()]
    got = KG.kv_fold(kd, to(plan, DEVICE), None if S0 is None else S0.to(DEVICE), block_v=16, block_t=16)
    assert got.dtype == torch.float32 and got.shape == want.shape
    close(got, want, dtype)
    for a, b in zip(before, kd.tensors()):
        assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


def test_fold_kernel_refuses_what_the_reference_refuses():
    """Validation is the reference's (raised before any launch), fp64 goes to the reference."""
    g = torch.Generator().manual_seed(0)
    NB, plan = plan_of(g, [5, 2], 4)
    kv = Mamba2PagedBuffers.allocate(NB, 4, 2, 8, 16, 1, dtype=torch.float32, device=DEVICE)
    for t in kv.tensors():
        t.normal_()
    A = -torch.rand(2, device=DEVICE)
    with pytest.raises(ValueError, match="initial_state"):
        KM.kv_fold(kv, to(plan, DEVICE), A, torch.zeros(3, 2, 8, 16, device=DEVICE))
    with pytest.raises(ValueError, match="A must be"):
        KM.kv_fold(kv, to(plan, DEVICE), A[:1])
    with pytest.raises(ValueError, match="fp64"):
        KM.kv_fold(kv, to(plan, DEVICE), A, torch.zeros(2, 2, 8, 16, dtype=torch.float64, device=DEVICE))


def test_dispatch_routes_kv_fold_to_the_kernel(monkeypatch, kernels_env):
    """``ops_for(...).kv_fold`` runs the kernel where kernels run, and agrees with the reference."""
    kernels_env("triton")
    g = torch.Generator().manual_seed(1)
    NB, plan = plan_of(g, [9, 0, 17], 4)
    kv = GDNPagedBuffers.allocate(NB, 4, 1, 2, 16, 16, dtype=torch.float32, device=DEVICE)
    kv.u.normal_(generator=None)
    kv.k.normal_()
    kv.g.uniform_(-0.3, 0.0)
    calls = []
    real = KG.kv_fold
    monkeypatch.setattr(KG, "kv_fold", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = dispatch.ops_for("gdn").kv_fold(kv, to(plan, DEVICE))
    assert calls
    close(got, NG.kv_fold(GDNPagedBuffers(kv.u.double(), kv.k.double(), kv.g.double()), to(plan, DEVICE)),
          torch.float32)


# ------------------------------------------------------------------ rebuild_state: the ring as pages
def _ring_plan(g, P, L, rows):
    """A decode plan over ``rows`` slots (padding rows: slot 0) with random starts (wrap-around)
    and committed lengths 0 .. L-1, L."""
    from replayssm.cache.ring import StepPlan

    slot = torch.tensor(rows, dtype=torch.long)
    start = torch.randint(0, L, (len(rows),), generator=g)
    hist = torch.tensor([(i * 5) % (L + 1) for i in range(len(rows))])
    hist[0] = L
    return StepPlan(slot, start, hist, torch.zeros(len(rows), dtype=torch.bool), 1, "decode", L)


def _poison_ring(ring: torch.Tensor, plan) -> None:
    """NaN in every ring entry a row does not hold (its uncommitted tail, unused slots)."""
    held = torch.zeros(ring.shape[:2], dtype=torch.bool)
    for s, st, h in zip(plan.slot.tolist(), plan.start.tolist(), plan.hist.tolist()):
        for j in range(h):
            held[s, (st + j) % ring.shape[1]] = True
    ring[~held] = float("nan")


def _plan_to(plan, device):
    from replayssm.cache.ring import StepPlan

    return StepPlan(plan.slot.to(device), plan.start.to(device), plan.hist.to(device), plan.flush.to(device),
                    plan.num_new, plan.kind, plan.capacity)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("family", ["m2", "gdn"])
def test_rebuild_state_kernel(dtype, family, nan_empty):
    """Checkpoint folded with the committed ring entries (any start, wrap-around, h = 0 .. L)
    against the reference in fp64; padding rows (slot 0) included; the buffers are untouched."""
    from replayssm.cache.buffers import GDNBuffers, Mamba2Buffers

    g = torch.Generator().manual_seed(7 if family == "m2" else 8)
    P, L = 7, 6
    rows = [3, 1, 0, 6, 2, 5, 4]
    plan = _ring_plan(g, P, L, rows)
    if family == "m2":
        H, G, d, n = 4, 2, 24, 20
        buf = Mamba2Buffers.allocate(P - 1, L, H, d, n, G, dtype=dtype)
        buf.x.normal_(generator=g)
        buf.B.normal_(generator=g)
        buf.dt.uniform_(0.0, 0.3, generator=g)
        A = -torch.rand(H, generator=g) - 0.2
        names = ("x", "B", "dt")
    else:
        H, HV, K, V = 2, 4, 20, 24
        buf = GDNBuffers.allocate(P - 1, L, H, HV, K, V, dtype=dtype)
        buf.u.normal_(generator=g)
        buf.k.normal_(generator=g)
        buf.k /= buf.k.norm(dim=-1, keepdim=True)
        buf.g.uniform_(-0.3, 0.0, generator=g)
        names = ("u", "k", "g")
    buf.state.normal_(generator=g)
    for nm in names:
        _poison_ring(getattr(buf, nm), plan)
    cls = type(buf)
    b64 = cls(state=buf.state.double(), **{k: getattr(buf, k).double() for k in names})
    want = N2.rebuild_state(b64, plan, A.double()) if family == "m2" else NG.rebuild_state(b64, plan)
    bd = cls(state=buf.state.to(DEVICE), **{k: getattr(buf, k).to(DEVICE) for k in names})
    before = [t.clone() for t in (bd.state, *[getattr(bd, k) for k in names])]
    pd = _plan_to(plan, DEVICE)
    got = KM.rebuild_state(bd, pd, A.to(DEVICE), block_d=16) if family == "m2" else \
        KG.rebuild_state(bd, pd, block_v=16, block_t=16)
    assert got.dtype == buf.state.dtype and got.shape == want.shape
    close(got, want, dtype)
    for a, b in zip(before, (bd.state, *[getattr(bd, k) for k in names])):
        assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


# ------------------------------------------------------------------ conv_fold: x, B from conv inputs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_fold_kernel(dtype, bias, nan_empty):
    """The Mamba-2 store fold with the conv inside the kernel against the reference (fp64):
    starts on and off block boundaries (windows reading back across blocks and before
    position 0), 0 / 1 / many positions, groups, NaN in every row no chain holds."""
    g = torch.Generator().manual_seed(11 + bias)
    H, d, G, n, W, bs = 4, 24, 2, 20, 4, 4
    seqs = [45, 9, 1, 20, 8, 70]
    starts = [4, 0, 0, 9, 8, 0]
    counts = [41, 9, 1, 11, 0, 70]
    pre, dt, table, _ = _case(g, seqs, bs, H, d, G, n, W, dtype=torch.float32)
    pre = pre.to(dtype)
    w = (torch.randn(pre.shape[1], W, generator=g) * 0.5).to(dtype)
    b = (torch.randn(pre.shape[1], generator=g) * 0.5).to(dtype) if bias else None
    A = -torch.rand(H, generator=g) - 0.1
    S0 = torch.randn(len(seqs), H, d, n, generator=g)
    plan = PagedPlan(torch.zeros(len(seqs), dtype=torch.long), torch.tensor(counts), table, 1, bs)
    st = torch.tensor(starts)
    want = N2.conv_fold(pre.double(), dt.double(), plan, st, w.double(), None if b is None else b.double(),
                        A.double(), S0.double(), head_dim=d, ngroups=G, d_state=n)
    dev = lambda t: None if t is None else t.to(DEVICE)     # noqa: E731
    before = (pre.clone(), dt.clone())
    got = KM.conv_fold(dev(pre), dev(dt), to(plan, DEVICE), dev(st), dev(w), dev(b), dev(A), dev(S0), head_dim=d,
                       ngroups=G, d_state=n, block_d=16)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # 16-bit: the kernel rounds x, B to the inputs' dtype as stored entries are; the fp64
    # reference does not, so the tolerance is the 16-bit one
    close(got, want, dtype)
    assert torch.equal(got[4].cpu(), S0[4])
    assert torch.equal(torch.nan_to_num(before[0], 7.0), torch.nan_to_num(pre.cpu(), 7.0))
    assert torch.equal(torch.nan_to_num(before[1], 7.0), torch.nan_to_num(dt.cpu(), 7.0))
