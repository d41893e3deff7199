"""``ops.mamba2.naive.conv_fold`` (the prefix store's Mamba-2 fold: ``x, B`` from stored conv
inputs) against the plain recurrence over the conv of each row's whole sequence, in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayssm.cache.paged import PagedPlan
from replayssm.ops.mamba2 import naive as N2


def _case(g, seqs, bs, H, d, G, n, W, dtype=torch.float64):
    """Chains of random distinct blocks holding ``seqs`` tokens each; NaN in every row no
    chain holds.  Returns (preconv, dt, table, per-row (pre [T, C], dt [T, H]))."""
    Cch = H * d + 2 * G * n
    need = [-(-T // bs) for T in seqs]
    NB = sum(need) + 3
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seqs), max(need + [1]) + 1, dtype=torch.long)
    pre = torch.full((NB * bs, Cch), float("nan"), dtype=dtype)
    dt = torch.full((NB * bs, H), float("nan"), dtype=dtype)
    rows, k = [], 0
    for i, (T, m) in enumerate(zip(seqs, need)):
        table[i, :m] = torch.tensor(perm[k:k + m])
        k += m
        p = torch.randn(T, Cch, generator=g, dtype=dtype)
        t = torch.rand(T, H, generator=g, dtype=dtype) * 0.3
        idx = table[i, torch.arange(T) // bs] * bs + torch.arange(T) % bs
        pre[idx], dt[idx] = p, t
        rows.append((p, t))
    return pre, dt, table, rows


def _truth(p, t, lo, hi, w, b, A, H, d, G, n, S0):
    """The recurrence over positions lo..hi-1 of one sequence: x, B = silu(causal conv)."""
    W = w.shape[1]
    xb = F.silu(F.conv1d(F.pad(p.T[None], (W - 1, 0)), w[:, None], b, groups=p.shape[1])[0].T)
    S = S0.clone()
    for j in range(lo, hi):
        x = xb[j, :H * d].reshape(H, d)
        B = xb[j, H * d:H * d + G * n].reshape(G, n).repeat_interleave(H // G, 0)
        S = torch.exp(A * t[j])[:, None, None] * S + t[j][:, None, None] * x[:, :, None] * B[:, None, :]
    return S


@pytest.mark.parametrize("bias", [True, False])
def test_conv_fold_is_the_recurrence_over_the_conv(bias):
    g = torch.Generator().manual_seed(3)
    H, d, G, n, W, bs = 4, 3, 2, 5, 4, 4
    seqs = [13, 9, 1, 20, 8]
    starts = [4, 0, 0, 8, 8]                                   # block boundaries; a window reads back
    counts = [9, 9, 1, 7, 0]                                   # the last row folds nothing
    pre, dt, table, rows = _case(g, seqs, bs, H, d, G, n, W)
    w = torch.randn(pre.shape[1], W, generator=g, dtype=torch.float64)
    b = torch.randn(pre.shape[1], generator=g, dtype=torch.float64) if bias else None
    A = -torch.rand(H, generator=g, dtype=torch.float64) - 0.1
    S0 = torch.randn(len(seqs), H, d, n, generator=g, dtype=torch.float64)
    plan = PagedPlan(torch.zeros(len(seqs), dtype=torch.long), torch.tensor(counts), table, 1, bs)
    before = (pre.clone(), dt.clone())
    got = N2.conv_fold(pre, dt, plan, torch.tensor(starts), w, b, A, S0, head_dim=d, ngroups=G, d_state=n)
    for i, ((p, t), s0, c0, m) in enumerate(zip(rows, starts, counts, counts)):
        want = _truth(p, t, s0, s0 + m, w, b, A, H, d, G, n, S0[i])
        torch.testing.assert_close(got[i], want, atol=1e-10, rtol=1e-10)
    assert torch.equal(got[4], S0[4])
    assert torch.equal(torch.nan_to_num(before[0], 7.0), torch.nan_to_num(pre, 7.0))
    assert torch.equal(torch.nan_to_num(before[1], 7.0), torch.nan_to_num(dt, 7.0))


def test_conv_fold_refuses_bad_calls():
    g = torch.Generator().manual_seed(4)
    H, d, G, n, W, bs = 2, 3, 1, 4, 4, 4
    pre, dt, table, _ = _case(g, [8], bs, H, d, G, n, W)
    w = torch.randn(pre.shape[1], W, dtype=torch.float64)
    A = -torch.rand(H, dtype=torch.float64)
    plan = PagedPlan(torch.zeros(1, dtype=torch.long), torch.tensor([8]), table, 1, bs)
    kw = dict(head_dim=d, ngroups=G, d_state=n)
    with pytest.raises(ValueError, match="conv channels"):
        N2.conv_fold(pre, dt, plan, torch.tensor([0]), w, None, A, head_dim=d + 9, ngroups=G, d_state=n)
    with pytest.raises(ValueError, match="conv_weight"):
        N2.conv_fold(pre, dt, plan, torch.tensor([0]), w[1:], None, A, **kw)
    with pytest.raises(ValueError, match="start"):
        N2.conv_fold(pre, dt, plan, torch.tensor([0.0]), w, None, A, **kw)
    with pytest.raises(ValueError, match="inside each row"):
        N2.conv_fold(pre, dt, plan, torch.tensor([8]), w, None, A, **kw)     # 8 + 8 > the table's 12 rows
    with pytest.raises(ValueError, match="initial_state"):
        N2.conv_fold(pre, dt, plan, torch.tensor([0]), w, None, A, torch.zeros(2, H, d, n), **kw)
