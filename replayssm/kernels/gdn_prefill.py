"""Triton kernels for Gated DeltaNet prefill over a packed batch of variable-length
sequences (the chunked delta rule in WY/UT form; contract of
:func:`replayssm.ops.gdn.naive.chunked_prefill_varlen`).

Per chunk of ``Q = 64`` tokens (restarting at every sequence start), with ``G`` the in-chunk
cumulative log-decay (non-increasing, ``g <= 0``), l2-normalised ``k``, ``q`` (q scaled) and
the strictly lower ``A_{ij} = β_i e^{G_i−G_j} k_i·k_j``::

    X = (I + A)^{-1},   w = X (β e^{G} k),   u' = X (β v)                (parallel over chunks)
    U = u' − w S                                     (the corrected values u_t; S: state entering)
    y = e^{G} (q S) + [e^{G_i−G_j} q_i·k_j]_{j<=i} U
    S ← e^{G_Q} S + Σ_j e^{G_Q−G_j} k_j U_jᵀ

Two launches:

1. ``_gdn_wu_kernel``: one program per (chunk, value head) computes ``w`` and ``u'``.  The
   inverse of the unit lower triangular ``I + A``: the 16×16 diagonal blocks by
   column-oriented forward substitution (all four blocks at once, 15 rank-1 steps), then
   ``N = X_d A_off`` (strictly block-lower, ``N⁴ = 0``) and
   ``X = (I − N)(I + N²) X_d`` — four ``tl.dot`` s.  Chunks are found from ``cu_seqlens`` on
   the device: sequence ``i``'s chunks take the slots ``cu[i] // Q + i + c`` (a binary search
   inverts that), so no host sync and no chunk table.
2. ``_gdn_scan_kernel``: one program per (sequence, value head, V-block) holds the state block
   ``S [K, BV]`` in fp32 registers and walks the sequence's chunks in order (state passing on
   chip, no per-chunk states in memory), writing ``y``, optionally ``U`` (``return_u``), and
   the final state.

Decays are ``exp`` of non-positive segment sums (the upper triangle is ``-inf`` before
``exp``).  The l2-norm of q/k and the gate cumsum are fused into both kernels.  ``tl.dot``
operands are the activation dtype (bf16/fp16: tensor cores; ``X`` and the state are rounded
to it, as the peers do) or fp32 with ``precision``; the inverse's block products use
``inv_precision`` (``"tf32"`` for 16-bit inputs, ``"ieee"`` for fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.gdn.naive import check_prefill_varlen
from ._triton import HAVE_TRITON, count_args, next_pow2, pad16, search_steps, triton, tl

__all__ = ["chunked_prefill_varlen", "DEFAULTS"]

#: default tiles (tuned on the H100 for HV=32, H=16, K=V=128; see docs/BENCHMARKS.md): the
#: nilpotent-product inverse (``inv=2``) made the w/u kernel 1.7× faster than the loop (``inv=0``)
#: ``block_v=None`` follows :func:`pick_block_v`.
DEFAULTS = dict(block_v=None, num_warps=4, num_stages=2, wu_warps=4, inv=2)


def _inverse_precision(dtype: torch.dtype, K: int, precision: str) -> str:
    """``tl.dot`` precision of the w/u kernel's inverse: TF32 for 16-bit inputs with K >= 128
    (the models' head size, checked on the H100), else ``precision``.  On the H100 (Triton
    3.6, 4 warps) the TF32 inverse came out wrong for K = 6, 16 and 32 (errors ~1 against
    the reference, 2026-11-23), while IEEE or 8 warps were exact: small heads take IEEE."""
    return "tf32" if dtype != torch.float32 and pad16(K) >= 128 else precision


def pick_block_v(N: int, HV: int, V: int, device) -> int:
    """V-block of the scan: 64 when that still gives one program per SM, else 32 (H100,
    HV=32, V=128, 2026-11-23: 16×2048 1.61 vs 1.91 ms, 1×8192 0.92 vs 0.70 ms)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return 64 if N * HV * -(-V // 64) >= sms else 32
_Q = 64  # chunk length of the kernels (four 16-row blocks)

if HAVE_TRITON:

    @triton.jit
    def _rnorm(x, L2: tl.constexpr):
        """Row scales ``1 / sqrt(Σx² + 1e-6)`` of ``x [R, C]`` in fp32 (ones without ``L2``):
        the l2-norm is applied to dot results and small operands, never to a copy of ``x``."""
        if L2:
            xf = x.to(tl.float32)
            return tl.rsqrt(tl.sum(xf * xf, 1) + 1e-6)
        return tl.full([x.shape[0]], 1.0, tl.float32)

    @triton.jit
    def _block_diag_inverse(A, Q: tl.constexpr, INV: tl.constexpr, IPREC: tl.constexpr):
        """``(I + A_d)^{-1}`` of the 16×16 diagonal blocks of the strictly lower ``A [Q, Q]``,
        as a block-diagonal ``[Q, Q]`` tile.

        ``INV = 0``: column-oriented forward substitution on the whole tile (all blocks at
        once, 15 rank-1 steps); ``INV = 1``: the same on a ``[Q/16, 16, 16]`` tile (reductions
        over 16 entries); ``INV = 2``: ``(I − P)(I + P²)(I + P⁴)(I + P⁸)`` with ``P = A_d``
        (nilpotent, ``P¹⁶ = 0``) as six batched ``tl.dot`` s."""
        NB: tl.constexpr = Q // 16
        r = tl.arange(0, Q)[:, None]
        c = tl.arange(0, Q)[None, :]
        same = (r // 16) == (c // 16)
        if INV == 0:
            Ad = tl.where(same, A, 0.0)
            X = tl.where(r == c, 1.0, 0.0)
            for s in tl.static_range(15):  # column s of every block: X_i -= A_is X_s (i > s)
                col = tl.sum(tl.where(c == (r // 16) * 16 + s, Ad, 0.0), 1)
                row = tl.sum(tl.where(r == (c // 16) * 16 + s, X, 0.0), 0)
                X = X - tl.where(same, col[:, None] * row[None, :], 0.0)
            return X
        b1 = tl.arange(0, NB)[:, None, None, None]
        b2 = tl.arange(0, NB)[None, None, :, None]
        A3 = tl.sum(tl.where(b1 == b2, tl.reshape(A, [NB, 16, NB, 16]), 0.0), 2)  # [NB, 16, 16]
        r3 = tl.arange(0, 16)[None, :, None]
        c3 = tl.arange(0, 16)[None, None, :]
        eye = tl.where(r3 == c3, 1.0, 0.0) + tl.zeros([NB, 16, 16], tl.float32)
        if INV == 1:
            X3 = eye
            for s in tl.static_range(15):
                col = tl.sum(tl.where(c3 == s, A3, 0.0), 2)   # [NB, 16]: A[b, i, s]
                row = tl.sum(tl.where(r3 == s, X3, 0.0), 1)   # [NB, 16]: X[b, s, j]
                X3 = X3 - col[:, :, None] * row[:, None, :]
        else:
            P = A3
            X3 = eye - P
            for _ in tl.static_range(3):
                P = tl.dot(P, P, input_precision=IPREC)
                X3 = X3 + tl.dot(X3, P, input_precision=IPREC)
        X4 = tl.where(b1 == b2, tl.broadcast_to(X3[:, :, None, :], [NB, 16, NB, 16]), 0.0)
        return tl.reshape(X4, [Q, Q])

    @triton.jit(**count_args("N"))
    def _gdn_wu_kernel(
        k_ptr, v_ptr, g_ptr, b_ptr, cu_ptr, w_ptr, u_ptr,
        N, H, HV, K, V, RATIO, sk, sv, sg, sb,
        LOGN: tl.constexpr, Q: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        L2: tl.constexpr, PREC: tl.constexpr, IPREC: tl.constexpr, INV: tl.constexpr,
    ):
        pid = tl.program_id(0)
        hv = pid % HV
        cs = pid // HV  # chunk slot
        # sequence i owns slots [cu[i] // Q + i, cu[i+1] // Q + i + 1): binary search
        lo = cs * 0
        hi = lo + N
        for _ in tl.static_range(LOGN):
            mid = (lo + hi) // 2
            base = tl.load(cu_ptr + mid).to(tl.int32) // Q + mid
            go = base <= cs
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        s0 = tl.load(cu_ptr + lo).to(tl.int64)
        s1 = tl.load(cu_ptr + lo + 1).to(tl.int64)
        t0 = s0 + (cs - (s0.to(tl.int32) // Q + lo)).to(tl.int64) * Q
        if t0 < s1:
            hk = hv // RATIO
            offs_q = tl.arange(0, Q)
            offs_k = tl.arange(0, BK)
            offs_v = tl.arange(0, BV)
            t = t0 + offs_q
            mt = t < s1
            mk = offs_k < K
            mv = offs_v < V
            gv = tl.load(g_ptr + t * sg + hv, mask=mt, other=0.0).to(tl.float32)
            beta = tl.load(b_ptr + t * sb + hv, mask=mt, other=0.0).to(tl.float32)
            G = tl.cumsum(gv, 0)
            kr = tl.load(k_ptr + t[:, None] * sk + hk * K + offs_k[None, :], mask=mt[:, None] & mk[None, :],
                         other=0.0)
            DT = kr.dtype
            rk = _rnorm(kr, L2)
            r = offs_q[:, None]
            c = offs_q[None, :]
            kk = tl.dot(kr, tl.trans(kr), input_precision=PREC) * rk[:, None] * rk[None, :]
            A = tl.where(r > c, beta[:, None] * tl.exp(tl.where(r > c, G[:, None] - G[None, :], float("-inf")))
                         * kk, 0.0)
            same = (r // 16) == (c // 16)
            X = _block_diag_inverse(A, Q, INV, IPREC)
            Nm = tl.dot(X, tl.where(same, 0.0, A), input_precision=IPREC)  # strictly block-lower, N^4 = 0
            T1 = X + tl.dot(tl.dot(Nm, Nm, input_precision=IPREC), X, input_precision=IPREC)
            X = T1 - tl.dot(Nm, T1, input_precision=IPREC)  # (I + A)^{-1} = (I - N)(I + N^2) X_d
            w = tl.dot((X * (beta * tl.exp(G) * rk)[None, :]).to(DT), kr, input_precision=PREC)
            tl.store(w_ptr + (t[:, None] * HV + hv) * K + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
                     mask=mt[:, None] & mk[None, :])
            vr = tl.load(v_ptr + t[:, None] * sv + hv * V + offs_v[None, :], mask=mt[:, None] & mv[None, :],
                         other=0.0)
            u = tl.dot((X * beta[None, :]).to(vr.dtype), vr, input_precision=PREC)
            tl.store(u_ptr + (t[:, None] * HV + hv) * V + offs_v[None, :], u.to(u_ptr.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])

    @triton.jit
    def _gdn_scan_kernel(
        q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, y_ptr, uo_ptr,
        cu_ptr, sin_ptr, sout_ptr, slot_ptr, fresh_ptr,
        H, HV, K, V, RATIO, NVB, sq, sk, sg, scale,
        Q: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
        HAS_INIT: tl.constexpr, HAS_SLOT: tl.constexpr, HAS_FRESH: tl.constexpr, RET_U: tl.constexpr,
        PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        vb = pid % NVB
        hv = (pid // NVB) % HV
        i = pid // (NVB * HV)
        hk = hv // RATIO
        s0 = tl.load(cu_ptr + i).to(tl.int64)
        s1 = tl.load(cu_ptr + i + 1).to(tl.int64)
        if HAS_SLOT:
            row = tl.load(slot_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        offs_q = tl.arange(0, Q)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        m2 = mk[:, None] & mv[None, :]
        soff = ((row * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
        if HAS_INIT:
            ld = m2
            if HAS_FRESH:
                fr = tl.load(fresh_ptr + i).to(tl.int32)
                ld = ld & (tl.zeros([BK, BV], dtype=tl.int32) + fr == 0)
            S = tl.load(sin_ptr + soff, mask=ld, other=0.0).to(tl.float32)       # [BK, BV]
        else:
            S = tl.zeros([BK, BV], dtype=tl.float32)
        DT = w_ptr.dtype.element_ty
        causal = offs_q[:, None] >= offs_q[None, :]
        nchunks = tl.cdiv(s1 - s0, Q)
        for c in range(nchunks):
            t = s0 + c * Q + offs_q
            mt = t < s1
            mqk = mt[:, None] & mk[None, :]
            mtv = mt[:, None] & mv[None, :]
            gv = tl.load(g_ptr + t * sg + hv, mask=mt, other=0.0).to(tl.float32)
            G = tl.cumsum(gv, 0)
            last = tl.min(G, 0)  # = G[Q-1]
            qr = tl.load(q_ptr + t[:, None] * sq + hk * K + offs_k[None, :], mask=mqk, other=0.0)
            kr = tl.load(k_ptr + t[:, None] * sk + hk * K + offs_k[None, :], mask=mqk, other=0.0)
            rq = _rnorm(qr, L2) * scale
            rk = _rnorm(kr, L2)
            w = tl.load(w_ptr + (t[:, None] * HV + hv) * K + offs_k[None, :], mask=mqk, other=0.0)
            up = tl.load(u_ptr + (t[:, None] * HV + hv) * V + offs_v[None, :], mask=mtv, other=0.0)
            Sd = S.to(DT)
            U = up.to(tl.float32) - tl.dot(w, Sd, input_precision=PREC)                 # [Q, BV]
            if RET_U:
                tl.store(uo_ptr + (t[:, None] * HV + hv) * V + offs_v[None, :], U.to(uo_ptr.dtype.element_ty),
                         mask=mtv)
            qk = tl.dot(qr, tl.trans(kr), input_precision=PREC) * rk[None, :]          # [Q, Q]
            P = qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
            y = tl.dot(qr, Sd, input_precision=PREC) * tl.exp(G)[:, None] + tl.dot(P.to(DT), U.to(DT),
                                                                                     input_precision=PREC)
            tl.store(y_ptr + (t[:, None] * HV + hv) * V + offs_v[None, :], (y * rq[:, None]).to(y_ptr.dtype.element_ty),
                     mask=mtv)
            Uk = (U * (rk * tl.exp(last - G))[:, None]).to(DT)
            S = tl.exp(last) * S + tl.dot(tl.trans(kr), Uk, input_precision=PREC)
        tl.store(sout_ptr + soff, S.to(sout_ptr.dtype.element_ty), mask=m2)


def _rows(t: Tensor) -> tuple[Tensor, int]:
    """``t [Nt, heads, dim]`` or ``[Nt, heads]`` with each token's block contiguous, and its
    token stride (a copy only when the per-token block is not contiguous)."""
    inner = 1
    for s in t.shape[1:]:
        inner *= s
    ok = t.stride(-1) == 1 and (t.dim() == 2 or t.shape[1] == 1 or t.stride(1) == t.shape[2])
    if not ok or (t.shape[0] > 1 and t.stride(0) < inner):
        t = t.contiguous()
    return t, (t.stride(0) if t.shape[0] > 1 else inner)


def chunked_prefill_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           cu_seqlens: Tensor, initial_state: Tensor | None = None,
                           scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                           return_u: bool = False, state_pool: Tensor | None = None,
                           slots: Tensor | None = None, fresh: Tensor | None = None,
                           check: bool | None = None, block_v: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           wu_warps: int | None = None, precision: str = "ieee",
                           inv_precision: str | None = None, inv: int | None = None):
    """Kernel form of :func:`replayssm.ops.gdn.naive.chunked_prefill_varlen` (same arguments
    and returns; states read and written in their dtype,
    fp32/bf16/fp16, math in fp32; a returned final state is fp32).

    ``chunk_size`` is validated for the reference's contract; the kernels' chunk is 64
    tokens (results differ from the reference only by rounding).  Kernel-only tuning:
    ``block_v`` (V-block per scan program), ``num_warps`` / ``num_stages`` (scan),
    ``wu_warps`` (the w/u kernel), ``precision`` (``tl.dot`` of fp32 operands),
    ``inv_precision`` (the inverse's block products; default
    :func:`_inverse_precision`: ``"tf32"`` for 16-bit inputs with K >= 128, else ``precision``).  q/k/v/g/beta may be strided along the token axis (slices of a
    projection) as long as each token's block is contiguous.
    """
    Nt, H, HV, K, V, N, sl, fr, check = check_prefill_varlen(q, k, v, g, beta, scale, cu_seqlens, chunk_size,
                                                              initial_state, state_pool, slots, fresh, check)
    src = state_pool if state_pool is not None else initial_state
    if src is not None and src.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the prefill kernels keep fp32/bf16/fp16 states (math in fp32), got {src.dtype} "
                         f"(fp64 runs the reference op)")
    for name, t in (("q", q), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"the prefill kernels take fp16/bf16/fp32 activations, got {name} {t.dtype}")
    if v.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q/k are {q.dtype}, v is {v.dtype}")
    if state_pool is not None and not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous for the Triton kernels")
    dev = q.device
    y = torch.empty(Nt, HV, V, dtype=v.dtype, device=dev)
    u_out = torch.empty(Nt, HV, V, dtype=v.dtype, device=dev) if return_u else None
    pool_form = state_pool is not None
    final = state_pool if pool_form else torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    out = (y, None if pool_form else final) + ((u_out,) if return_u else ())
    if N == 0:
        return out
    qr, sq = _rows(q)
    kr, sk = _rows(k)
    vr, sv = _rows(v)
    gr, sg = _rows(g)
    br, sb = _rows(beta)
    cu = cu_seqlens.contiguous()
    iprec = inv_precision or _inverse_precision(q.dtype, K, precision)
    w, up = wu_pass(kr, sk, vr, sv, gr, sg, br, sb, cu, N, H, use_qk_l2norm, precision, iprec,
                    wu_warps or DEFAULTS["wu_warps"], DEFAULTS["inv"] if inv is None else inv)
    sc = K ** -0.5 if scale is None else float(scale)
    BV = max(16, min(next_pow2(block_v or DEFAULTS["block_v"] or pick_block_v(N, HV, V, dev)), pad16(V)))
    NVB = triton.cdiv(V, BV)
    sin = src.contiguous() if src is not None else final
    _gdn_scan_kernel[(N * HV * NVB,)](
        qr, kr, w, up, gr, y, u_out if return_u else y,
        cu, sin, final, sl if pool_form else cu, fr.view(torch.uint8) if fr is not None else cu,
        H, HV, K, V, HV // H, NVB, sq, sk, sg, sc,
        Q=_Q, BK=pad16(K), BV=BV, L2=bool(use_qk_l2norm), HAS_INIT=src is not None, HAS_SLOT=pool_form,
        HAS_FRESH=fr is not None, RET_U=bool(return_u), PREC=precision,
        num_warps=num_warps or DEFAULTS["num_warps"], num_stages=num_stages or DEFAULTS["num_stages"])
    return out


def wu_pass(k: Tensor, sk: int, v: Tensor, sv: int, g: Tensor, sg: int, beta: Tensor, sb: int, cu: Tensor,
            N: int, H: int, use_qk_l2norm: bool = True, precision: str = "ieee", inv_precision: str = "tf32",
            num_warps: int = 4, inv: int = 0) -> tuple[Tensor, Tensor]:
    """Launch 1: ``w [Nt,HV,K]`` (k dtype) and ``u' [Nt,HV,V]`` (v dtype) of every chunk
    (``inv``: the diagonal-block inverse variant of :func:`_block_diag_inverse`).
    Inputs as :func:`chunked_prefill_varlen` takes them (``s*``: token strides)."""
    Nt, HV, V = v.shape
    K = k.shape[2]
    w = torch.empty(Nt, HV, K, dtype=k.dtype, device=k.device)
    up = torch.empty(Nt, HV, V, dtype=v.dtype, device=v.device)
    if Nt:
        _gdn_wu_kernel[((Nt // _Q + N) * HV,)](
            k, v, g, beta, cu, w, up, N, H, HV, K, V, HV // H, sk, sv, sg, sb,
            LOGN=search_steps(N), Q=_Q, BK=pad16(K), BV=pad16(V), L2=bool(use_qk_l2norm),
            PREC=precision, IPREC=inv_precision, INV=inv, num_warps=num_warps)
    return w, up
