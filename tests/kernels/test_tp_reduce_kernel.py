"""The tensor-parallel finish kernel (sum over ranks, deferred gated-norm scale, residual add,
next RMSNorm) with its barrier compiled out: the "ranks" are separate tensors whose addresses
the kernel reads, as it reads peers' buffers over NVLink; against a float64 reference."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels.tp_reduce import tp_reduce  # noqa: E402
from replayssm.ops.tp_reduce import reduce_add_norm  # noqa: E402

DEVICE = kernel_device()


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("W,rpg,R,N,dtype,sdt,scaled,zc", [
    (1, 1, 3, 24, torch.float32, torch.float32, False, False),
    (2, 2, 7, 40, torch.bfloat16, torch.float32, True, False),
    (2, 2, 5, 33, torch.float32, torch.float32, True, True),
    (4, 2, 9, 48, torch.bfloat16, torch.float32, True, False),     # two norm groups of two ranks
    (4, 4, 1, 20, torch.bfloat16, torch.bfloat16, False, True),
    (4, 1, 3, 16, torch.float32, torch.float32, True, False),      # one group per rank
])
def test_tp_reduce_matches_float64(W, rpg, R, N, dtype, sdt, scaled, zc, nan_empty):
    g = torch.Generator().manual_seed(W * 100 + R * 10 + N)
    parts = [torch.randn(R, N, generator=g).to(dtype).to(DEVICE) for _ in range(W)]
    ss = [(torch.rand(R, generator=g) * N * 0.5 + 0.1).to(DEVICE) for _ in range(W)] if scaled else None
    hfull = torch.randn(R, N + 5, generator=g).to(sdt).to(DEVICE)
    h = hfull[:, 2:2 + N]                                     # strided rows
    w = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    gs = 3 * N
    kw = dict(ranks_per_group=rpg, group_size=gs, gate_eps=1e-5) if scaled else {}
    for rank in range(W):   # every rank reads the same buffers: bitwise the same outputs
        y, s, o = tp_reduce(_ptrs(parts), parts[rank], R, rank=rank, ss_ptrs=_ptrs(ss) if scaled else None,
                            residual=h, sum_dtype=sdt, weight=w, eps=1e-6, zero_centered=zc, want_sum=True,
                            **kw)
        if rank == 0:
            first = (y, s, o)
        else:
            for a, b in zip(first, (y, s, o)):
                assert torch.equal(a, b)
    d = torch.float64
    y64, s64, o64 = reduce_add_norm([p.cpu() for p in parts], [q.cpu() for q in ss] if scaled else None,
                                    residual=h.cpu(), weight=w.cpu(), eps=1e-6, zero_centered=zc, dtype=d, **kw)
    lo = dtype == torch.bfloat16
    tol = dict(atol=3e-2, rtol=3e-2) if lo else dict(atol=2e-5, rtol=2e-5)
    assert y.dtype == dtype and s.dtype == sdt and o.dtype == dtype
    torch.testing.assert_close(o.cpu().double(), o64, **tol)
    torch.testing.assert_close(s.cpu().double(), s64, **(dict(atol=5e-2, rtol=3e-2) if lo or sdt != torch.float32 else tol))
    torch.testing.assert_close(y.cpu().double(), y64, **(dict(atol=6e-2, rtol=4e-2) if lo else tol))
    # the same-dtype reference (the CPU tensor-parallel path) rounds like the kernel
    yr, sr, orf = reduce_add_norm([p.cpu() for p in parts], [q.cpu() for q in ss] if scaled else None,
                                  residual=h.cpu(), sum_dtype=sdt, weight=w.cpu(), eps=1e-6, zero_centered=zc, **kw)
    torch.testing.assert_close(o.cpu(), orf, atol=1e-5 if not lo else 1e-2, rtol=1e-5 if not lo else 1e-2)
    torch.testing.assert_close(y.cpu(), yr, atol=1e-5 if not lo else 2e-2, rtol=1e-5 if not lo else 2e-2)


def test_tp_reduce_sum_only_and_add_only():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(5, 12, generator=g).to(DEVICE) for _ in range(3)]
    _, _, o = tp_reduce(_ptrs(parts), parts[0], 5)
    torch.testing.assert_close(o.cpu().double(), sum(p.cpu().double() for p in parts), atol=1e-5, rtol=1e-5)
    h = torch.randn(5, 12, generator=g).to(DEVICE)
    y, s, o = tp_reduce(_ptrs(parts), parts[1], 5, rank=1, residual=h, sum_dtype=torch.float64 if DEVICE == "cpu"
                        else torch.float32)
    assert y is None and o is None
    torch.testing.assert_close(s.cpu().double(), h.cpu().double() + sum(p.cpu().double() for p in parts),
                               atol=1e-5, rtol=1e-5)


def test_tp_reduce_rejects_bad_input():
    p = torch.zeros(4, 8, device=DEVICE)
    ptrs = _ptrs([p, p, p])
    with pytest.raises(ValueError, match="groups"):
        tp_reduce(ptrs, p, 4, ranks_per_group=2)
    with pytest.raises(ValueError, match="rank"):
        tp_reduce(ptrs, p, 4, rank=3)
    with pytest.raises(ValueError, match="residual"):
        tp_reduce(ptrs, p, 4, residual=torch.zeros(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        tp_reduce(ptrs, p, 4, weight=torch.ones(7, device=DEVICE))


def _pair(D: int, rows: int, dtype):
    """Two ranks' ``FusedFinish`` in one process (no barrier: each "rank" runs after both
    wrote), their buffers host tensors addressed like peers' symmetric buffers."""
    from replayssm.distributed.fused import FusedFinish

    parts = [[torch.zeros(rows, D, dtype=dtype, device=DEVICE) for _ in range(2)] for _ in range(2)]
    sums = [[torch.zeros(rows, device=DEVICE) for _ in range(2)] for _ in range(2)]
    fins = []
    for r in range(2):
        f = FusedFinish.__new__(FusedFinish)
        f.rank, f.size, f.D, f.dtype, f.max_rows, f.parity, f.ok = r, 2, D, dtype, rows, 0, True
        f.parts, f.sums, f.allreduce, f.pad_ptrs = parts[r], sums[r], None, None
        f.part_ptrs = [_ptrs([parts[q][p] for q in range(2)]) for p in range(2)]
        f.ss_ptrs = [_ptrs([sums[q][p] for q in range(2)]) for p in range(2)]
        fins.append(f)
    return fins


def test_fused_finish_buffers_parity_and_deferred_sums():
    """The plumbing around the kernel: partials written into (or copied into) this call's
    parity, the deferred gated-norm sums beside them, ``add_norm`` (parity flips) then
    ``add`` (trailing: back to parity 0), against the float64 reference on both ranks."""
    from replayssm.distributed.fused import DeferredSum, GroupScale
    from replayssm.layers.norms import RMSNorm

    D, R = 24, 5
    g = torch.Generator().manual_seed(0)
    fins = _pair(D, 8, torch.float32)
    norm = RMSNorm(D, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(D, generator=g)).to(DEVICE)
    h = torch.randn(1, R, D, generator=g).to(DEVICE)
    p1 = [torch.randn(1, R, D, generator=g).to(DEVICE) for _ in range(2)]
    q1 = [torch.rand(R, generator=g).to(DEVICE) * 30 + 1 for _ in range(2)]
    p2 = [torch.randn(1, R, D, generator=g).to(DEVICE) for _ in range(2)]
    # call 1 (parity 0): rank r's out_proj wrote into its buffer, its norm its sums
    d1 = []
    for r, f in enumerate(fins):
        f.part_out(R).copy_(p1[r].reshape(R, D))
        f.sums_out(R).copy_(q1[r])
        d1.append(DeferredSum(f, f.part_out(R).view(1, R, D), GroupScale(f.sums_out(R), 0, 1, 2 * D, 1e-5), "fused"))
    out1 = [d.add_norm(h, norm, torch.float32, torch.float32) for d in d1]
    assert all(f.parity == 1 for f in fins)
    y_ref, s_ref, _ = reduce_add_norm([p.reshape(R, D) for p in p1], q1, group_size=2 * D, gate_eps=1e-5,
                                      residual=h.reshape(R, D), weight=norm.weight, eps=1e-6, dtype=torch.float64)
    for y, s in out1:
        torch.testing.assert_close(y.reshape(R, D).double(), y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.reshape(R, D).double(), s_ref, atol=1e-5, rtol=1e-5)
    # call 2 (parity 1): a mixer's own output tensor, copied in by both ranks before either reads
    for r, f in enumerate(fins):
        f.part_out(R).copy_(p2[r].reshape(R, D))
    s1 = out1[0][1]
    outs = [DeferredSum(f, p2[r], None, "fused").add(s1, torch.float32) for r, f in enumerate(fins)]
    assert all(f.parity == 0 for f in fins)
    want = s1.double() + p2[0].double() + p2[1].double()
    for s in outs:
        assert s.shape == (1, R, D)
        torch.testing.assert_close(s.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0], outs[1])


def test_barrier_counters_with_the_peer_signals_preset():
    """The barrier's counter protocol, one rank of two in the interpreter: with the peer's
    entry (and trailing) signal already on this rank's pad the call passes, signals the peer
    once per call whatever the grid, moves its epochs on and leaves its program counters at
    0; counters compare through the int32 difference, so they may wrap around."""
    W, R, N = 2, 5, 24
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(R, N, generator=g).to(DEVICE) for _ in range(W)]
    h = torch.randn(R, N, generator=g).to(DEVICE)
    pads = [torch.zeros(2 * W + 4, dtype=torch.int32, device=DEVICE) for _ in range(W)]
    EPOCH, TRAIL_EPOCH, ARRIVED, DONE = 2 * W, 2 * W + 1, 2 * W + 2, 2 * W + 3
    want = h.double() + parts[0].double() + parts[1].double()
    for call, trailing in enumerate([True, False, True]):
        pads[0][1] += 1                      # rank 1 has entered call `call`
        if trailing:
            pads[0][W + 1] += 1              # ... and finished reading (its trailing signal)
        _, s, _ = tp_reduce(_ptrs(parts), parts[0], R, rank=0, residual=h, sum_dtype=torch.float64
                            if DEVICE == "cpu" else torch.float32, pad_ptrs=_ptrs(pads), trailing=trailing)
        torch.testing.assert_close(s.double().cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
        assert int(pads[1][0]) == call + 1, "one entry signal per call to the peer"
        assert int(pads[0][EPOCH]) == call + 1
        assert int(pads[1][W]) == int(pads[0][TRAIL_EPOCH]) == [1, 1, 2][call]
        assert int(pads[0][ARRIVED]) == int(pads[0][DONE]) == 0
    # wrap-around: the epoch at the int32 maximum, the peer's counter already wrapped
    top = 2**31 - 1
    pads = [torch.zeros(2 * W + 4, dtype=torch.int32, device=DEVICE) for _ in range(W)]
    pads[0][EPOCH] = top
    pads[0][1] = -(2**31)                    # = top + 1 in int32
    tp_reduce(_ptrs(parts), parts[0], R, rank=0, residual=h, pad_ptrs=_ptrs(pads))
    assert int(pads[0][EPOCH]) == -(2**31)
