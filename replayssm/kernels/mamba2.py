"""Triton kernels for Mamba-2 decoding: recurrent baseline, output-only replay decode,
replay / tree / KV-only verify, snapshot verify baseline (the forms of ``docs/MATH.md``).

Same arguments and results as :mod:`replayssm.ops.mamba2.naive`.  Layouts (contiguous):
state ``[P,H,d,n]`` fp32, ring ``x [P,L,H,d]``, ``B [P,L,G,n]``, ``dt [P,L,H]``.
Grid: one program per (row, head, d-block); the state tile is ``[BD, n]`` with the whole
``n`` (d_state) axis in one tile, so ``S q`` and the flush need no cross-program reduction.
Per-row plan data (slot, start, hist, flush, block table) is read on the device; flush is a
run-time branch, so one launch (and one CUDA graph) covers rows that flush and rows that
do not.  No host synchronisation anywhere.

Decode (``T = 1``) writes its ring entry in-kernel (the new position ``(start+h) % L`` is
never a committed entry).  Verify/tree/KV steps may overwrite committed entries (a
flushing row with ``h + T > L``) that other programs of the row still read, so their new
entries are written with torch index ops after the kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.tree import ancestor_bits, ancestor_mask
from ..ops.mamba2.naive import check_conv_fold, check_kv_fold, check_rebuild_state
from ._triton import (HAVE_TRITON, check_ring, flat_grid, history_entries, next_pow2, pad16, tile, tile_ids,
                      token_rows, triton, tl, verify_precision, few_new_tokens)
from ._triton import contiguous as _c
from .append import append_entries
from .fold import conv_fold as _conv_fold
from .fold import paged_fold, ring_fold

__all__ = [
    "recurrent_step",
    "recurrent_update",
    "replay_decode",
    "replay_verify",
    "tree_verify",
    "kv_verify",
    "snapshot_verify",
    "kv_fold",
    "conv_fold",
    "rebuild_state",
    "tree_bits",
]


# =============================================================================== kernels
if HAVE_TRITON:

    @triton.jit
    def _m2_recurrent_kernel(
        sin_ptr, sout_ptr, slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr,
        H, G, d, n, HPG, XS, BS, CS,
        BD: tl.constexpr, BN: tl.constexpr, HAS_SLOT: tl.constexpr, HAS_D: tl.constexpr,
    ):
        """Recurrent form: load S, update, read out, store S (like selective_state_update)."""
        db, hd, r = tile_ids(tl.cdiv(d, BD), H)  # d-blocks of one (row, head) side by side
        g = hd // HPG
        if HAS_SLOT:
            srow = tl.load(slot_ptr + r).to(tl.int64)
        else:
            srow = r.to(tl.int64)
        offs_d = db * BD + tl.arange(0, BD)
        offs_n = tl.arange(0, BN)
        md = offs_d < d
        mn = offs_n < n
        m2 = md[:, None] & mn[None, :]
        soff = ((srow * H + hd) * d + offs_d[:, None]) * n + offs_n[None, :]
        S = tl.load(sin_ptr + soff, mask=m2, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r.to(tl.int64) * XS + hd * d + offs_d, mask=md, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * H + hd).to(tl.float32)
        A = tl.load(A_ptr + hd).to(tl.float32)
        Bv = tl.load(B_ptr + r.to(tl.int64) * BS + g * n + offs_n, mask=mn, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + r.to(tl.int64) * CS + g * n + offs_n, mask=mn, other=0.0).to(tl.float32)
        S = tl.exp(A * dt) * S + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(S * Cv[None, :], 1)
        if HAS_D:
            y += tl.load(D_ptr + hd).to(tl.float32) * x
        tl.store(y_ptr + (r * H + hd) * d + offs_d, y.to(y_ptr.dtype.element_ty), mask=md)
        tl.store(sout_ptr + soff, S.to(sout_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _m2_snapshot_kernel(
        state_ptr, slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, snap_ptr,
        T, H, G, d, n, HPG,
        BD: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
    ):
        """Snapshot baseline: serial scan over T drafts, one state snapshot stored per draft."""
        db, hd, r = tile_ids(tl.cdiv(d, BD), H)  # d-blocks of one (row, head) side by side
        g = hd // HPG
        srow = tl.load(slot_ptr + r).to(tl.int64)
        offs_d = db * BD + tl.arange(0, BD)
        offs_n = tl.arange(0, BN)
        md = offs_d < d
        mn = offs_n < n
        m2 = md[:, None] & mn[None, :]
        tile = offs_d[:, None] * n + offs_n[None, :]
        S = tl.load(state_ptr + (srow * H + hd) * d * n + tile, mask=m2, other=0.0).to(tl.float32)
        A = tl.load(A_ptr + hd).to(tl.float32)
        if HAS_D:
            Dv = tl.load(D_ptr + hd).to(tl.float32)
        rT = r.to(tl.int64) * T
        for t in range(T):
            x = tl.load(x_ptr + ((rT + t) * H + hd) * d + offs_d, mask=md, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + (rT + t) * H + hd).to(tl.float32)
            Bv = tl.load(B_ptr + ((rT + t) * G + g) * n + offs_n, mask=mn, other=0.0).to(tl.float32)
            Cv = tl.load(C_ptr + ((rT + t) * G + g) * n + offs_n, mask=mn, other=0.0).to(tl.float32)
            S = tl.exp(A * dt) * S + (dt * x)[:, None] * Bv[None, :]
            y = tl.sum(S * Cv[None, :], 1)
            if HAS_D:
                y += Dv * x
            tl.store(y_ptr + ((rT + t) * H + hd) * d + offs_d, y.to(y_ptr.dtype.element_ty), mask=md)
            tl.store(snap_ptr + ((rT + t) * H + hd) * d * n + tile, S.to(snap_ptr.dtype.element_ty),
                     mask=m2)

    @triton.jit
    def _m2_scores_kernel(
        Br_ptr, slot_ptr, start_ptr, hist_ptr, B_ptr, C_ptr, sc_ptr,
        L, G, n, BS, CS,
        LP: tl.constexpr, BN: tl.constexpr,
    ):
        """Decode precompute: the scores ``B_j·C`` (shared by a group's heads) once per (row, group)
        for the ring entries and the new one -> scratch ``[Bt, G, LP+1]``; also appends the new
        ``B`` to the ring."""
        r = tl.program_id(0)
        g = tl.program_id(1)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        start = tl.load(start_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        jj = tl.arange(0, LP)
        mj = jj < h
        offs_n = tl.arange(0, BN)
        mn = offs_n < n
        e = slot * L + (start + jj) % L
        Bh = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_n[None, :], mask=mj[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        Braw = tl.load(B_ptr + r.to(tl.int64) * BS + g * n + offs_n, mask=mn, other=0.0)
        Bv = Braw.to(tl.float32)
        Cv = tl.load(C_ptr + r.to(tl.int64) * CS + g * n + offs_n, mask=mn, other=0.0).to(tl.float32)
        sc = tl.sum(Bh * Cv[None, :], 1)
        base = (r.to(tl.int64) * G + g) * (LP + 1)
        tl.store(sc_ptr + base + jj, sc)
        tl.store(sc_ptr + base + LP, tl.sum(Bv * Cv, 0))
        enew = slot * L + (start + h) % L
        tl.store(Br_ptr + (enew * G + g) * n + offs_n, Braw, mask=mn)

    @triton.jit
    def _m2_fold_fma(state_ptr, xr_ptr, Br_ptr, dtr_ptr, B_ptr, sbase, slot, start, h, hd, g, A, tot, lv, dtv, xv,
                     bbase, offs_d, md, L, H, G, d, n, BN: tl.constexpr, BNC: tl.constexpr):
        """A flush row's ``S_{h+1} = e^{tot+l} S0 + Δ x Bᵀ + Σ_{j<h} Δ_j e^{tot-cum_j+l} x_j B_jᵀ``
        by rank-1 updates, ``n`` in chunks of ``BNC``: each chunk of ``S0`` is read again (from
        L2: the readout just read it, so no tile is held across the readout), then a loop that
        runs ``h`` times adds one ring entry per iteration; stored rounded once."""
        a1 = tl.exp(tot + lv)
        for k0 in range(0, BN, BNC):  # a run-time loop: no chunk's loads hoisted above another's stores
            offs_k = k0 + tl.arange(0, BNC)
            mk = offs_k < n
            m2 = md[:, None] & mk[None, :]
            bk = tl.load(B_ptr + bbase + offs_k, mask=mk, other=0.0).to(tl.float32)
            S0c = tl.load(state_ptr + sbase + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            Sn = a1 * S0c + (dtv * xv)[:, None] * bk[None, :]
            c = tot * 0.0
            for j in range(0, h):
                ej = slot * L + (start + j) % L
                dj = tl.load(dtr_ptr + ej * H + hd).to(tl.float32)
                c += A * dj
                xj = tl.load(xr_ptr + (ej * H + hd) * d + offs_d, mask=md, other=0.0).to(tl.float32)
                bj = tl.load(Br_ptr + (ej * G + g) * n + offs_k, mask=mk, other=0.0).to(tl.float32)
                Sn += (dj * tl.exp(tot - c + lv) * xj)[:, None] * bj[None, :]
            tl.store(state_ptr + sbase + offs_k[None, :], Sn.to(state_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _m2_fold_unrolled(state_ptr, xr_ptr, Br_ptr, dtr_ptr, sbase, S0, slot, start, h, hd, g, A, tot, lv, dtv, xv,
                          bnew, offs_d, md, offs_n, mn, L, H, G, d, n, LP: tl.constexpr):
        """The ``fma`` fold for narrow tiles: ``S_{h+1} = e^{tot+l} S0 + Δ x Bᵀ + Σ_{j<h} Δ_j
        e^{tot-cum_j+l} x_j B_jᵀ`` over the tile the readout holds, one rank-1 update per ring
        position in a loop unrolled over all ``LP`` positions (entries past ``h`` masked to zero):
        every entry's loads are independent, so they go out together (one L2 round trip, where
        the run-time loop of :func:`_m2_fold_fma` waits for each)."""
        Sn = tl.exp(tot + lv) * S0 + (dtv * xv)[:, None] * bnew[None, :]
        c = tot * 0.0
        for j in tl.static_range(LP):
            ok = h > j
            ej = slot * L + (start + j) % L
            dj = tl.where(ok, tl.load(dtr_ptr + ej * H + hd).to(tl.float32), 0.0)  # a ring entry, maybe unused
            c += A * dj
            xj = tl.load(xr_ptr + (ej * H + hd) * d + offs_d, mask=md & (offs_d * 0 + j < h), other=0.0).to(tl.float32)
            bj = tl.load(Br_ptr + (ej * G + g) * n + offs_n, mask=mn & (offs_n * 0 + j < h), other=0.0).to(tl.float32)
            Sn += (dj * tl.exp(tot - c + lv) * xj)[:, None] * bj[None, :]
        tl.store(state_ptr + sbase + offs_n[None, :], Sn.to(state_ptr.dtype.element_ty), mask=md[:, None] & mn[None, :])

    @triton.jit
    def _m2_decode_tile(
        state_ptr, xr_ptr, Br_ptr, dtr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, sc_ptr,
        r, hd, db, L, H, G, d, n, HPG, XS, BS, CS,
        LP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BNC: tl.constexpr,
        HAS_D: tl.constexpr, PRE_SCORES: tl.constexpr, PREC: tl.constexpr, FMA: tl.constexpr,
        HOLD: tl.constexpr = False, EARLY: tl.constexpr = False, UNROLL: tl.constexpr = False,
    ):
        """One ``(row, head, d-block)`` tile of output-only replay decode:
        ``y = e^{pre}(S0 C) + Σ_j Δ_j e^{pre-pre_j} (B_j·C) x_j + Δ (B·C) x + D x``; appends
        ``(x, dt)`` (and ``B`` unless ``PRE_SCORES``: the scores kernel did) at ring position h.
        The whole ``[BD, n]`` checkpoint tile is read in one load.

        A flush row then stores ``S_{h+1} = e^{pre} S0 + Σ_{j≤h} Δ_j e^{pre-pre_j} x_j B_jᵀ``
        (the new entry included), ``n`` in chunks of ``BNC``: each chunk of ``S0`` is read again
        right after the first read (from L2, not DRAM), so the register tile of the readout is
        not held across the fold's ``tl.dot``.  One DRAM read and, on flush rows, one write: no
        second pass over the state.  ``FMA``: each re-read chunk is instead folded by a
        run-time loop of rank-1 updates over the row's ``h`` entries (:func:`_m2_fold_fma`: no
        ``tl.dot``, no shared memory, no 16-row minimum: any ``BD``).  ``HOLD``: the readout's
        tile stays in registers and one ``tl.dot`` over the entries already loaded gives the
        whole ``S_{h+1}`` tile (no re-read, no second walk over the ring; small tiles).
        ``UNROLL``: the held tile folded by rank-1 updates, one per ring position, unrolled
        (:func:`_m2_fold_unrolled`: no ``tl.dot``, any ``BD``; narrow tiles).
        ``EARLY``: the flush flag is loaded with the slot, start and fill, before the state (one
        dependent round trip fewer at the end of the program than the late load after the
        stores)."""
        g = hd // HPG
        slot = tl.load(slot_ptr + r).to(tl.int64)
        start = tl.load(start_ptr + r).to(tl.int64)
        h = tl.load(hist_ptr + r).to(tl.int64)
        if EARLY:
            fl = tl.load(flush_ptr + r)
        r64 = r.to(tl.int64)
        offs_d = db * BD + tl.arange(0, BD)
        offs_n = tl.arange(0, BN)
        md = offs_d < d
        mn = offs_n < n
        jj = tl.arange(0, LP)
        mj = jj < h
        e = slot * L + (start + jj) % L  # ring entry of history position j
        sbase = ((slot * H + hd) * d + offs_d[:, None]) * n
        S0 = tl.load(state_ptr + sbase + offs_n[None, :], mask=md[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)                                              # [BD, BN]
        A = tl.load(A_ptr + hd).to(tl.float32)
        dtj = tl.load(dtr_ptr + e * H + hd, mask=mj, other=0.0).to(tl.float32)
        Xh = tl.load(xr_ptr + (e[:, None] * H + hd) * d + offs_d[None, :], mask=mj[:, None] & md[None, :],
                     other=0.0).to(tl.float32)                                              # [LP, BD]
        xraw = tl.load(x_ptr + r64 * XS + hd * d + offs_d, mask=md, other=0.0)
        xv = xraw.to(tl.float32)
        dtv = tl.load(dt_ptr + r64 * H + hd).to(tl.float32)
        bbase = r64 * BS + g * n
        Cv = tl.load(C_ptr + r64 * CS + g * n + offs_n, mask=mn, other=0.0).to(tl.float32)
        # ---- decays: pre_t - pre_j = (tot - cum_j) + l_new, all <= 0
        dtj = tl.where(mj, dtj, 0.0)
        lj = A * dtj
        cj = tl.cumsum(lj, 0)
        tot = tl.sum(lj, 0)
        lv = A * dtv
        wj = dtj * tl.exp(tot - cj + lv)  # 0 past h
        if PRE_SCORES:
            base = (r64 * G + g) * (LP + 1)
            sc = tl.load(sc_ptr + base + jj)
            scn = tl.load(sc_ptr + base + LP)
        else:
            Bh = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_n[None, :], mask=mj[:, None] & mn[None, :],
                         other=0.0).to(tl.float32)
            sc = tl.sum(Bh * Cv[None, :], 1)
            bnew = tl.load(B_ptr + bbase + offs_n, mask=mn, other=0.0).to(tl.float32)
            scn = tl.sum(bnew * Cv, 0)
        coef = tl.where(mj, wj * sc, 0.0)
        y = tl.exp(tot + lv) * tl.sum(S0 * Cv[None, :], 1) + tl.sum(coef[:, None] * Xh, 0) + (dtv * scn) * xv
        if HAS_D:
            y += tl.load(D_ptr + hd).to(tl.float32) * xv
        tl.store(y_ptr + (r64 * H + hd) * d + offs_d, y.to(y_ptr.dtype.element_ty), mask=md)
        # ---- append (x, B, dt) at ring position h (never a committed entry for decode)
        enew = slot * L + (start + h) % L
        tl.store(xr_ptr + (enew * H + hd) * d + offs_d, xraw, mask=md)
        if db == 0:
            tl.store(dtr_ptr + enew * H + hd, dtv.to(dtr_ptr.dtype.element_ty))
            if not PRE_SCORES:
                if hd % HPG == 0:
                    tl.store(Br_ptr + (enew * G + g) * n + offs_n, tl.load(B_ptr + bbase + offs_n, mask=mn), mask=mn)
        if EARLY:
            flush = fl != 0
        else:
            flush = tl.load(flush_ptr + r) != 0  # after the stores: the order of the measured defaults
        if HOLD:
            if flush:
                if PRE_SCORES:  # the scores kernel read B; this program reads its entries here
                    Bh = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_n[None, :],
                                 mask=mj[:, None] & mn[None, :], other=0.0).to(tl.float32)
                    bnew = tl.load(B_ptr + bbase + offs_n, mask=mn, other=0.0).to(tl.float32)
                newj = jj == h
                XW = tl.trans(tl.where(newj[:, None], xv[None, :], Xh) * tl.where(newj, dtv, wj)[:, None])  # [BD, LP]
                Bf = tl.where(newj[:, None], bnew[None, :], Bh)                                            # [LP, BN]
                Sn = tl.exp(tot + lv) * S0 + tl.dot(XW, Bf, input_precision=PREC)
                tl.store(state_ptr + sbase + offs_n[None, :], Sn.to(state_ptr.dtype.element_ty),
                         mask=md[:, None] & mn[None, :])
        elif UNROLL:
            if flush:
                if PRE_SCORES:
                    bnew = tl.load(B_ptr + bbase + offs_n, mask=mn, other=0.0).to(tl.float32)
                _m2_fold_unrolled(state_ptr, xr_ptr, Br_ptr, dtr_ptr, sbase, S0, slot, start, h, hd, g, A, tot, lv,
                                  dtv, xv, bnew, offs_d, md, offs_n, mn, L, H, G, d, n, LP)
        elif FMA:
            if flush:
                _m2_fold_fma(state_ptr, xr_ptr, Br_ptr, dtr_ptr, B_ptr, sbase, slot, start, h, hd, g, A, tot, lv,
                             dtv, xv, bbase, offs_d, md, L, H, G, d, n, BN, BNC)
        elif flush:
            newj = jj == h
            # S_{h+1} weights: Δ_j e^{tot+l_new-cum_j} for j < h, Δ for the new entry (row h)
            XW = tl.trans(tl.where(newj[:, None], xv[None, :], Xh) * tl.where(newj, dtv, wj)[:, None])  # [BD, LP]
            a1 = tl.exp(tot + lv)
            for k0 in tl.static_range(0, BN, BNC):
                offs_k = k0 + tl.arange(0, BNC)
                mk = offs_k < n
                Bk = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_k[None, :],
                             mask=mj[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [LP, BNC]
                bk = tl.load(B_ptr + bbase + offs_k, mask=mk, other=0.0).to(tl.float32)
                S0c = tl.load(state_ptr + sbase + offs_k[None, :], mask=md[:, None] & mk[None, :],
                              other=0.0).to(tl.float32)
                Sn = a1 * S0c + tl.dot(XW, tl.where(newj[:, None], bk[None, :], Bk), input_precision=PREC)
                tl.store(state_ptr + sbase + offs_k[None, :], Sn.to(state_ptr.dtype.element_ty),
                         mask=md[:, None] & mk[None, :])

    @triton.jit
    def _m2_replay_decode_kernel(
        state_ptr, xr_ptr, Br_ptr, dtr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, sc_ptr,
        L, H, G, d, n, HPG, XS, BS, CS,
        LP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BNC: tl.constexpr,
        HAS_D: tl.constexpr, PRE_SCORES: tl.constexpr, PREC: tl.constexpr, FMA: tl.constexpr,
        HOLD: tl.constexpr = False, EARLY: tl.constexpr = False, UNROLL: tl.constexpr = False,
    ):
        """Replay decode (:func:`_m2_decode_tile`) over a flat grid of ``d-blocks × heads ×
        rows`` (d-blocks of one (row, head) side by side: one contiguous stream)."""
        db, hd, r = tile_ids(tl.cdiv(d, BD), H)
        _m2_decode_tile(state_ptr, xr_ptr, Br_ptr, dtr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr,
                        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, sc_ptr,
                        r, hd, db, L, H, G, d, n, HPG, XS, BS, CS, LP, BD, BN, BNC, HAS_D, PRE_SCORES, PREC, FMA,
                        HOLD, EARLY, UNROLL)

    @triton.jit
    def _m2_fold_kernel(
        state_ptr, xr_ptr, Br_ptr, dtr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr, A_ptr,
        L, H, G, d, n, HPG, EXTRA,
        LP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
    ):
        """Flush rows only: fold the first ``h + EXTRA`` ring entries into the checkpoint,
        ``S ← e^{tot} S0 + Σ_j Δ_j e^{tot-cum_j} x_j B_jᵀ`` (one ``tl.dot``).  Run after the
        decode kernel (which appended the new entry, ``EXTRA = 1``), so that kernel carries no
        shared-memory tile for its rare flush branch."""
        db, hd, r = tile_ids(tl.cdiv(d, BD), H)  # d-blocks of one (row, head) side by side
        flush = tl.load(flush_ptr + r) != 0
        if flush:
            g = hd // HPG
            slot = tl.load(slot_ptr + r).to(tl.int64)
            start = tl.load(start_ptr + r).to(tl.int64)
            cnt = tl.load(hist_ptr + r).to(tl.int64) + EXTRA
            offs_d = db * BD + tl.arange(0, BD)
            offs_n = tl.arange(0, BN)
            md = offs_d < d
            mn = offs_n < n
            m2 = md[:, None] & mn[None, :]
            jj = tl.arange(0, LP)
            mj = jj < cnt
            e = slot * L + (start + jj) % L
            A = tl.load(A_ptr + hd).to(tl.float32)
            dtj, cj, tot = _m2_history_decays(dtr_ptr, e, mj, A, hd, H)
            wj = tl.where(mj, dtj * tl.exp(tot - cj), 0.0)
            Xh = tl.load(xr_ptr + (e[:, None] * H + hd) * d + offs_d[None, :], mask=mj[:, None] & md[None, :],
                         other=0.0).to(tl.float32)
            Bh = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_n[None, :], mask=mj[:, None] & mn[None, :],
                         other=0.0).to(tl.float32)
            soff = ((slot * H + hd) * d + offs_d[:, None]) * n + offs_n[None, :]
            S0 = tl.load(state_ptr + soff, mask=m2, other=0.0).to(tl.float32)
            Snew = tl.exp(tot) * S0 + tl.dot(tl.trans(Xh * wj[:, None]), Bh, input_precision=PREC)
            tl.store(state_ptr + soff, Snew.to(state_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _mm(a, b, PREC: tl.constexpr):
        """``a @ b`` with fp32 accumulation; fp32 operands at ``PREC`` (tf32x3: fp32-level)."""
        if a.dtype == tl.float32:
            out = tl.dot(a, b, input_precision=PREC)
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _m2_score_tiles(Br_ptr, B_ptr, C_ptr, e, mj, tok, ms, g, G, n, BS, CS,
                        BN: tl.constexpr, PREC: tl.constexpr):
        """``(HC [LP, TP], NC [TP, TP])``: ``B_hist Cᵀ`` over the history entries ``e`` (ring or
        pool rows, valid where ``mj``) and ``B_new Cᵀ`` over the drafts ``tok`` (valid where
        ``ms``); ring operands in their storage dtype, fp32 ones at ``PREC``."""
        offs_n = tl.arange(0, BN)
        mn = offs_n < n
        Bh = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_n[None, :], mask=mj[:, None] & mn[None, :],
                     other=0.0)                                                             # [LP, BN]
        Bn = tl.load(B_ptr + tok[:, None] * BS + g * n + offs_n[None, :], mask=ms[:, None] & mn[None, :],
                     other=0.0)                                                             # [TP, BN]
        Cn = tl.load(C_ptr + tok[:, None] * CS + g * n + offs_n[None, :], mask=ms[:, None] & mn[None, :],
                     other=0.0)                                                             # [TP, BN]
        return _mm(Bh.to(Cn.dtype), tl.trans(Cn), PREC), _mm(Bn, tl.trans(Cn), PREC)

    @triton.jit
    def _m2_saved_scores(sc_ptr, r64, g, G, mj, ms, LP: tl.constexpr, TP: tl.constexpr):
        """``(HC [LP, TP], NC [TP, TP])`` of (row, group) from :func:`_m2_verify_scores_kernel`'s
        scratch; only the committed rows and real queries are read (zeros elsewhere)."""
        ss = tl.arange(0, TP)
        base = sc_ptr + (r64 * G + g) * (LP + TP) * TP
        HC = tl.load(base + tl.arange(0, LP)[:, None] * TP + ss[None, :], mask=mj[:, None] & ms[None, :], other=0.0)
        NC = tl.load(base + (LP + ss[:, None]) * TP + ss[None, :], mask=ms[:, None] & ms[None, :], other=0.0)
        return HC, NC

    @triton.jit
    def _m2_verify_scores_kernel(
        Br_ptr, slot_ptr, start_ptr, hist_ptr, bt_ptr, B_ptr, C_ptr, sc_ptr,
        T, L, G, n, MAXB, BS, CS,
        TP: tl.constexpr, LP: tl.constexpr, BN: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
    ):
        """Verify precompute, once per (row, group) instead of once per (head, d-block) of the
        group: ``HC = B_hist Cᵀ [LP, TP]`` over the committed entries and ``NC = B_new Cᵀ
        [TP, TP]`` over the drafts -> scratch ``[Bt, G, LP + TP, TP]`` fp32 (every entry
        written; rows past ``h`` / ``T`` hold zeros)."""
        r = tl.program_id(0)
        g = tl.program_id(1)
        r64 = r.to(tl.int64)
        slot, h, mj, e = history_entries(slot_ptr, start_ptr, hist_ptr, bt_ptr, r, L, MAXB, LP, PAGED)
        ss = tl.arange(0, TP)
        ms = ss < T
        tok = r64 * T + ss
        HC, NC = _m2_score_tiles(Br_ptr, B_ptr, C_ptr, e, mj, tok, ms, g, G, n, BS, CS, BN, PREC)
        base = sc_ptr + (r64 * G + g) * (LP + TP) * TP
        jj = tl.arange(0, LP)
        tl.store(base + jj[:, None] * TP + ss[None, :], HC)
        tl.store(base + (LP + ss[:, None]) * TP + ss[None, :], NC)

    @triton.jit
    def _m2_history_decays(dtr_ptr, e, mj, A, hd, H):
        """``(Δ_j, cum_j, tot)`` of head ``hd`` over the history entries ``e`` (valid where
        ``mj``; zeros past them): ``cum_j = Σ_{i≤j} A Δ_i``, ``tot`` the sum over all."""
        dtj = tl.where(mj, tl.load(dtr_ptr + e * H + hd, mask=mj, other=0.0).to(tl.float32), 0.0)
        lj = A * dtj
        return dtj, tl.cumsum(lj, 0), tl.sum(lj, 0)

    @triton.jit
    def _m2_verify_weights(slot_ptr, start_ptr, hist_ptr, bt_ptr, dtr_ptr, dt_ptr, bits_ptr, A_ptr, Br_ptr, B_ptr,
                           C_ptr, sc_ptr, r, hd, g, G, H, L, MAXB, n, T, BS, CS,
                           LP: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr, PAGED: tl.constexpr,
                           PRE: tl.constexpr, TREE: tl.constexpr, PREC: tl.constexpr):
        """Everything of a verify (row ``r``, head ``hd``) but ``x``:
        ``(slot, e, mj, Δ_j, cum_j, tot, tok, ms, Wh [LP, TP], Wn [TP, TP], G [TP])`` with
        ``Wh[j, m] = Δ_j e^{tot-cum_j+G_m} (B_j·C_m)`` over the committed history and
        ``Wn[s, m] = [s ⪯ m] Δ_s e^{G_m-G_s} (B_s·C_m)`` over the drafts, ``G_m`` the
        log-decay of the drafts on the path to query ``m`` (chain, or the tree's
        ancestor-or-self bits in ``bits_ptr``).  The score products come from the scores
        kernel's scratch (``PRE``) or are computed here."""
        r64 = r.to(tl.int64)
        slot, h, mj, e = history_entries(slot_ptr, start_ptr, hist_ptr, bt_ptr, r, L, MAXB, LP, PAGED)
        A = tl.load(A_ptr + hd).to(tl.float32)
        dtj, cj, tot = _m2_history_decays(dtr_ptr, e, mj, A, hd, H)
        ss = tl.arange(0, TP)
        ms = ss < T
        tok = r64 * T + ss
        if PRE:  # HC, NC from the (row, group) scratch of _m2_verify_scores_kernel
            HC, NC = _m2_saved_scores(sc_ptr, r64, g, G, mj, ms, LP, TP)
        else:
            HC, NC = _m2_score_tiles(Br_ptr, B_ptr, C_ptr, e, mj, tok, ms, g, G, n, BS, CS, BN, PREC)
        dtn = tl.where(ms, tl.load(dt_ptr + tok * H + hd, mask=ms, other=0.0).to(tl.float32), 0.0)
        ln = A * dtn
        if TREE:
            bits = tl.load(bits_ptr + tok, mask=ms, other=0)
        else:
            bits = (2 << ss) - 1
        # ancT[s, m]: draft s is on the path to query m (m included)
        ancT = (((bits[None, :] >> ss[:, None]) & 1) != 0) & ms[:, None] & ms[None, :]
        Gm = tl.sum(tl.where(ancT, ln[:, None], 0.0), 0)                                   # [TP] by m
        Gs = tl.sum(tl.where(ss[:, None] == ss[None, :], Gm[None, :], 0.0), 1)              # same, by s
        Wh = tl.where(mj[:, None] & ms[None, :],
                      dtj[:, None] * tl.exp(tot - cj[:, None] + Gm[None, :]) * HC, 0.0)
        Wn = tl.where(ancT, dtn[:, None] * tl.exp(Gm[None, :] - Gs[:, None]) * NC, 0.0)
        return slot, e, mj, dtj, cj, tot, tok, ms, Wh, Wn, Gm

    @triton.jit
    def _m2_verify_combine_kernel(
        xr_ptr, Br_ptr, dtr_ptr, slot_ptr, start_ptr, hist_ptr,
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bits_ptr, y_ptr, sc_ptr, ro_ptr,
        T, L, H, G, d, n, HPG, XS, BS, CS,
        TP: tl.constexpr, LP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
        HAS_D: tl.constexpr, TREE: tl.constexpr, PRE: tl.constexpr, PREC: tl.constexpr,
    ):
        """Split verify, part 2, one program per (row, head), never touching the state:
        ``Y [T, d] = e^{tot+G} ∘ R + Whᵀ X_hist + Wnᵀ X_new + D X_new`` with ``R = C S0ᵀ`` from
        :func:`_m2_verify_readout_kernel`'s scratch ``ro [Bt·T, H, d]`` and the weights of
        :func:`_m2_verify_weights` computed once for all of ``d`` (in blocks of ``BD``)."""
        _, hd, r = tile_ids(1, H)  # the heads of one row side by side
        g = hd // HPG
        slot, e, mj, dtj, cj, tot, tok, ms, Wh, Wn, Gm = _m2_verify_weights(
            slot_ptr, start_ptr, hist_ptr, slot_ptr, dtr_ptr, dt_ptr, bits_ptr, A_ptr, Br_ptr, B_ptr, C_ptr, sc_ptr,
            r, hd, g, G, H, L, 1, n, T, BS, CS, LP, TP, BN, False, PRE, TREE, PREC)
        WhT = tl.trans(Wh)
        WnT = tl.trans(Wn)
        decay = tl.exp(tot + Gm)
        if HAS_D:
            Dh = tl.load(D_ptr + hd).to(tl.float32)
        for d0 in range(0, d, BD):
            offs_d = d0 + tl.arange(0, BD)
            md = offs_d < d
            Xh = tl.load(xr_ptr + (e[:, None] * H + hd) * d + offs_d[None, :], mask=mj[:, None] & md[None, :],
                         other=0.0).to(tl.float32)                                          # [LP, BD]
            Xn = tl.load(x_ptr + tok[:, None] * XS + hd * d + offs_d[None, :], mask=ms[:, None] & md[None, :],
                         other=0.0).to(tl.float32)                                          # [TP, BD]
            R = tl.load(ro_ptr + (tok[:, None] * H + hd) * d + offs_d[None, :], mask=ms[:, None] & md[None, :],
                        other=0.0)
            Y = tl.dot(WhT, Xh, input_precision=PREC) + tl.dot(WnT, Xn, input_precision=PREC) + decay[:, None] * R
            if HAS_D:
                Y += Dh * Xn
            tl.store(y_ptr + (tok[:, None] * H + hd) * d + offs_d[None, :], Y.to(y_ptr.dtype.element_ty),
                     mask=ms[:, None] & md[None, :])

    @triton.jit
    def _m2_fold_weights(slot_ptr, start_ptr, hist_ptr, xr_ptr, dtr_ptr, A_ptr, r, hd, offs_d, md, L, H, d,
                         LP: tl.constexpr):
        """A flush row's fold operands: ``(XW [BD, LP], e^{tot}, e, mj)`` with
        ``XW[i, j] = Δ_j e^{tot-cum_j} x_j[i]`` over the committed entries ``e`` (valid where
        ``mj``)."""
        slot, h, mj, e = history_entries(slot_ptr, start_ptr, hist_ptr, slot_ptr, r, L, 1, LP, False)
        A = tl.load(A_ptr + hd).to(tl.float32)
        dtj, cj, tot = _m2_history_decays(dtr_ptr, e, mj, A, hd, H)
        Xh = tl.load(xr_ptr + (e[:, None] * H + hd) * d + offs_d[None, :],
                     mask=mj[:, None] & md[None, :], other=0.0).to(tl.float32)                  # [LP, BD]
        XW = tl.trans(Xh * tl.where(mj, dtj * tl.exp(tot - cj), 0.0)[:, None])               # [BD, LP]
        return XW, tl.exp(tot), e, mj

    @triton.jit
    def _m2_readout_chunks(state_ptr, sbase, C_ptr, Br_ptr, tok, ms, md, g, G, n, CS, XW, a1, e, mj,
                           BD: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr, BNC: tl.constexpr,
                           FOLD: tl.constexpr, PREC: tl.constexpr, FOLD_PREC: tl.constexpr):
        """``S0 Cᵀ [BD, TP]`` over ``n`` in chunks of ``BNC`` (the checkpoint tile at ``sbase``);
        ``FOLD``: each chunk is then overwritten by ``a1 S0 + XW B_histᵀ`` (a flush row's
        ``S_h``) right after it is read."""
        SCT = tl.zeros([BD, TP], dtype=tl.float32)
        for k0 in tl.static_range(0, BN, BNC):
            offs_k = k0 + tl.arange(0, BNC)
            mk = offs_k < n
            S0c = tl.load(sbase + offs_k[None, :], mask=md[:, None] & mk[None, :],
                          other=0.0).to(tl.float32)                                         # [BD, BNC]
            Ck = tl.load(C_ptr + tok[:, None] * CS + g * n + offs_k[None, :], mask=ms[:, None] & mk[None, :],
                         other=0.0).to(tl.float32)                                              # [TP, BNC]
            SCT += tl.dot(S0c, tl.trans(Ck), input_precision=PREC)
            if FOLD:
                Bk = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_k[None, :],
                             mask=mj[:, None] & mk[None, :], other=0.0).to(tl.float32)          # [LP, BNC]
                Sh = a1 * S0c + tl.dot(XW, Bk, input_precision=FOLD_PREC)
                tl.store(sbase + offs_k[None, :], Sh.to(state_ptr.dtype.element_ty), mask=md[:, None] & mk[None, :])
        return SCT

    @triton.jit
    def _m2_verify_readout_kernel(
        state_ptr, xr_ptr, Br_ptr, dtr_ptr, slot_ptr, start_ptr, hist_ptr, flush_ptr, A_ptr, C_ptr, ro_ptr,
        T, L, H, G, d, n, HPG, CS,
        TP: tl.constexpr, LP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BNC: tl.constexpr,
        FOLD: tl.constexpr, PREC: tl.constexpr, FOLD_PREC: tl.constexpr,
    ):
        """Split verify, part 1, shaped like a decode step: the checkpoint readout
        ``R[s, i] = Σ_k S0[i, k] C_s[k]`` of every query -> scratch ``ro [Bt·T, H, d]`` fp32 (the
        decays are applied by the combine), ``S0 Cᵀ`` on tensor cores over ``n`` in chunks of
        ``BNC``: one DRAM read of ``S0``.  ``FOLD``: flush rows, in a branch of their own, also
        store ``S_h = e^{tot} S0 + Σ_j Δ_j e^{tot-cum_j} x_j B_jᵀ`` (committed entries) from each
        chunk just read."""
        db, hd, r = tile_ids(tl.cdiv(d, BD), H)
        g = hd // HPG
        r64 = r.to(tl.int64)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        offs_d = db * BD + tl.arange(0, BD)
        md = offs_d < d
        sbase = state_ptr + ((slot * H + hd) * d + offs_d[:, None]) * n
        ss = tl.arange(0, TP)
        ms = ss < T
        tok = r64 * T + ss
        if FOLD:
            if tl.load(flush_ptr + r) != 0:
                XW, a1, e, mj = _m2_fold_weights(slot_ptr, start_ptr, hist_ptr, xr_ptr, dtr_ptr, A_ptr, r, hd, offs_d,
                                                 md, L, H, d, LP)
                SCT = _m2_readout_chunks(state_ptr, sbase, C_ptr, Br_ptr, tok, ms, md, g, G, n, CS, XW, a1, e, mj,
                                         BD, TP, BN, BNC, True, PREC, FOLD_PREC)
            else:
                SCT = _m2_readout_chunks(state_ptr, sbase, C_ptr, Br_ptr, tok, ms, md, g, G, n, CS, 0, 0, 0, 0,
                                         BD, TP, BN, BNC, False, PREC, FOLD_PREC)
        else:
            SCT = _m2_readout_chunks(state_ptr, sbase, C_ptr, Br_ptr, tok, ms, md, g, G, n, CS, 0, 0, 0, 0,
                                     BD, TP, BN, BNC, False, PREC, FOLD_PREC)
        tl.store(ro_ptr + (tok[None, :] * H + hd) * d + offs_d[:, None], SCT, mask=md[:, None] & ms[None, :])

    @triton.jit
    def _m2_verify_dot_kernel(
        state_ptr, xr_ptr, Br_ptr, dtr_ptr,
        slot_ptr, start_ptr, hist_ptr, bt_ptr,
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bits_ptr, y_ptr, flush_ptr,
        T, L, H, G, d, n, HPG, MAXB, XS, BS, CS,
        TP: tl.constexpr, LP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BNC: tl.constexpr,
        HAS_D: tl.constexpr, TREE: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
        FOLD: tl.constexpr, FOLD_PREC: tl.constexpr, sc_ptr=None, PRE: tl.constexpr = False,
        LEFT: tl.constexpr = False,
    ):
        """Replay verify as small matrix products (tensor cores), all queries at once:

        ``Y [T, BD] = (e^{tot+G} ∘ C S0ᵀ) + Whᵀ X_hist + Wnᵀ X_new + D X_new`` with
        ``Wh[j, m] = Δ_j e^{tot-cum_j+G_m} (B_j·C_m)`` over the committed history and
        ``Wn[s, m] = [s ⪯ m] Δ_s e^{G_m-G_s} (B_s·C_m)`` over the drafts (chain, or the tree's
        ancestor-or-self bits).  Queries are padded to ``TP ≥ 16`` rows.  ``C S0ᵀ`` runs over
        ``n`` in chunks of ``BNC`` so the checkpoint never sits whole in registers (the whole
        ``[BD, BN]`` tile spilled at 255 registers/thread: Nsight Compute, H100).  Ring
        operands stay in their storage dtype for the score products; fp32 ones use ``PREC``.
        ``FOLD``: flush rows also store ``S_h = e^{tot} S0 + Σ_j Δ_j e^{tot-cum_j} x_j B_jᵀ``
        (committed entries) chunk by chunk, right after the chunk's last read, instead of a
        separate ``_m2_fold_kernel`` pass over the state; its product runs at ``FOLD_PREC``
        (the stored state keeps fp32-level sums even where the outputs use ``PREC = tf32``).
        ``x``, ``B``, ``C`` are read as token rows ``XS`` / ``BS`` / ``CS`` apart (views of the
        projection's output, no copies).
        Grid ``(d-blocks, heads, rows)``; ring form reads the history at ``(start + j) % L``
        of the row's slot; ``PAGED``: from a block table, with ``S0 = 0`` (KV-only form);
        ``TREE``: ``bits_ptr`` holds each query's ancestor-or-self bitmask
        (:func:`tree_bits`), else the chain."""
        db, hd, r = tile_ids(tl.cdiv(d, BD), H)  # d-blocks of one (row, head) side by side
        g = hd // HPG
        offs_d = db * BD + tl.arange(0, BD)
        md = offs_d < d
        slot, e, mj, dtj, cj, tot, tok, ms, Wh, Wn, Gm = _m2_verify_weights(
            slot_ptr, start_ptr, hist_ptr, bt_ptr, dtr_ptr, dt_ptr, bits_ptr, A_ptr, Br_ptr, B_ptr, C_ptr, sc_ptr,
            r, hd, g, G, H, L, MAXB, n, T, BS, CS, LP, TP, BN, PAGED, PRE, TREE, PREC)
        Xh = tl.load(xr_ptr + (e[:, None] * H + hd) * d + offs_d[None, :], mask=mj[:, None] & md[None, :],
                     other=0.0).to(tl.float32)                                              # [LP, BD]
        Xn = tl.load(x_ptr + tok[:, None] * XS + hd * d + offs_d[None, :], mask=ms[:, None] & md[None, :],
                     other=0.0).to(tl.float32)                                              # [TP, BD]
        Y = tl.dot(tl.trans(Wh), Xh, input_precision=PREC)                                  # [TP, BD]
        Y += tl.dot(tl.trans(Wn), Xn, input_precision=PREC)
        if not PAGED:
            SC = tl.zeros([TP, BD], dtype=tl.float32)
            SCT = tl.zeros([BD, TP], dtype=tl.float32)
            if FOLD:
                flush = tl.load(flush_ptr + r) != 0
                XW = tl.trans(Xh * tl.where(mj, dtj * tl.exp(tot - cj), 0.0)[:, None])    # [BD, LP]
            for k0 in tl.static_range(0, BN, BNC):
                offs_k = k0 + tl.arange(0, BNC)
                mk = offs_k < n
                sptr = state_ptr + ((slot * H + hd) * d + offs_d[:, None]) * n + offs_k[None, :]
                S0 = tl.load(sptr, mask=md[:, None] & mk[None, :], other=0.0).to(tl.float32)               # [BD, BNC]
                Ck = tl.load(C_ptr + tok[:, None] * CS + g * n + offs_k[None, :], mask=ms[:, None] & mk[None, :],
                             other=0.0).to(tl.float32)                                      # [TP, BNC]
                if LEFT:
                    SCT += tl.dot(S0, tl.trans(Ck), input_precision=PREC)
                else:
                    SC += tl.dot(Ck, tl.trans(S0), input_precision=PREC)
                if FOLD:
                    if flush:
                        Bk = tl.load(Br_ptr + (e[:, None] * G + g) * n + offs_k[None, :],
                                     mask=mj[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [LP, BNC]
                        Sh = tl.exp(tot) * S0 + tl.dot(XW, Bk, input_precision=FOLD_PREC)
                        tl.store(sptr, Sh.to(state_ptr.dtype.element_ty), mask=md[:, None] & mk[None, :])
            if LEFT:
                SC = tl.trans(SCT)
            Y += tl.exp(tot + Gm)[:, None] * SC
        if HAS_D:
            Y += tl.load(D_ptr + hd).to(tl.float32) * Xn
        tl.store(y_ptr + (tok[:, None] * H + hd) * d + offs_d[None, :], Y.to(y_ptr.dtype.element_ty),
                 mask=ms[:, None] & md[None, :])


# =============================================================================== wrappers
def _dims(x: Tensor, B: Tensor, has_time: bool):
    if has_time:
        Bt, T, H, d = x.shape
    else:
        (Bt, H, d), T = x.shape, 1
    G, n = B.shape[-2:]
    if H % G:
        raise ValueError(f"nheads H={H} is not a multiple of ngroups G={G}")
    return Bt, T, H, d, G, n


def _block_d(d: int, block_d: int | None) -> int:
    return tile(d, block_d, 64)


def _check_ring(buf, plan, x: Tensor, dims) -> None:
    Bt, T, H, d, G, n = dims
    P, L = buf.state.shape[0], plan.capacity
    if buf.x.dtype != x.dtype or buf.B.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: inputs are {x.dtype}, ring holds {buf.x.dtype}/{buf.B.dtype}")
    check_ring((("state", buf.state, (P, H, d, n)), ("x", buf.x, (P, L, H, d)),
                ("B", buf.B, (P, L, G, n)), ("dt", buf.dt, (P, L, H))), plan, Bt, T)


def recurrent_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     D: Tensor | None = None, slot: Tensor | None = None, out_state: Tensor | None = None,
                     block_d: int | None = None, num_warps: int = 4) -> Tensor:
    """Recurrent decode kernel (the recurrent form) on a state pool: ``state[slot]`` is read, updated and
    written to ``out_state[slot]`` (default: in place).  Returns ``y [Bt,H,d]``."""
    Bt, _, H, d, G, n = _dims(x, B, False)
    (x, XS), (B, BS), (C, CS), dt = token_rows(x, 1), token_rows(B, 1), token_rows(C, 1), _c(dt)
    out_state = state if out_state is None else out_state
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BD = next_pow2(block_d) if block_d else min(next_pow2(d), 16)
    grid = flat_grid(triton.cdiv(d, BD), H, Bt)
    if Bt:
        _m2_recurrent_kernel[grid](
            state, out_state, slot if slot is not None else state, x, dt, A, B, C,
            D if D is not None else A, y, H, G, d, n, H // G, XS, BS, CS,
            BD=BD, BN=next_pow2(n), HAS_SLOT=slot is not None, HAS_D=D is not None, num_warps=num_warps)
    return y


def recurrent_step(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor | None = None, check: bool | None = None) -> tuple[Tensor, Tensor]:
    """Same contract as the naive op: returns ``(y, new_state)``; ``state`` is not modified."""
    state = state.contiguous()
    new = torch.empty_like(state)
    y = recurrent_update(state, x, dt, A, B, C, D, out_state=new)
    return y, new


def _fold(buf, plan, A: Tensor, extra: int, grid, BD: int, precision: str) -> None:
    """Flush rows: fold the first ``h + extra`` ring entries into the checkpoint (after the
    decode (``extra = 1``, the new entry included) or verify (``extra = 0``) kernel)."""
    P, H, d, n = buf.state.shape
    G = buf.B.shape[2]
    L = plan.capacity
    _m2_fold_kernel[grid](
        buf.state, buf.x, buf.B, buf.dt, plan.slot, plan.start, plan.hist, plan.flush, A,
        L, H, G, d, n, H // G, extra, LP=pad16(L), BD=BD, BN=pad16(n), PREC=precision, num_warps=4)


#: up to this many (row, head, d-block) tiles a decode step is one launch (no scores kernel)
SMALL_GRID = 2048

#: ``fold_form`` of :func:`replay_decode`: how a flush row folds its entries into ``S_{h+1}``
#: (``dot``: re-read chunks and ``tl.dot``; ``fma``: re-read chunks and rank-1 updates in a
#: run-time loop; ``hold``: one ``tl.dot`` over the tile and entries the readout holds;
#: ``unroll``: rank-1 updates of the held tile, one per ring position, unrolled)
FOLD_FORMS = ("dot", "fma", "hold", "unroll")
#: state values per chunk of the ``fma`` fold (both families): the chunks are a run-time loop,
#: each re-read from L2 and held while the row's entries are added (16 fp32 registers a thread
#: on 2 warps; local sm_90 compile, 2026-11-27: the GDN 64-wide tile on 2 warps at 206
#: registers against 202 without flush code; 4096-value chunks 254, unrolled chunks spilled)
FMA_CHUNK = 1024
#: the keys a launch config of :func:`replay_decode` may set (:data:`DECODE_TABLE`)
DECODE_KEYS = ("block_d", "num_warps", "pre_scores", "fold_form", "block_n", "prefetch")

#: tuned launch configs of :func:`replay_decode`, consulted before the measured defaults of
#: :func:`decode_defaults`: rows ``(max_batch, state_itemsize, config)`` (``state_itemsize``
#: 4 / 2, or None for any state dtype); the first row with ``batch <= max_batch`` and a
#: matching state dtype gives the config (keys of :data:`DECODE_KEYS`).  Empty: the defaults.
#: ``scripts/tune_replay_decode.py`` prints the rows its GPU run measured fastest.  Rows of
#: the H200 run of 2026-11-27: bf16 states at 9..64 rows, 64-wide d-blocks on 4 warps (1.03x
#: the default, staggered 1.02x); everything else kept its default.  fp32 rows of the H200 run
#: of 2026-11-27 evening (80 heads, the 2.7B; the peers in the same run): one row 4.3 vs 4.7 us
#: (held fold, state loads issued with the plan words), 2..8 rows 10.6 vs 13.7 us, 9..64 rows
#: 56.0 vs 57.8 us (prefetch on 32-wide d-blocks); 256 rows kept the default.
DECODE_TABLE: list = [
    (8, 2, {}),
    (64, 2, {"block_d": 64, "num_warps": 4, "pre_scores": True, "fold_form": "dot"}),
    (1, 4, {"block_d": 16, "num_warps": 2, "pre_scores": False, "fold_form": "hold", "prefetch": True}),
    (8, 4, {"block_d": 32, "num_warps": 2, "pre_scores": True, "fold_form": "dot", "prefetch": True}),
    (64, 4, {"block_d": 32, "num_warps": 2, "pre_scores": True, "fold_form": "dot", "prefetch": True}),
]


def decode_defaults(Bt: int, H: int, d: int, block_d: int | None = None, state_itemsize: int = 4) -> dict:
    """Launch config of :func:`replay_decode` for a batch: the first matching row of
    :data:`DECODE_TABLE`, else the measured default (H100, 2026-11-23, KERNEL_NOTES.md):
    small grids are launch-bound and run as one launch on 4 warps; larger ones compute the
    per-group scores in a small kernel first and run the decode kernel on 2 warps; 32-wide
    d-blocks, flush rows folding with ``tl.dot``."""
    base = dict(block_d=32, fold_form="dot", block_n=32, prefetch=False)
    if Bt * H * triton.cdiv(d, _block_d(d, block_d or 32)) <= SMALL_GRID:
        base.update(pre_scores=False, num_warps=4)
    else:
        base.update(pre_scores=True, num_warps=2)
    return dict(base, **table_row(DECODE_TABLE, DECODE_KEYS, Bt, state_itemsize))


def table_row(table: list, keys: tuple, Bt: int, state_itemsize: int) -> dict:
    """The config of the first ``(max_batch, state_itemsize, config)`` row of a decode table
    with ``Bt <= max_batch`` and a matching state element size (``None``: any), else ``{}``;
    a row naming a key outside ``keys`` raises ``ValueError`` (a pasted row with a typo)."""
    for max_batch, itemsize, cfg in table:
        bad = sorted(set(cfg) - set(keys))
        if bad:
            raise ValueError(f"decode table row for batches <= {max_batch} has unknown keys {bad}: expected {keys}")
        if Bt <= max_batch and itemsize in (None, state_itemsize):
            return dict(cfg)
    return {}


def decode_block(size: int, block: int, fold_form: str) -> int:
    """Tile width along ``d`` (Mamba-2) / ``V`` (GDN) of a replay-decode program: ``block``
    rounded up to a power of two, at most ``next_pow2(size)``; the ``dot`` and ``hold`` folds
    need 16 rows (``tl.dot``), ``fma`` and ``unroll`` take any width."""
    if fold_form not in FOLD_FORMS:
        raise ValueError(f"bad fold_form {fold_form!r}: expected one of {FOLD_FORMS}")
    if int(block) < 1:
        raise ValueError(f"tile width must be positive, got {block}")
    return max(1 if fold_form in ("fma", "unroll") else 16, min(next_pow2(block), next_pow2(size)))


def replay_decode(buf, plan, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                  D: Tensor | None = None, route: str = "output", check: bool | None = None,
                  block_d: int | None = None, num_warps: int | None = None, pre_scores: bool | None = None,
                  precision: str = "tf32x3", block_n: int | None = None, fold_form: str | None = None,
                  prefetch: bool | None = None) -> Tensor:
    """Replay decode, output-only (``route`` is accepted for API parity: both routes
    give the same numbers), in one pass over the checkpoints: flush rows store ``S_{h+1}`` in
    the kernel that reads ``S0``, re-reading the tile in ``n`` chunks (from L2).
    ``fold_form="dot"``: chunks of ``block_n``, folded with ``tl.dot`` (``precision``);
    ``"fma"``: rank-1 updates over the row's entries, a run-time loop (any ``block_d``, no
    shared memory; chunks of up to :data:`FMA_CHUNK` state values); ``"hold"``: one ``tl.dot``
    over the tile and ring entries the readout already holds (small tiles: no re-read);
    ``"unroll"``: rank-1 updates of the held tile, one per ring position, unrolled (narrow
    tiles: the entries' loads go out together).
    ``prefetch``: the flush flag loaded with the row's slot, start and fill (before the state)
    instead of after the stores.
    ``pre_scores``: a small kernel first computes the per-group ``B_j·C`` once (and appends
    ``B``) instead of every head's programs.  Unset knobs come from :func:`decode_defaults`.
    """
    if route not in ("output", "state"):
        raise ValueError(f"bad route {route!r}: expected 'output' or 'state'")
    if plan.kind != "decode":
        raise ValueError(f"replay_decode needs a 'decode' plan, got {plan.kind!r}")
    dims = _dims(x, B, False)
    Bt, _, H, d, G, n = dims
    _check_ring(buf, plan, x, dims)
    auto = decode_defaults(Bt, H, d, block_d, buf.state.element_size())
    pre_scores = auto["pre_scores"] if pre_scores is None else bool(pre_scores)
    num_warps = num_warps or auto["num_warps"]
    fold_form = fold_form or auto["fold_form"]
    BD = decode_block(d, block_d or auto["block_d"], fold_form)
    block_n = block_n or auto["block_n"]
    prefetch = auto["prefetch"] if prefetch is None else bool(prefetch)
    (x, XS), (B, BS), (C, CS), dt = token_rows(x, 1), token_rows(B, 1), token_rows(C, 1), _c(dt)
    L = plan.capacity
    LP, BN = pad16(L), pad16(n)
    # fold chunk: block_n for the dot; for fma up to FMA_CHUNK state values
    BNC = min(BN, pad16(block_n)) if fold_form == "dot" else min(BN, max(16, FMA_CHUNK // BD))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if Bt == 0:
        return y
    sc = None
    if pre_scores:
        sc = torch.empty(Bt, G, LP + 1, dtype=torch.float32, device=x.device)
        _m2_scores_kernel[(Bt, G)](buf.B, plan.slot, plan.start, plan.hist, B, C, sc, L, G, n, BS, CS,
                                   LP=LP, BN=BN, num_warps=4)
    _m2_replay_decode_kernel[flat_grid(triton.cdiv(d, BD), H, Bt)](
        buf.state, buf.x, buf.B, buf.dt, plan.slot, plan.start, plan.hist, plan.flush,
        x, dt, A, B, C, D if D is not None else A, y, sc if sc is not None else y,
        L, H, G, d, n, H // G, XS, BS, CS,
        LP=LP, BD=BD, BN=BN, BNC=BNC, HAS_D=D is not None, PRE_SCORES=pre_scores,
        PREC=precision, FMA=fold_form == "fma", HOLD=fold_form == "hold", EARLY=prefetch, UNROLL=fold_form == "unroll",
        num_warps=num_warps)
    return y


def tree_bits(parent: Tensor, batch: int) -> Tensor:
    """Ancestor-or-self sets as int32 bitmasks ``[Bt, N]`` (bit s of node m: s is m or an
    ancestor of m).  Device tensor ops only (N small, N <= 31)."""
    p = parent.long()
    if p.dim() == 1:
        p = p[None].expand(batch, -1)
    return ancestor_bits(ancestor_mask(p))


#: from this many (row, head) pairs the verify kernel takes its large-grid forms (see :func:`_verify`)
LARGE_GRID = 4096


def _verify(buf, plan, x, dt, A, B, C, D, bits, paged=None, block_d=None, num_warps=None, precision=None,
            fused_fold=True, fold_precision="tf32x3", pre_scores=None, state_left=None, split=None, readout=None):
    """All draft queries as small tensor-core products (``_m2_verify_dot_kernel``); flush
    rows fold ``S_h`` in the same pass (``fused_fold``; its product at ``fold_precision``),
    else in the fold kernel after it.  ``precision``: the output products' (default
    :func:`~replayssm.kernels._triton.verify_precision`).  ``pre_scores``: the score
    products once per (row, group) in ``_m2_verify_scores_kernel`` instead of in every
    (head, d-block) program; ``state_left``: the readout as ``S0 Cᵀ`` (checkpoint tile as the
    left operand) instead of ``C S0ᵀ``.  ``split`` (ring forms): the checkpoint readout and
    the flush rows' fold in a decode-shaped kernel of their own
    (:func:`_m2_verify_readout_kernel`, tile ``readout = dict(block_d, num_warps,
    block_n)``), then the history / draft products and the combine in
    :func:`_m2_verify_combine_kernel` (one program per (row, head), ``block_d`` /
    ``num_warps`` its tile), which never reads the state.  Tiles from the sweeps of
    ``scripts/tune_verify.py`` (T = 5); ``None`` picks them."""
    dims = _dims(x, B, True)
    Bt, T, H, d, G, n = dims
    (x, XS), (B, BS), (C, CS), dt = token_rows(x, 2), token_rows(B, 2), token_rows(C, 2), _c(dt)
    precision = verify_precision(x.dtype, precision, fold_precision)
    # Large grids: 64-wide d-blocks on 2 warps where they tile d exactly (the 2.7B's d = 64:
    # the tile of the 2026-11-23 sweep); elsewhere (Nemotron-H's d = 80, where a 64-wide tile
    # idles 3/8 of its second block) 32-wide blocks on 1 warp with the scores precomputed and
    # the state as the left operand: 1.15x the 2-warp form at B = 64 and 256 (H200 sweep
    # 2026-11-25).  Small grids keep 32-wide blocks on 2 warps, all in one kernel (B = 1: the
    # extra launch costs more than it saves).  Those large grids split the readout from the
    # rest (readout on 1 warp, 64-wide n chunks, flush rows folding inline in a branch of their
    # own): 1.22x at B = 256 on a running batch's mixed fill (H100, 2026-11-26); on the 2.7B's
    # d = 64 the split lost.
    big = Bt * H >= LARGE_GRID
    wide = big and d % 64 == 0
    lean = big and not wide and block_d in (None, 32) and paged is None  # KV-only: not swept
    block_d = block_d or (64 if wide else 32)
    num_warps = num_warps or (1 if lean else 2)
    pre_scores = lean if pre_scores is None else pre_scores
    state_left = lean if state_left is None else state_left
    split = (lean if split is None else bool(split)) and paged is None
    TP = max(16, next_pow2(T))
    extra = dict(PREC=precision, BNC=min(32, pad16(n)), FOLD=fused_fold, FOLD_PREC=fold_precision, LEFT=state_left)
    BD, BN = _block_d(d, block_d), pad16(n)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if Bt == 0:
        return y
    grid = flat_grid(triton.cdiv(d, BD), H, Bt)
    if paged is None:
        L = plan.capacity
        if pre_scores:
            sc = torch.empty(Bt, G, pad16(L) + TP, TP, dtype=torch.float32, device=x.device)
            _m2_verify_scores_kernel[(Bt, G)](buf.B, plan.slot, plan.start, plan.hist, plan.slot, B, C, sc,
                                              T, L, G, n, 1, BS, CS, TP=TP, LP=pad16(L), BN=BN, PAGED=False,
                                              PREC=precision, num_warps=4)
            extra.update(sc_ptr=sc, PRE=True)
        if split:
            ro = dict(block_d=32, num_warps=1, block_n=64)
            if set(readout or {}) - set(ro):
                raise ValueError(f"readout tile keys {sorted(set(readout) - set(ro))} unknown: expected {sorted(ro)}")
            ro.update(readout or {})
            RBD = _block_d(d, ro["block_d"])
            rbuf = torch.empty(Bt * T, H, d, dtype=torch.float32, device=x.device)
            _m2_verify_readout_kernel[flat_grid(triton.cdiv(d, RBD), H, Bt)](
                buf.state, buf.x, buf.B, buf.dt, plan.slot, plan.start, plan.hist, plan.flush, A, C, rbuf,
                T, L, H, G, d, n, H // G, CS, TP=TP, LP=pad16(L), BD=RBD, BN=BN, BNC=min(BN, pad16(ro["block_n"])),
                FOLD=fused_fold, PREC=precision, FOLD_PREC=fold_precision, num_warps=ro["num_warps"])
            _m2_verify_combine_kernel[flat_grid(H, Bt)](
                buf.x, buf.B, buf.dt, plan.slot, plan.start, plan.hist,
                x, dt, A, B, C, D if D is not None else A, bits if bits is not None else plan.slot, y,
                extra.get("sc_ptr", y), rbuf, T, L, H, G, d, n, H // G, XS, BS, CS,
                TP=TP, LP=pad16(L), BD=BD, BN=BN, HAS_D=D is not None, TREE=bits is not None,
                PRE=bool(pre_scores), PREC=precision, num_warps=num_warps)
        else:
            _m2_verify_dot_kernel[grid](
                buf.state, buf.x, buf.B, buf.dt, plan.slot, plan.start, plan.hist, plan.slot,
                x, dt, A, B, C, D if D is not None else A, bits if bits is not None else plan.slot, y,
                plan.flush,
                T, L, H, G, d, n, H // G, 1, XS, BS, CS,
                TP=TP, LP=pad16(L), BD=BD, BN=BN, HAS_D=D is not None, TREE=bits is not None, PAGED=False,
                num_warps=num_warps, **extra)
        if not fused_fold:  # S_h (committed entries), after every query read S0
            _fold(buf, plan, A, 0, grid, BD, fold_precision)
    else:
        kv, pplan = paged
        bt = pplan.block_table.contiguous()
        if pre_scores:
            LPp = pad16(pplan.max_len)
            sc = torch.empty(Bt, G, LPp + TP, TP, dtype=torch.float32, device=x.device)
            _m2_verify_scores_kernel[(Bt, G)](kv.B, pplan.slot, pplan.length, pplan.length, bt, B, C, sc,
                                              T, pplan.block_size, G, n, bt.shape[1], BS, CS, TP=TP, LP=LPp, BN=BN,
                                              PAGED=True, PREC=precision, num_warps=4)
            extra.update(sc_ptr=sc, PRE=True)
        _m2_verify_dot_kernel[grid](
            x, kv.x, kv.B, kv.dt, pplan.slot, pplan.length, pplan.length, bt,
            x, dt, A, B, C, D if D is not None else A, bits if bits is not None else pplan.slot, y,
            pplan.slot,
            T, pplan.block_size, H, G, d, n, H // G, bt.shape[1], XS, BS, CS,
            TP=TP, LP=pad16(pplan.max_len), BD=BD, BN=BN, HAS_D=D is not None, TREE=bits is not None,
            PAGED=True, num_warps=num_warps, **extra)
    return y


def _append(xr, Br, dtr, slot, start, hist, bt, x, B, dt, L, paged: bool) -> None:
    """One launch appending ``(x, B, dt) [Bt,T,...]`` at positions ``h + s`` of each row."""
    append_entries((xr, Br, dtr), (x, B, dt), slot, start, hist, bt if paged else None, L)

def _write_entries(buf, plan, x, B, dt) -> None:
    _append(buf.x, buf.B, buf.dt, plan.slot, plan.start, plan.hist, plan.slot, x, B, dt,
            plan.capacity, False)


def replay_verify(buf, plan, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                  D: Tensor | None = None, route: str = "output", check: bool | None = None,
                  block_d: int | None = None, num_warps: int | None = None, precision: str | None = None,
                  fused_fold: bool = True, fold_precision: str = "tf32x3", pre_scores: bool | None = None,
                  state_left: bool | None = None, split: bool | None = None, readout: dict | None = None) -> Tensor:
    """Replay verify of T drafts: the verify kernel, whose flush rows also store
    ``S_h`` (``fused_fold``; else a separate fold kernel), then one append kernel writes the
    T entries.  ``precision``: the output products' (default
    :func:`~replayssm.kernels._triton.verify_precision`); ``fold_precision``: the state fold's;
    ``pre_scores`` / ``state_left``: kernel forms (see :func:`_verify`; ``None`` picks)."""
    if plan.kind != "verify":
        raise ValueError(f"replay_verify needs a 'verify' plan, got {plan.kind!r}")
    dims = _dims(x, B, True)
    _check_ring(buf, plan, x, dims)
    y = _verify(buf, plan, x, dt, A, B, C, D, None, block_d=block_d, num_warps=num_warps,
                precision=precision, fused_fold=fused_fold, fold_precision=fold_precision, pre_scores=pre_scores,
                state_left=state_left, split=split, readout=readout)
    _write_entries(buf, plan, x, B, dt)
    return y


def tree_verify(buf, plan, parent: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                D: Tensor | None = None, route: str = "output", check: bool | None = None,
                bits: Tensor | None = None, block_d: int | None = None, num_warps: int | None = None,
                precision: str | None = None, fused_fold: bool = True, fold_precision: str = "tf32x3",
                pre_scores: bool | None = None, state_left: bool | None = None, split: bool | None = None,
                readout: dict | None = None) -> Tensor:
    """Tree verify (STree) under the ancestor mask; ``bits`` (from :func:`tree_bits`) may be
    passed precomputed once per step for all layers."""
    if plan.kind != "tree":
        raise ValueError(f"tree_verify needs a 'tree' plan, got {plan.kind!r}")
    dims = _dims(x, B, True)
    _check_ring(buf, plan, x, dims)
    if bits is None:
        bits = tree_bits(parent, dims[0])
    y = _verify(buf, plan, x, dt, A, B, C, D, bits, block_d=block_d, num_warps=num_warps, precision=precision,
                fused_fold=fused_fold, fold_precision=fold_precision, pre_scores=pre_scores, state_left=state_left,
                split=split, readout=readout)
    _write_entries(buf, plan, x, B, dt)
    return y


#: the KV-only kernel takes steps of at most this many new tokens: its score tiles grow with
#: the square of the padded step length (a 245-token KV-only prefill asked for 512 KiB of
#: shared memory on an H200, which has 227 KiB); longer steps (KV-only prefill of a long
#: chunk) run the reference op
KV_MAX_NEW = 64


#: calls the kernels take (others run the reference; ``kernels.dispatch``)
SUPPORTS = {"kv_verify": lambda kv, pplan, x, *args, **kw: few_new_tokens(x, KV_MAX_NEW)}


def kv_verify(kv, pplan, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
              D: Tensor | None = None, check: bool | None = None, block_d: int | None = None,
              num_warps: int | None = None, precision: str | None = None, parent: Tensor | None = None,
              pre_scores: bool | None = None) -> Tensor:
    """KV-only form (no state) over paged buffers; appends the new entries after the kernel."""
    if kv.x.dtype != x.dtype or kv.B.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: inputs are {x.dtype}, pool holds {kv.x.dtype}/{kv.B.dtype}")
    bits = None if parent is None else tree_bits(parent, x.shape[0])
    y = _verify(None, None, x, dt, A, B, C, D, bits, paged=(kv, pplan), block_d=block_d,
                num_warps=num_warps, precision=precision, pre_scores=pre_scores)
    _append(kv.x, kv.B, kv.dt, pplan.slot, pplan.length, pplan.length, pplan.block_table.contiguous(),
            x, B, dt, pplan.block_size, True)
    return y


def snapshot_verify(state: Tensor, slot: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                    D: Tensor | None = None, check: bool | None = None, block_d: int | None = None,
                    num_warps: int = 4, snapshots: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Snapshot baseline: serial scan, one state stored per draft -> ``(y, snapshots)``."""
    Bt, T, H, d, G, n = _dims(x, B, True)
    x, dt, B, C = _c(x), _c(dt), _c(B), _c(C)
    BD = next_pow2(block_d) if block_d else min(next_pow2(d), 16)
    y = torch.empty_like(x)
    if snapshots is None:
        snapshots = torch.empty(Bt, T, H, d, n, dtype=state.dtype, device=state.device)
    if Bt and T:
        _m2_snapshot_kernel[flat_grid(triton.cdiv(d, BD), H, Bt)](
            state, slot, x, dt, A, B, C, D if D is not None else A, y, snapshots,
            T, H, G, d, n, H // G, BD=BD, BN=next_pow2(n), HAS_D=D is not None, num_warps=num_warps)
    return y, snapshots


def kv_fold(kv, pplan, A: Tensor, initial_state: Tensor | None = None, check: bool | None = None,
            block_t: int | None = None, block_d: int | None = None, num_warps: int | None = None,
            precision: str = "ieee") -> Tensor:
    """Kernel form of :func:`replayssm.ops.mamba2.naive.kv_fold` (same arguments, fp32 result):
    ``S = e^{pre_n} S0 + Σ_j Δ_j e^{pre_n−pre_j} x_j B_jᵀ`` in one launch (:mod:`.fold`)."""
    H = check_kv_fold(kv, pplan, A, initial_state, check)[1]
    return paged_fold(kv.x, kv.B, kv.dt, pplan, scale=A, weighted=True, initial_state=initial_state,
                      num_state_heads=H, block_t=block_t, block_r=block_d, num_warps=num_warps, precision=precision)


def rebuild_state(buf, plan, A: Tensor, block_t: int | None = None, block_d: int | None = None,
                  num_warps: int | None = None, precision: str = "ieee") -> Tensor:
    """Kernel form of :func:`replayssm.ops.mamba2.naive.rebuild_state`: ``S_h`` of every row
    from its checkpoint and committed ring entries, one launch (:func:`.fold.ring_fold`);
    returned in fp32 (the compute dtype: a bf16/fp16 checkpoint is upcast, never rounded
    here)."""
    check_rebuild_state(buf, plan, A)
    S = ring_fold(buf.state, buf.x, buf.B, buf.dt, plan, scale=A, weighted=True, block_t=block_t, block_r=block_d,
                  num_warps=num_warps, precision=precision)
    return S


def conv_fold(preconv: Tensor, dt: Tensor, pplan, start: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
              A: Tensor, initial_state: Tensor | None = None, *, head_dim: int, ngroups: int, d_state: int,
              check: bool | None = None, block_t: int | None = None, block_d: int | None = None,
              num_warps: int | None = None, precision: str = "ieee") -> Tensor:
    """Kernel form of :func:`replayssm.ops.mamba2.naive.conv_fold` (same arguments, fp32
    result): the conv of each entry's inputs computed inside the fold, one launch
    (:func:`.fold.conv_fold`), nothing materialised."""
    check_conv_fold(preconv, dt, pplan, start, conv_weight, conv_bias, A, initial_state, head_dim, ngroups, d_state,
                    check)
    return _conv_fold(preconv, dt, pplan, start, conv_weight, conv_bias, A, initial_state, head_dim=head_dim,
                      ngroups=ngroups, d_state=d_state, block_t=block_t, block_r=block_d, num_warps=num_warps,
                      precision=precision)
