"""Triton kernels for Gated DeltaNet decoding: recurrent baseline, replay decode (state route
and output route), replay / tree / KV-only verify with the T×T unit-lower-triangular solve
done in-kernel by forward substitution, and the serial snapshot baseline (the forms of
``docs/MATH.md``).

Same arguments and results as :mod:`replayssm.ops.gdn.naive`.  Layouts (contiguous): state
``[P,HV,K,V]`` (fla/HF layout, ``Sᵀ``) fp32; ring ``u [P,L,HV,V]``, ``k [P,L,H,K]``,
``g [P,L,HV]``.  One program per (row, value head, V-block); the whole K axis sits in one
tile, so ``S k``/``S q`` and the l2-norms need no cross-program reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import (HAVE_TRITON, check_ring, count_args, count_flags, flag_chunk, flat_grid, history_entries, next_pow2,
                      nth_flag, pad16, persistent_programs, tile, tile_ids, token_rows, triton, tl,
                      verify_precision, few_new_tokens)
from ._triton import contiguous as _c
from ..ops.gdn.naive import check_kv_fold, check_rebuild_state
from .append import append_entries
from .fold import paged_fold, ring_fold
from .mamba2 import FMA_CHUNK, decode_block, table_row, tree_bits

__all__ = [
    "recurrent_step",
    "recurrent_update",
    "replay_decode",
    "replay_verify",
    "tree_verify",
    "kv_verify",
    "snapshot_verify",
    "kv_fold",
    "rebuild_state",
]

_EPS = 1e-6

if HAVE_TRITON:

    @triton.jit
    def _l2n(x, L2: tl.constexpr):
        if L2:
            x = x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)
        return x

    @triton.jit
    def _l2n_rows(x, L2: tl.constexpr):
        if L2:
            x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        return x

    @triton.jit
    def _gdn_recurrent_kernel(
        sin_ptr, sout_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr, snap_ptr,
        T, H, HV, K, V, REP, scale,
        BK: tl.constexpr, BV: tl.constexpr, HAS_SLOT: tl.constexpr, L2: tl.constexpr,
        SNAP: tl.constexpr,
    ):
        """Recurrent form over T tokens: load S, T delta-rule updates, store S (SNAP: once per
        token into ``snap [Bt,T,HV,K,V]``, the snapshot baseline; else the final state into sout)."""
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)  # V-blocks of one (row, head) side by side
        kh = hv // REP
        if HAS_SLOT:
            srow = tl.load(slot_ptr + r).to(tl.int64)
        else:
            srow = r.to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        m2 = mk[:, None] & mv[None, :]
        tile = offs_k[:, None] * V + offs_v[None, :]
        S = tl.load(sin_ptr + (srow * HV + hv) * K * V + tile, mask=m2, other=0.0).to(tl.float32)
        rT = r.to(tl.int64) * T
        for t in range(T):
            tok = rT + t
            q = _l2n(tl.load(q_ptr + (tok * H + kh) * K + offs_k, mask=mk, other=0.0).to(tl.float32), L2) * scale
            k = _l2n(tl.load(k_ptr + (tok * H + kh) * K + offs_k, mask=mk, other=0.0).to(tl.float32), L2)
            v = tl.load(v_ptr + (tok * HV + hv) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
            a = tl.exp(tl.load(g_ptr + tok * HV + hv).to(tl.float32))
            beta = tl.load(b_ptr + tok * HV + hv).to(tl.float32)
            S = S * a
            u = beta * (v - tl.sum(S * k[:, None], 0))
            S += k[:, None] * u[None, :]
            y = tl.sum(S * q[:, None], 0)
            tl.store(y_ptr + (tok * HV + hv) * V + offs_v, y.to(y_ptr.dtype.element_ty), mask=mv)
            if SNAP:
                tl.store(snap_ptr + (tok * HV + hv) * K * V + tile, S.to(snap_ptr.dtype.element_ty), mask=m2)
        if not SNAP:
            tl.store(sout_ptr + (srow * HV + hv) * K * V + tile, S.to(sout_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _gdn_scores_kernel(
        kr_ptr, slot_ptr, start_ptr, hist_ptr, q_ptr, k_ptr, sc_ptr, qk_ptr,
        L, H, K, scale, QS, KS,
        LP: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr,
    ):
        """Decode precompute, once per (row, key head) instead of in every value head's
        V-block programs: the normalised ``k`` and scaled ``q`` -> ``qk [Bt, H, 2, K]`` (fp32),
        the history scores ``k_j·k``, ``k_j·q`` and ``k·q`` -> ``sc [Bt, H, 2, LP+1]``
        (``[0, :LP]`` = ``k_j·k``, ``[0, LP]`` = ``k·q``, ``[1, :LP]`` = ``k_j·q``); appends the
        normalised ``k`` to the ring at position h."""
        pid = tl.program_id(0)
        kh = pid % H
        r = (pid // H).to(tl.int64)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        start = tl.load(start_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        jj = tl.arange(0, LP)
        mj = jj < h
        offs_k = tl.arange(0, BK)
        mk = offs_k < K
        e = slot * L + (start + jj) % L
        Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mj[:, None] & mk[None, :],
                     other=0.0).to(tl.float32)
        q = _l2n(tl.load(q_ptr + r * QS + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32), L2) * scale
        k = _l2n(tl.load(k_ptr + r * KS + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32), L2)
        base = (r * H + kh) * 2 * (LP + 1)
        tl.store(sc_ptr + base + jj, tl.sum(Kh * k[None, :], 1))
        tl.store(sc_ptr + base + LP, tl.sum(k * q, 0))
        tl.store(sc_ptr + base + LP + 1 + jj, tl.sum(Kh * q[None, :], 1))
        qbase = (r * H + kh) * 2 * K
        tl.store(qk_ptr + qbase + offs_k, k, mask=mk)
        tl.store(qk_ptr + qbase + K + offs_k, q, mask=mk)
        enew = slot * L + (start + h) % L
        tl.store(kr_ptr + (enew * H + kh) * K + offs_k, k.to(kr_ptr.dtype.element_ty), mask=mk)

    @triton.jit
    def _gdn_fold_fma(state_ptr, ur_ptr, kr_ptr, gr_ptr, k_ptr, qk_ptr, slot, start, h, r64, hv, kh, tot, gs, us, rk,
                      qbase, offs_v, mv, L, H, HV, K, V, KS,
                      BK: tl.constexpr, BKC: tl.constexpr, PRE_SCORES: tl.constexpr):
        """A flush row's ``S_{h+1} = e^{tot'} S0 + k uᵀ + Σ_{j<h} e^{tot'-cum_j} k_j u_jᵀ``
        (``tot'`` including the new entry's ``g``; the new ``k``, ``u``, ``g`` as the ring stores
        them) by rank-1 updates, ``K`` in chunks of ``BKC`` rows: each chunk of ``S0`` is read
        again (from L2: the readout just read it, so no tile is held across the readout), then
        a loop that runs ``h`` times adds one ring entry per iteration; stored rounded once."""
        tot1 = tot + gs.to(tl.float32)
        a1 = tl.exp(tot1)
        un = us.to(tl.float32)
        for k0 in range(0, BK, BKC):  # a run-time loop: no chunk's loads hoisted above another's stores
            offs_c = k0 + tl.arange(0, BKC)
            mc = offs_c < K
            if PRE_SCORES:
                kc = tl.load(qk_ptr + qbase + offs_c, mask=mc, other=0.0)
            else:
                kc = tl.load(k_ptr + r64 * KS + kh * K + offs_c, mask=mc, other=0.0).to(tl.float32) * rk
            kc = kc.to(kr_ptr.dtype.element_ty).to(tl.float32)
            cptr = state_ptr + ((slot * HV + hv) * K + offs_c[:, None]) * V + offs_v[None, :]
            mcv = mc[:, None] & mv[None, :]
            Sn = a1 * tl.load(cptr, mask=mcv, other=0.0).to(tl.float32) + kc[:, None] * un[None, :]
            c = tot * 0.0
            for j in range(0, h):
                ej = slot * L + (start + j) % L
                c += tl.load(gr_ptr + ej * HV + hv).to(tl.float32)
                kj = tl.load(kr_ptr + (ej * H + kh) * K + offs_c, mask=mc, other=0.0).to(tl.float32)
                uj = tl.load(ur_ptr + (ej * HV + hv) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
                Sn += (tl.exp(tot1 - c) * kj)[:, None] * uj[None, :]
            tl.store(cptr, Sn.to(state_ptr.dtype.element_ty), mask=mcv)

    @triton.jit
    def _gdn_fold_unrolled(state_ptr, ur_ptr, kr_ptr, gr_ptr, soff, S0, kn, slot, start, h, hv, kh, tot, gs, us,
                           offs_k, mk, offs_v, mv, L, H, HV, K, V, LP: tl.constexpr):
        """The ``fma`` fold for narrow tiles: ``S_{h+1} = e^{tot'} S0 + k uᵀ + Σ_{j<h} e^{tot'-cum_j}
        k_j u_jᵀ`` over the tile the readout holds, one rank-1 update per ring position in a loop
        unrolled over all ``LP`` positions (entries past ``h`` masked to zero): the entries' loads
        are independent and go out together.  ``kn``: the new key as the ring stores it."""
        tot1 = tot + gs.to(tl.float32)
        Sn = tl.exp(tot1) * S0 + kn[:, None] * us.to(tl.float32)[None, :]
        c = tot * 0.0
        for j in tl.static_range(LP):
            ej = slot * L + (start + j) % L
            c += tl.where(h > j, tl.load(gr_ptr + ej * HV + hv).to(tl.float32), 0.0)  # a ring entry, maybe unused
            kj = tl.load(kr_ptr + (ej * H + kh) * K + offs_k, mask=mk & (offs_k * 0 + j < h), other=0.0).to(tl.float32)
            uj = tl.load(ur_ptr + (ej * HV + hv) * V + offs_v, mask=mv & (offs_v * 0 + j < h), other=0.0).to(tl.float32)
            Sn += (tl.exp(tot1 - c) * kj)[:, None] * uj[None, :]
        tl.store(state_ptr + soff, Sn.to(state_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])

    @triton.jit
    def _gdn_decode_tile(
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr, sc_ptr, qk_ptr,
        r, hv, vb, L, H, HV, K, V, REP, scale, QS, KS, VS,
        LP: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
        OUTPUT_ROUTE: tl.constexpr, PRE_SCORES: tl.constexpr, FOLD: tl.constexpr, PREC: tl.constexpr,
        FMA: tl.constexpr, HOLD: tl.constexpr = False, EARLY: tl.constexpr = False, pslot=0, pstart=0, ph=0, pfl=0,
        UNROLL: tl.constexpr = False,
    ):
        """One ``(row, value head, V-block)`` tile of GDN replay: ``u = β(v − α S_h k)``,
        ``y = α S_h q + u (k·q)``; appends ``u``, ``g`` (and the normalised ``k`` unless
        ``PRE_SCORES``: the scores kernel did).  Output route: ``S_h k``/``S_h q`` from one read
        of ``S0`` plus ``Σ_j w_j (k_j·x) u_j``; state route: rebuild the ``[K, BV]`` tile of
        ``S_h`` (one small GEMM) and read it twice.  ``PRE_SCORES``: ``k``, ``q``, ``k_j·k``,
        ``k_j·q`` from :func:`_gdn_scores_kernel`.  ``FOLD``: a flush row then stores
        ``S_{h+1} = e^{tot'} S0 + Σ_{j≤h} e^{tot'-cum_j} k_j u_jᵀ`` with the new entry as the
        ring stores it, ``K`` in chunks of ``BKC`` read again right after the first read (from
        L2, not DRAM), so no register tile is held across the fold's ``tl.dot``.  ``FMA`` (output
        route): each re-read chunk is instead folded by a run-time loop of rank-1 updates over
        the row's ``h`` entries (:func:`_gdn_fold_fma`: no ``tl.dot``, no shared memory, any
        ``BV``).  ``HOLD``: the readout's tile stays in registers and one ``tl.dot`` over the
        ring entries gives the whole ``S_{h+1}`` tile (no re-read).  ``UNROLL``: the held tile
        folded by rank-1 updates unrolled over the ring positions (:func:`_gdn_fold_unrolled`;
        narrow tiles).  ``EARLY``: the caller
        loaded the plan words ``pslot, pstart, ph`` and the flush flag ``pfl`` in one round
        (before any other load) and passes them; else they are loaded here, the flush flag
        after the stores."""
        kh = hv // REP
        r64 = r.to(tl.int64)
        if EARLY:
            slot = pslot.to(tl.int64)
            start = pstart.to(tl.int64)
            h = ph.to(tl.int64)
        else:
            slot = tl.load(slot_ptr + r).to(tl.int64)
            start = tl.load(start_ptr + r).to(tl.int64)
            h = tl.load(hist_ptr + r).to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        m2 = mk[:, None] & mv[None, :]
        jj = tl.arange(0, LP)
        mj = jj < h
        e = slot * L + (start + jj) % L
        soff = ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
        S0 = tl.load(state_ptr + soff, mask=m2, other=0.0).to(tl.float32)
        gj = tl.load(gr_ptr + e * HV + hv, mask=mj, other=0.0).to(tl.float32)
        qbase = (r64 * H + kh) * 2 * K
        # load order as measured: the ring keys right after the state in the form without scores
        # (the 2026-11-22 kernel's order), the scores after the values in the other
        if not PRE_SCORES:
            Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mj[:, None] & mk[None, :],
                         other=0.0).to(tl.float32)
        Uh = tl.load(ur_ptr + (e[:, None] * HV + hv) * V + offs_v[None, :], mask=mj[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        if not PRE_SCORES:
            q = _l2n(tl.load(q_ptr + r64 * QS + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32), L2) * scale
            kraw = tl.load(k_ptr + r64 * KS + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32)
            k = _l2n(kraw, L2)
        v = tl.load(v_ptr + r64 * VS + hv * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        gv = tl.load(g_ptr + r64 * HV + hv).to(tl.float32)
        beta = tl.load(b_ptr + r64 * HV + hv).to(tl.float32)
        if PRE_SCORES:
            k = tl.load(qk_ptr + qbase + offs_k, mask=mk, other=0.0)
            q = tl.load(qk_ptr + qbase + K + offs_k, mask=mk, other=0.0)
            base = (r64 * H + kh) * 2 * (LP + 1)
            sk = tl.load(sc_ptr + base + jj)
            kq = tl.load(sc_ptr + base + LP)
            sq = tl.load(sc_ptr + base + LP + 1 + jj)
        else:
            sk = tl.sum(Kh * k[None, :], 1)
            sq = tl.sum(Kh * q[None, :], 1)
            kq = tl.sum(k * q, 0)
        gj = tl.where(mj, gj, 0.0)
        cj = tl.cumsum(gj, 0)
        tot = tl.sum(gj, 0)
        wj = tl.where(mj, tl.exp(tot - cj), 0.0)  # e^{pre_h - pre_j}
        a0 = tl.exp(tot)
        if OUTPUT_ROUTE:
            hk = a0 * tl.sum(S0 * k[:, None], 0) + tl.sum((wj * sk)[:, None] * Uh, 0)
            hq = a0 * tl.sum(S0 * q[:, None], 0) + tl.sum((wj * sq)[:, None] * Uh, 0)
        else:
            Sh = a0 * S0 + tl.dot(tl.trans(Kh * wj[:, None]), Uh, input_precision=PREC)
            hk = tl.sum(Sh * k[:, None], 0)
            hq = tl.sum(Sh * q[:, None], 0)
        alpha = tl.exp(gv)
        u = beta * (v - alpha * hk)
        y = alpha * hq + u * kq
        tl.store(y_ptr + (r64 * HV + hv) * V + offs_v, y.to(y_ptr.dtype.element_ty), mask=mv)
        # ---- append (u, k, g) at ring position h (never a committed entry for decode)
        enew = slot * L + (start + h) % L
        us = u.to(ur_ptr.dtype.element_ty)
        tl.store(ur_ptr + (enew * HV + hv) * V + offs_v, us, mask=mv)
        gs = gv.to(gr_ptr.dtype.element_ty)
        if vb == 0:
            tl.store(gr_ptr + enew * HV + hv, gs)
            if not PRE_SCORES:
                if hv % REP == 0:
                    tl.store(kr_ptr + (enew * H + kh) * K + offs_k, k.to(kr_ptr.dtype.element_ty), mask=mk)
        if FOLD:
            if EARLY:
                flush = pfl != 0
            else:
                flush = tl.load(flush_ptr + r) != 0
            if flush:
                rk = 1.0
                if not PRE_SCORES:
                    if L2:  # the factor _l2n applied to the whole row
                        rk = tl.rsqrt(tl.sum(kraw * kraw, 0) + 1e-6)
                if HOLD:
                    if PRE_SCORES:  # the scores kernel read the ring keys; this program reads them here
                        Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :],
                                     mask=mj[:, None] & mk[None, :], other=0.0).to(tl.float32)
                    newj = jj == h
                    tot1 = tot + gs.to(tl.float32)
                    wf = tl.where(newj, 1.0, tl.where(mj, tl.exp(tot1 - cj), 0.0))
                    Kf = tl.where(newj[:, None], k.to(kr_ptr.dtype.element_ty).to(tl.float32)[None, :], Kh)   # [LP, BK]
                    Uf = tl.where(newj[:, None], us.to(tl.float32)[None, :], Uh)                             # [LP, BV]
                    Sn = tl.exp(tot1) * S0 + tl.dot(tl.trans(Kf * wf[:, None]), Uf, input_precision=PREC)
                    tl.store(state_ptr + soff, Sn.to(state_ptr.dtype.element_ty), mask=m2)
                elif UNROLL:
                    _gdn_fold_unrolled(state_ptr, ur_ptr, kr_ptr, gr_ptr, soff, S0,
                                       k.to(kr_ptr.dtype.element_ty).to(tl.float32), slot, start, h, hv, kh, tot, gs,
                                       us, offs_k, mk, offs_v, mv, L, H, HV, K, V, LP)
                elif FMA:
                    _gdn_fold_fma(state_ptr, ur_ptr, kr_ptr, gr_ptr, k_ptr, qk_ptr, slot, start, h, r64, hv, kh, tot,
                                  gs, us, rk, qbase, offs_v, mv, L, H, HV, K, V, KS, BK, BKC, PRE_SCORES)
                else:
                    _gdn_fold_dot(state_ptr, kr_ptr, k_ptr, qk_ptr, slot, e, mj, jj, h, r64, hv, kh, tot, cj, gs, us,
                                  Uh, rk, qbase, offs_v, mv, H, HV, K, V, KS, BK, BKC, PRE_SCORES, PREC)

    @triton.jit
    def _gdn_fold_dot(state_ptr, kr_ptr, k_ptr, qk_ptr, slot, e, mj, jj, h, r64, hv, kh, tot, cj, gs, us, Uh, rk,
                      qbase, offs_v, mv, H, HV, K, V, KS,
                      BK: tl.constexpr, BKC: tl.constexpr, PRE_SCORES: tl.constexpr, PREC: tl.constexpr):
        """The ``dot`` form of :func:`_gdn_fold_fma`: per ``BKC``-row chunk, one ``tl.dot`` over the
        ``LP`` padded entries (the new one at row ``h``)."""
        newj = jj == h
        tot1 = tot + gs.to(tl.float32)
        wf = tl.where(newj, 1.0, tl.where(mj, tl.exp(tot1 - cj), 0.0))
        Uf = tl.where(newj[:, None], us.to(tl.float32)[None, :], Uh)                         # [LP, BV]
        for k0 in tl.static_range(0, BK, BKC):
            offs_c = k0 + tl.arange(0, BKC)
            mc = offs_c < K
            Kc = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_c[None, :],
                         mask=mj[:, None] & mc[None, :], other=0.0).to(tl.float32)  # [LP, BKC]
            if PRE_SCORES:
                kc = tl.load(qk_ptr + qbase + offs_c, mask=mc, other=0.0)
            else:
                kc = tl.load(k_ptr + r64 * KS + kh * K + offs_c, mask=mc, other=0.0).to(tl.float32) * rk
            Kf = tl.where(newj[:, None], kc.to(kr_ptr.dtype.element_ty).to(tl.float32)[None, :], Kc)
            cptr = state_ptr + ((slot * HV + hv) * K + offs_c[:, None]) * V + offs_v[None, :]
            S0c = tl.load(cptr, mask=mc[:, None] & mv[None, :], other=0.0).to(tl.float32)            # [BKC, BV]
            Sn = tl.exp(tot1) * S0c + tl.dot(tl.trans(Kf * wf[:, None]), Uf, input_precision=PREC)
            tl.store(cptr, Sn.to(state_ptr.dtype.element_ty), mask=mc[:, None] & mv[None, :])

    @triton.jit(**count_args("Bt", "NPROG"))  # batch size and persistent grid: one compiled kernel for all
    def _gdn_replay_decode_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr, sc_ptr, qk_ptr,
        Bt, NPROG, L, H, HV, K, V, REP, scale, QS, KS, VS,
        LP: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
        L2: tl.constexpr, OUTPUT_ROUTE: tl.constexpr, PRE_SCORES: tl.constexpr, FOLD: tl.constexpr,
        PREC: tl.constexpr, SKIP_FLUSH: tl.constexpr, PERSIST: tl.constexpr, FMA: tl.constexpr,
        HOLD: tl.constexpr = False, EARLY: tl.constexpr = False, ONLY_FLUSH: tl.constexpr = False,
        UNROLL: tl.constexpr = False,
    ):
        """Replay decode (:func:`_gdn_decode_tile`) over a flat grid of ``V-blocks × value
        heads × rows`` (V-blocks of one (row, head) side by side: they share DRAM pages).
        ``SKIP_FLUSH``: flush rows' programs return at once (the hot kernel of ``apart`` and
        ``gated``); ``PERSIST``: a persistent grid over the flush rows only, found on the
        device (``apart``); ``ONLY_FLUSH``: the whole grid, every program of a row that does
        not flush returning after its flag (``gated``).
        ``EARLY``: the row's slot, start, fill and flush flag in one round of loads (the late
        form reads the flag first where it skips flush rows, then the plan words: two rounds
        before the state's); the persistent grid then takes a contiguous range of tiles per
        program (a row's tiles one after another: the row is searched once per row, not per
        tile)."""
        nv = tl.cdiv(V, BV)
        if PERSIST:
            ntile = nv * HV
            work = count_flags(flush_ptr, Bt, BT) * ntile
            if EARLY:  # a contiguous range of tiles per program: the row is searched once per row, not per tile
                per = tl.cdiv(work, NPROG)
                lo = tl.program_id(0) * per
                rank = lo // ntile
                r = nth_flag(flush_ptr, Bt, rank, BT)
                for w in range(lo, tl.minimum(lo + per, work)):
                    if w // ntile != rank:
                        rank = w // ntile
                        r = nth_flag(flush_ptr, Bt, rank, BT)
                    t = w % ntile
                    pslot, pstart, ph, pfl = _plan_words(slot_ptr, start_ptr, hist_ptr, flush_ptr, r)
                    _gdn_decode_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
                                     q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr, sc_ptr, qk_ptr,
                                     r, t // nv, t % nv, L, H, HV, K, V, REP, scale, QS, KS, VS,
                                     LP, BK, BKC, BV, L2, OUTPUT_ROUTE, PRE_SCORES, FOLD, PREC, FMA, HOLD, EARLY,
                                     pslot, pstart, ph, pfl, UNROLL)
            else:  # tiles strided by the grid, the row searched for every tile (the measured default)
                for w in range(tl.program_id(0), work, NPROG):
                    r = nth_flag(flush_ptr, Bt, w // ntile, BT)
                    t = w % ntile
                    _gdn_decode_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
                                     q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr, sc_ptr, qk_ptr,
                                     r, t // nv, t % nv, L, H, HV, K, V, REP, scale, QS, KS, VS,
                                     LP, BK, BKC, BV, L2, OUTPUT_ROUTE, PRE_SCORES, FOLD, PREC, FMA, HOLD, EARLY,
                                     0, 0, 0, 0, UNROLL)
        else:
            vb, hv, r = tile_ids(nv, HV)
            go = True
            pslot, pstart, ph, pfl = 0, 0, 0, 0
            if EARLY:
                pslot, pstart, ph, pfl = _plan_words(slot_ptr, start_ptr, hist_ptr, flush_ptr, r)
                if SKIP_FLUSH:
                    go = pfl == 0
                if ONLY_FLUSH:
                    go = pfl != 0
            elif SKIP_FLUSH:
                go = tl.load(flush_ptr + r) == 0
            elif ONLY_FLUSH:
                go = tl.load(flush_ptr + r) != 0
            if go:
                _gdn_decode_tile(state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
                                 q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, y_ptr, sc_ptr, qk_ptr,
                                 r, hv, vb, L, H, HV, K, V, REP, scale, QS, KS, VS,
                                 LP, BK, BKC, BV, L2, OUTPUT_ROUTE, PRE_SCORES, FOLD, PREC, FMA, HOLD, EARLY,
                                 pslot, pstart, ph, pfl, UNROLL)

    @triton.jit
    def _plan_words(slot_ptr, start_ptr, hist_ptr, flush_ptr, r):
        """``(slot, start, fill, flush flag)`` of row ``r``: four independent loads, one round."""
        return tl.load(slot_ptr + r), tl.load(start_ptr + r), tl.load(hist_ptr + r), tl.load(flush_ptr + r)

    @triton.jit
    def _gdn_fold_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        L, H, HV, K, V, REP, EXTRA,
        LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):
        """Flush rows only: fold the first ``h + EXTRA`` ring entries into the checkpoint,
        ``S ← e^{tot} S0 + Σ_j e^{tot-cum_j} k_j u_jᵀ`` (one ``tl.dot``), after the decode
        kernel appended the new entry (``EXTRA = 1``)."""
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)  # V-blocks of one (row, head) side by side
        flush = tl.load(flush_ptr + r) != 0
        if flush:
            kh = hv // REP
            slot = tl.load(slot_ptr + r).to(tl.int64)
            start = tl.load(start_ptr + r).to(tl.int64)
            cnt = tl.load(hist_ptr + r).to(tl.int64) + EXTRA
            offs_k = tl.arange(0, BK)
            offs_v = vb * BV + tl.arange(0, BV)
            mk = offs_k < K
            mv = offs_v < V
            m2 = mk[:, None] & mv[None, :]
            jj = tl.arange(0, LP)
            mj = jj < cnt
            e = slot * L + (start + jj) % L
            gj = tl.where(mj, tl.load(gr_ptr + e * HV + hv, mask=mj, other=0.0).to(tl.float32), 0.0)
            cj = tl.cumsum(gj, 0)
            tot = tl.sum(gj, 0)
            wj = tl.where(mj, tl.exp(tot - cj), 0.0)
            Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mj[:, None] & mk[None, :],
                         other=0.0).to(tl.float32)
            Uh = tl.load(ur_ptr + (e[:, None] * HV + hv) * V + offs_v[None, :], mask=mj[:, None] & mv[None, :],
                         other=0.0).to(tl.float32)
            soff = ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
            S0 = tl.load(state_ptr + soff, mask=m2, other=0.0).to(tl.float32)
            Snew = tl.exp(tot) * S0 + tl.dot(tl.trans(Kh * wj[:, None]), Uh, input_precision=PREC)
            tl.store(state_ptr + soff, Snew.to(state_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _draft_inputs(v_ptr, g_ptr, b_ptr, bits_ptr, tok, ss, ms, offs_v, mv, hv, HV, V, TREE: tl.constexpr):
        """Per draft ``s``: values ``Vn [TP, BV]``, ``β``, the ancestor-or-self mask
        ``anc [s, s']`` (tree bits, else the chain) and the path log-decay ``G_s``."""
        Vn = tl.load(v_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], mask=ms[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        gn = tl.where(ms, tl.load(g_ptr + tok * HV + hv, mask=ms, other=0.0).to(tl.float32), 0.0)
        bn = tl.where(ms, tl.load(b_ptr + tok * HV + hv, mask=ms, other=0.0).to(tl.float32), 0.0)
        if TREE:
            bits = tl.load(bits_ptr + tok, mask=ms, other=0)
        else:
            bits = (2 << ss) - 1
        anc = (((bits[:, None] >> ss[None, :]) & 1) != 0) & ms[:, None] & ms[None, :]
        Gs = tl.sum(tl.where(anc, gn[None, :], 0.0), 1)
        return Vn, bn, anc, Gs

    @triton.jit
    def _solve_drafts(KK, QK, HK, Vn, Gs, bn, anc, ss, T):
        """The T×T system of speculative verify over the drafts (chain or tree mask ``anc [s, s']``):
        ``(I + A) U = β ∘ (V − e^{G} HK)`` with ``A[s, s'] = β_s e^{G_s−G_s'} (k_s·k_s')`` for
        strict ancestors ``s'``, by forward substitution.  Returns ``U``, the output mask
        ``Mq[s, s'] = e^{G_s−G_s'} (q_s·k_s')`` and ``e^{G}``."""
        eG = tl.exp(Gs)
        Dm = tl.exp(tl.where(anc, Gs[:, None] - Gs[None, :], 0.0))
        strict = anc & (ss[:, None] != ss[None, :])
        Amat = tl.where(strict, bn[:, None] * Dm * KK, 0.0)
        U = bn[:, None] * (Vn - eG[:, None] * HK)
        for i in range(1, T):
            sel = ss[:, None] == i
            arow = tl.sum(tl.where(sel, Amat, 0.0), 0)
            corr = tl.sum(arow[:, None] * U, 0)
            U = tl.where(sel, U - corr[None, :], U)
        Mq = tl.where(anc, Dm * QK, 0.0)
        return U, Mq, eG

    @triton.jit
    def _gdn_verify_rows_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr,
        slot_ptr, start_ptr, hist_ptr, bt_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bits_ptr, y_ptr, uo_ptr, ko_ptr,
        T, L, H, HV, K, V, REP, MAXB, scale,
        TP: tl.constexpr, LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        L2: tl.constexpr, TREE: tl.constexpr, PAGED: tl.constexpr,
    ):
        """Replay verify (chains, trees, KV-only), output route, one draft at a time.

        Per draft s (unrolled): ``S_h k_s = α0 S0 k_s + Σ_j w_j (k_j·k_s) u_j`` (same for q_s)
        and the rows ``k_s·k_{s'}``, ``q_s·k_{s'}`` of the T×T system ``(I + A) U = R``
        (restricted to the causal chain or the tree's ancestor bits), solved by forward
        substitution; then ``Y = e^{G} S_h q + (mask ∘ e^{G_s−G_s'} QKᵀ) U`` as outer-product
        sums.  Register tiles only: the ``[BK, BV]`` checkpoint tile is read once.  Writes
        ``U`` and the normalised keys to scratch (appended by the wrapper).  PAGED: KV-only
        (``S0 = 0``).  Flush rows are folded by ``_gdn_fold_kernel`` after this kernel."""
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)  # V-blocks of one (row, head) side by side
        kh = hv // REP
        r64 = r.to(tl.int64)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        m2 = mk[:, None] & mv[None, :]
        slot, h, mj, e = history_entries(slot_ptr, start_ptr, hist_ptr, bt_ptr, r, L, MAXB, LP, PAGED)
        gj = tl.where(mj, tl.load(gr_ptr + e * HV + hv, mask=mj, other=0.0).to(tl.float32), 0.0)
        cj = tl.cumsum(gj, 0)
        tot = tl.sum(gj, 0)
        wj = tl.where(mj, tl.exp(tot - cj), 0.0)
        a0 = tl.exp(tot)
        Kh = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mj[:, None] & mk[None, :],
                     other=0.0).to(tl.float32)
        Uh = tl.load(ur_ptr + (e[:, None] * HV + hv) * V + offs_v[None, :], mask=mj[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        ss = tl.arange(0, TP)
        ms = ss < T
        tok = r64 * T + ss
        mks = ms[:, None] & mk[None, :]
        Qn = _l2n_rows(tl.load(q_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks,
                               other=0.0).to(tl.float32), L2) * scale
        Kn = _l2n_rows(tl.load(k_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks,
                               other=0.0).to(tl.float32), L2)
        Vn, bn, anc, Gs = _draft_inputs(v_ptr, g_ptr, b_ptr, bits_ptr, tok, ss, ms, offs_v, mv, hv, HV, V, TREE)
        if not PAGED:
            soff = ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
            S0 = tl.load(state_ptr + soff, mask=m2, other=0.0).to(tl.float32)
        # ---- per-draft history readouts and rows of K Kᵀ, Q Kᵀ
        HK = tl.zeros([TP, BV], dtype=tl.float32)
        HQ = tl.zeros([TP, BV], dtype=tl.float32)
        KK = tl.zeros([TP, TP], dtype=tl.float32)
        QK = tl.zeros([TP, TP], dtype=tl.float32)
        for s in tl.static_range(TP):
            if s < T:
                row = ss[:, None] == s
                ks = tl.sum(tl.where(row, Kn, 0.0), 0)
                qs = tl.sum(tl.where(row, Qn, 0.0), 0)
                hk = tl.sum((wj * tl.sum(Kh * ks[None, :], 1))[:, None] * Uh, 0)
                hq = tl.sum((wj * tl.sum(Kh * qs[None, :], 1))[:, None] * Uh, 0)
                if not PAGED:
                    hk += a0 * tl.sum(S0 * ks[:, None], 0)
                    hq += a0 * tl.sum(S0 * qs[:, None], 0)
                HK = tl.where(row, hk[None, :], HK)
                HQ = tl.where(row, hq[None, :], HQ)
                KK = tl.where(row, tl.sum(Kn * ks[None, :], 1)[None, :], KK)
                QK = tl.where(row, tl.sum(Kn * qs[None, :], 1)[None, :], QK)
        # ---- the T×T system (I + A) U = R by forward substitution
        U, Mq, eG = _solve_drafts(KK, QK, HK, Vn, Gs, bn, anc, ss, T)
        Y = eG[:, None] * HQ
        for s in tl.static_range(TP):
            if s < T:
                ucol = tl.sum(tl.where(ss[:, None] == s, U, 0.0), 0)
                mcol = tl.sum(tl.where(ss[None, :] == s, Mq, 0.0), 1)
                Y += mcol[:, None] * ucol[None, :]
        mo = ms[:, None] & mv[None, :]
        tl.store(y_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], Y.to(y_ptr.dtype.element_ty), mask=mo)
        tl.store(uo_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], U.to(uo_ptr.dtype.element_ty), mask=mo)
        if vb == 0:
            if hv % REP == 0:
                tl.store(ko_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], Kn.to(ko_ptr.dtype.element_ty),
                         mask=mks)


    @triton.jit
    def _gdn_verify_dot_kernel(
        state_ptr, ur_ptr, kr_ptr, gr_ptr,
        slot_ptr, start_ptr, hist_ptr, bt_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bits_ptr, y_ptr, uo_ptr, ko_ptr, flush_ptr,
        T, L, H, HV, K, V, REP, MAXB, scale,
        TP: tl.constexpr, LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKC: tl.constexpr,
        L2: tl.constexpr, TREE: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
        FOLD: tl.constexpr, FOLD_PREC: tl.constexpr,
    ):
        """Replay verify as small matrix products over ``K`` in chunks of ``BKC`` (the Mamba-2
        ``_m2_verify_dot_kernel`` treatment; the whole ``[BK, BV]`` checkpoint never sits in
        registers):

        ``HK = α0 Kn S0 + (w ∘ Kn Khᵀ) Uh``, ``HQ`` likewise with ``Qn``; ``KK = Kn Knᵀ``,
        ``QK = Qn Knᵀ`` (drafts padded to ``TP ≥ 16`` rows); then the T×T system
        ``(I + A) U = R`` by forward substitution, and ``Y = e^{G} HQ + (mask ∘ e^{G_s−G_s'} QK) U``.
        ``FOLD``: flush rows store ``S_h = α0 S0 + Σ_j w_j k_j u_jᵀ`` chunk by chunk in the same
        pass (no ``_gdn_fold_kernel``), its product at ``FOLD_PREC`` (the stored state keeps
        fp32-level sums even where the outputs use ``PREC = tf32``).  Arguments of
        ``_gdn_verify_rows_kernel`` plus ``flush_ptr``."""
        vb, hv, r = tile_ids(tl.cdiv(V, BV), HV)  # V-blocks of one (row, head) side by side
        kh = hv // REP
        r64 = r.to(tl.int64)
        offs_v = vb * BV + tl.arange(0, BV)
        mv = offs_v < V
        slot, h, mj, e = history_entries(slot_ptr, start_ptr, hist_ptr, bt_ptr, r, L, MAXB, LP, PAGED)
        gj = tl.where(mj, tl.load(gr_ptr + e * HV + hv, mask=mj, other=0.0).to(tl.float32), 0.0)
        cj = tl.cumsum(gj, 0)
        tot = tl.sum(gj, 0)
        wj = tl.where(mj, tl.exp(tot - cj), 0.0)
        a0 = tl.exp(tot)
        Uh = tl.load(ur_ptr + (e[:, None] * HV + hv) * V + offs_v[None, :], mask=mj[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)                                              # [LP, BV]
        ss = tl.arange(0, TP)
        ms = ss < T
        tok = r64 * T + ss
        # l2 norms of the drafts' q and k rows (first pass over K)
        sq = tl.zeros([TP], dtype=tl.float32)
        sk = tl.zeros([TP], dtype=tl.float32)
        for k0 in tl.static_range(0, BK, BKC):
            offs_k = k0 + tl.arange(0, BKC)
            mks = ms[:, None] & (offs_k < K)[None, :]
            qc = tl.load(q_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks, other=0.0).to(tl.float32)
            kc = tl.load(k_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks, other=0.0).to(tl.float32)
            sq += tl.sum(qc * qc, 1)
            sk += tl.sum(kc * kc, 1)
        if L2:
            rq = tl.rsqrt(sq + 1e-6) * scale
            rk = tl.rsqrt(sk + 1e-6)
        else:
            rq = tl.zeros([TP], dtype=tl.float32) + scale
            rk = tl.zeros([TP], dtype=tl.float32) + 1.0
        if FOLD:
            flush = tl.load(flush_ptr + r) != 0
        # second pass: the products over K, chunk by chunk
        KK = tl.zeros([TP, TP], dtype=tl.float32)
        QK = tl.zeros([TP, TP], dtype=tl.float32)
        SK = tl.zeros([TP, LP], dtype=tl.float32)
        SQ = tl.zeros([TP, LP], dtype=tl.float32)
        HK = tl.zeros([TP, BV], dtype=tl.float32)
        HQ = tl.zeros([TP, BV], dtype=tl.float32)
        for k0 in tl.static_range(0, BK, BKC):
            offs_k = k0 + tl.arange(0, BKC)
            mk = offs_k < K
            mks = ms[:, None] & mk[None, :]
            qc = tl.load(q_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks,
                         other=0.0).to(tl.float32) * rq[:, None]                            # [TP, BKC]
            kc = tl.load(k_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], mask=mks,
                         other=0.0).to(tl.float32) * rk[:, None]
            if vb == 0:
                if hv % REP == 0:
                    tl.store(ko_ptr + (tok[:, None] * H + kh) * K + offs_k[None, :], kc.to(ko_ptr.dtype.element_ty),
                             mask=mks)
            khc = tl.load(kr_ptr + (e[:, None] * H + kh) * K + offs_k[None, :], mask=mj[:, None] & mk[None, :],
                          other=0.0).to(tl.float32)                                         # [LP, BKC]
            KK += tl.dot(kc, tl.trans(kc), input_precision=PREC)
            QK += tl.dot(qc, tl.trans(kc), input_precision=PREC)
            SK += tl.dot(kc, tl.trans(khc), input_precision=PREC)
            SQ += tl.dot(qc, tl.trans(khc), input_precision=PREC)
            if not PAGED:
                sptr = state_ptr + ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
                S0 = tl.load(sptr, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)              # [BKC, BV]
                HK += tl.dot(kc, S0, input_precision=PREC)
                HQ += tl.dot(qc, S0, input_precision=PREC)
                if FOLD:
                    if flush:
                        Sh = a0 * S0 + tl.dot(tl.trans(khc * wj[:, None]), Uh, input_precision=FOLD_PREC)
                        tl.store(sptr, Sh.to(state_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])
        HK = a0 * HK + tl.dot(SK * wj[None, :], Uh, input_precision=PREC)
        HQ = a0 * HQ + tl.dot(SQ * wj[None, :], Uh, input_precision=PREC)
        Vn, bn, anc, Gs = _draft_inputs(v_ptr, g_ptr, b_ptr, bits_ptr, tok, ss, ms, offs_v, mv, hv, HV, V, TREE)
        # the T×T system (I + A) U = R by forward substitution
        U, Mq, eG = _solve_drafts(KK, QK, HK, Vn, Gs, bn, anc, ss, T)
        Y = eG[:, None] * HQ + tl.dot(Mq, U, input_precision=PREC)
        mo = ms[:, None] & mv[None, :]
        tl.store(y_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], Y.to(y_ptr.dtype.element_ty), mask=mo)
        tl.store(uo_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], U.to(uo_ptr.dtype.element_ty), mask=mo)


# =============================================================================== wrappers
def _dims(q: Tensor, v: Tensor, has_time: bool):
    if has_time:
        Bt, T, H, K = q.shape
    else:
        (Bt, H, K), T = q.shape, 1
    HV, V = v.shape[-2:]
    if HV % H:
        raise ValueError(f"num_v_heads {HV} is not a multiple of num_k_heads {H}")
    return Bt, T, H, HV, K, V


def _bv(V: int, block_v: int | None) -> int:
    return tile(V, block_v, 32)


def _scale(scale, K):
    return K ** -0.5 if scale is None else float(scale)


def _check_ring(buf, plan, v: Tensor, dims) -> None:
    Bt, T, H, HV, K, V = dims
    P, L = buf.state.shape[0], plan.capacity
    check_ring((("state", buf.state, (P, HV, K, V)), ("u", buf.u, (P, L, HV, V)),
                ("k", buf.k, (P, L, H, K)), ("g", buf.g, (P, L, HV))), plan, Bt, T)

def recurrent_update(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     scale: float | None = None, use_qk_l2norm: bool = True, slot: Tensor | None = None,
                     out_state: Tensor | None = None, block_v: int | None = None,
                     num_warps: int = 4) -> Tensor:
    """Recurrent decode kernel on a state pool (``state[slot]`` updated in place by default)."""
    Bt, _, H, HV, K, V = _dims(q, v, False)
    q, k, v, g, beta = (_c(t) for t in (q, k, v, g, beta))
    out_state = state if out_state is None else out_state
    y = torch.empty_like(v)
    BV = next_pow2(block_v) if block_v else min(next_pow2(V), 16)
    if Bt:
        _gdn_recurrent_kernel[flat_grid(triton.cdiv(V, BV), HV, Bt)](
            state, out_state, slot if slot is not None else state, q, k, v, g, beta, y, y,
            1, H, HV, K, V, HV // H, _scale(scale, K),
            BK=next_pow2(K), BV=BV, HAS_SLOT=slot is not None, L2=bool(use_qk_l2norm), SNAP=False,
            num_warps=num_warps)
    return y


def recurrent_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   scale: float | None = None, use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """Same contract as the naive op: ``(y, new_state)``; ``state`` is not modified."""
    state = state.contiguous()
    new = torch.empty_like(state)
    y = recurrent_update(state, q, k, v, g, beta, scale, use_qk_l2norm, out_state=new)
    return y, new


def snapshot_verify(state: Tensor, slot: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    scale: float | None = None, use_qk_l2norm: bool = True, check: bool | None = None,
                    block_v: int | None = None, num_warps: int = 4,
                    snapshots: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Snapshot baseline: serial scan from ``state[slot]``, one state stored per draft."""
    Bt, T, H, HV, K, V = _dims(q, v, True)
    q, k, v, g, beta = (_c(t) for t in (q, k, v, g, beta))
    y = torch.empty_like(v)
    if snapshots is None:
        snapshots = torch.empty(Bt, T, HV, K, V, dtype=state.dtype, device=state.device)
    BV = next_pow2(block_v) if block_v else min(next_pow2(V), 16)
    if Bt and T:
        _gdn_recurrent_kernel[flat_grid(triton.cdiv(V, BV), HV, Bt)](
            state, state, slot, q, k, v, g, beta, y, snapshots,
            T, H, HV, K, V, HV // H, _scale(scale, K),
            BK=next_pow2(K), BV=BV, HAS_SLOT=True, L2=bool(use_qk_l2norm), SNAP=True, num_warps=num_warps)
    return y, snapshots


def _fold(buf, plan, extra: int, grid, BV: int, precision: str) -> None:
    """Flush rows: fold the first ``h + extra`` ring entries into the checkpoint (after the
    decode (``extra = 1``, the new entry as the ring stores it) or verify (``extra = 0``)
    kernel)."""
    P, HV, K, V = buf.state.shape
    H = buf.k.shape[2]
    L = plan.capacity
    _gdn_fold_kernel[grid](
        buf.state, buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.flush,
        L, H, HV, K, V, HV // H, extra, LP=pad16(L), BK=pad16(K), BV=BV, PREC=precision, num_warps=4)


#: ``flush_mode`` of :func:`replay_decode` (see :func:`replayssm.kernels.mamba2.replay_decode`)
FLUSH_MODES = ("split", "fused", "apart", "gated")

#: up to this many (row, value head, 32-wide V-block) tiles a decode step is one launch
SMALL_GRID = 2048

#: the keys a launch config of :func:`replay_decode` may set (:data:`DECODE_TABLE`)
DECODE_KEYS = ("block_v", "num_warps", "pre_scores", "flush_mode", "fold_form", "fold_warps", "prefetch")

#: tuned launch configs of :func:`replay_decode` (output route), consulted before the measured
#: defaults of :func:`decode_defaults`: rows ``(max_batch, state_itemsize, config)`` as in
#: :data:`replayssm.kernels.mamba2.DECODE_TABLE`.  Empty: the defaults.  The H200 run of
#: 2026-11-27 evening (fp32 states, HV 32, K = V = 128): one row 5.2 vs 5.6 us on 32-wide V tiles
#: with the state loads issued with the plan words; every other batch within 2% of the default.
DECODE_TABLE: list = [
    (1, 4, {"block_v": 32, "num_warps": 4, "pre_scores": False, "fold_form": "dot", "flush_mode": "fused",
            "prefetch": True, "fold_warps": 4}),
]


def decode_defaults(Bt: int, HV: int, V: int, state_itemsize: int = 4) -> dict:
    """Launch config of :func:`replay_decode` (output route) for a batch: the first matching
    row of :data:`DECODE_TABLE`, else the measured default (H100, 2026-11-23, KERNEL_NOTES.md):
    small grids run as one launch (``fused``, 4 warps: its fold spills on fewer); larger ones
    run the per-head scores kernel, the hot kernel on 64-wide V tiles and 2 warps, and the
    flush rows apart.  Flush rows fold with ``tl.dot``."""
    base = dict(fold_form="dot", fold_warps=4, prefetch=False)
    if Bt * HV * triton.cdiv(V, 32) <= SMALL_GRID:
        base.update(pre_scores=False, flush_mode="fused", num_warps=4, block_v=32)
    else:
        base.update(pre_scores=True, flush_mode="apart", num_warps=2, block_v=64)
    return dict(base, **table_row(DECODE_TABLE, DECODE_KEYS, Bt, state_itemsize))


def replay_decode(buf, plan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  scale: float | None = None, use_qk_l2norm: bool = True, route: str = "output",
                  check: bool | None = None, block_v: int | None = None, num_warps: int | None = None,
                  precision: str = "tf32x3", pre_scores: bool | None = None, flush_mode: str | None = None,
                  fold_warps: int | None = None, fold_form: str | None = None,
                  prefetch: bool | None = None) -> Tensor:
    """Replay decode, appending ``(u, k, g)``.  ``flush_mode`` (default:
    :func:`decode_defaults`) is how flush rows store ``S_{h+1}``:

    * ``"fused"``: one kernel; flush rows fold the tile they read (the small-batch form).
    * ``"apart"``: the hot kernel (no flush code) skips the flush rows; a persistent kernel of
      ``fold_warps``-warp programs then runs decode + fold for them only, the rows found on
      the device (large batches).
    * ``"gated"``: the hot kernel as in ``apart``, then decode + fold for the flush rows in a
      second kernel over the whole grid (``fold_warps`` warps; the other rows' programs
      return after one load): no device-side search for the flush rows per tile.
    * ``"split"``: the hot kernel for every row, then the fold kernel re-reads the flush
      rows' checkpoints (three state passes on a flush step; the state route's form).

    ``fold_form`` (``fused`` / ``apart`` / ``gated``): flush rows re-read their tile in K chunks (from L2);
    ``"dot"`` folds 32-row chunks with ``tl.dot`` (``precision``); ``"fma"`` by rank-1 updates
    over the row's entries, a run-time loop (any ``block_v``, no shared memory; chunks of up to
    :data:`~replayssm.kernels.mamba2.FMA_CHUNK` state values); ``"hold"``: one ``tl.dot`` over
    the readout's tile, still in registers, and the ring entries (no re-read; small tiles);
    ``"unroll"``: rank-1 updates of the held tile unrolled over the ring positions (narrow tiles).
    ``prefetch``: the row's slot, start, fill and flush flag in one round of loads, before
    the state (the late form: the flag first where flush rows are skipped, or after the stores).
    ``pre_scores``: normalised ``q``/``k`` and the history scores once per (row, key head) in
    a small kernel (output route only).  ``route="state"`` rebuilds ``S_h`` in the kernel.
    ``precision``: the ``tl.dot`` of the state route and of the fold."""
    if route not in ("state", "output"):
        raise ValueError(f"bad route {route!r}: expected 'state' or 'output'")
    if plan.kind != "decode":
        raise ValueError(f"replay_decode needs a 'decode' plan, got {plan.kind!r}")
    dims = _dims(q, v, False)
    Bt, _, H, HV, K, V = dims
    _check_ring(buf, plan, v, dims)
    auto = decode_defaults(Bt, HV, V, buf.state.element_size())
    if route == "state":
        auto = dict(pre_scores=False, flush_mode="split", num_warps=1, block_v=32, fold_form="dot", fold_warps=4,
                    prefetch=False)
    flush_mode = flush_mode or auto["flush_mode"]
    pre_scores = auto["pre_scores"] if pre_scores is None else bool(pre_scores)
    num_warps = num_warps or auto["num_warps"]
    fold_warps = fold_warps or auto["fold_warps"]
    fold_form = fold_form or auto["fold_form"]
    prefetch = auto["prefetch"] if prefetch is None else bool(prefetch)
    if flush_mode not in FLUSH_MODES:
        raise ValueError(f"bad flush_mode {flush_mode!r}: expected one of {FLUSH_MODES}")
    if route == "state" and (pre_scores or flush_mode != "split"):
        raise ValueError("route='state' runs with pre_scores=False and flush_mode='split' only")
    if fold_form in ("fma", "hold", "unroll") and flush_mode == "split":
        raise ValueError(f"fold_form={fold_form!r} folds inside the decode kernel: flush_mode 'fused', 'apart' "
                         "or 'gated'")
    BV = decode_block(V, block_v or auto["block_v"], fold_form if flush_mode != "split" else "dot")
    (q, QS), (k, KS), (v, VS) = token_rows(q, 1), token_rows(k, 1), token_rows(v, 1)
    g, beta = _c(g), _c(beta)
    L = plan.capacity
    LP, BK = pad16(L), pad16(K)
    y = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if Bt == 0:
        return y
    sc = qk = y
    if pre_scores:
        sc = torch.empty(Bt, H, 2, LP + 1, dtype=torch.float32, device=v.device)
        qk = torch.empty(Bt, H, 2, K, dtype=torch.float32, device=v.device)
        _gdn_scores_kernel[(Bt * H,)](buf.k, plan.slot, plan.start, plan.hist, q, k, sc, qk,
                                      L, H, K, _scale(scale, K), QS, KS, LP=LP, BK=BK, L2=bool(use_qk_l2norm),
                                      num_warps=4)
    nv = triton.cdiv(V, BV)
    args = (buf.state, buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.flush,
            q, k, v, g, beta, y, sc, qk)
    dims_args = (L, H, HV, K, V, HV // H, _scale(scale, K), QS, KS, VS)
    # fold chunk: 32 rows for the dot; for fma up to 1024 state values (16 fp32 registers on 2 warps:
    # with 4096 the Qwen3-Next-shape 64-wide tile on 2 warps compiled at 254 registers, with 1024 at 206)
    BKC = min(BK, 32) if fold_form == "dot" else min(BK, max(16, FMA_CHUNK // BV))
    const = dict(LP=LP, BK=BK, BKC=BKC, BV=BV, BT=flag_chunk(Bt), L2=bool(use_qk_l2norm),
                 OUTPUT_ROUTE=route == "output", PRE_SCORES=pre_scores, PREC=precision, FMA=fold_form == "fma",
                 HOLD=fold_form == "hold", EARLY=prefetch, UNROLL=fold_form == "unroll")
    grid = flat_grid(nv, HV, Bt)
    _gdn_replay_decode_kernel[grid](*args, Bt, 1, *dims_args, **const, FOLD=flush_mode == "fused",
                                    SKIP_FLUSH=flush_mode in ("apart", "gated"), PERSIST=False, num_warps=num_warps)
    if flush_mode == "apart":
        nprog = persistent_programs(v.device, Bt * HV * nv, 32 // fold_warps)
        _gdn_replay_decode_kernel[(nprog,)](*args, Bt, nprog, *dims_args, **const, FOLD=True, SKIP_FLUSH=False,
                                            PERSIST=True, num_warps=fold_warps)
    elif flush_mode == "gated":
        _gdn_replay_decode_kernel[grid](*args, Bt, 1, *dims_args, **const, FOLD=True, SKIP_FLUSH=False, PERSIST=False,
                                        ONLY_FLUSH=True, num_warps=fold_warps)
    elif flush_mode == "split":
        _fold(buf, plan, 1, grid, BV, precision)
    return y


#: verify kernels: ``rows`` (register tiles), ``dot`` (tensor-core products over K chunks)
VERIFY_IMPLS = ("rows", "dot")

#: measured overrides of :func:`verify_form`'s rule for 16-bit activations: rows ``(min_T,
#: min row × value-head pairs, impl)``, the first row the call reaches wins.  H100
#: (``scripts/tune_gdn_verify.py``, 2026-11-27, Qwen3.5-4B / Qwen3-Next-4B shapes, bf16 and
#: fp32 states, mixed fills): ``dot`` beat ``rows`` at T = 3 and 4 at every batch measured —
#: B = 256, T = 4: 437 vs 826 µs (bf16 states), 496 vs 710 (fp32); B = 16, T = 4: 26.6 vs
#: 78.0; B = 1, T = 3: 10.6 vs 15.6 — so ``dot`` from T = 3; T = 2 (one draft) not measured.
#: A third form (``split``, a per key-head prep kernel and a state-streaming readout) lost
#: everywhere (B = 256, T = 5: 681 vs 463 µs; its prep alone 263) and was removed
#: (docs/KERNEL_NOTES.md).
VERIFY_TABLE: list = [(3, 0, "dot")]


def verify_form(dtype: torch.dtype, T: int, impl: str | None, precision: str | None,
                fold_precision: str = "tf32x3", pairs: int | None = None) -> tuple[str, str]:
    """``(impl, precision)`` of a verify call of ``T`` queries over ``pairs`` (row, value head)
    pairs: a matching :data:`VERIFY_TABLE` row, else for 16-bit activations the
    ``dot`` kernel with tf32 output products from T = 5 (H100 sweep 2026-11-25, B = 1..256,
    T = 5: whole 128-wide V tiles on 4 warps ran 1.5-2.2x the rows kernel; at tf32x3 that
    tile spilled and lost; its 16-row padding makes small T its worst case, not measured);
    else the ``rows`` kernel (FMA outputs, fp32-level)."""
    precision = verify_precision(dtype, precision, fold_precision)
    if impl is None and precision == "tf32" and pairs is not None:
        impl = next((name for tmin, pmin, name in VERIFY_TABLE if T >= tmin and pairs >= pmin), None)
    if impl is None:
        impl = "dot" if precision == "tf32" and T >= 5 else "rows"
    return impl, precision


def _verify(buf, plan, q, k, v, g, beta, scale, use_qk_l2norm, route, bits, paged=None,
            block_v=None, num_warps=None, ring_dtype=None, precision=None, impl=None, fused_fold=True,
            fold_precision="tf32x3"):
    """The verify kernel (output route: both routes give the same numbers up to rounding).
    ``impl="rows"``: one draft at a time on register tiles, then the fold kernel for the rows
    that flush.  ``impl="dot"``: small tensor-core products over K chunks, the flush rows
    folded in the same pass when ``fused_fold``.  ``impl=None`` / ``precision=None``:
    :func:`verify_form`.  Folds (fused or not) run at ``fold_precision``."""
    if route not in ("state", "output"):
        raise ValueError(f"bad route {route!r}: expected 'state' or 'output'")
    Bt, T, H, HV, K, V = _dims(q, v, True)
    impl, precision = verify_form(q.dtype, T, impl, precision, fold_precision, pairs=Bt * HV)
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"bad verify impl {impl!r}: expected one of {VERIFY_IMPLS}")
    q, k, v, g, beta = (_c(t) for t in (q, k, v, g, beta))
    flush = ()
    if impl == "rows":
        wide = T >= 5  # H100 sweep (scripts/tune_verify.py): 64-wide V tiles on 2 warps win from T = 5
        BV = _bv(V, block_v or (64 if wide else 32))
        num_warps = num_warps or (2 if wide else 1)
        kernel, extra = _gdn_verify_rows_kernel, dict(TP=max(2, next_pow2(T)))
    else:
        # tf32 outputs: whole 128-wide V tiles on 4 warps; from 2048 (row, value-head) pairs
        # 64-wide tiles on 2 warps (H200 sweep 2026-11-25, T = 5: 1.03x at B = 64 and 256 on
        # 32 value heads, level at B = 16)
        tf32, big = precision == "tf32", Bt * HV >= 2048
        BV = _bv(V, block_v or (64 if big or not tf32 else 128))
        num_warps = num_warps or (2 if tf32 and big else 4)
        kernel = _gdn_verify_dot_kernel
        extra = dict(TP=max(16, next_pow2(T)), BKC=min(32, pad16(K)), PREC=precision, FOLD=fused_fold,
                     FOLD_PREC=fold_precision)
    y = torch.empty_like(v)
    U = torch.empty(Bt, T, HV, V, dtype=ring_dtype[0], device=v.device)
    Kn = torch.empty(Bt, T, H, K, dtype=ring_dtype[1], device=v.device)
    if Bt == 0:
        return y, U, Kn
    grid = flat_grid(triton.cdiv(V, BV), HV, Bt)
    common = dict(BK=pad16(K), BV=BV, L2=bool(use_qk_l2norm), TREE=bits is not None, num_warps=num_warps,
                  **extra)
    if paged is None:
        if impl == "dot":
            flush = (plan.flush,)
        kernel[grid](
            buf.state, buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.slot,
            q, k, v, g, beta, bits if bits is not None else plan.slot, y, U, Kn, *flush,
            T, plan.capacity, H, HV, K, V, HV // H, 1, _scale(scale, K),
            LP=pad16(plan.capacity), PAGED=False, **common)
        if not (impl == "dot" and fused_fold):  # S_h (committed entries), after every draft read S0
            _fold(buf, plan, 0, grid, BV, fold_precision)
    else:
        kv, pplan = paged
        bt = pplan.block_table.contiguous()
        if impl == "dot":
            flush = (pplan.slot,)
        kernel[grid](
            v, kv.u, kv.k, kv.g, pplan.slot, pplan.length, pplan.length, bt,
            q, k, v, g, beta, bits if bits is not None else pplan.slot, y, U, Kn, *flush,
            T, pplan.block_size, H, HV, K, V, HV // H, bt.shape[1], _scale(scale, K),
            LP=pad16(pplan.max_len), PAGED=True, **common)
    return y, U, Kn


def _append_entries(ur, kr, gr, slot, start, hist, bt, U, Kn, g, L, paged: bool) -> None:
    append_entries((ur, kr, gr), (U, Kn, g), slot, start, hist, bt if paged else None, L)

def _append(buf, plan, U, Kn, g) -> None:
    _append_entries(buf.u, buf.k, buf.g, plan.slot, plan.start, plan.hist, plan.slot, U, Kn, g,
                    plan.capacity, False)


def replay_verify(buf, plan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  scale: float | None = None, use_qk_l2norm: bool = True, route: str = "output",
                  check: bool | None = None, block_v: int | None = None, num_warps: int | None = None,
                  precision: str | None = None, impl: str | None = None, fused_fold: bool = True,
                  fold_precision: str = "tf32x3") -> Tensor:
    """Replay verify of T drafts: the verify kernel (output route; ``route`` is
    accepted for API parity; ``impl`` / ``precision`` default to :func:`verify_form`), the
    fold (flush rows store ``S_h``, at ``fold_precision``), then one append kernel."""
    if plan.kind != "verify":
        raise ValueError(f"replay_verify needs a 'verify' plan, got {plan.kind!r}")
    dims = _dims(q, v, True)
    _check_ring(buf, plan, v, dims)
    y, U, Kn = _verify(buf, plan, q, k, v, g, beta, scale, use_qk_l2norm, route, None,
                       block_v=block_v, num_warps=num_warps, ring_dtype=(buf.u.dtype, buf.k.dtype),
                       precision=precision, impl=impl, fused_fold=fused_fold, fold_precision=fold_precision)
    _append(buf, plan, U, Kn, g)
    return y


def tree_verify(buf, plan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                scale: float | None = None, use_qk_l2norm: bool = True, route: str = "output",
                check: bool | None = None, bits: Tensor | None = None, block_v: int | None = None,
                num_warps: int | None = None, precision: str | None = None, impl: str | None = None,
                fused_fold: bool = True, fold_precision: str = "tf32x3") -> Tensor:
    """Tree verify: the triangular solve restricted to the ancestor mask."""
    if plan.kind != "tree":
        raise ValueError(f"tree_verify needs a 'tree' plan, got {plan.kind!r}")
    dims = _dims(q, v, True)
    _check_ring(buf, plan, v, dims)
    if bits is None:
        bits = tree_bits(parent, dims[0])
    y, U, Kn = _verify(buf, plan, q, k, v, g, beta, scale, use_qk_l2norm, route, bits,
                       block_v=block_v, num_warps=num_warps, ring_dtype=(buf.u.dtype, buf.k.dtype),
                       precision=precision, impl=impl, fused_fold=fused_fold, fold_precision=fold_precision)
    _append(buf, plan, U, Kn, g)
    return y


#: the KV-only kernel takes steps of at most this many new tokens: its score tiles grow with
#: the square of the padded step length (a 245-token KV-only prefill asked for 512 KiB of
#: shared memory on an H200, which has 227 KiB); longer steps (KV-only prefill of a long
#: chunk) run the reference op.  16, as KDA's: at Qwen3-Next-80B's shapes under TP=4 (8 value
#: heads of 128 a rank) ptxas had not finished the 32-token form after 90 s on an H200
KV_MAX_NEW = 16


#: calls the kernels take (others run the reference; ``kernels.dispatch``)
SUPPORTS = {"kv_verify": lambda kv, pplan, q, *args, **kw: few_new_tokens(q, KV_MAX_NEW)}


def kv_verify(kv, pplan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              scale: float | None = None, use_qk_l2norm: bool = True, check: bool | None = None,
              parent: Tensor | None = None, route: str = "output", block_v: int | None = None,
              num_warps: int | None = None, precision: str = "tf32x3", impl: str = "rows") -> Tensor:
    """KV-only form (``S0 = 0``) over paged buffers (a draft tree when ``parent`` is given);
    appends ``(U, k, g)`` after the kernel."""
    bits = None if parent is None else tree_bits(parent, q.shape[0])
    y, U, Kn = _verify(None, None, q, k, v, g, beta, scale, use_qk_l2norm, route, bits,
                       paged=(kv, pplan), block_v=block_v, num_warps=num_warps,
                       ring_dtype=(kv.u.dtype, kv.k.dtype), precision=precision, impl=impl)
    _append_entries(kv.u, kv.k, kv.g, pplan.slot, pplan.length, pplan.length, pplan.block_table.contiguous(),
                    U, Kn, g, pplan.block_size, True)
    return y


def kv_fold(kv, pplan, initial_state: Tensor | None = None, check: bool | None = None,
            block_t: int | None = None, block_v: int | None = None, num_warps: int | None = None,
            precision: str = "ieee") -> Tensor:
    """Kernel form of :func:`replayssm.ops.gdn.naive.kv_fold` (same arguments, fp32 result):
    ``S = e^{pre_n} S0 + Σ_j e^{pre_n−pre_j} k_j ⊗ u_j`` in one launch (:mod:`.fold`;
    ``block_v`` is the block of the state's key rows a program holds)."""
    HV = check_kv_fold(kv, pplan, initial_state, check)[2]
    return paged_fold(kv.k, kv.u, kv.g, pplan, scale=None, weighted=False, initial_state=initial_state,
                      num_state_heads=HV, block_t=block_t, block_r=block_v, num_warps=num_warps, precision=precision)


def rebuild_state(buf, plan, block_t: int | None = None, block_v: int | None = None, num_warps: int | None = None,
                  precision: str = "ieee") -> Tensor:
    """Kernel form of :func:`replayssm.ops.gdn.naive.rebuild_state`: ``S_h`` of every row from
    its checkpoint and committed ring entries, one launch (:func:`.fold.ring_fold`); returned
    in fp32 (the compute dtype: a bf16/fp16 checkpoint is upcast, never rounded
    here)."""
    check_rebuild_state(buf, plan)
    S = ring_fold(buf.state, buf.k, buf.u, buf.g, plan, scale=None, weighted=False, block_t=block_t,
                  block_r=block_v, num_warps=num_warps, precision=precision)
    return S
