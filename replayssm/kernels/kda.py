"""Triton kernels for KDA (Kimi Delta Attention) decoding: replay decode, replay verify,
tree verify and the KV-only form (the forms of ``docs/MATH.md``, "KDA"), with the arguments,
results and cache writes of :mod:`replayssm.ops.kda.naive`.

Layouts (contiguous): state ``[P,HV,K,V]`` (``Sᵀ``) fp32; ring ``u [P,L,HV,V]``,
``k [P,L,H,K]``, ``g [P,L,HV,K]`` (a log-decay per key channel, fp32); KV-only pages
``[NB·bs, ...]`` of the same entries.  One program per (row, value head, V-block) holds the
whole K axis.  It builds its ``[K, BV]`` tile of ``S_h`` from the checkpoint (zeros in the
KV-only form) and the ``h`` committed entries, 16 at a time, oldest first:
``S ← e^{tot_c} ⊙ S + Σ_{j∈c} (e^{tot_c − cum_j} ⊙ k_j) ⊗ u_j`` (``cum_j`` the inclusive
per-channel cumulative log-decay within the chunk, ``tot_c`` its sum; one ``tl.dot``), then:

* decode: ``u = β (v − S_h(α ⊙ k))``, ``y = S_h(α ⊙ q) + u (k·q)`` (``α = e^g``); appends
  ``(u, k, g)`` at ring position ``h`` in the same kernel (never a position the history
  reads); a flush row stores ``α ⊙ S_h + k ⊗ u`` from the entry as the ring stores it;
* verify (chain, or tree by ancestor-or-self bits; ring or pages): ``G_s`` = per-channel
  path sum of the drafts' log-decays; ``HK_s = S_h(e^{G_s} ⊙ k_s)``, ``HQ_s`` likewise; the
  T×T system ``(I + A) U = β ∘ (V − HK)``, ``A[s,s'] = β_s Σ_c k_s k_s' e^{G_s − G_s'}`` (s' a
  strict ancestor) by forward substitution; ``Y = HQ + M U`` with
  ``M[s,s'] = Σ_c q_s k_s' e^{G_s − G_s'}`` (s' an ancestor or s).  Ring flush rows store
  ``S_h``; the entries are appended by :func:`~replayssm.kernels.append.append_entries`
  after the kernel (a flushing step may overwrite ring positions other programs still read).
  The KV-only form takes steps of at most :data:`KV_MAX_NEW` new tokens (``SUPPORTS``:
  a longer KV-only prefill runs the reference's chunked scan).

The state route is the only one (``route="output"`` is accepted and gives the same numbers
up to rounding, as in the reference).  ``precision``: the ``tl.dot`` input precision of the
history fold and the verify products (``"ieee"``, ``"tf32"``, ``"tf32x3"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, check_ring, few_new_tokens, flat_grid, next_pow2, pad16, tile, tile_ids, triton, tl
from ._triton import contiguous as _c
from ..ops.common import check_route, check_tree, want_check
from ..ops.kda import naive as _ref
from .append import append_entries
from .mamba2 import tree_bits

__all__ = ["replay_decode", "replay_verify", "tree_verify", "kv_verify", "kv_tree_verify"]

_ROUTES = ("state", "output")

if HAVE_TRITON:

    @triton.jit
    def _l2n_rows(x, L2: tl.constexpr):
        if L2:
            x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        return x

    @triton.jit
    def _history_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, bt_ptr, r, hv, kh,
                      offs_k, mk, offs_v, mv, L, MAXB, H, HV, K, V,
                      BK: tl.constexpr, BV: tl.constexpr, LC: tl.constexpr, PAGED: tl.constexpr,
                      PREC: tl.constexpr):
        """``[BK, BV]`` tile of ``S_h``: the checkpoint (zeros when ``PAGED``: the KV-only form)
        folded with the ``h`` committed entries, ``LC`` at a time, oldest first:
        ``S ← e^{tot_c} ⊙ S + Σ_{j∈c} (e^{tot_c − cum_j} ⊙ k_j) ⊗ u_j`` (one ``tl.dot`` per chunk).
        Entries: ring ``slot·L + (start + j) mod L``; paged: block ``bt[r, j // L]`` (``L`` the
        block size).  Returns ``(S_h tile, its state offsets, slot, h)``."""
        slot = tl.load(slot_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        m2 = mk[:, None] & mv[None, :]
        soff = ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
        if PAGED:
            Sh = tl.zeros([BK, BV], dtype=tl.float32)
            start = h * 0
        else:
            Sh = tl.load(state_ptr + soff, mask=m2, other=0.0).to(tl.float32)
            start = tl.load(start_ptr + r).to(tl.int64)
        for c0 in range(0, h.to(tl.int32), LC):
            jj = c0 + tl.arange(0, LC)
            mj = jj < h
            if PAGED:
                blk = tl.load(bt_ptr + r.to(tl.int64) * MAXB + jj // L, mask=mj, other=0).to(tl.int64)
                e = blk * L + jj % L
            else:
                e = slot * L + (start + jj) % L
            mjk = mj[:, None] & mk[None, :]
            Gh = tl.load(gr_ptr + (e[:, None] * HV + hv) * K + offs_k[None, :], mask=mjk, other=0.0).to(tl.float32)
            cum = tl.cumsum(Gh, 0)
            tot = tl.sum(Gh, 0)
            W = tl.where(mjk, tl.exp(tot[None, :] - cum), 0.0)
            Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mjk, other=0.0).to(tl.float32)
            Uh = tl.load(ur_ptr + (e[:, None] * HV + hv) * V + offs_v[None, :], mask=mj[:, None] & mv[None, :],
                         other=0.0).to(tl.float32)
            Sh = tl.exp(tot)[:, None] * Sh + tl.dot(tl.trans(Kh * W), Uh, input_precision=PREC)
        return Sh, soff, slot, h

    @triton.jit
    def _kda_decode_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr,
        L, H, HV, K, V, REP, scale,
        LC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    ):
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)  # V-blocks of one (row, head) side by side
        kh = hv // REP
        r64 = r.to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        Sh, soff, slot, h = _history_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, slot_ptr,
                                          r, hv, kh, offs_k, mk, offs_v, mv, L, 1, H, HV, K, V,
                                          BK, BV, LC, False, PREC)
        start = tl.load(start_ptr + r).to(tl.int64)
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
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, bt_ptr, flush_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bits_ptr, y_ptr, uo_ptr, ko_ptr,
        T, L, MAXB, H, HV, K, V, REP, scale,
        TP: tl.constexpr, LC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
        TREE: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
    ):
        """Verify of T drafts (chain or tree) from the ring's ``S_h`` or, ``PAGED``, the
        KV-only pages' (no checkpoint, no flush)."""
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)
        kh = hv // REP
        r64 = r.to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        Sh, soff, slot, h = _history_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, bt_ptr,
                                          r, hv, kh, offs_k, mk, offs_v, mv, L, MAXB, H, HV, K, V,
                                          BK, BV, LC, PAGED, PREC)
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
            acoef = tl.sum(tl.where(sel, Amat, 0.0), 0)   # (not `arow`: a loop variable keeps one type)
            U = tl.where(sel, U - tl.sum(acoef[:, None] * U, 0)[None, :], U)
        Y = HQ + tl.dot(tl.where(anc, QK, 0.0), U, input_precision=PREC)
        mo = ms[:, None] & mv[None, :]
        tl.store(y_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], Y.to(y_ptr.dtype.element_ty), mask=mo)
        tl.store(uo_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], U.to(uo_ptr.dtype.element_ty), mask=mo)
        if vb == 0:
            if hv % REP == 0:
                tl.store(ko_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], Kn.to(ko_ptr.dtype.element_ty),
                         mask=mks)
        if not PAGED:
            if tl.load(flush_ptr + r) != 0:   # the checkpoint becomes S_h (committed entries only)
                tl.store(state_ptr + soff, Sh.to(state_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])


# =============================================================================== wrappers
#: ring / page entries folded per step of a kernel's history loop
HISTORY_CHUNK = 16
#: the KV-only kernel takes steps of at most this many new tokens (a longer KV-only prefill
#: runs the reference's chunked scan)
KV_MAX_NEW = 16


#: calls the kernels take (others run the reference; ``kernels.dispatch``)
SUPPORTS = {"kv_verify": lambda kv, pplan, q, *args, **kw: few_new_tokens(q, KV_MAX_NEW),
            "kv_tree_verify": lambda kv, pplan, parent, q, *args, **kw: few_new_tokens(q, KV_MAX_NEW)}


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


def _tree(parent, dims, q, check) -> Tensor:
    Bt, N = dims[0], dims[1]
    ck = want_check(check, q, parent) if isinstance(parent, Tensor) else True
    check_tree(parent, Bt, N, q.device, ck)
    if N > 31:
        raise ValueError(f"the KDA tree kernels take at most 31 nodes per tree (int32 ancestor bits), got {N}")
    return tree_bits(parent, Bt)


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
    _kda_decode_kernel[flat_grid(triton.cdiv(V, BV), HV, Bt)](
        buf.state, buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.flush,
        q, k, v, g, beta, y, plan.capacity, H, HV, K, V, HV // H, _scale(scale, K),
        LC=HISTORY_CHUNK, BK=pad16(K), BV=BV, L2=bool(use_qk_l2norm), PREC=precision, num_warps=num_warps)
    return y


def _verify(pools, index, bits, q, k, v, g, beta, scale, use_qk_l2norm, block_v, num_warps, precision,
            paged: bool) -> Tensor:
    """The verify kernel (ring: ``index`` a StepPlan; paged: a PagedPlan), then one append."""
    state, ur, kr, gr = pools
    Bt, T, H, K = q.shape
    HV, V = v.shape[-2:]
    q, k, v, g, beta = (_c(t) for t in (q, k, v, g, beta))
    y = torch.empty_like(v)
    if Bt == 0 or T == 0:
        return y
    U = torch.empty(Bt, T, HV, V, dtype=ur.dtype, device=v.device)
    Kn = torch.empty(Bt, T, H, K, dtype=kr.dtype, device=v.device)
    BV = tile(V, block_v, 32)
    if paged:
        bt = index.block_table.contiguous()
        L, hist, start, flush, maxb = index.block_size, index.length, index.length, index.slot, bt.shape[1]
    else:
        bt, L, hist, start, flush, maxb = index.slot, index.capacity, index.hist, index.start, index.flush, 1
    _kda_verify_kernel[flat_grid(triton.cdiv(V, BV), HV, Bt)](
        state, ur, kr, gr, index.slot, start, hist, bt, flush,
        q, k, v, g, beta, bits if bits is not None else index.slot, y, U, Kn,
        T, L, maxb, H, HV, K, V, HV // H, _scale(scale, K),
        TP=max(16, next_pow2(T)), LC=HISTORY_CHUNK, BK=pad16(K), BV=BV, L2=bool(use_qk_l2norm),
        TREE=bits is not None, PAGED=paged, PREC=precision, num_warps=num_warps)
    append_entries((ur, kr, gr), (U, Kn, g), index.slot, start, hist, bt if paged else None, L)
    return y


def replay_verify(buf, plan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  scale: float | None = None, use_qk_l2norm: bool = True, route: str = "state",
                  check: bool | None = None, block_v: int | None = None, num_warps: int = 4,
                  precision: str = "ieee") -> Tensor:
    """Replay verify of T drafts per row (the reference op's contract): the verify kernel
    (flush rows store ``S_h``), then one append launch."""
    _check(buf, plan, "verify", q, k, v, g, beta, scale, route, check, True)
    return _verify((buf.state, buf.u, buf.k, buf.g), plan, None, q, k, v, g, beta, scale, use_qk_l2norm,
                   block_v, num_warps, precision, False)


def tree_verify(buf, plan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                scale: float | None = None, use_qk_l2norm: bool = True, route: str = "state",
                check: bool | None = None, bits: Tensor | None = None, block_v: int | None = None,
                num_warps: int = 4, precision: str = "ieee") -> Tensor:
    """Tree verify of N nodes per row (at most 31: the ancestor bitmasks are int32)."""
    dims = _check(buf, plan, "tree", q, k, v, g, beta, scale, route, check, True)
    b = _tree(parent, dims, q, check) if bits is None else bits
    return _verify((buf.state, buf.u, buf.k, buf.g), plan, b.to(torch.int32).contiguous(), q, k, v, g, beta, scale,
                   use_qk_l2norm, block_v, num_warps, precision, False)


def _check_kv(kv, pplan, q, k, v, g, beta, scale, check):
    dims = _ref._check_inputs(q, k, v, g, beta, True, scale)
    _ref._check_kv(kv, pplan, dims, q.device, want_check(check, q))
    for name in ("u", "k", "g"):
        if not getattr(kv, name).is_contiguous():
            raise ValueError(f"kv.{name} must be contiguous for the Triton kernels")
    return dims


def kv_verify(kv, pplan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              scale: float | None = None, use_qk_l2norm: bool = True, check: bool | None = None,
              parent: Tensor | None = None, block_v: int | None = None, num_warps: int = 4,
              precision: str = "ieee") -> Tensor:
    """KV-only form (``S0 = 0``, every entry in the pages) of T new tokens per row (a draft
    tree when ``parent`` is given); appends ``(U, k, g)`` after the kernel."""
    dims = _check_kv(kv, pplan, q, k, v, g, beta, scale, check)
    bits = None if parent is None else _tree(parent, dims, q, check).to(torch.int32).contiguous()
    return _verify((kv.u, kv.u, kv.k, kv.g), pplan, bits, q, k, v, g, beta, scale, use_qk_l2norm, block_v,
                   num_warps, precision, True)


def kv_tree_verify(kv, pplan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   scale: float | None = None, use_qk_l2norm: bool = True, check: bool | None = None,
                   block_v: int | None = None, num_warps: int = 4, precision: str = "ieee") -> Tensor:
    """:func:`kv_verify` of a draft tree (the reference op's argument order)."""
    return kv_verify(kv, pplan, q, k, v, g, beta, scale, use_qk_l2norm, check, parent, block_v, num_warps, precision)
