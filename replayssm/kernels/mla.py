"""Triton kernel for absorbed multi-head latent attention over a paged latent cache (contract,
layout and mask of :func:`replayssm.ops.attention.mla.mla_attention`).

:func:`mla_attention`: flash-decoding over one latent pool ``[num_blocks, block_size, 1,
rank + dr]``.  A program owns ``QT`` consecutive queries of one sequence times ``HG`` of its
heads (the ``BLOCK_M`` rows of one tensor-core product; decode: all heads of the sequence in
one program) and one of ``S`` splits of the keys those queries may read.  Per step of
``BLOCK_N`` keys it loads the latent tile ``c [BLOCK_N, rank]`` and the shared key part
``k_rot [BLOCK_N, dr]`` *once* and uses ``c`` twice::

    s = Q_c c^T + Q_rot k_rot^T,   online softmax,   acc += p c

so each cached latent is read once per program for both the scores and the value sum (the
generic ``paged_attention`` reads the ``rank + dr`` row twice, pads it to a power of two and
keeps an accumulator of that width).  Query tiles are found on the device from
``cu_seqlens_q`` (no host sync, CUDA-graph safe); with ``S > 1`` every split writes an
unnormalised partial ``(acc, max, sum)`` that the paged-attention combine kernel merges.
Accumulation in fp32 (fp64 for fp64 inputs: the interpreter's exactness runs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.attention.mla import check_mla
from ._triton import HAVE_TRITON, count_args, next_pow2, triton, tl
from .attention import _LOG2E, _sm_count

__all__ = ["mla_attention", "mla_tiles"]

if HAVE_TRITON:
    from .attention import _combine_kernel, _find_tile, _key_span, _mask_keys, _softmax_step

    @triton.jit(**count_args("N", "Nt"))
    def _mla_kernel(
        q_ptr, c_ptr, bt_ptr, cu_ptr, len_ptr, bits_ptr, o_ptr, part_ptr, ml_ptr,
        N, MB, H, RANK, DR, Nt, S, qk_scale,
        D: tl.constexpr, BS: tl.constexpr, T_TREE: tl.constexpr, HG: tl.constexpr, QT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr, DRP: tl.constexpr, NP: tl.constexpr,
        ROT: tl.constexpr, TREE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
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
            ti = mm // HG                                  # token of the tile
            head = g * HG + mm % HG
            tok_local = j * QT + ti
            row_ok = (ti < QT) & (tok_local < Tb) & (head < H)
            qpos = L - Tb + tok_local                      # key position of each row's query
            tok = (t0 + tok_local).to(tl.int64)
            qrow = (tok * H + head) * D
            rr = tl.arange(0, RP)
            rm = rr < RANK
            Qc = tl.load(q_ptr + qrow[:, None] + rr[None, :], mask=row_ok[:, None] & rm[None, :], other=0.0)
            if ROT:
                ee = tl.arange(0, DRP)
                em = ee < DR
                Qr = tl.load(q_ptr + qrow[:, None] + RANK + ee[None, :], mask=row_ok[:, None] & em[None, :],
                             other=0.0)
            lo, hi, bits = _key_span(bits_ptr, b64, tok_local, row_ok, qpos, L, Tb, j, s, S, QT, BLOCK_N, T_TREE, TREE)
            m_i = tl.full([BLOCK_M], float("-inf"), ACC)
            l_i = tl.zeros([BLOCK_M], ACC)
            acc = tl.zeros([BLOCK_M, RP], ACC)
            nn = tl.arange(0, BLOCK_N)
            for start in range(lo, hi, BLOCK_N):
                pos = start + nn
                pm = pos < hi
                blk = tl.load(bt_ptr + b64 * MB + pos // BS, mask=pm, other=0).to(tl.int64)
                crow = (blk * BS + pos % BS) * D
                C = tl.load(c_ptr + crow[:, None] + rr[None, :], mask=pm[:, None] & rm[None, :], other=0.0)
                C = C.to(Qc.dtype)
                sc = tl.dot(Qc, tl.trans(C), out_dtype=ACC, input_precision=PREC)
                if ROT:
                    Kr = tl.load(c_ptr + crow[:, None] + RANK + ee[None, :], mask=pm[:, None] & em[None, :],
                                 other=0.0)
                    sc += tl.dot(Qr, tl.trans(Kr.to(Qr.dtype)), out_dtype=ACC, input_precision=PREC)
                sc = _mask_keys(sc * qk_scale, row_ok, pm, pos, qpos, bits, L, T_TREE, TREE)
                p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i)
                acc = acc * alpha[:, None] + tl.dot(p.to(C.dtype), C, out_dtype=ACC, input_precision=PREC)
                m_i = m_new
            orow = tok * H + head
            omask = row_ok[:, None] & rm[None, :]
            if SPLIT:
                prow = s.to(tl.int64) * Nt * H + orow
                tl.store(part_ptr + prow[:, None] * RANK + rr[None, :], acc, mask=omask)
                tl.store(ml_ptr + prow * 2, m_i, mask=row_ok)
                tl.store(ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
            else:
                o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(o_ptr + orow[:, None] * RANK + rr[None, :], o.to(o_ptr.dtype.element_ty), mask=omask)


def mla_tiles(Nt: int, N: int, H: int, rank: int, block_m: int | None = None,
              block_n: int | None = None, num_warps: int | None = None) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, HG, QT, BLOCK_N, warps)`` from shapes: rows per program (``QT`` tokens ×
    ``HG`` heads), keys per step, warps.  The ``[BLOCK_M, rank]`` accumulator stays in
    registers: at most 32 rows for ranks of 512 and more, 64 below; decode puts all heads of a
    sequence in one program (when they fit), verify / tree steps fill the rows with tokens."""
    RP = max(16, next_pow2(rank))
    cap = 32 if RP >= 512 else 64
    if block_m is None:
        block_m = cap if -(-Nt // max(N, 1)) > 1 else min(cap, next_pow2(H))
    block_m = max(16, next_pow2(block_m))
    HG = min(H, block_m)
    QT = block_m // HG
    # H200 sweep (2026-11-27, rank 512, 32 heads, B=64 x 4K context): 64 keys a step and 4
    # warps 156 us, against 32 / 8 (the first default) 278 us, 32 / 4 181 us, 64 / 8 194 us
    BN = max(16, next_pow2(block_n)) if block_n else 64
    warps = num_warps or 4
    return block_m, HG, QT, BN, warps


def mla_splits(programs: int, device) -> int:
    """Split-K count from shapes only: about two waves of programs while the rows alone fill
    less than one, at most 64; one split once they fill a wave.  H200 sweeps at the shipped
    tiles (64 keys a step, 4 warps; rank 512, 32 heads; µs, 2026-11-27 night): B=1 × 4K 15.0
    at 64 splits (17.6 at 32); B=16 × 4K 50.1 at 16 (71.3 at 8, 62.7 at 32); B=64 × 4K 146 at
    4 (182 at 3, 158 at 8); B=256 × 1K 123 at 1 (171 at 2) — the rule picks 64 / 17 / 5 / 1
    (the first rule, one wave, picked 64 / 9 / 3 / 1)."""
    sms = _sm_count(device)
    programs = max(programs, 1)
    if programs >= sms:
        return 1
    return max(1, min(64, -(-2 * sms // programs)))


def mla_attention(q: Tensor, cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor, *,
                  rank: int, scale: float, tree_bits: Tensor | None = None, out: Tensor | None = None,
                  check: bool | None = None, num_splits: int | None = None, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> Tensor:
    """Kernel form of :func:`replayssm.ops.attention.mla.mla_attention` (one launch, plus the
    combine launch when split).

    Kernel-only keywords: ``num_splits`` (default: :func:`mla_splits` of the programs),
    ``block_m`` / ``block_n`` / ``num_warps`` (:func:`mla_tiles`), ``num_stages``.  Shapes
    alone choose every launch parameter (CUDA-graph safe).
    """
    N, T = check_mla(q, cache, block_table, cu_seqlens_q, kv_lens, rank, tree_bits, out, check)
    Nt, H, D = q.shape
    BS = cache.shape[1]
    o = out if out is not None else q.new_empty(Nt, H, rank)
    if Nt == 0 or N == 0:
        return o
    q = q.contiguous()
    BM, HG, QT, BN, warps = mla_tiles(Nt, N, H, rank, block_m, block_n, num_warps)
    groups = -(-H // HG)
    tiles = -(-Nt // QT) + N
    S = max(1, int(num_splits or mla_splits(max(N, -(-Nt // QT)) * groups, q.device)))
    f64 = torch.float64 in (q.dtype, cache.dtype)
    acc_t = torch.float64 if f64 else torch.float32
    prec = "ieee" if f64 or torch.float32 in (q.dtype, cache.dtype) else "tf32"
    if S > 1:
        part = torch.empty(S, Nt, H, rank, dtype=acc_t, device=q.device)
        ml = torch.empty(S, Nt, H, 2, dtype=acc_t, device=q.device)
    else:
        part = ml = o
    RP = max(16, next_pow2(rank))
    DR = D - rank
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _mla_kernel[(tiles, groups, S)](
        q, cache, block_table, cu_seqlens_q, kv_lens, tree_bits if tree_bits is not None else kv_lens,
        o, part, ml, N, block_table.shape[1], H, rank, DR, Nt, S, scale * _LOG2E,
        D=D, BS=BS, T_TREE=max(T, 1), HG=HG, QT=QT, BLOCK_M=BM, BLOCK_N=BN, RP=RP,
        DRP=max(16, next_pow2(DR)), NP=max(64, next_pow2(N + 1)), ROT=DR > 0, TREE=tree_bits is not None,
        SPLIT=S > 1, PREC=prec, ACC=tl.float64 if f64 else tl.float32, num_warps=warps, **extra)
    if S > 1:
        _combine_kernel[(Nt * H,)](part, ml, o, Nt * H, rank, S, SP=max(16, next_pow2(S)), DP=RP, num_warps=4)
    return o
