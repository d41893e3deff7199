"""Packed variable-length prefill references (``chunked_prefill_varlen`` of both families and
``ops.conv.naive.conv_prefill_varlen``) against the float64 recurrence run on each sequence
alone: empty and one-token sequences inside the batch, lengths around the chunk size,
nonzero initial states, GVA / groups, and the in-place pool form with NaN-poisoned fresh
rows and rows that must stay untouched.  Bad input raises ``ValueError`` before the pool is
written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayssm.ops.conv import naive as RC
from replayssm.ops.delta_rule import _prep_qk
from replayssm.ops.gdn import naive as NG
from replayssm.ops.mamba2 import naive as N2

F64 = torch.float64
LENS = [0, 1, 4, 5, 0, 9, 3, 1]  # chunk 4: lengths chunk-1, chunk, chunk+1, 2 chunks+1; empties


def cu_of(lens, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=device)


def m2_inputs(lens, H=4, G=2, d=3, n=5, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    Nt = sum(lens)
    x = torch.randn(Nt, H, d, generator=g, dtype=F64)
    dt = F.softplus(torch.randn(Nt, H, generator=g, dtype=F64))
    A = -torch.exp(torch.randn(H, generator=g, dtype=F64) * 0.5)
    B = torch.randn(Nt, G, n, generator=g, dtype=F64)
    C = torch.randn(Nt, G, n, generator=g, dtype=F64)
    D = torch.randn(H, generator=g, dtype=F64)
    S0 = torch.randn(len(lens), H, d, n, generator=g, dtype=F64)
    return [t.to(dtype) for t in (x, dt, A, B, C, D)], S0


def gdn_inputs(lens, H=2, HV=4, K=5, V=3, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    Nt = sum(lens)
    q = torch.randn(Nt, H, K, generator=g, dtype=F64)
    k = torch.randn(Nt, H, K, generator=g, dtype=F64)
    v = torch.randn(Nt, HV, V, generator=g, dtype=F64)
    gg = -F.softplus(torch.randn(Nt, HV, generator=g, dtype=F64))
    beta = torch.sigmoid(torch.randn(Nt, HV, generator=g, dtype=F64))
    S0 = torch.randn(len(lens), HV, K, V, generator=g, dtype=F64) * 0.3
    return [t.to(dtype) for t in (q, k, v, gg, beta)], S0


def gdn_truth(q, k, v, g, beta, S0):
    """Per-token recurrence of one sequence (fp64): ``y [T,HV,V]``, final, ``u [T,HV,V]``."""
    HV = v.shape[1]
    qn, kn = _prep_qk(q, k, F64, None, True)
    rep = HV // q.shape[1]
    qn, kn = qn.repeat_interleave(rep, 1), kn.repeat_interleave(rep, 1)
    St, ys, us = S0.clone(), [], []
    for t in range(v.shape[0]):
        St = torch.exp(g[t])[:, None, None] * St
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", St, kn[t]))
        St = St + kn[t][:, :, None] * u[:, None, :]
        ys.append(torch.einsum("hkv,hk->hv", St, qn[t]))
        us.append(u)
    empty = v.new_zeros(0, *v.shape[1:])
    return (torch.stack(ys) if ys else empty), St, (torch.stack(us) if us else empty)


# ============================================================================ Mamba-2
@pytest.mark.parametrize("chunk", [4, 3])
def test_mamba2_varlen_matches_recurrence_per_sequence(chunk):
    (x, dt, A, B, C, D), S0 = m2_inputs(LENS)
    cu = cu_of(LENS)
    y, fin = N2.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, initial_state=S0, chunk_size=chunk)
    assert y.shape == x.shape and fin.shape == S0.shape
    for i in range(len(LENS)):
        s, e = int(cu[i]), int(cu[i + 1])
        yr, fr = N2.recurrent_scan(x[None, s:e], dt[None, s:e], A, B[None, s:e], C[None, s:e], D,
                                   initial_state=S0[i:i + 1])
        torch.testing.assert_close(y[s:e], yr[0], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(fin[i], fr[0], atol=1e-10, rtol=1e-10)
    # no initial state: zeros
    y0, f0 = N2.chunked_prefill_varlen(x, dt, A, B, C, None, cu_seqlens=cu)
    yz, fz = N2.chunked_prefill_varlen(x, dt, A, B, C, None, cu_seqlens=cu, initial_state=torch.zeros_like(S0))
    torch.testing.assert_close(y0, yz)
    torch.testing.assert_close(f0, fz)


def test_mamba2_varlen_pool_form_in_place():
    (x, dt, A, B, C, D), S0 = m2_inputs(LENS, seed=1)
    cu = cu_of(LENS)
    P = 12
    slots = torch.tensor([7, 2, 11, 4, 9, 1, 5, 3])
    fresh = torch.tensor([False, True, False, True, False, False, True, False])
    pool = torch.full((P,) + S0.shape[1:], float("nan"), dtype=F64)
    pool[slots[~fresh]] = S0[~fresh]
    pool[[0, 6, 8, 10]] = 0.5  # untouched rows
    before = pool.clone()
    y, none = N2.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, state_pool=pool, slots=slots, fresh=fresh)
    assert none is None
    init = torch.where(fresh[:, None, None, None], 0.0, S0)
    yr, fr = N2.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, initial_state=init)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(pool[slots], fr)
    torch.testing.assert_close(pool[[0, 6, 8, 10]], before[[0, 6, 8, 10]])
    assert not torch.isnan(y).any()


def test_mamba2_varlen_rejects_bad_input_before_writing():
    (x, dt, A, B, C, D), S0 = m2_inputs([2, 3])
    pool = torch.randn(4, *S0.shape[1:], dtype=F64)
    before = pool.clone()
    slots = torch.tensor([1, 2])
    f = N2.chunked_prefill_varlen
    for cu, match in ((torch.tensor([0, 3, 2, 5]), "non-decreasing"), (torch.tensor([0, 2, 4]), "end at"),
                      (torch.tensor([[0, 2, 5]]), "1-D"), (torch.tensor([0.0, 2, 5]), "int32")):
        with pytest.raises(ValueError, match=match):
            f(x, dt, A, B, C, D, cu_seqlens=cu, state_pool=pool, slots=slots)
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="not both"):
        f(x, dt, A, B, C, D, cu_seqlens=cu, initial_state=S0, state_pool=pool, slots=slots)
    with pytest.raises(ValueError, match="several sequences"):
        f(x, dt, A, B, C, D, cu_seqlens=cu, state_pool=pool, slots=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"slots must be in"):
        f(x, dt, A, B, C, D, cu_seqlens=cu, state_pool=pool, slots=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="without state_pool"):
        f(x, dt, A, B, C, D, cu_seqlens=cu, slots=slots)
    with pytest.raises(ValueError, match="x must be"):
        f(x[None], dt, A, B, C, D, cu_seqlens=cu)
    with pytest.raises(ValueError, match="fresh must be"):
        f(x, dt, A, B, C, D, cu_seqlens=cu, state_pool=pool, slots=slots, fresh=torch.tensor([1, 0]))
    assert torch.equal(pool, before)
    # the null slot may repeat (padding sequences)
    f(x, dt, A, B, C, D, cu_seqlens=cu, state_pool=pool, slots=torch.tensor([0, 0]))


# ============================================================================ GDN
@pytest.mark.parametrize("chunk", [4, 64])
def test_gdn_varlen_matches_recurrence_with_u(chunk):
    (q, k, v, g, beta), S0 = gdn_inputs(LENS)
    cu = cu_of(LENS)
    y, fin, u = NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=cu, initial_state=S0, chunk_size=chunk,
                                          return_u=True)
    for i in range(len(LENS)):
        s, e = int(cu[i]), int(cu[i + 1])
        yt, ft, ut = gdn_truth(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S0[i])
        yr, fr = NG.recurrent_scan(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                                   initial_state=S0[i:i + 1])
        torch.testing.assert_close(yt, yr[0], atol=1e-12, rtol=1e-12)  # the truth is the recurrence
        torch.testing.assert_close(y[s:e], yt, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(u[s:e], ut, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(fin[i], ft, atol=1e-10, rtol=1e-10)
    y2, f2 = NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=cu, initial_state=S0, chunk_size=chunk)
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(f2, fin)


def test_gdn_varlen_pool_form_fresh_rows_never_read():
    (q, k, v, g, beta), S0 = gdn_inputs(LENS, seed=2)
    cu = cu_of(LENS)
    slots = torch.tensor([3, 9, 1, 6, 2, 8, 4, 11])
    fresh = torch.tensor([True, False, False, True, False, True, False, False])
    pool = torch.full((13,) + S0.shape[1:], float("nan"), dtype=F64)
    pool[slots[~fresh]] = S0[~fresh]
    keep = [0, 5, 7, 10, 12]
    pool[keep] = 1.25
    y, none, u = NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=cu, state_pool=pool, slots=slots,
                                           fresh=fresh, return_u=True)
    assert none is None
    init = torch.where(fresh[:, None, None, None], 0.0, S0)
    yr, fr, ur = NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=cu, initial_state=init, return_u=True)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(u, ur)
    torch.testing.assert_close(pool[slots], fr)
    assert bool((pool[keep] == 1.25).all())


def test_gdn_varlen_rejects_bad_input():
    (q, k, v, g, beta), S0 = gdn_inputs([2, 3])
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="non-decreasing"):
        NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 3, 5]))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=cu, initial_state=S0[:1])
    with pytest.raises(ValueError, match="multiple of key heads"):
        NG.chunked_prefill_varlen(q, k, v[:, :3], g[:, :3], beta[:, :3], cu_seqlens=cu)
    with pytest.raises(ValueError, match="chunk_size"):
        NG.chunked_prefill_varlen(q, k, v, g, beta, cu_seqlens=cu, chunk_size=0)


# ============================================================================ short conv
@pytest.mark.parametrize("W", [4, 2])
def test_conv_varlen_matches_per_sequence_prefill(W):
    g = torch.Generator().manual_seed(W)
    lens = [0, 1, 2, 6, 0, 3]  # shorter than W-1 keeps old window entries
    cu = cu_of(lens)
    C, P = 5, 9
    x = torch.randn(sum(lens), C + 2, generator=g, dtype=F64)[:, 1:1 + C]  # strided rows
    w = torch.randn(C, W, generator=g, dtype=F64)
    b = torch.randn(C, generator=g, dtype=F64)
    slots = torch.tensor([4, 1, 7, 2, 8, 5])
    fresh = torch.tensor([False, True, False, False, True, False])
    pool = torch.full((P, C, W - 1), float("nan"), dtype=F64)
    pool[slots[~fresh]] = torch.randn(int((~fresh).sum()), C, W - 1, generator=g, dtype=F64)
    pool[[0, 3, 6]] = 2.0
    start = pool.clone()
    out = RC.conv_prefill_varlen(x, w, b, cu, pool, slots, fresh, "silu")
    for i, L in enumerate(lens):
        s, e = int(cu[i]), int(cu[i + 1])
        win0 = torch.zeros(C, W - 1, dtype=F64) if fresh[i] else start[slots[i]]
        seq = torch.cat([win0, x[s:e].T], 1)  # [C, W-1+L]
        for t in range(L):
            ref = F.silu((seq[:, t:t + W] * w).sum(1) + b)
            torch.testing.assert_close(out[s + t], ref)
        torch.testing.assert_close(pool[slots[i]], seq[:, L:])
    assert bool((pool[[0, 3, 6]] == 2.0).all())
