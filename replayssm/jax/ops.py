"""Array programs for the JAX backend: norms, the causal conv, and every Mamba-2 / Gated
DeltaNet form (chunked prefill, recurrent step, replay decode and chain verify).

Written for a compiler (``papers/compiler_first_ssd.txt``): static shapes, masks instead of
data-dependent branches, einsums for the heavy terms, decays as ``exp`` of segment sums of
log-decays, and float32 (float64 in exactness tests) for every decay, state and
accumulation.  The math is that of the reference ops (:mod:`replayssm.ops.mamba2.naive`,
:mod:`replayssm.ops.gdn.naive`; notation in ``docs/MATH.md``); each function names the
equation it implements.  Nothing here holds a cache: the model (:mod:`replayssm.jax.model`)
gathers ring entries, calls these, and writes the results back.

Shapes: batch ``Bt``, tokens ``T``, ring capacity ``L``.  Mamba-2: heads ``H``, head dim
``d``, groups ``G``, state ``n`` (head ``h`` reads group ``h // (H // G)``).  GDN: key heads
``H``, value heads ``HV``, dims ``K``, ``V``; states ``[.., HV, K, V]`` (HF/fla layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "compute_dtype", "ein", "linear", "softplus", "silu", "activation", "rms_norm", "gated_rms_norm",
    "conv_over", "last_window",
    "segsum", "m2_chunked", "m2_step", "m2_attend", "m2_build_state",
    "l2norm", "gdn_prep_qk", "gdn_chunked", "gdn_step", "gdn_readout", "gdn_build_state", "gdn_block", "gdn_hist_weights",
    "gather_ring",
]

_F32 = jnp.float32

#: How a one-token step forms its output from the state (read when a program is traced):
#: ``"dot"`` — after the update, ``y = S_new C`` (an elementwise update, then a dot reading the
#: new state: two passes over it); ``"reduce"`` — from the old state as reductions beside the
#: update's read (Mamba-2 ``y = a (S C) + Δ (B·C) x``, GDN ``y = e^g Sᵀq + (k·q) u``; replay
#: decode's ``S0 C`` and its sums over ring entries likewise: no transposed copy of the ring
#: for a dot), which XLA may fuse into one pass.  Same math; on the CPU the
#: ``dot`` form compiled without copies for every model type (``reduce`` made XLA copy a
#: single-layer stage's state), so it is the default; ``scripts/gpu_jax.py`` times both.
STEP_READOUTS = ("dot", "reduce")
_step_readout = "dot"


def set_step_readout(kind: str) -> None:
    """Choose :data:`STEP_READOUTS` for programs traced from now on."""
    global _step_readout
    if kind not in STEP_READOUTS:
        raise ValueError(f"step readout must be one of {STEP_READOUTS}, got {kind!r}")
    _step_readout = kind


def step_readout() -> str:
    """The :data:`STEP_READOUTS` entry programs traced now use."""
    return _step_readout


def compute_dtype(dtype):
    """float64 stays float64; every other dtype computes in float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def ein(spec: str, *xs):
    """``jnp.einsum`` with full float32 precision for float32 operands (no TF32 on GPUs);
    half-precision operands use the hardware's native products (float32 accumulation)."""
    half = any(jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16) for x in xs)
    return jnp.einsum(spec, *xs, precision=None if half else lax.Precision.HIGHEST)


def linear(x, w, b=None):
    """``y = x Wᵀ (+ b)``, ``w [out, in]`` (HF layout)."""
    y = ein("...i,oi->...o", x, w)
    return y if b is None else y + b


def softplus(x):
    """torch's softplus (``x`` itself above 20, ``log1p(exp(x))`` below)."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def silu(x):
    return x * jax.nn.sigmoid(x)


def activation(name: str, x):
    if name == "silu":
        return silu(x)
    if name == "relu2":
        return jnp.square(jnp.maximum(x, 0))
    if name == "relu":
        return jnp.maximum(x, 0)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unsupported activation {name!r}")


def _rms(x, eps):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x, w, eps: float, zero_centered: bool = False):
    """``w · rms(x)`` or, zero-centred (Qwen3-Next), ``(1 + w) · rms(x)``; rms in >= fp32."""
    cdt = compute_dtype(x.dtype)
    xn = _rms(x.astype(cdt), eps)
    if zero_centered:
        return (xn * (1.0 + w.astype(cdt))).astype(x.dtype)
    return w * xn.astype(x.dtype)


def gated_rms_norm(x, z, w, eps: float, group_size: int, gate_first: bool):
    """Gated RMSNorm.  ``gate_first`` (Mamba-2): ``w · rms_g(x · silu(z))`` over groups of
    ``group_size`` channels; else (GDN): ``(w · rms(x)) · silu(z)``."""
    dt = x.dtype
    cdt = compute_dtype(dt)
    xf = x.astype(cdt)
    if gate_first:
        xf = xf * silu(z.astype(cdt))
        shp = xf.shape
        xf = _rms(xf.reshape(*shp[:-1], -1, group_size), eps).reshape(shp)
        return w * xf.astype(dt)
    y = w * _rms(xf, eps).astype(dt)
    return (y * silu(z.astype(cdt))).astype(dt)


# ------------------------------------------------------------------------------ conv
def conv_over(xp, w, b, act: bool):
    """Causal depthwise conv: ``xp [Bt, W-1+T, C]`` (window then inputs), ``w [C, W]``
    -> ``[Bt, T, C]``: ``out_t = b + Σ_k w[:, k] xp_{t+k}`` (then silu), in xp's dtype."""
    W = w.shape[1]
    T = xp.shape[1] - (W - 1)
    wc = w.astype(xp.dtype)
    y = xp[:, W - 1:W - 1 + T] * wc[:, W - 1]
    for k in range(W - 1):
        y = y + xp[:, k:k + T] * wc[:, k]
    if b is not None:
        y = y + b.astype(xp.dtype)
    return silu(y) if act else y


def last_window(xp, count, Wm1: int):
    """``xp [Bt, W-1+T, C]``: the ``W-1`` rows ending after ``count [Bt]`` inputs."""
    idx = count[:, None] + jnp.arange(Wm1)[None, :]
    return jnp.take_along_axis(xp, idx[:, :, None], axis=1)


def gather_ring(ring, start):
    """Ring entries of each row oldest first: ``ring [Bt, L, ...]``, ``start [Bt]``."""
    L = ring.shape[1]
    idx = (start[:, None] + jnp.arange(L)[None, :]) % L
    return jnp.take_along_axis(ring, idx.reshape(idx.shape + (1,) * (ring.ndim - 2)), axis=1)


# ------------------------------------------------------------------------------ Mamba-2
def _rep(t, H: int):
    """Groups -> heads along axis -2 (head h reads group h // (H // G))."""
    G = t.shape[-2]
    return t if G == H else jnp.repeat(t, H // G, axis=-2)


def segsum(l):
    """``l [..., Q] -> [..., Q, Q]``: ``S[i, j] = Σ_{j<k≤i} l_k`` (``-inf`` above the diagonal),
    by a cumulative sum of a masked copy (no differences of long prefix sums)."""
    Q = l.shape[-1]
    strict = jnp.tril(jnp.ones((Q, Q), bool), -1)
    rep = jnp.where(strict, l[..., :, None], jnp.zeros((), l.dtype))
    out = jnp.cumsum(rep, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((Q, Q), bool)), out, -jnp.inf)


def m2_chunked(x, dt, A, B, C, S_init, Q: int):
    """SSD chunked form of ``S_t = e^{AΔ_t} S_{t-1} + Δ_t x_t B_tᵀ``, ``y_t = S_t C_t``.

    x ``[Bt,T,H,d]``, dt ``[Bt,T,H]``, B/C ``[Bt,T,G,n]`` (all in the compute dtype),
    ``S_init [Bt,H,d,n]``.  Tokens pad to chunks of ``Q`` with ``Δ = 0``; per chunk
    ``Λ = segsum(AΔ)``: intra-chunk ``y_i = Σ_{j≤i} e^{Λ_ij} Δ_j (B_j·C_i) x_j``, chunk
    states, inter-chunk passing by ``segsum`` of chunk totals, read-out of the incoming
    state.  Returns ``(y [Bt,T,H,d] without D·x, final state)``.
    """
    Bt, T, H, d = x.shape
    nc = -(-T // Q)
    pad = nc * Q - T

    def prep(t):
        if pad:
            t = jnp.concatenate([t, jnp.zeros((Bt, pad) + t.shape[2:], t.dtype)], 1)
        return t.reshape((Bt, nc, Q) + t.shape[2:])

    xc, dc, Bc, Cc = prep(x), prep(dt), prep(B), prep(C)
    l = A * dc                                                       # [Bt,nc,Q,H]
    decay = jnp.exp(segsum(jnp.moveaxis(l, 3, 2)))                   # [Bt,nc,H,Q,Q]
    scores = jnp.repeat(ein("bcign,bcjgn->bcijg", Cc, Bc), H // B.shape[2], axis=-1)  # per group
    y = ein("bchij,bcijh,bcjh,bcjhd->bcihd", decay, scores, dc, xc)
    to_end = decay[..., -1, :]                                       # [Bt,nc,H,Q]
    states = ein("bchj,bcjh,bcjhd,bcjhn->bchdn", to_end, dc, xc, _rep(Bc, H))
    totals = l.sum(2)                                                # [Bt,nc,H]
    z = jnp.swapaxes(jnp.concatenate([jnp.zeros((Bt, 1, H), l.dtype), totals], 1), 1, 2)
    pass_decay = jnp.exp(segsum(z))                                  # [Bt,H,nc+1,nc+1]
    all_states = jnp.concatenate([S_init[:, None], states], 1)
    S_out = ein("bhij,bjhdn->bihdn", pass_decay, all_states)
    y = y + jnp.exp(jnp.cumsum(l, 2))[..., None] * ein("bchdn,bcihn->bcihd", S_out[:, :nc], _rep(Cc, H))
    return y.reshape(Bt, nc * Q, H, d)[:, :T], S_out[:, nc]


def m2_step(S, x, dt, A, B, C):
    """One recurrent step: ``S ← e^{AΔ} S + Δ x Bᵀ``, ``y = S C`` (``x [Bt,H,d]``,
    ``dt [Bt,H]``, ``B/C [Bt,G,n]``).  Returns ``(y, S)``."""
    H = x.shape[1]
    a = jnp.exp(A * dt)
    Bh, Ch = _rep(B, H), _rep(C, H)
    if _step_readout == "reduce":   # y = S_new C = a (S C) + Δ (B·C) x, from the old state
        y = a[..., None] * jnp.sum(S * Ch[:, :, None, :], -1) + (dt * jnp.sum(Bh * Ch, -1))[..., None] * x
        return y, a[..., None, None] * S + (dt[..., None] * x)[..., :, None] * Bh[..., None, :]
    S = a[..., None, None] * S + (dt[..., None] * x)[..., :, None] * Bh[..., None, :]
    return ein("bhdn,bhn->bhd", S, Ch), S


def _segment_logs(logs, P):
    """``logs [Bt,W,H]``, ``P [Bt,M,W]`` (entries query m reads) -> ``E [Bt,M,W,H]``
    (``Σ_{v>w, P[m,v]} logs_v``) and ``cum [Bt,M,H]`` (``Σ_{v: P[m,v]} logs_v``)."""
    W = logs.shape[1]
    after = jnp.triu(jnp.ones((W, W), bool), 1)
    sel = (P[:, :, None, :] & after).astype(logs.dtype)
    return ein("bmwv,bvh->bmwh", sel, logs), ein("bmv,bvh->bmh", P.astype(logs.dtype), logs)


def m2_attend(S0, xs, Bs, dts, logs, C, P):
    """Output-only replay (decode and verify) for M queries over a masked window of W entries:
    ``y_m = e^{cum_m} (S0 C_m) + Σ_{w: P[m,w]} e^{E[m,w]} Δ_w (B_w·C_m) x_w``.

    ``S0 [Bt,H,d,n]`` or None, ``xs [Bt,W,H,d]`` (or a tuple of blocks along ``W``, e.g. the
    ring's entries and the step's: each block is read where it lies, never concatenated into
    a copy), ``Bs [Bt,W,G,n]``, ``dts/logs [Bt,W,H]`` (masked entries zeroed),
    ``C [Bt,M,G,n]``, ``P [Bt,M,W]`` -> ``[Bt,M,H,d]``.  ``B_w·C_m`` is formed once per group.
    """
    blocks = xs if isinstance(xs, tuple) else (xs,)
    H = blocks[0].shape[2]
    E, cum = _segment_logs(logs, P)
    decay = jnp.exp(jnp.where(P[..., None], E, -jnp.inf))
    one = C.shape[1] == 1 and _step_readout == "reduce"   # decode: reductions, fused with the ring reads
    scores = jnp.sum(Bs * C, -1)[:, None] if one else ein("bwgn,bmgn->bmwg", Bs, C)
    coef = decay * dts[:, None] * jnp.repeat(scores, H // Bs.shape[2], axis=-1)
    y, off = 0.0, 0
    for xb in blocks:
        cb = coef[:, :, off:off + xb.shape[1]]
        off += xb.shape[1]
        y = y + (jnp.sum(cb[:, 0, :, :, None] * xb, 1)[:, None] if one else ein("bmwh,bwhd->bmhd", cb, xb))
    if S0 is not None:
        Ch = _rep(C, H)
        s0c = jnp.sum(S0 * Ch[:, 0, :, None, :], -1)[:, None] if one else ein("bhdn,bmhn->bmhd", S0, Ch)
        y = y + jnp.exp(cum)[..., None] * s0c
    return y


def m2_build_state(S0, xs, Bs, dts, logs, P):
    """``S = e^{cum} S0 + Σ_{w: P_w} e^{E_w} Δ_w x_w B_wᵀ`` with ``P [Bt, W]`` -> ``[Bt,H,d,n]``."""
    H = xs.shape[2]
    E, cum = _segment_logs(logs, P[:, None])
    coef = jnp.exp(jnp.where(P[..., None], E[:, 0], -jnp.inf)) * dts
    S = ein("bwh,bwhd,bwhn->bhdn", coef, xs, _rep(Bs, H))
    return S + jnp.exp(cum[:, 0])[..., None, None] * S0


# ------------------------------------------------------------------------------ Gated DeltaNet
def l2norm(x, eps: float = 1e-6):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_prep_qk(q, k, cdt):
    """Upcast, l2-normalise, scale q by ``K^-1/2``: ``(q·scale, k)``."""
    q, k = l2norm(q.astype(cdt)), l2norm(k.astype(cdt))
    return q * (q.shape[-1] ** -0.5), k


def gdn_step(St, q, k, v, g, beta):
    """One delta-rule step (the recurrent form): ``St ← e^g St``; ``u = β (v − Stᵀ k)``;
    ``St ← St + k ⊗ u``; ``y = Stᵀ q`` (q/k ``[Bt,H,K]`` prepared, v ``[Bt,HV,V]``)."""
    HV = St.shape[1]
    ke, qe = _rep(k, HV), _rep(q, HV)
    if _step_readout == "reduce":   # both readouts from the old state: y = e^g Sᵀq + (k·q) u
        eg = jnp.exp(g)[..., None]
        sk, sq = jnp.sum(St * ke[..., :, None], -2), jnp.sum(St * qe[..., :, None], -2)
        u = beta[..., None] * (v - eg * sk)
        y = eg * sq + jnp.sum(ke * qe, -1)[..., None] * u
        return y, eg[..., None] * St + ke[..., :, None] * u[..., None, :]
    St = jnp.exp(g)[..., None, None] * St
    u = beta[..., None] * (v - ein("bhkv,bhk->bhv", St, ke))
    St = St + ke[..., :, None] * u[..., None, :]
    return ein("bhkv,bhk->bhv", St, qe), St


def gdn_block(hk, hq, q, k, v, G, beta, mask):
    """Corrections and outputs of a block of T tokens after state ``S_h`` (the triangular solve
    of speculative verify):
    ``(I + A) U = R``, ``A_{s,s'} = β_s e^{G_s−G_{s'}} (k_s·k_{s'})`` (s' < s in ``mask``),
    ``R_s = β_s (v_s − e^{G_s} S_h k_s)``; ``y_s = e^{G_s} S_h q_s + Σ_{s'≤s} e^{G_s−G_{s'}}
    (k_{s'}·q_s) U_{s'}``.  ``hk/hq [Bt,T,HV,V]`` = ``S_h k_s``, ``S_h q_s``; q/k ``[Bt,T,H,K]``;
    v ``[Bt,T,HV,V]``; G/beta ``[Bt,T,HV]``; mask ``[T,T]`` bool.  Returns ``U, y``."""
    T, HV = v.shape[1], v.shape[2]
    cdt = v.dtype
    eye = jnp.eye(T, dtype=bool)
    Gh = jnp.swapaxes(G, 1, 2)                                       # [Bt,HV,T]
    D = jnp.exp(jnp.where(mask, Gh[..., :, None] - Gh[..., None, :], -jnp.inf))
    rep = HV // k.shape[2]
    kk = jnp.repeat(ein("bshk,bthk->bhst", k, k), rep, axis=1)
    qk = jnp.repeat(ein("bshk,bthk->bhst", q, k), rep, axis=1)
    bh = jnp.swapaxes(beta, 1, 2)
    A = jnp.where(mask & ~eye, bh[..., :, None] * D * kk, jnp.zeros((), cdt))
    eG = jnp.exp(G)[..., None]
    R = jnp.swapaxes(beta[..., None] * (v - eG * hk), 1, 2)          # [Bt,HV,T,V]
    U = jax.scipy.linalg.solve_triangular(jnp.eye(T, dtype=cdt) + A, R, lower=True, unit_diagonal=True)
    W = jnp.where(mask, D * qk, jnp.zeros((), cdt))
    y = eG * hq + ein("bhst,bhtv->bshv", W, U)
    return jnp.swapaxes(U, 1, 2), y


def gdn_chunked(q, k, v, g, beta, St, Q: int, with_u: bool = False):
    """Chunked delta rule (WY/UT form) from state ``St [Bt,HV,K,V]``: per chunk of Q tokens
    (``G`` = in-chunk cumulative log-decay) :func:`gdn_block` against the incoming state, then
    ``St ← e^{G_Q} St + Σ_s e^{G_Q−G_s} k_s ⊗ U_s``.  The chunk-local triangular inverse is
    formed for all chunks at once; only the state passing runs sequentially (``lax.scan``).
    q/k prepared ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g/beta ``[Bt,T,HV]`` (padding: g = β = 0).
    Returns ``(y [Bt,T,HV,V], final state)``, and with ``with_u`` the corrections
    ``U [Bt,T,HV,V]`` (``S_s = e^{g_s} S_{s-1} + k_s ⊗ U_s``)."""
    Bt, T, H, K = q.shape
    HV, V = v.shape[2:]
    cdt = v.dtype
    nc = -(-T // Q)
    pad = nc * Q - T

    def prep(t):
        if pad:
            t = jnp.concatenate([t, jnp.zeros((Bt, pad) + t.shape[2:], t.dtype)], 1)
        return jnp.swapaxes(t.reshape((Bt, nc, Q) + t.shape[2:]), 0, 1)  # chunk-major

    qc, kc, vc, gc, bc = prep(q), prep(k), prep(v), prep(g), prep(beta)
    G = jnp.cumsum(gc, 2)                                            # [nc,Bt,Q,HV]
    mask = jnp.tril(jnp.ones((Q, Q), bool))
    eye = jnp.eye(Q, dtype=bool)
    rep = HV // H
    Gh = jnp.moveaxis(G, 2, 3)                                       # [nc,Bt,HV,Q]
    D = jnp.exp(jnp.where(mask, Gh[..., :, None] - Gh[..., None, :], -jnp.inf))
    kk = jnp.repeat(ein("cbshk,cbthk->cbhst", kc, kc), rep, axis=2)
    qk = jnp.repeat(ein("cbshk,cbthk->cbhst", qc, kc), rep, axis=2)
    bh = jnp.moveaxis(bc, 2, 3)
    A = jnp.where(mask & ~eye, bh[..., :, None] * D * kk, jnp.zeros((), cdt))
    Tm = jnp.eye(Q, dtype=cdt) + A                                   # [nc,Bt,HV,Q,Q]
    eG = jnp.exp(G)[..., None]                                       # [nc,Bt,Q,HV,1]
    ke = _rep(kc, HV)
    # U = Tm^-1 β (v − e^G S k) = Uv − Wk S   (both right-hand sides in one solve)
    rhs = jnp.concatenate([jnp.moveaxis(bc[..., None] * vc, 2, 3),
                           jnp.moveaxis(bc[..., None] * eG * ke, 2, 3)], -1)   # [nc,Bt,HV,Q,V+K]
    sol = jax.scipy.linalg.solve_triangular(Tm, rhs, lower=True, unit_diagonal=True)
    Uv, Wk = sol[..., :V], sol[..., V:]
    Wqk = jnp.where(mask, D * qk, jnp.zeros((), cdt))
    qe = _rep(qc, HV)
    last = jnp.exp(G[:, :, -1:] - G)                                 # [nc,Bt,Q,HV]
    tot = jnp.exp(G[:, :, -1])                                       # [nc,Bt,HV]

    def chunk(S, xs):
        Uv_c, Wk_c, Wqk_c, qe_c, ke_c, eG_c, last_c, tot_c = xs
        U = Uv_c - ein("bhsk,bhkv->bhsv", Wk_c, S)                   # [Bt,HV,Q,V]
        y = eG_c * ein("bshk,bhkv->bshv", qe_c, S) + ein("bhst,bhtv->bshv", Wqk_c, U)
        S = tot_c[..., None, None] * S + ein("bsh,bshk,bhsv->bhkv", last_c, ke_c, U)
        return S, ((y, jnp.swapaxes(U, 1, 2)) if with_u else y)

    S, ys = lax.scan(chunk, St, (Uv, Wk, Wqk, qe, ke, eG, last, tot))

    def tokens(t):   # chunk-major [nc, Bt, Q, ...] -> [Bt, T, ...]
        return jnp.swapaxes(t, 0, 1).reshape((Bt, nc * Q) + t.shape[3:])[:, :T]

    if with_u:
        return tokens(ys[0]), S, tokens(ys[1])
    return tokens(ys), S


def gdn_hist_weights(g, valid):
    """Masked ring log-decays -> ``w_j = e^{pre_h − pre_j}`` (0 past ``h``) and ``pre_h``."""
    g = jnp.where(valid[..., None], g, jnp.zeros((), g.dtype))
    tot = g.sum(1)
    w = jnp.where(valid[..., None], jnp.exp(tot[:, None] - jnp.cumsum(g, 1)), jnp.zeros((), g.dtype))
    return w, tot


def gdn_build_state(S0, u, k, w, tot):
    """``S_h = e^{pre_h} S0 + Σ_j w_j k_j ⊗ u_j`` (``u [Bt,L,HV,V]``, ``k [Bt,L,H,K]``)."""
    HV = u.shape[2]
    return jnp.exp(tot)[..., None, None] * S0 + ein("bjh,bjhk,bjhv->bhkv", w, _rep(k, HV), u)


def gdn_readout(S0, u, k, w, tot, x):
    """``S_h x_m`` without forming ``S_h`` (one read of ``S0`` serves all M vectors):
    ``e^{pre_h} (S0ᵀ x_m) + Σ_j w_j (k_j·x_m) u_j`` for ``x [Bt,M,H,K]`` -> ``[Bt,M,HV,V]``."""
    HV = u.shape[2]
    scores = jnp.repeat(ein("bjhk,bmhk->bjmh", k, x), HV // k.shape[2], axis=-1)
    return (jnp.exp(tot)[:, None, :, None] * ein("bhkv,bmhk->bmhv", S0, _rep(x, HV))
            + ein("bjh,bjmh,bjhv->bmhv", w, scores, u))
