"""The push and two-shot tensor-parallel finish kernels (``kernels.tp_push``), one rank at a
time in the interpreter: the peers' pushes and flags are pre-set in that rank's regions (as
the peers would have left them), the rank runs, and the test checks its outputs (bitwise the
pull kernel's, close to the float64 reference), what it stored into every peer's regions,
the flags it raised and its epoch counters."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels.tp_push import PushBuffers, push_layout, tp_push  # noqa: E402
from replayssm.kernels.tp_reduce import tp_reduce  # noqa: E402
from replayssm.ops.tp_reduce import reduce_add_norm  # noqa: E402

DEVICE = kernel_device()


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


class World:
    """W ranks' allocations (host tensors standing for the symmetric buffers) and views."""

    def __init__(self, W, max_rows, N, dtype, programs):
        self.W, self.R, self.N, self.dtype, self.P = W, max_rows, N, dtype, programs
        es = torch.finfo(dtype).bits // 8
        self.lay = push_layout(W, max_rows, N, es, programs)
        self.mem = [torch.zeros(self.lay["total"][1], dtype=torch.uint8, device=DEVICE) for _ in range(W)]
        self.ctl = [torch.zeros(2, dtype=torch.int32, device=DEVICE) for _ in range(W)]
        bases = [m.data_ptr() for m in self.mem]
        self.bufs = [PushBuffers.from_bases(bases, c, N, es, max_rows, programs) for c in self.ctl]

    def _view(self, r, name, dtype, shape):
        off, n = self.lay[name]
        return self.mem[r][off:off + n].view(dtype).view(*shape)

    def recv(self, r):
        return self._view(r, "recv", self.dtype, (2, self.W, self.R, self.N))

    def qrecv(self, r):
        return self._view(r, "qrecv", torch.float32, (2, self.W, self.R))

    def gather(self, r):
        return self._view(r, "gather", self.dtype, (self.R, self.N))

    def flags(self, r):
        return self._view(r, "flags", torch.int32, (2, self.W, self.P))


def _data(W, R, N, dtype, sdt, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(R, N, generator=g).to(dtype).to(DEVICE) for _ in range(W)]
    ss = [(torch.rand(R, generator=g) * N * 0.5 + 0.1).to(DEVICE) for _ in range(W)]
    hfull = torch.randn(R, N + 5, generator=g).to(sdt).to(DEVICE)
    w = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    return parts, ss, hfull[:, 2:2 + N], w           # strided residual rows


CASES = [  # W, ranks per group, rows, N, dtype, residual dtype, scaled, zero-centered, programs, epoch
    (2, 2, 7, 40, torch.bfloat16, torch.float32, True, False, 4, 0),
    (2, 2, 5, 33, torch.float32, torch.float32, True, True, 8, 1),          # odd width, parity 1
    (4, 2, 9, 48, torch.bfloat16, torch.float32, True, False, 3, 2**31 - 1),  # 2 groups, 3 rows a program, wrap
    (4, 4, 3, 20, torch.bfloat16, torch.bfloat16, False, True, 8, 5),
    (4, 1, 6, 30, torch.float32, torch.float32, True, False, 2, 2),         # W does not divide N
]


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("W,rpg,R,N,dtype,sdt,scaled,zc,P,e", CASES)
def test_push_matches_pull_and_float64(two_shot, W, rpg, R, N, dtype, sdt, scaled, zc, P, e, nan_empty):
    parts, ss, h, w = _data(W, R, N, dtype, sdt, W * 100 + R * 10 + N)
    kw = dict(ranks_per_group=rpg, group_size=3 * N, gate_eps=1e-5) if scaled else {}
    common = dict(residual=h, sum_dtype=sdt, weight=w, eps=1e-6, zero_centered=zc, want_sum=True, **kw)
    # the pull kernel (no barrier): what every rank must write, bitwise
    want = tp_reduce(_ptrs(parts), parts[0], R, ss_ptrs=_ptrs(ss) if scaled else None, **common)
    y64, s64, o64 = reduce_add_norm([p.cpu() for p in parts], [q.cpu() for q in ss] if scaled else None,
                                    residual=h.cpu(), weight=w.cpu(), eps=1e-6, zero_centered=zc,
                                    dtype=torch.float64, **kw)
    lo = dtype == torch.bfloat16
    tol = dict(atol=3e-2, rtol=3e-2) if lo else dict(atol=2e-5, rtol=2e-5)
    e32 = e - 2**32 if e >= 2**31 else e
    nxt = e + 1 - 2**32 if e + 1 >= 2**31 else e + 1     # int32 wrap-around
    par = e % 2
    SW = -(-N // W)
    sl = [slice(p * SW, min(N, p * SW + SW)) for p in range(W)]
    G = min(R, P)
    for r in range(W):
        wd = World(W, R + 2, N, dtype, P)
        wd.ctl[r][0] = e32
        for k in range(W):          # the peers' pushes and flags, as they leave them
            if k == r:
                continue
            wd.flags(r)[:, k, :G] = nxt
            if two_shot:
                wd.recv(r)[0, k, :R] = parts[k]
                wd.qrecv(r)[0, k, :R] = ss[k]
                wd.gather(r)[:R, sl[k]] = want[2][:, sl[k]]
            else:
                wd.recv(r)[par, k, :R] = parts[k]
                wd.qrecv(r)[par, k, :R] = ss[k]
        part = torch.zeros(R + 3, N, dtype=dtype, device=DEVICE)
        part[:R] = parts[r]
        y, s, o = tp_push(part, wd.bufs[r], R, rank=r, two_shot=two_shot, sums=ss[r] if scaled else None,
                          programs=P, **common)
        for a, b in zip((y, s, o), want):
            assert torch.equal(a, b), "not bitwise the pull kernel's result"
        assert y.dtype == dtype and s.dtype == sdt and o.dtype == dtype
        torch.testing.assert_close(o.cpu().double(), o64, **tol)
        torch.testing.assert_close(y.cpu().double(), y64, **(dict(atol=6e-2, rtol=4e-2) if lo else tol))
        torch.testing.assert_close(s.cpu().double(), s64,
                                   **(dict(atol=5e-2, rtol=3e-2) if lo or sdt != torch.float32 else tol))
        # what it left on the peers (and itself)
        for p in range(W):
            if p != r:
                assert (wd.flags(p)[0, r, :G] == nxt).all() and (wd.flags(p)[0, r, G:] == 0).all()
                if two_shot:
                    assert (wd.flags(p)[1, r, :G] == nxt).all() and (wd.flags(p)[1, r, G:] == 0).all()
                else:
                    assert (wd.flags(p)[1] == 0).all()
            if two_shot:
                if p != r:
                    assert torch.equal(wd.recv(p)[0, r, :R, sl[p]], parts[r][:, sl[p]])
                    if scaled:
                        assert torch.equal(wd.qrecv(p)[0, r, :R], ss[r])
                assert torch.equal(wd.gather(p)[:R, sl[r]], want[2][:, sl[r]])
            elif p != r:
                assert torch.equal(wd.recv(p)[par, r, :R], parts[r])
                assert (wd.recv(p)[1 - par, r] == 0).all() and (wd.recv(p)[par, r, R:] == 0).all()
                if scaled:
                    assert torch.equal(wd.qrecv(p)[par, r, :R], ss[r])
        assert int(wd.ctl[r][0]) == nxt and int(wd.ctl[r][1]) == 0


def test_push_calls_in_sequence_alternate_parity():
    """Three calls on one rank of two: the epoch moves on, each call's pushes land in the
    next parity, and a call of fewer rows than programs flags only its own programs."""
    W, N, P = 2, 24, 4
    wd = World(W, 6, N, torch.float32, P)
    g = torch.Generator().manual_seed(1)
    raised = [0] * P
    for call, R in enumerate((5, 2, 6)):
        mine, peer = (torch.randn(R, N, generator=g).to(DEVICE) for _ in range(2))
        wd.recv(0)[call % 2, 1, :R] = peer
        wd.flags(0)[0, 1, :min(R, P)] = call + 1
        _, _, o = tp_push(mine.clone(), wd.bufs[0], R, rank=0, programs=P)
        torch.testing.assert_close(o, mine + peer, atol=1e-6, rtol=1e-6)
        assert torch.equal(wd.recv(1)[call % 2, 0, :R], mine)
        assert int(wd.ctl[0][0]) == call + 1
        raised[:min(R, P)] = [call + 1] * min(R, P)
        assert wd.flags(1)[0, 0].tolist() == raised
    # no rows: no launch, nothing moves
    tp_push(torch.zeros(1, N, device=DEVICE), wd.bufs[0], 0, rank=0)
    assert int(wd.ctl[0][0]) == 3


def test_push_rejects_bad_input():
    wd = World(2, 4, 16, torch.float32, 4)
    b = wd.bufs[0]
    p = torch.zeros(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="groups"):
        tp_push(p, b, 4, ranks_per_group=3)
    with pytest.raises(ValueError, match="rank"):
        tp_push(p, b, 4, rank=2)
    with pytest.raises(ValueError, match="part"):
        tp_push(torch.zeros(4, 15, device=DEVICE), b, 4)
    with pytest.raises(ValueError, match="part"):
        tp_push(torch.zeros(16, 4, device=DEVICE).t(), b, 4)
    with pytest.raises(ValueError, match="rows"):
        tp_push(torch.zeros(6, 16, device=DEVICE), b, 5)
    with pytest.raises(ValueError, match="sums"):
        tp_push(p, b, 4, sums=torch.zeros(4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        tp_push(p, b, 4, residual=torch.zeros(3, 16, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        tp_push(p, b, 4, weight=torch.ones(15, device=DEVICE))
    with pytest.raises(ValueError, match="programs"):
        tp_push(p, b, 4, programs=5)
    assert int(wd.ctl[0][0]) == 0 and all(int(m.abs().sum()) == 0 for m in wd.mem)   # nothing touched


@pytest.mark.parametrize("method", ["push", "twoshot"])
def test_fused_finish_drives_the_push_kernels(method, monkeypatch):
    """``FusedFinish`` with ``REPLAYSSM_TP_FUSED_METHOD=push|twoshot``: a deferred sum with
    the gated-norm scale finished by ``add_norm`` on rank 0 of two (rank 1's pushes and flags
    pre-set) against the float64 reference; the method switch rejects unknown names."""
    from replayssm.distributed.fused import DeferredSum, FusedFinish, GroupScale, fused_method, fused_programs
    from replayssm.layers.norms import RMSNorm

    monkeypatch.setenv("REPLAYSSM_TP_FUSED_METHOD", method)
    assert fused_method() == method
    with pytest.raises(ValueError, match="REPLAYSSM_TP_FUSED_METHOD"):
        fused_method("nvls")
    for bad in ("0", "x"):
        with pytest.raises(ValueError, match="REPLAYSSM_TP_FUSED_PROGRAMS"):
            fused_programs(bad)
    D, R, P = 24, 5, 4
    wd = World(2, 8, D, torch.float32, P)
    f = FusedFinish.__new__(FusedFinish)
    f.rank, f.size, f.D, f.dtype, f.max_rows, f.parity, f.ok = 0, 2, D, torch.float32, 8, 0, True
    f.method, f.programs, f.push = fused_method(), P, wd.bufs[0]
    f.parts = [torch.zeros(8, D, device=DEVICE) for _ in range(2)]
    f.sums = [torch.zeros(8, device=DEVICE) for _ in range(2)]
    g = torch.Generator().manual_seed(4)
    p = [torch.randn(R, D, generator=g).to(DEVICE) for _ in range(2)]
    q = [torch.rand(R, generator=g).to(DEVICE) * 30 + 1 for _ in range(2)]
    h = torch.randn(1, R, D, generator=g).to(DEVICE)
    norm = RMSNorm(D, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(D, generator=g)).to(DEVICE)
    wd.recv(0)[0, 1, :R] = p[1]
    wd.qrecv(0)[0, 1, :R] = q[1]
    wd.flags(0)[:, 1, :] = 1
    if method == "twoshot":   # rank 1's reduced slice [12, 24) already gathered here
        _, _, o = reduce_add_norm(p, q, group_size=2 * D, gate_eps=1e-5)
        wd.gather(0)[:R, 12:] = o[:, 12:]
    f.part_out(R).copy_(p[0])
    f.sums_out(R).copy_(q[0])
    d = DeferredSum(f, f.part_out(R).view(1, R, D), GroupScale(f.sums_out(R), 0, 1, 2 * D, 1e-5), "fused")
    y, s = d.add_norm(h, norm, torch.float32, torch.float32)
    y64, s64, _ = reduce_add_norm(p, q, group_size=2 * D, gate_eps=1e-5, residual=h.reshape(R, D),
                                  weight=norm.weight, eps=1e-6, dtype=torch.float64)
    torch.testing.assert_close(y.reshape(R, D).double(), y64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.reshape(R, D).double(), s64, atol=1e-5, rtol=1e-5)
    assert int(wd.ctl[0][0]) == 1 and f.parity == 1
    if method == "push":
        assert torch.equal(wd.recv(1)[0, 0, :R], p[0]) and torch.equal(wd.qrecv(1)[0, 0, :R], q[0])
    else:
        assert torch.equal(wd.recv(1)[0, 0, :R, 12:], p[0][:, 12:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pull_kernel_aligned_addressing_is_the_same_sum(dtype):
    """``tp_reduce(aligned=True)`` (``REPLAYSSM_TP_FUSED_METHOD=pull``, the default) addresses each rank's
    partial as ``like`` plus an element offset: bitwise the plain form's result on 16-byte
    aligned buffers (one allocation, rows of 48 channels), and ``like`` must be aligned."""
    W, R, N = 3, 5, 48
    g = torch.Generator().manual_seed(8)
    es = torch.finfo(dtype).bits // 8
    step = -(-R * N * es // 256) * 256 // es                 # 256-byte aligned partials in one buffer
    flat = torch.zeros(W * step + 256 // es, dtype=dtype, device=DEVICE)   # room to align the start
    off = (-flat.data_ptr() % 256) // es
    parts = [flat[off + k * step: off + k * step + R * N].view(R, N) for k in range(W)]
    for p in parts:
        p.copy_(torch.randn(R, N, generator=g).to(dtype))
    ss = [torch.rand(R, generator=g).to(DEVICE) * 9 + 1 for _ in range(W)]
    h = torch.randn(R, N, generator=g).to(DEVICE)
    w = (1 + 0.2 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    kw = dict(ss_ptrs=_ptrs(ss), group_size=2 * N, gate_eps=1e-5, residual=h, sum_dtype=torch.float32, weight=w,
              eps=1e-6, want_sum=True)
    for rank in range(W):
        a = tp_reduce(_ptrs(parts), parts[rank], R, rank=rank, **kw)
        b = tp_reduce(_ptrs(parts), parts[rank], R, rank=rank, aligned=True, **kw)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="aligned"):
        tp_reduce(_ptrs(parts), flat[off + 1: off + 1 + R * N].view(R, N), R, aligned=True, **kw)


def test_push_grid_is_capped_by_programs(monkeypatch):
    """The launch grid is ``min(rows, programs)`` (programs stride over the rows past it), so
    no row count reaches a grid limit; a bad method name fails before any buffer is built."""
    from replayssm.distributed.fused import FusedFinish
    from replayssm.kernels import tp_push as mod

    seen = []
    real = mod._tp_push_kernel

    class Rec:
        def __getitem__(self, grid):
            seen.append(grid)
            return real[grid]

    monkeypatch.setattr(mod, "_tp_push_kernel", Rec())
    wd = World(1, 40, 8, torch.float32, 3)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for two_shot in (False, True):
        _, _, o = mod.tp_push(x, wd.bufs[0], 40, two_shot=two_shot, programs=3)
        assert torch.equal(o, x)                       # one rank: the sum is its partial
    _, _, o = mod.tp_push(x, wd.bufs[0], 2, programs=3)
    assert seen == [(3,), (3,), (2,)] and torch.equal(o, x[:2])
    with pytest.raises(ValueError, match="REPLAYSSM_TP_FUSED_METHOD"):
        FusedFinish(None, "cpu", torch.float32, 8, 1024, 0, 1, None, method="multimem")
