"""Packed prefill kernels (``kernels/mamba2_prefill.py``, ``kernels/gdn_prefill.py``,
``kernels/conv.conv_prefill_varlen``) against their reference twins.

On CPU the Triton interpreter runs tiny odd shapes: kernel chunks that do not divide the
lengths, lengths 1 and chunk±1, empty and one-token sequences inside the batch, nonzero
initial states, groups / GVA, pool slots in random order with fresh and cached sequences
mixed, NaN-poisoned pool rows (fresh rows must not be read, rows outside ``slots`` must not
be touched) and NaN-poisoned output allocations (every output element must be written).
Outputs, final states, pool rows and GDN's ``u`` are compared.  (The interpreter's bf16
``tl.dot`` is unreliable, so 16-bit inputs are tested in fp16 here; bf16 runs on the GPU.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.ops.conv import naive as RC  # noqa: E402
from replayssm.kernels import conv as KC  # noqa: E402
from replayssm.kernels import dispatch  # noqa: E402
from replayssm.kernels import gdn_prefill as KG  # noqa: E402
from replayssm.kernels import mamba2_prefill as KM  # noqa: E402
from replayssm.ops.gdn import naive as NG  # noqa: E402
from replayssm.ops.mamba2 import naive as N2  # noqa: E402

DEVICE = kernel_device()
F32, F16 = torch.float32, torch.float16


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)


def tol(dtype):
    return dict(atol=2e-5, rtol=2e-4) if dtype == F32 else dict(atol=2e-2, rtol=2e-2)


def pool_case(g, N, shape, P):
    """Random distinct slots (random order), fresh flags mixed, NaN everywhere except the
    cached rows; returns ``(pool, slots, fresh, cached, untouched rows)``."""
    slots = (torch.randperm(P - 1, generator=g)[:N] + 1)
    fresh = torch.rand(N, generator=g) < 0.4
    fresh[0], fresh[1] = True, False
    pool = torch.full((P,) + shape, float("nan"))
    cached = torch.randn((N,) + shape, generator=g) * 0.3
    pool[slots[~fresh]] = cached[~fresh]
    others = sorted(set(range(P)) - set(slots.tolist()))
    return pool.to(DEVICE), slots.to(DEVICE), fresh.to(DEVICE), cached.to(DEVICE), others


def m2_inputs(g, lens, H, G, d, n, dtype):
    Nt = sum(lens)
    x = torch.randn(Nt, H, d, generator=g)
    dt = F.softplus(torch.randn(Nt, H, generator=g))
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    B = torch.randn(Nt, G, n, generator=g)
    C = torch.randn(Nt, G, n, generator=g)
    D = torch.randn(H, generator=g)
    return [t.to(DEVICE) for t in (x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D)]


# ============================================================================ Mamba-2
@pytest.mark.parametrize("dtype,block_t", [(F32, 16), (F16, 32)])
def test_mamba2_prefill_kernel_matches_reference(dtype, block_t, nan_empty):
    g = torch.Generator().manual_seed(block_t)
    lens = [0, 17, 1, 15, 0, 33, 16, 3]  # block 16: chunk±1, 1, 2 chunks+1, empties
    H, G, d, n = 4, 2, 5, 7
    x, dt, A, B, C, D = m2_inputs(g, lens, H, G, d, n, dtype)
    cu = cu_of(lens)
    S0 = (torch.randn(len(lens), H, d, n, generator=g) * 0.3).to(DEVICE)
    y, fin = KM.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, initial_state=S0, block_t=block_t)
    yr, fr = N2.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, initial_state=S0)
    torch.testing.assert_close(y.float(), yr.float(), **tol(dtype))
    torch.testing.assert_close(fin, fr, **tol(dtype))
    # pool form, no D
    pool, slots, fresh, _, others = pool_case(g, len(lens), (H, d, n), 13)
    ref_pool = pool.clone()
    y, none = KM.chunked_prefill_varlen(x, dt, A, B, C, None, cu_seqlens=cu, state_pool=pool, slots=slots,
                                        fresh=fresh, block_t=block_t, block_d=16)
    yr, _ = N2.chunked_prefill_varlen(x, dt, A, B, C, None, cu_seqlens=cu, state_pool=ref_pool, slots=slots,
                                      fresh=fresh)
    assert none is None
    torch.testing.assert_close(y.float(), yr.float(), **tol(dtype))
    torch.testing.assert_close(pool[slots], ref_pool[slots], **tol(dtype))
    assert torch.isnan(pool[others]).all(), "rows outside slots were written"


def test_mamba2_prefill_kernel_strided_inputs_and_zero_tokens():
    g = torch.Generator().manual_seed(3)
    H, G, d, n = 2, 1, 16, 16
    lens = [5, 0, 20]
    Nt = sum(lens)
    # x, B, C as slices of one projection row (as the layer's xBC split), dt strided too
    proj = torch.randn(Nt, H * d + 2 * G * n + 3, generator=g).to(DEVICE)
    x = proj[:, :H * d].view(Nt, H, d)
    B = proj[:, H * d:H * d + G * n].view(Nt, G, n)
    C = proj[:, H * d + G * n:H * d + 2 * G * n].view(Nt, G, n)
    dt = F.softplus(torch.randn(Nt, 2 * H, generator=g)).to(DEVICE)[:, ::2]
    A = -torch.rand(H, generator=g).to(DEVICE)
    cu = cu_of(lens)
    y, fin = KM.chunked_prefill_varlen(x, dt, A, B, C, cu_seqlens=cu, block_t=16)
    yr, fr = N2.chunked_prefill_varlen(x, dt, A, B, C, cu_seqlens=cu)
    torch.testing.assert_close(y, yr, **tol(F32))
    torch.testing.assert_close(fin, fr, **tol(F32))
    assert bool((fin[1] == 0).all())
    # no tokens at all: final = initial
    S0 = torch.randn(2, H, d, n, generator=g).to(DEVICE)
    e = torch.zeros(0, device=DEVICE)
    y0, f0 = KM.chunked_prefill_varlen(e.view(0, H, d), e.view(0, H), A, e.view(0, G, n), e.view(0, G, n),
                                       cu_seqlens=cu_of([0, 0]), initial_state=S0)
    assert y0.shape == (0, H, d) and torch.equal(f0, S0)


def test_mamba2_prefill_kernel_rejects_bad_input():
    g = torch.Generator().manual_seed(0)
    x, dt, A, B, C, D = m2_inputs(g, [3], 2, 1, 4, 4, F32)
    cu = cu_of([3])
    with pytest.raises(ValueError, match="fp64 runs the reference op"):
        KM.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu,
                                  initial_state=torch.zeros(1, 2, 4, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="block_t"):
        KM.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, block_t=24)
    with pytest.raises(ValueError, match="end at"):
        KM.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu_of([2]), check=True)


# ============================================================================ GDN
def gdn_inputs(g, lens, H, HV, K, V, dtype):
    Nt = sum(lens)
    q = torch.randn(Nt, H, K, generator=g)
    k = torch.randn(Nt, H, K, generator=g)
    v = torch.randn(Nt, HV, V, generator=g)
    gg = -F.softplus(torch.randn(Nt, HV, generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(Nt, HV, generator=g))
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), gg, beta)]


@pytest.mark.parametrize("dtype", [F32, F16])
def test_gdn_prefill_kernel_matches_reference(dtype, nan_empty):
    g = torch.Generator().manual_seed(7 if dtype == F32 else 8)
    lens = [0, 65, 1, 63, 0, 64, 2]  # chunk 64: chunk±1, chunk, 1, empties
    H, HV, K, V = 2, 4, 6, 5  # GVA: HV = 2H
    q, k, v, gg, beta = gdn_inputs(g, lens, H, HV, K, V, dtype)
    cu = cu_of(lens)
    if dtype == F32:
        S0 = (torch.randn(len(lens), HV, K, V, generator=g) * 0.3).to(DEVICE)
        y, fin, u = KG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, initial_state=S0, return_u=True)
        yr, fr, ur = NG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, initial_state=S0, return_u=True)
        torch.testing.assert_close(fin, fr, **tol(dtype))
    else:  # pool form, explicit scale
        pool, slots, fresh, _, others = pool_case(g, len(lens), (HV, K, V), 11)
        ref_pool = pool.clone()
        y, none, u = KG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, state_pool=pool, slots=slots,
                                               fresh=fresh, scale=0.7, return_u=True, block_v=16)
        yr, _, ur = NG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, state_pool=ref_pool, slots=slots,
                                              fresh=fresh, scale=0.7, return_u=True)
        assert none is None
        torch.testing.assert_close(pool[slots], ref_pool[slots], **tol(dtype))
        assert torch.isnan(pool[others]).all(), "rows outside slots were written"
    torch.testing.assert_close(y.float(), yr.float(), **tol(dtype))
    torch.testing.assert_close(u.float(), ur.float(), **tol(dtype))


def test_gdn_prefill_kernel_without_l2norm_and_no_u():
    g = torch.Generator().manual_seed(11)
    lens = [3, 0, 20]
    q, k, v, gg, beta = gdn_inputs(g, lens, 1, 1, 16, 16, F32)
    q, k = q * 0.2, k * 0.2
    cu = cu_of(lens)
    out = KG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, use_qk_l2norm=False)
    ref = NG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, use_qk_l2norm=False)
    assert len(out) == 2
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **tol(F32))


# ============================================================================ conv
@pytest.mark.parametrize("W,dtype,act", [(4, F32, "silu"), (2, F16, None), (1, F32, "silu")])
def test_conv_prefill_varlen_kernel_matches_reference(W, dtype, act):
    g = torch.Generator().manual_seed(W)
    lens = [0, 1, 2, 37, 0, 3, 5]  # shorter than W-1 keeps old window entries
    C, P = 19, 11
    cu = cu_of(lens)
    x = torch.randn(sum(lens), C + 4, generator=g).to(dtype).to(DEVICE)[:, 2:2 + C]  # strided rows
    w = torch.randn(C, W, generator=g).to(DEVICE)
    b = torch.randn(C, generator=g).to(DEVICE)
    pool, slots, fresh, _, others = pool_case(g, len(lens), (C, W - 1), P)
    pool = pool.to(dtype)
    ref_pool = pool.clone()
    out = KC.conv_prefill_varlen(x, w, b, cu, pool, slots, fresh, act, block_t=16, block_c=16)
    ref = RC.conv_prefill_varlen(x, w, b, cu, ref_pool, slots, fresh, act)
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))
    torch.testing.assert_close(pool[slots], ref_pool[slots], atol=0, rtol=0)
    assert torch.isnan(pool[others].float()).all() or W == 1


# ============================================================================ routing
def test_dispatch_routes_packed_prefill():
    g = torch.Generator().manual_seed(5)
    lens = [4, 0, 9]
    cu = cu_of(lens)
    x, dt, A, B, C, D = m2_inputs(g, lens, 2, 1, 4, 4, F32)
    ops = dispatch.ops_for("mamba2")
    ya, fa = ops.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, block_t=16)  # kernel-only kw dropped
    yk, fk = dispatch.KernelOps("mamba2", backend="triton").chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu,
                                                                                    block_t=16)
    torch.testing.assert_close(ya, yk, **tol(F32))
    torch.testing.assert_close(fa, fk, **tol(F32))
    # fp64 stays on the reference under "auto", whatever the device
    y64, _ = ops.chunked_prefill_varlen(x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(),
                                        cu_seqlens=cu)
    assert y64.dtype == torch.float64
    q, k, v, gg, beta = gdn_inputs(g, lens, 1, 2, 4, 4, F32)
    y, S, u = dispatch.ops_for("gdn").chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, return_u=True)
    assert u.shape == v.shape and S.shape == (3, 2, 4, 4)
    w = torch.randn(8, 4, generator=g).to(DEVICE)
    pool = torch.zeros(4, 8, 3, device=DEVICE)
    xc = torch.randn(13, 8, generator=g).to(DEVICE)
    out = dispatch.ops_for("conv").conv_prefill_varlen(xc, w, None, cu, pool, torch.tensor([1, 2, 3], device=DEVICE))
    assert out.shape == (13, 8) and bool((pool[2] == 0).all())


# ============================================================================ kernel variants
@pytest.mark.parametrize("inv", [0, 1, 2])
def test_gdn_prefill_inverse_variants(inv):
    """Every diagonal-block inverse of the w/u kernel (loop on the tile, loop on [4,16,16],
    nilpotent product) gives the reference."""
    g = torch.Generator().manual_seed(20 + inv)
    lens = [70, 0, 5]
    q, k, v, gg, beta = gdn_inputs(g, lens, 1, 2, 8, 8, F32)
    beta = torch.ones_like(beta) * 0.99  # strong coupling: the inverse matters
    cu = cu_of(lens)
    y, S, u = KG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, return_u=True, inv=inv)
    yr, Sr, ur = NG.chunked_prefill_varlen(q, k, v, gg, beta, cu_seqlens=cu, return_u=True)
    for a, b in ((y, yr), (S, Sr), (u, ur)):
        torch.testing.assert_close(a, b, **tol(F32))


@pytest.mark.parametrize("pre", [False, True])
def test_mamba2_prefill_cb_variants(pre):
    g = torch.Generator().manual_seed(30)
    lens = [20, 0, 33, 1]
    x, dt, A, B, C, D = m2_inputs(g, lens, 4, 2, 8, 8, F32)
    cu = cu_of(lens)
    y, S = KM.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu, block_t=16, precompute_cb=pre)
    yr, Sr = N2.chunked_prefill_varlen(x, dt, A, B, C, D, cu_seqlens=cu)
    torch.testing.assert_close(y, yr, **tol(F32))
    torch.testing.assert_close(S, Sr, **tol(F32))


def test_gdn_prefill_inverse_precision_rule():
    """TF32 block inverse only where it was checked exact on the H100 (16-bit, K >= 128);
    small heads, where Triton 3.6 produced a wrong TF32 inverse, take IEEE."""
    rule = KG._inverse_precision
    assert rule(torch.bfloat16, 128, "ieee") == "tf32"
    assert rule(torch.float16, 256, "ieee") == "tf32"
    for K in (6, 16, 32, 64):
        assert rule(torch.bfloat16, K, "ieee") == "ieee"
    assert rule(F32, 128, "ieee") == "ieee"
