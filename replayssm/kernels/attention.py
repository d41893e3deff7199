"""Triton kernels for softmax attention over a paged KV cache (contracts, layout and mask of
:mod:`replayssm.ops.attention.naive`).

* :func:`write_kv`: one program per token copies its ``k, v [Hkv, Dh]`` to its flat slot
  (negative slot: skipped).
* :func:`paged_attention`: flash-style online softmax.  A program owns one *query tile*
  (``QT`` consecutive queries of one sequence times the ``R = H / Hkv`` query heads that share
  a KV head, packed as the ``BLOCK_M`` rows of one tensor-core product), one KV head, and one
  of ``S`` splits of the tile's key range.  It walks only the keys the tile may read
  (``kv_lens[b] - T_b + last query + 1`` of them, through the block table), so its cost
  follows the real context.  The grid is sized from shapes only (``cdiv(Nt, QT) + N`` tiles,
  an upper bound): a program finds its sequence from ``cu_seqlens_q`` on the device and
  exits when it has none, so the kernel needs no host sync and captures in CUDA graphs.
  With ``S > 1`` (split-KV, flash-decoding) each split writes an unnormalised partial
  ``(acc, max, sum)`` and :func:`_combine_kernel` merges them.

Scores ``q·k`` and ``p·v`` run on tensor cores (fp32 accumulation; full-fp32 products for
fp32 inputs); softmax in fp32 with base-2 exponentials.  Keys past ``kv_lens`` are loaded as
zeros (never read as garbage), a row with no allowed key in a split keeps ``max = -inf`` and
contributes nothing.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..ops.attention.checks import check_paged, check_write
from ._triton import HAVE_TRITON, count_args, next_pow2, triton, tl

__all__ = ["write_kv", "paged_attention", "default_splits"]

_LOG2E = 1.4426950408889634

if HAVE_TRITON:

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, W, BW: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            for o in range(0, W, BW):
                offs = o + tl.arange(0, BW)
                m = offs < W
                kv = tl.load(k_ptr + t * k_stride + offs, mask=m)
                tl.store(kc_ptr + slot * W + offs, kv.to(kc_ptr.dtype.element_ty), mask=m)
                vv = tl.load(v_ptr + t * v_stride + offs, mask=m)
                tl.store(vc_ptr + slot * W + offs, vv.to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _find_tile(cu_ptr, N, pid, QT: tl.constexpr, NP: tl.constexpr):
        """``(b, j)``: query tile ``pid`` is tile ``j`` of sequence ``b`` (``b >= N``: none).
        Sequence ``b`` has ``ceil(T_b / QT)`` tiles, numbered in sequence order."""
        offs = tl.arange(0, NP)
        m = offs < N
        lo = tl.load(cu_ptr + offs, mask=m, other=0)
        hi = tl.load(cu_ptr + offs + 1, mask=m, other=0)
        tiles = tl.where(m, (hi - lo + QT - 1) // QT, 0)
        cum = tl.cumsum(tiles, 0)
        b = tl.sum((cum <= pid).to(tl.int32), 0)
        before = tl.sum(tl.where(offs < b, tiles, 0), 0)
        return b, pid - before

    @triton.jit
    def _key_span(bits_ptr, b64, tok_local, row_ok, qpos, L, Tb, j, s, S,
                  QT: tl.constexpr, BLOCK_N: tl.constexpr, T_TREE: tl.constexpr, TREE: tl.constexpr):
        """Keys ``[lo, hi)`` split ``s`` of ``S`` of a tile may read — up to its last query's
        position, all ``L`` for a tree — in whole ``BLOCK_N`` steps, and the rows' tree bits
        (``qpos`` as a placeholder without TREE: not read)."""
        if TREE:
            kv_hi = L
            bits = tl.load(bits_ptr + b64 * T_TREE + tok_local, mask=row_ok, other=0)
        else:
            kv_hi = L - Tb + tl.minimum(Tb, (j + 1) * QT)
            bits = qpos
        chunk = tl.cdiv(tl.cdiv(kv_hi, S), BLOCK_N) * BLOCK_N
        lo = s * chunk
        return lo, tl.minimum(kv_hi, lo + chunk), bits

    @triton.jit
    def _mask_keys(sc, row_ok, pm, pos, qpos, bits, L, T_TREE: tl.constexpr, TREE: tl.constexpr):
        """Scores ``sc [M, N]`` with the keys a row may not read set to -inf: causal (keys up
        to the row's query position ``qpos``) or, for a draft tree, the committed prefix plus
        the row's ancestors (bit ``i`` of ``bits`` = tree node ``i``; unused without TREE)."""
        ok = row_ok[:, None] & pm[None, :]
        if TREE:
            rel = pos - (L - T_TREE)
            node = ((bits[:, None] >> tl.maximum(rel, 0)[None, :]) & 1) != 0
            ok = ok & ((rel < 0)[None, :] | node)
        else:
            ok = ok & (pos[None, :] <= qpos[:, None])
        return tl.where(ok, sc, float("-inf"))

    @triton.jit
    def _softmax_step(sc, m_i, l_i):
        """One key block of the online softmax (base 2): ``m' = max(m, max_j sc)``,
        ``p = 2^(sc - m')``, ``α = 2^(m - m')``, ``l' = α l + Σ_j p``; returns
        ``(p, α, m', l')`` (a row with no readable key yet keeps ``m' = -inf``, ``p = 0``)."""
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(sc - m_use[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit(**count_args("N", "Nt"))
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, len_ptr, bits_ptr, o_ptr, part_ptr, ml_ptr,
        N, MB, H, DH, Nt, S, qk_scale,
        HKV: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, T_TREE: tl.constexpr, QT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr,
        TREE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        b, j = _find_tile(cu_ptr, N, pid, QT, NP)
        if b < N:
            b64 = b.to(tl.int64)
            t0 = tl.load(cu_ptr + b64)
            Tb = tl.load(cu_ptr + b64 + 1) - t0
            L = tl.load(len_ptr + b64)
            mm = tl.arange(0, BLOCK_M)
            ti = mm // R                                   # token of the tile
            hh = mm % R                                    # head within the KV group
            tok_local = j * QT + ti
            row_ok = (ti < QT) & (tok_local < Tb)
            qpos = L - Tb + tok_local                      # key position of each row's query
            tok = (t0 + tok_local).to(tl.int64)
            head = g * R + hh
            dd = tl.arange(0, DP)
            dm = dd < DH
            qrow = (tok * H + head) * DH
            Q = tl.load(q_ptr + qrow[:, None] + dd[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)
            lo, hi, bits = _key_span(bits_ptr, b64, tok_local, row_ok, qpos, L, Tb, j, s, S, QT, BLOCK_N, T_TREE, TREE)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DP], tl.float32)
            nn = tl.arange(0, BLOCK_N)
            for start in range(lo, hi, BLOCK_N):
                pos = start + nn
                pm = pos < hi
                blk = tl.load(bt_ptr + b64 * MB + pos // BS, mask=pm, other=0).to(tl.int64)
                krow = ((blk * BS + pos % BS) * HKV + g) * DH
                kmask = pm[:, None] & dm[None, :]
                K = tl.load(k_ptr + krow[:, None] + dd[None, :], mask=kmask, other=0.0)
                sc = tl.dot(Q, tl.trans(K.to(Q.dtype)), input_precision=PREC) * qk_scale
                sc = _mask_keys(sc, row_ok, pm, pos, qpos, bits, L, T_TREE, TREE)
                p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i)
                V = tl.load(v_ptr + krow[:, None] + dd[None, :], mask=kmask, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype), V, input_precision=PREC)
                m_i = m_new
            orow = (tok * H + head)
            if SPLIT:
                prow = s.to(tl.int64) * Nt * H + orow
                tl.store(part_ptr + prow[:, None] * DH + dd[None, :], acc, mask=row_ok[:, None] & dm[None, :])
                tl.store(ml_ptr + prow * 2, m_i, mask=row_ok)
                tl.store(ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
            else:
                o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(o_ptr + orow[:, None] * DH + dd[None, :], o.to(o_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & dm[None, :])

    @triton.jit(**count_args("NtH"))
    def _combine_kernel(part_ptr, ml_ptr, o_ptr, NtH, DH, S, SP: tl.constexpr, DP: tl.constexpr):
        """``o = Σ_s 2^{m_s - M} acc_s / Σ_s 2^{m_s - M} l_s`` over the splits of one row."""
        r = tl.program_id(0).to(tl.int64)
        ss = tl.arange(0, SP)
        sm = ss < S
        prow = ss.to(tl.int64) * NtH + r
        m = tl.load(ml_ptr + prow * 2, mask=sm, other=float("-inf"))
        lsum = tl.load(ml_ptr + prow * 2 + 1, mask=sm, other=0.0)
        M = tl.max(m, 0)
        M = tl.where(M == float("-inf"), 0.0, M)
        w = tl.exp2(m - M)
        den = tl.sum(w * lsum, 0)
        dd = tl.arange(0, DP)
        dm = dd < DH
        part = tl.load(part_ptr + prow[:, None] * DH + dd[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        o = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + r * DH + dd, o.to(o_ptr.dtype.element_ty), mask=dm)


# ---------------------------------------------------------------------------- wrappers
def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
             check: bool | None = None) -> None:
    """Kernel form of :func:`replayssm.ops.attention.naive.write_kv` (one launch)."""
    check_write(k_cache, v_cache, k, v, slot_mapping, check)
    Nt, Hkv, Dh = k.shape
    if Nt == 0:
        return
    W = Hkv * Dh
    k = k if k[0].is_contiguous() else k.contiguous()
    v = v if v[0].is_contiguous() else v.contiguous()
    _write_kv_kernel[(Nt,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), W,
                            BW=min(2048, next_pow2(W)), num_warps=4)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _sm_count(device) -> int:
    return _sms(torch.device(device))


def default_splits(programs: int, device, waves: int = 4) -> int:
    """Split-KV count from shapes only (never from the block table's width, so
    ``max_seq_len`` changes nothing): enough programs for ``waves`` per SM, at most 16."""
    want = -(-waves * _sm_count(device) // max(programs, 1))
    return max(1, min(16, want))


def _tiles(Nt: int, N: int, R: int, Dh: int, block_m: int | None):
    """``(BLOCK_M, QT, BLOCK_N, warps)`` from shapes (H100 sweep, 2026-11-23): decode and
    verify (up to 64 query rows per sequence) use 16-row tiles, as many programs as possible,
    a sequence's tiles re-reading its keys from L2; prefill uses 64-row tiles (4 warps), or
    128 rows and 8 warps for head dims above 128."""
    mean_t = -(-Nt // max(N, 1))
    if block_m is None:
        block_m = 16 if mean_t * R <= 64 else 64 if Dh <= 128 else 128
    block_m = max(16, next_pow2(max(block_m, R)))
    QT = block_m // R
    warps = 8 if block_m >= 128 else 4
    return block_m, QT, 64, warps


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                    kv_lens: Tensor, *, scale: float, tree_bits: Tensor | None = None, out: Tensor | None = None,
                    check: bool | None = None, num_splits: int | None = None, block_m: int | None = None,
                    block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Kernel form of :func:`replayssm.ops.attention.naive.paged_attention`.

    Kernel-only keywords: ``num_splits`` (split-KV count, default :func:`default_splits`),
    ``block_m`` (query rows per tile = tokens × heads of a KV group), ``block_n`` (keys per
    step), ``num_warps``.  Shapes alone choose every launch parameter (CUDA-graph safe).
    """
    N, T, Dh = check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, tree_bits, out, check)
    Nt, H, _ = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    R = H // Hkv
    o = out if out is not None else torch.empty_like(q)
    if Nt == 0 or N == 0:
        return o
    q = q.contiguous()
    BM, QT, BN, warps = _tiles(Nt, N, R, Dh, block_m)
    BN = max(16, next_pow2(block_n)) if block_n else BN
    warps = num_warps or warps
    tiles = -(-Nt // QT) + N
    MB = block_table.shape[1]
    S = num_splits or default_splits(max(N, -(-Nt // QT)) * Hkv, q.device)
    S = max(1, int(S))
    prec = "ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32"
    bits = tree_bits if tree_bits is not None else kv_lens
    if S > 1:
        part = torch.empty(S, Nt, H, Dh, dtype=torch.float32, device=q.device)
        ml = torch.empty(S, Nt, H, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = o
    DP = max(16, next_pow2(Dh))
    _paged_attn_kernel[(tiles, Hkv, S)](
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, bits, o, part, ml,
        N, MB, H, Dh, Nt, S, scale * _LOG2E,
        HKV=Hkv, R=R, BS=BS, T_TREE=max(T, 1), QT=QT, BLOCK_M=BM, BLOCK_N=BN, DP=DP,
        NP=max(64, next_pow2(N + 1)), TREE=tree_bits is not None, SPLIT=S > 1, PREC=prec, num_warps=warps)
    if S > 1:
        _combine_kernel[(Nt * H,)](part, ml, o, Nt * H, Dh, S, SP=max(16, next_pow2(S)), DP=DP, num_warps=4)
    return o
