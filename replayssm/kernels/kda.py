"""Triton kernels for KDA (Kimi Delta Attention) replay decoding: replay decode, replay verify
and tree verify (the forms of ``docs/MATH.md``, "KDA"), with the arguments, results and
cache writes of :mod:`replayssm.ops.kda.naive`.

Layouts (contiguous): state ``[P,HV,K,V]`` (``Sᵀ``) fp32; ring ``u [P,L,HV,V]``,
``k [P,L,H,K]``, ``g [P,L,HV,K]`` (a log-decay per key channel, fp32).  One program per
(row, value head, V-block) holds the whole K axis.  It rebuilds its ``[K, BV]`` tile of
``S_h = e^{tot} ⊙ S0 + Σ_j (e^{tot − cum_j} ⊙ k_j) ⊗ u_j`` (``cum_j`` the inclusive per-channel
cumulative log-decay of the ring, ``tot`` its sum; one ``tl.dot``) and reads it out:

* decode: ``u = β (v − S_h(α ⊙ k))``, ``y = S_h(α ⊙ q) + u (k·q)`` (``α = e^g``); appends
  ``(u, k, g)`` at ring position ``h`` in the same kernel (never a position the history
  reads); a flush row stores ``α ⊙ S_h + k ⊗ u`` from the entry as the ring stores it;
* verify (chain or tree, ancestor-or-self bits): ``G_s`` = per-channel path sum of the drafts'
  log-decays; ``HK_s = S_h(e^{G_s} ⊙ k_s)``, ``HQ_s`` likewise; the T×T system
  ``(I + A) U = β ∘ (V − HK)``, ``A[s,s'] = β_s Σ_c k_s k_s' e^{G_s − G_s'}`` (s' a strict
  ancestor) by forward substitution; ``Y = HQ + M U`` with ``M[s,s'] = Σ_c q_s k_s' e^{G_s − G_s'}``
  (s' an ancestor or s).  Flush rows store ``S_h``; the entries are appended by
  :func:`~replayssm.kernels.append.append_entries` after the kernel (a flushing step may
  overwrite ring positions other programs still read).

The state route is the only one (``route="output"`` is accepted and gives the same numbers
up to rounding, as in the reference).  ``precision``: the ``tl.dot`` input precision of the
history rebuild and the verify products (``"ieee"``, ``"tf32"``, ``"tf32x3"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, check_ring, flat_grid, next_pow2, pad16, tile, tile_ids, triton, tl
from ._triton import contiguous as _c
from ..ops.common import check_route, want_check
from ..ops.kda import naive as _ref
from .append import append_entries
from .mamba2 import tree_bits

__all__ = ["replay_decode", "replay_verify", "tree_verify"]

_ROUTES = ("state", "output")

if HAVE_TRITON:

    @triton.jit
    def _l2n_rows(x, L2: tl.constexpr):
        if L2:
            x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        return x

    @triton.jit
    def _history_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot, start, h, hv, kh, offs_k, mk, offs_v, mv,
                      L, H, HV, K, V, LP: tl.constexpr, PREC: tl.constexpr):
        """``[BK, BV]`` tile of ``S_h`` from the checkpoint and the ``h`` committed entries."""
        jj = tl.arange(0, LP)
        mj = jj < h
        e = slot * L + (start + jj) % L
        mjk = mj[:, None] & mk[None, :]
        Gh = tl.load(gr_ptr + (e[:, None] * HV + hv) * K + offs_k[None, :], mask=mjk, other=0.0).to(tl.float32)
        cum = tl.cumsum(Gh, 0)
        tot = tl.sum(Gh, 0)
        W = tl.where(mjk, tl.exp(tot[None, :] - cum), 0.0)
        Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mjk, other=0.0).to(tl.float32)
        Uh = tl.load(ur_ptr + (e[:, None] * HV + hv) * V + offs_v[None, :], mask=mj[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        soff = ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
        S0 = tl.load(state_ptr + soff, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
        return tl.exp(tot)[:, None] * S0 + tl.dot(tl.trans(Kh * W), Uh, input_precision=PREC), soff

    @triton.jit
    def _kda_decode_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr,
        L, H, HV, K, V, REP, scale,
        LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    ):
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)  # V-blocks of one (row, head) side by side
        kh = hv // REP
        r64 = r.to(tl.int64)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        start = tl.load(start_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        Sh, soff = _history_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot, start, h, hv, kh, offs_k, mk, offs_v, mv,
                                 L, H, HV, K, V, LP, PREC)
        q = tl.load(q_ptr + (r64 * H + kh) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (r64 * H + kh) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        if L2:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        gv = tl.load(g_ptr + (r64 * HV + hv) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (r64 * HV + hv) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + r64 * HV + hv).to(tl.float32)
        a = tl.exp(gv)
        hk = tl.sum(Sh * (a * k)[:, None], 0)
        hq = tl.sum(Sh * (a * q)[:, None], 0)
        u = beta * (v - hk)
        y = hq + u * tl.sum(k * q, 0)
        tl.store(y_ptr + (r64 * HV + hv) * V + offs_v, y.to(y_ptr.dtype.element_ty), mask=mv)
        # ---- append (u, k, g) at ring position h (not an entry the history reads)
        enew = slot * L + (start + h) % L
        us = u.to(ur_ptr.dtype.element_ty)
        tl.store(ur_ptr + (enew * HV + hv) * V + offs_v, us, mask=mv)
        ks = k.to(kr_ptr.dtype.element_ty)
        gs = gv.to(gr_ptr.dtype.element_ty)
        if vb == 0:
            tl.store(gr_ptr + (enew * HV + hv) * K + offs_k, gs, mask=mk)
            if hv % REP == 0:
                tl.store(kr_ptr + (enew * H + kh) * K + offs_k, ks, mask=mk)
        if tl.load(flush_ptr + r) != 0:   # S_{h+1} from the entry as the ring stores it
            Sn = tl.exp(gs.to(tl.float32))[:, None] * Sh + ks.to(tl.float32)[:, None] * us.to(tl.float32)[None, :]
            tl.store(state_ptr + soff, Sn.to(state_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])

    @triton.jit
    def _kda_verify_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bits_ptr, y_ptr, uo_ptr, ko_ptr,
        T, L, H, HV, K, V, REP, scale,
        TP: tl.constexpr, LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
        TREE: tl.constexpr, PREC: tl.constexpr,
    ):
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)
        kh = hv // REP
        r64 = r.to(tl.int64)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        start = tl.load(start_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        Sh, soff = _history_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot, start, h, hv, kh, offs_k, mk, offs_v, mv,
                                 L, H, HV, K, V, LP, PREC)
        ss = tl.arange(0, TP)
        ms = ss < T
        tok = r64 * T + ss
        mks = ms[:, None] & mk[None, :]
        Qn = _l2n_rows(tl.load(q_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks,
                               other=0.0).to(tl.float32), L2) * scale
        Kn = _l2n_rows(tl.load(k_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks,
                               other=0.0).to(tl.float32), L2)
        Gn = tl.load(g_ptr + (tok[:, None] * HV + hv) * K + offs_k[None, :], mask=mks, other=0.0).to(tl.float32)
        Vn = tl.load(v_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], mask=ms[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        bn = tl.load(b_ptr + tok * HV + hv, mask=ms, other=0.0).to(tl.float32)
        if TREE:
            bits = tl.load(bits_ptr + tok, mask=ms, other=0)
        else:
            bits = (2 << ss) - 1
        anc = (((bits[:, None] >> ss[None, :]) & 1) != 0) & ms[:, None] & ms[None, :]   # [s, s']
        ancf = tl.where(anc, 1.0, 0.0)
        # ---- per-channel path log-decays G_s = Σ_{s' ancestor-or-self} g_s'
        Gs = tl.zeros([TP, BK], dtype=tl.float32)
        for j in tl.static_range(TP):
            if j < T:
                gj = tl.sum(tl.where(ss[:, None] == j, Gn, 0.0), 0)
                cj = tl.sum(tl.where(ss[None, :] == j, ancf, 0.0), 1) > 0.0
                Gs += tl.where(cj[:, None], gj[None, :], 0.0)
        eG = tl.exp(Gs)
        HK = tl.dot(Kn * eG, Sh, input_precision=PREC)
        HQ = tl.dot(Qn * eG, Sh, input_precision=PREC)
        # ---- rows of the pairwise products with their per-channel decays
        KK = tl.zeros([TP, TP], dtype=tl.float32)
        QK = tl.zeros([TP, TP], dtype=tl.float32)
        for s in tl.static_range(TP):
            if s < T:
                row = ss[:, None] == s
                ks = tl.sum(tl.where(row, Kn, 0.0), 0)
                qs = tl.sum(tl.where(row, Qn, 0.0), 0)
                gs_ = tl.sum(tl.where(row, Gs, 0.0), 0)
                arow = tl.sum(tl.where(row, ancf, 0.0), 0) > 0.0                       # [s'] ancestors of s
                D = tl.exp(tl.where(arow[:, None] & mk[None, :], gs_[None, :] - Gs, 0.0))  # [s', BK]
                KK = tl.where(row, tl.sum(Kn * ks[None, :] * D, 1)[None, :], KK)
                QK = tl.where(row, tl.sum(Kn * qs[None, :] * D, 1)[None, :], QK)
        strict = anc & (ss[:, None] != ss[None, :])
        Amat = tl.where(strict, bn[:, None] * KK, 0.0)
        U = bn[:, None] * (Vn - HK)
        for i in range(1, T):   # forward substitution (topological order: ancestors first)
            sel = ss[:, None] == i
            arow = tl.sum(tl.where(sel, Amat, 0.0), 0)
            U = tl.where(sel, U - tl.sum(arow[:, None] * U, 0)[None, :], U)
        Y = HQ + tl.dot(tl.where(anc, QK, 0.0), U, input_precision=PREC)
        mo = ms[:, None] & mv[None, :]
        tl.store(y_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], Y.to(y_ptr.dtype.element_ty), mask=mo)
        tl.store(uo_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], U.to(uo_ptr.dtype.element_ty), mask=mo)
        if vb == 0:
            if hv % REP == 0:
                tl.store(ko_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], Kn.to(ko_ptr.dtype.element_ty),
                         mask=mks)
        if tl.load(flush_ptr + r) != 0:   # the checkpoint becomes S_h (committed entries only)
            tl.store(state_ptr + soff, Sh.to(state_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])


# =============================================================================== wrappers
def _scale(scale, K):
    return K ** -0.5 if scale is None else float(scale)


def _check(buf, plan, kind, q, k, v, g, beta, scale, route, check, has_time):
    """The reference op's checks (nothing is written before they pass), plus contiguous buffers."""
    check_route(route, _ROUTES)
    dims = _ref._check_inputs(q, k, v, g, beta, has_time, scale)
    _ref._check_buffers(buf, plan, kind, dims, q.device, want_check(check, q))
    Bt, T, H, HV, K, V = dims
    P, L = buf.state.shape[0], plan.capacity
    check_ring((("state", buf.state, (P, HV, K, V)), ("u", buf.u, (P, L, HV, V)), ("k", buf.k, (P, L, H, K)),
                ("g", buf.g, (P, L, HV, K))), plan, Bt, T)
    if buf.state.dtype != torch.float32:
        raise ValueError(f"the KDA kernels keep fp32 states, got {buf.state.dtype}")
    return dims


def replay_decode(buf, plan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  scale: float | None = None, use_qk_l2norm: bool = True, route: str = "state",
                  check: bool | None = None, block_v: int | None = None, num_warps: int = 4,
                  precision: str = "ieee") -> Tensor:
    """Replay decode of one token per row (the reference op's contract); one launch."""
    Bt, _, H, HV, K, V = _check(buf, plan, "decode", q, k, v, g, beta, scale, route, check, False)
    q, k, v, g, beta = (_c(t) for t in (q, k, v, g, beta))
    y = torch.empty_like(v)
    if Bt == 0:
        return y
    BV = tile(V, block_v, 32)
    L = plan.capacity
    _kda_decode_kernel[flat_grid(triton.cdiv(V, BV), HV, Bt)](
        buf.state, buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.flush,
        q, k, v, g, beta, y, L, H, HV, K, V, HV // H, _scale(scale, K),
        LP=pad16(L), BK=pad16(K), BV=BV, L2=bool(use_qk_l2norm), PREC=precision, num_warps=num_warps)
    return y


def _verify(buf, plan, bits, q, k, v, g, beta, scale, use_qk_l2norm, block_v, num_warps, precision) -> Tensor:
    Bt, T, H, K = q.shape
    HV, V = v.shape[-2:]
    q, k, v, g, beta = (_c(t) for t in (q, k, v, g, beta))
    y = torch.empty_like(v)
    if Bt == 0 or T == 0:
        return y
    U = torch.empty(Bt, T, HV, V, dtype=buf.u.dtype, device=v.device)
    Kn = torch.empty(Bt, T, H, K, dtype=buf.k.dtype, device=v.device)
    BV = tile(V, block_v, 32)
    L = plan.capacity
    _kda_verify_kernel[flat_grid(triton.cdiv(V, BV), HV, Bt)](
        buf.state, buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.flush,
        q, k, v, g, beta, bits if bits is not None else plan.slot, y, U, Kn,
        T, L, H, HV, K, V, HV // H, _scale(scale, K),
        TP=max(16, next_pow2(T)), LP=pad16(L), BK=pad16(K), BV=BV, L2=bool(use_qk_l2norm), TREE=bits is not None,
        PREC=precision, num_warps=num_warps)
    append_entries((buf.u, buf.k, buf.g), (U, Kn, g), plan.slot, plan.start, plan.hist, None, L)
    return y


def replay_verify(buf, plan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  scale: float | None = None, use_qk_l2norm: bool = True, route: str = "state",
                  check: bool | None = None, block_v: int | None = None, num_warps: int = 4,
                  precision: str = "ieee") -> Tensor:
    """Replay verify of T drafts per row (the reference op's contract): the verify kernel
    (flush rows store ``S_h``), then one append launch."""
    _check(buf, plan, "verify", q, k, v, g, beta, scale, route, check, True)
    return _verify(buf, plan, None, q, k, v, g, beta, scale, use_qk_l2norm, block_v, num_warps, precision)


def tree_verify(buf, plan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                scale: float | None = None, use_qk_l2norm: bool = True, route: str = "state",
                check: bool | None = None, bits: Tensor | None = None, block_v: int | None = None,
                num_warps: int = 4, precision: str = "ieee") -> Tensor:
    """Tree verify of N nodes per row (at most 31: the ancestor bitmasks are int32)."""
    dims = _check(buf, plan, "tree", q, k, v, g, beta, scale, route, check, True)
    Bt, N = dims[0], dims[1]
    ck = want_check(check, q, parent) if isinstance(parent, Tensor) else True
    _ref.check_tree(parent, Bt, N, q.device, ck)
    if N > 31:
        raise ValueError(f"tree_verify kernel takes at most 31 nodes per tree (int32 ancestor bits), got {N}")
    if bits is None:
        bits = tree_bits(parent, Bt)
    return _verify(buf, plan, bits.to(torch.int32).contiguous(), q, k, v, g, beta, scale, use_qk_l2norm,
                   block_v, num_warps, precision)
