"""KDA Triton kernels (replay decode, replay verify, tree verify) against the float64
reference ops (``replayssm.ops.kda.naive``).

On CPU the kernels run in the Triton interpreter with odd shapes (K = 7, V = 20: two
V-blocks of 16, the second partly masked; 2 key heads for 4 value heads; ring L = 8).  One
schedule per case drives a kernel cache (fp32) and a reference cache (fp64) through the same
plans: rows at different fill levels and ring starts (wrap-around), flushes on different
rows and steps, a padding row on the null slot, random accepted counts and tree paths.
Every output of a real row and every cache tensor (state, ring u / k / g; slot 0 aside) is
compared after every step.  Ring entries past each row's valid length stay NaN.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.cache.buffers import KDABuffers  # noqa: E402
from replayssm.cache.ring import RingIndex  # noqa: E402
from replayssm.cache.tree import gather_path, path_to  # noqa: E402
from replayssm.kernels import dispatch  # noqa: E402
from replayssm.kernels import kda as KK  # noqa: E402
from replayssm.ops.kda import naive as NK  # noqa: E402

DEVICE = kernel_device()
F64 = torch.float64
BUF = ("state", "u", "k", "g")


def shapes():
    if DEVICE == "cpu":
        return dict(Bt=4, H=2, HV=4, K=7, V=20, P=7, L=8)
    return dict(Bt=24, H=8, HV=16, K=128, V=128, P=40, L=16)


def close(ref, got, what, tol=2e-4):
    got = got.to(F64)
    assert not torch.isnan(got).any(), f"{what}: NaN in the kernel's result"
    torch.testing.assert_close(got, ref.to(F64), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def close_buffers(ref, buf, what):
    for name in BUF:
        a, b = getattr(ref, name)[1:], getattr(buf, name)[1:].to(F64)
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what} buf.{name}: NaN pattern differs"
        torch.testing.assert_close(torch.nan_to_num(b), torch.nan_to_num(a), atol=2e-4, rtol=2e-4,
                                   msg=lambda m: f"{what} buf.{name}: {m}")


class Pair:
    """A kernel cache (fp32) and a reference cache (fp64) with one ring index."""

    def __init__(self, seed):
        s = self.s = shapes()
        g = torch.Generator().manual_seed(seed)
        P, L = s["P"], s["L"]
        self.ring = RingIndex(P - 1, L, torch.device(DEVICE))
        self.buf = KDABuffers.allocate(P - 1, L, s["H"], s["HV"], s["K"], s["V"], device=DEVICE, poison=True)
        self.buf.state.copy_(torch.randn(self.buf.state.shape, generator=g))
        self.ref = KDABuffers(*(t.to(F64).clone() for t in (self.buf.state, self.buf.u, self.buf.k, self.buf.g)))
        perm = torch.randperm(P - 1, generator=g)[: s["Bt"] - 1] + 1
        self.slots = torch.cat([perm[:2], torch.zeros(1, dtype=torch.long), perm[2:]]).to(DEVICE)  # row 2 pads
        self.real = self.slots != 0
        self.ring.start[1:] = torch.randint(0, L, (P - 1,), generator=g).to(DEVICE)
        self.gen = g

    def fill(self, lengths):
        """Committed entries for each row (``lengths`` per row), the same in both caches."""
        L = self.s["L"]
        for sl, n in zip(self.slots.tolist(), lengths):
            if sl == 0:
                continue
            self.ring.length[sl] = n
            st = int(self.ring.start[sl])
            for j in range(n):
                pos = (st + j) % L
                u = torch.randn(self.buf.u[sl, pos].shape, generator=self.gen)
                k = torch.nn.functional.normalize(torch.randn(self.buf.k[sl, pos].shape, generator=self.gen), dim=-1)
                gg = -torch.rand(self.buf.g[sl, pos].shape, generator=self.gen) * 0.7
                for b in (self.buf, self.ref):
                    b.u[sl, pos], b.k[sl, pos], b.g[sl, pos] = u.to(b.u.dtype), k.to(b.k.dtype), gg.to(b.g.dtype)

    def inputs(self, T=None):
        s, g = self.s, self.gen
        lead = (s["Bt"],) if T is None else (s["Bt"], T)

        def r(*shape):
            return torch.randn(*lead, *shape, generator=g, dtype=F64)

        q, k, v = r(s["H"], s["K"]), r(s["H"], s["K"]), r(s["HV"], s["V"])
        gg = -torch.nn.functional.softplus(r(s["HV"], s["K"])) * 0.5
        beta = torch.sigmoid(r(s["HV"]))
        return [x.to(DEVICE) for x in (q, k, v, gg, beta)]

    def decode(self, step):
        x = self.inputs()
        plan = self.ring.plan_decode(self.slots)
        y_ref = NK.replay_decode(self.ref, plan, *x)
        y = KK.replay_decode(self.buf, plan, *(t.float() for t in x), block_v=16)
        close(y_ref[self.real], y[self.real], f"decode {step} y")
        close_buffers(self.ref, self.buf, f"decode {step}")
        self.ring.commit(plan)
        return plan.flush & self.real

    def verify(self, step, T, tree):
        x = self.inputs(T)
        plan = self.ring.plan_verify(self.slots, T, "tree" if tree else "verify")
        xf = [t.float() for t in x]
        if tree:
            parent = _parents(self.s["Bt"], T, self.gen).to(DEVICE)
            y_ref = NK.tree_verify(self.ref, plan, parent, *x)
            y = KK.tree_verify(self.buf, plan, parent, *xf, block_v=16)
        else:
            y_ref = NK.replay_verify(self.ref, plan, *x)
            y = KK.replay_verify(self.buf, plan, *xf, block_v=16)
        close(y_ref[self.real], y[self.real], f"{'tree' if tree else 'verify'} {step} y")
        close_buffers(self.ref, self.buf, f"{'tree' if tree else 'verify'} {step}")
        acc = torch.randint(0, T + 1, (self.s["Bt"],), generator=self.gen).to(DEVICE)
        if tree:
            leaf = torch.randint(0, T, (self.s["Bt"],), generator=self.gen).to(DEVICE)
            path, n = path_to(parent, leaf)
            acc = torch.minimum(acc, n)
            for b in (self.buf, self.ref):
                gather_path(b.ring_tensors(), plan, path, acc)
        self.ring.commit(plan, acc)
        return plan.flush & self.real


def _parents(Bt, T, g):
    """Random topological forests (one row a chain)."""
    parent = torch.stack([torch.randint(-1, i, (Bt,), generator=g) if i else torch.full((Bt,), -1)
                          for i in range(T)], 1)
    parent[0] = torch.arange(-1, T - 1)
    return parent


def test_replay_decode_flush_cycles_and_wraparound():
    p = Pair(seed=1)
    L = p.s["L"]
    p.fill([L - 1, 0, 0, 3])   # row 0 flushes at once, row 3 after 4 steps
    flushed = set()
    for step in range(6 if DEVICE == "cpu" else L + 2):
        flushed.add(tuple(p.decode(step).nonzero().flatten().tolist()))
    assert len(flushed - {()}) >= 2, f"want flushes on two different steps, got {flushed}"


@pytest.mark.parametrize("tree", [False, True])
def test_verify_schedule_with_commits(tree):
    """Verify (or tree verify) steps with random accepted counts and paths, decode steps
    between them, through flushes (``h + 2T > L``) on different rows."""
    p = Pair(seed=2 + tree)
    T = 3
    p.fill([5, 0, 0, 2])
    flushed = set()
    for step in range(3):
        flushed.add(tuple(p.verify(step, T, tree).nonzero().flatten().tolist()))
        p.decode(step)
    assert len(flushed - {()}) >= 1


def test_dispatch_routes_the_kda_kernels(kernels_env):
    kernels_env("triton")
    ops = dispatch.ops_for("kda")
    buf = KDABuffers.allocate(1, 4, 1, 1, 2, 2, device=DEVICE)
    assert ops.resolve("replay_decode", buf.state) is KK.replay_decode
    kernels_env("naive")
    assert ops.resolve("replay_decode", buf.state) is not KK.replay_decode


def test_bad_input_raises_before_any_write():
    p = Pair(seed=4)
    p.fill([2, 0, 0, 1])
    q, k, v, g, beta = (t.float() for t in p.inputs())
    plan = p.ring.plan_decode(p.slots)
    before = [getattr(p.buf, n).clone() for n in BUF]
    with pytest.raises(ValueError, match="g must have shape"):
        KK.replay_decode(p.buf, plan, q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="route"):
        KK.replay_decode(p.buf, plan, q, k, v, g, beta, route="fast")
    vplan = p.ring.plan_verify(p.slots, 2)
    with pytest.raises(ValueError):
        KK.replay_verify(p.buf, vplan, q, k, v, g, beta)   # no time axis
    for n, t in zip(BUF, before):
        assert torch.equal(torch.nan_to_num(getattr(p.buf, n)), torch.nan_to_num(t)), n


def test_kv_only_form_decode_verify_and_trees():
    """KV-only steps (``S0 = 0``, entries in paged blocks of 3, each row's blocks scattered
    over the pool): decodes, chains with random accepts, trees with random paths, then a
    step the kernel leaves to the reference (more than ``KV_MAX_NEW`` new tokens); outputs and
    every pool entry against the float64 reference."""
    from replayssm.cache.paged import KDAPagedBuffers, PagedIndex
    from replayssm.cache.paged import gather_path as kv_gather_path

    s = shapes()
    g = torch.Generator().manual_seed(11)
    bs, NB = 3, 40
    pidx = PagedIndex(s["P"] - 1, bs, NB, 16, torch.device(DEVICE))
    kv = KDAPagedBuffers.allocate(NB, bs, s["H"], s["HV"], s["K"], s["V"], device=DEVICE, poison=True)
    ref = KDAPagedBuffers(*(t.to(F64).clone() for t in kv.tensors()))
    p = Pair(seed=12)                        # for its slots and inputs
    slots, real = p.slots, p.real
    ops = dispatch.ops_for("kda", "triton")
    for step, (T, tree) in enumerate([(4, False), (1, False), (3, False), (3, True), (1, False), (3, True),
                                      (KK.KV_MAX_NEW + 2, False)]):
        for sl in slots.tolist():
            if sl:
                pidx.reserve(sl, int(pidx.length[sl]) + T)
        pplan = pidx.plan(slots, T)
        x = p.inputs(T)
        xf = [t.float() for t in x]
        if tree:
            parent = _parents(s["Bt"], T, g).to(DEVICE)
            y_ref = NK.kv_tree_verify(ref, pplan, parent, *x)
            y = ops.kv_tree_verify(kv, pplan, parent, *xf)
        else:
            y_ref = NK.kv_verify(ref, pplan, *x)
            y = ops.kv_verify(kv, pplan, *xf)
        close(y_ref[real], y[real], f"kv step {step} y")
        for name, a, b in zip(("u", "k", "g"), ref.tensors(), kv.tensors()):
            a, b = a[bs:], b[bs:].to(F64)   # block 0 is the null block
            assert torch.equal(torch.isnan(a), torch.isnan(b)), f"kv step {step} {name}: NaN pattern differs"
            close(torch.nan_to_num(a), torch.nan_to_num(b), f"kv step {step} {name}")
        acc = torch.randint(0, T + 1, (s["Bt"],), generator=g).to(DEVICE)
        if tree:
            path, n = path_to(parent, torch.randint(0, T, (s["Bt"],), generator=g).to(DEVICE))
            acc = torch.minimum(acc, n)
            for pools in (kv, ref):
                kv_gather_path(pools.tensors(), pplan, path, acc)
        elif step == 0:
            acc = torch.full_like(acc, T)
        acc[~real] = 0
        pidx.commit(pplan, acc)
    assert int(pidx.length[slots[0]]) >= 6
