"""Triton kernel folding paged entries into a state: the ``kv_fold`` of both SSM families
(contracts of :func:`replayssm.ops.mamba2.naive.kv_fold` and
:func:`replayssm.ops.gdn.naive.kv_fold`).

Both families' folds are one decayed sum of outer products.  For row ``b``, state head
``h`` and the row's ``n_b`` committed entries (logical positions ``0 .. n_b-1``, found
through the row's block table)::

    S_b,h = e^{Σ_j l_j} S0_b,h + Σ_j e^{Σ_{v>j} l_v} w_j · L_j[h_L] ⊗ R_j[h_R]

* Mamba-2: ``S [H, d, n]``, ``L = x [H, d]``, ``R = B [G, n]`` (``h_R = h // (H/G)``),
  ``l_j = A_h Δ_j``, ``w_j = Δ_j``;
* GDN: ``S [HV, K, V]``, ``L = k [H, K]`` (``h_L = h // (HV/H)``), ``R = u [HV, V]``,
  ``l_j = g_j``, ``w_j = 1``.

One program owns one (row, state head, block of the state's rows): it holds ``S [BR, BC]`` in
fp32 registers and walks the row's entries ``Q`` at a time, in order (one launch for all rows
and heads; nothing but the result is written)::

    S <- e^{Σ_chunk l} S + (L ⊙ e^{Σ_{v>j} l_v} w)ᵀ R          (one tl.dot per chunk)

Entries past a row's length (the tail of its last block, the null block) are masked loads,
never read.  ``tl.dot`` operands are the pool's dtype (bf16/fp16 tensor cores, the weighted
``L`` rounded to it as the prefill kernels do) or fp32 with ``precision``; accumulation fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.paged import PagedPlan
from ._triton import HAVE_TRITON, count_args, next_pow2, pad16, triton, tl

__all__ = ["paged_fold", "ring_fold", "conv_fold", "DEFAULTS"]

#: default tiles: ``block_t`` entries per chunk, ``block_r`` state rows per program
DEFAULTS = dict(block_t=32, block_r=64, num_warps=4)


if HAVE_TRITON:

    @triton.jit
    def _conv_rows(pre_ptr, w_ptr, bias_ptr, bt_ptr, b, p, mt, ch, mch, sp, sbt, MAXB,
                   BS: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr, Q: tl.constexpr, NC: tl.constexpr):
        """``silu(Σ_k w[ch, k] · pre[p-W+1+k, ch] + bias[ch])`` at positions ``p [Q]`` of row
        ``b``'s chain (inputs before position 0 read as zero), fp32 ``[Q, len(ch)]``; the taps
        summed last first, then ``0 .. W-2``, as the prefill's conv."""
        acc = tl.zeros([Q, NC], dtype=tl.float32)
        for i in tl.static_range(W):
            k = (i + W - 1) % W
            q = p - (W - 1) + k
            mq = mt & (q >= 0) & (q // BS < MAXB)
            qc = tl.where(mq, q, 0)
            blk = tl.load(bt_ptr + b.to(tl.int64) * sbt + qc // BS, mask=mq, other=0).to(tl.int64)
            rq = blk * BS + qc % BS
            v = tl.load(pre_ptr + rq[:, None] * sp + ch[None, :], mask=mq[:, None] & mch[None, :], other=0.0)
            wk = tl.load(w_ptr + ch * W + k, mask=mch, other=0.0).to(tl.float32)
            acc += v.to(tl.float32) * wk[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ch, mask=mch, other=0.0).to(tl.float32)[None, :]
        return acc / (1.0 + tl.exp(-acc))

    @triton.jit(**count_args("MAXB", "sbt"))      # the block table's width changes with every chain
    def _paged_fold_kernel(
        L_ptr, R_ptr, a_ptr, scale_ptr, s0_ptr, out_ptr, len_ptr, bt_ptr, start_ptr, w_ptr, bias_ptr,
        NH, R, C, ND, HPL, HPR, sl0, sl1, sr0, sr1, loff, roff, sa0, MAXB, sbt,
        BS: tl.constexpr, Q: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
        HAS_SCALE: tl.constexpr, WEIGHT: tl.constexpr, HAS_INIT: tl.constexpr, PREC: tl.constexpr,
        HAS_START: tl.constexpr, CONV: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rb = pid % ND
        h = (pid // ND) % NH
        b = pid // (ND * NH)
        hl = h // HPL
        hr = h // HPR
        offs_r = rb * BR + tl.arange(0, BR)
        offs_c = tl.arange(0, BC)
        offs_q = tl.arange(0, Q)
        mr = offs_r < R
        mc = offs_c < C
        soff = ((b.to(tl.int64) * NH + h) * R + offs_r[:, None]) * C + offs_c[None, :]
        if HAS_INIT:
            S = tl.load(s0_ptr + soff, mask=mr[:, None] & mc[None, :], other=0.0).to(tl.float32)
        else:
            S = tl.zeros([BR, BC], dtype=tl.float32)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + h).to(tl.float32)
        n = tl.load(len_ptr + b).to(tl.int32)
        if HAS_START:
            p0 = tl.load(start_ptr + b).to(tl.int32)
        else:
            p0 = 0
        DT = L_ptr.dtype.element_ty
        for c in range(tl.cdiv(n, Q)):
            p = p0 + c * Q + offs_q                                              # logical positions
            mt = (p < p0 + n) & (p // BS < MAXB)
            blk = tl.load(bt_ptr + b.to(tl.int64) * sbt + p // BS, mask=mt, other=0).to(tl.int64)
            row = blk * BS + p % BS                                              # pool rows
            a = tl.load(a_ptr + row * sa0 + h, mask=mt, other=0.0).to(tl.float32)
            if HAS_SCALE:
                l = scale * a
            else:
                l = a
            l = tl.where(mt, l, 0.0)
            cum = tl.cumsum(l, 0)
            tot = tl.sum(l, 0)
            wgt = tl.exp(tot - cum)                                              # e^{Σ_{v>j} l_v}
            if WEIGHT:
                wgt = wgt * a
            wgt = tl.where(mt, wgt, 0.0)
            if CONV:                                                             # x, B = silu(conv(pre))
                Lf = _conv_rows(L_ptr, w_ptr, bias_ptr, bt_ptr, b, p, mt, loff + hl * sl1 + offs_r, mr, sl0, sbt,
                                MAXB, BS, W, HAS_BIAS, Q, BR)
                Rm = _conv_rows(R_ptr, w_ptr, bias_ptr, bt_ptr, b, p, mt, roff + hr * sr1 + offs_c, mc, sr0, sbt,
                                MAXB, BS, W, HAS_BIAS, Q, BC).to(DT)
                Lf = Lf.to(DT).to(tl.float32)                                    # rounded as a stored entry
            else:
                Lf = tl.load(L_ptr + row[:, None] * sl0 + hl * sl1 + offs_r[None, :],
                             mask=mt[:, None] & mr[None, :], other=0.0).to(tl.float32)   # [Q, BR]
                Rm = tl.load(R_ptr + row[:, None] * sr0 + hr * sr1 + offs_c[None, :],
                             mask=mt[:, None] & mc[None, :], other=0.0)                   # [Q, BC]
            Lw = (Lf * wgt[:, None]).to(DT)
            S = tl.exp(tot) * S + tl.dot(tl.trans(Lw), Rm, input_precision=PREC)
        tl.store(out_ptr + soff, S, mask=mr[:, None] & mc[None, :])


def _rows(t: Tensor) -> Tensor:
    """``t [rows, heads, dim]`` with its last axis contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def paged_fold(L: Tensor, R: Tensor, a: Tensor, pplan, *, scale: Tensor | None, weighted: bool,
               initial_state: Tensor | None, num_state_heads: int, block_t: int | None = None,
               block_r: int | None = None, num_warps: int | None = None, precision: str = "ieee") -> Tensor:
    """The fold of the module docstring for every row of ``pplan`` (its ``length`` and
    ``block_table``; arguments already validated by the family's reference checks).

    ``L [rows, HL, Rd]``, ``R [rows, HR, C]`` (same dtype), ``a [rows, NH]`` (per-token
    log-decay input; with ``scale [NH]`` the log-decay is ``scale_h · a``, else ``a``),
    ``weighted``: each entry also weighted by ``a``; ``initial_state [Bt, NH, Rd, C]`` or None.
    Returns ``[Bt, NH, Rd, C]`` fp32.
    """
    if L.dtype not in (torch.float16, torch.bfloat16, torch.float32) or R.dtype != L.dtype:
        raise ValueError(f"the fold kernel takes fp16/bf16/fp32 entries of one dtype, got {L.dtype} and {R.dtype}")
    Lr, Rr = _rows(L), _rows(R)
    return _launch(Lr, Rr, a, pplan, scale, weighted, initial_state, num_state_heads, L.shape[2], R.shape[2],
                   L.shape[1], R.shape[1], (Lr.stride(0), Lr.stride(1), 0), (Rr.stride(0), Rr.stride(1), 0),
                   None, None, block_t, block_r, num_warps, precision)


def conv_fold(preconv: Tensor, dt: Tensor, pplan, start: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor,
              initial_state: Tensor | None, *, head_dim: int, ngroups: int, d_state: int, block_t: int | None = None,
              block_r: int | None = None, num_warps: int | None = None, precision: str = "ieee") -> Tensor:
    """The Mamba-2 fold of entries stored as conv inputs: positions ``start_b .. start_b +
    n_b - 1`` of each row's chain (``pplan``'s table from position 0), with ``x, B =
    split(silu(conv(preconv)))`` computed on the fly from the ``W`` conv inputs ending at each
    position (zeros before position 0; rounded to the inputs' dtype, as stored entries are)
    and ``Δ`` from ``dt``.  ``preconv [rows, Cch]`` (channels ``x | B | ...``), ``dt [rows,
    H]``, ``weight [Cch, W]``, ``bias [Cch]``, ``A [H]``.  Returns ``[Bt, H, d, n]`` fp32."""
    if preconv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the fold kernel takes fp16/bf16/fp32 conv inputs, got {preconv.dtype}")
    H = dt.shape[1]
    pre = _rows(preconv)
    conv = (weight.contiguous(), None if bias is None else bias.contiguous())
    return _launch(pre, pre, dt, pplan, A, True, initial_state, H, head_dim, d_state, H, ngroups,
                   (pre.stride(0), head_dim, 0), (pre.stride(0), d_state, H * head_dim), start, conv,
                   block_t, block_r, num_warps, precision)


def _launch(L, R, a, pplan, scale, weighted, initial_state, NH, Rd, C, HL, HR, sl, sr, start, conv,
            block_t, block_r, num_warps, precision) -> Tensor:
    if a.dtype == torch.float64 or (initial_state is not None and initial_state.dtype == torch.float64):
        raise ValueError("the fold kernel computes in fp32 (fp64 runs the reference op)")
    Bt, bs = pplan.batch, pplan.block_size
    out = torch.empty(Bt, NH, Rd, C, dtype=torch.float32, device=L.device)
    if Bt == 0:
        return out
    Q = int(block_t or DEFAULTS["block_t"])
    if Q < 16 or Q & (Q - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t!r}")
    BR = max(16, min(next_pow2(block_r or DEFAULTS["block_r"]), next_pow2(Rd)))
    BC = pad16(C)
    ND = triton.cdiv(Rd, BR)
    ar = a if a.stride(-1) == 1 else a.contiguous()
    bt = pplan.block_table.contiguous()
    s0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else out
    w, bias = conv if conv is not None else (ar, None)
    _paged_fold_kernel[(Bt * NH * ND,)](
        L, R, ar, scale if scale is not None else ar, s0, out, pplan.length.contiguous(), bt,
        start.contiguous() if start is not None else bt, w, bias if bias is not None else w,
        NH, Rd, C, ND, NH // HL, NH // HR, sl[0], sl[1], sr[0], sr[1], sl[2], sr[2],
        ar.stride(0), bt.shape[1], bt.stride(0),
        BS=bs, Q=Q, BR=BR, BC=BC, HAS_SCALE=scale is not None, WEIGHT=bool(weighted),
        HAS_INIT=initial_state is not None, PREC=precision, HAS_START=start is not None, CONV=conv is not None,
        W=w.shape[1] if conv is not None else 1, HAS_BIAS=bias is not None,
        num_warps=num_warps or DEFAULTS["num_warps"])
    return out


def ring_fold(state: Tensor, L: Tensor, R: Tensor, a: Tensor, plan, *, scale: Tensor | None, weighted: bool,
              **tuning) -> Tensor:
    """``S_h`` of every row of the ring ``plan`` (``rebuild_state``): its checkpoint
    ``state[slot]`` folded with its ``h`` committed ring entries, oldest first.

    The ring ``[P, Lc, heads, dim]`` is read as pages of one entry (row ``slot·Lc + (start +
    j) % Lc`` for entry ``j``), so :func:`paged_fold` runs it in one launch.  ``state [P,
    NH, Rd, C]``; ``L``/``R``/``a`` the ring tensors in the fold's roles.  Returns ``[Bt, NH,
    Rd, C]`` fp32."""
    P, Lc = L.shape[:2]
    slot = plan.slot.long()
    table = slot[:, None] * Lc + plan.hist_positions()
    pages = PagedPlan(slot, plan.hist, table, 1, 1)
    return paged_fold(L.reshape(P * Lc, *L.shape[2:]), R.reshape(P * Lc, *R.shape[2:]), a.reshape(P * Lc, -1),
                      pages, scale=scale, weighted=weighted, initial_state=state[slot],
                      num_state_heads=state.shape[1], **tuning)
