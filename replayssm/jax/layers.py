"""Mixers of the JAX backend: Mamba-2, Gated DeltaNet, attention, MLPs and MoEs.

Every mixer has one signature, ``mixer(p, sp, x, ctx, c, i) -> (out, c, pending, updates)``:
``p`` its parameters, ``sp`` its :class:`~replayssm.jax.params.MixerSpec`, ``x [Bt, T, D]``
the normalised input, ``ctx`` the step's :class:`Ctx`, ``c`` the cache of its *stage*
(arrays with a leading layer axis) and ``i`` its layer index there.  A mixer reads its own
slices (``c[name][i]``) and returns what the step changes as ``updates`` (new ring entries,
K/V entries, conv window, flushed checkpoints), which the model writes after the stage's layer
scan (:func:`apply_updates`): read-then-write of one array inside the scan body would make
XLA copy the whole stacked cache every layer.  The recurrent form's state is the exception:
read and rewritten slice by slice, in place.  ``pending`` holds what a verify step keeps until
the commit (pre-conv inputs, the snapshot baseline's states).

Step kinds (``ctx.kind``) and cache forms (``ctx.mode``):

==========  ===========================  ======================================
kind        recurrent                    replay
==========  ===========================  ======================================
full        chunked, no cache            chunked, no cache
prefill     chunked, final state stored  chunked, final state stored, ring empty
decode      state read + write           output-only from S0 + ring; flush rows
                                         (``h + 1 == L``) write ``S_{h+1}``
verify      serial scan, T snapshots     every draft reads S0 + ring under a
            (pending)                    causal mask; flush rows (``h + 2T > L``)
                                         write ``S_h``
==========  ===========================  ======================================

Per-row decisions (flush, fill level, positions) are arrays.  A step compiled with
``ctx.write_flush`` scatters the new checkpoints of the flushing rows only; the generation
loop runs steps compiled without it (no state write at all) while no row flushes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import ops
from .ops import compute_dtype, ein, linear

__all__ = ["Ctx", "MIXERS"]


@dataclass
class Ctx:
    """What every layer of one model call reads (static ``kind``/``mode``/``T``, arrays else)."""

    kind: str                      # "full" | "prefill" | "decode" | "verify"
    mode: str                      # "recurrent" | "replay"
    T: int
    positions: Any                 # [Bt, T] int
    seq_len: Any = None            # [Bt] committed tokens before this call
    valid: Any = None              # [Bt, T] bool (prefill)
    lengths: Any = None            # [Bt] (prefill)
    start: Any = None              # [Bt] ring index of the oldest committed entry (replay)
    hist: Any = None               # [Bt] committed ring entries h (replay)
    flush: Any = None              # [Bt] bool: this step writes the checkpoint (replay)
    L: int = 0                     # ring capacity
    write_flush: bool = True       # static: False compiles a step that writes no checkpoint


def _get(p: dict, name: str):
    return p.get(name)


def _set(c: dict, name: str, value) -> dict:
    return {**c, name: value}


def _rows(Bt: int):
    return jnp.arange(Bt)[:, None]


# ------------------------------------------------------------------------------ conv
def _conv(p, sp, xc, ctx: Ctx, c: dict, i, upd: dict):
    """Causal conv + silu of the pre-conv inputs ``xc [Bt, T, C]`` for this step kind; the new
    window (prefill, decode) goes to ``upd["win"]``."""
    w, b = p["conv_w"], _get(p, "conv_b")
    Wm1 = sp.W - 1
    cdt = jnp.promote_types(compute_dtype(xc.dtype), w.dtype)
    Bt = xc.shape[0]
    if ctx.kind in ("full", "prefill"):
        xp = jnp.concatenate([jnp.zeros((Bt, Wm1, xc.shape[2]), cdt), xc.astype(cdt)], 1)
        out = ops.conv_over(xp, w, b, True).astype(xc.dtype)
        if ctx.kind == "prefill":
            upd["win"] = ops.last_window(xp, ctx.lengths, Wm1).astype(c["win"].dtype)
        return out, {}
    win = c["win"][i]
    xp = jnp.concatenate([win.astype(cdt), xc.astype(cdt)], 1)
    out = ops.conv_over(xp, w, b, True).astype(xc.dtype)
    if ctx.kind == "decode":
        upd["win"] = xp[:, xp.shape[1] - Wm1:].astype(win.dtype)
        return out, {}
    return out, {"conv_x": xc.astype(win.dtype)}


def commit_conv(win, conv_x, accepted):
    """Stage-wide conv commit: each window becomes the last ``W-1`` of
    ``[window; x_new[:accepted]]`` (``win [Ly, Bt, W-1, C]``, ``conv_x [Ly, Bt, T, C]``)."""
    Wm1 = win.shape[2]
    xp = jnp.concatenate([win, conv_x.astype(win.dtype)], 2)
    idx = accepted[None, :, None, None] + jnp.arange(Wm1)[None, None, :, None]
    return jnp.take_along_axis(xp, jnp.broadcast_to(idx, win.shape[:3] + (1,)), axis=2)


def apply_updates(c: dict, upd: dict, ctx: Ctx) -> dict:
    """Write a stage's updates ``upd`` (stacked ``[Ly, ...]`` by the layer scan) into its cache
    ``c``, after the scan.

    Layers only *read* the cache (the recurrent form's state excepted: it is read and
    rewritten slice by slice in place); their writes are collected and done here, once per
    stage.  Reading and writing one array inside the same layer body makes XLA keep the old
    array alive and copy the whole stacked cache every layer; after the scan nothing reads the
    old values, so every write below is in place and moves only what changes: ring entries
    ``[Ly, Bt, T, ...]`` at ``(start + h + s) % L``, attention K/V at ``seq_len + s``, conv
    windows, and (steps compiled with ``write_flush``) the checkpoints of the flushing rows
    only (a scatter whose other rows' indices are out of range, hence dropped)."""
    if not upd:
        return c
    c = dict(c)
    any_v = next(iter(upd.values()))
    Bt, T = any_v.shape[1], ctx.T
    rows = _rows(Bt)
    for name, v in upd.items():
        if name in ("win", "state"):                       # every row's value is new
            c[name] = v.astype(c[name].dtype)
        elif name == "flush_state":
            drop = jnp.where(ctx.flush, jnp.arange(Bt), Bt)
            c["state"] = c["state"].at[:, drop].set(v.astype(c["state"].dtype), mode="drop")
        elif name in ("k", "v"):
            if ctx.kind == "prefill":
                c[name] = c[name].at[:, :, :T].set(v.astype(c[name].dtype))
            else:
                pos = jnp.minimum(ctx.seq_len[:, None] + jnp.arange(T)[None, :], c[name].shape[2] - 1)
                c[name] = c[name].at[:, rows, pos].set(v.astype(c[name].dtype))
        else:                                              # ring entries
            pos = (ctx.start[:, None] + ctx.hist[:, None] + jnp.arange(T)[None, :]) % ctx.L
            c[name] = c[name].at[:, rows, pos].set(v.astype(c[name].dtype))
    return c


def _history(c: dict, names, i, ctx: Ctx, cdt):
    """Committed ring entries oldest first, zeroed past ``h`` (entries there may be NaN),
    and the mask ``valid [Bt, L]``."""
    valid = jnp.arange(ctx.L)[None, :] < ctx.hist[:, None]
    out = []
    for name in names:
        t = ops.gather_ring(c[name][i], ctx.start).astype(cdt)
        m = valid.reshape(valid.shape + (1,) * (t.ndim - 2))
        out.append(jnp.where(m, t, jnp.zeros((), cdt)))
    return out, valid


def _rewrite_state(c: dict, i, S, y) -> dict:
    """Recurrent form: ``state[i] = S`` in place.  ``S`` is made data-dependent on the output
    ``y`` (``+ 0·Σy``) so that every read of the old state (XLA may re-read it to form ``y``)
    is ordered before the write; otherwise XLA copies the stacked state to keep the old one."""
    S = S + jnp.sum(y).astype(S.dtype) * 0.0
    return _set(c, "state", c["state"].at[i].set(S.astype(c["state"].dtype)))


def _flush_state(upd: dict, ctx: Ctx, make_state) -> None:
    """The new checkpoint of flushing rows (``upd["flush_state"]``, written by
    :func:`apply_updates` for those rows only).  Not traced at all in steps compiled for no
    flush (``ctx.write_flush`` False)."""
    if ctx.write_flush:
        upd["flush_state"] = make_state()


def _causal(T: int):
    return jnp.tril(jnp.ones((T, T), bool))


# ------------------------------------------------------------------------------ Mamba-2
def mamba(p, sp, h, ctx: Ctx, c: dict, i):
    """Mamba-2 mixer: ``[z | xBC | dt] = in_proj(h)``, conv, ``Δ = clamp(softplus(dt + b))``,
    SSM (+ ``D·x``), gated RMSNorm with ``z``, ``out_proj``."""
    Bt, T, _ = h.shape
    dtype = h.dtype
    cdt = compute_dtype(dtype)
    H, d, n, G = sp.H, sp.d, sp.n, sp.G
    inter = H * d
    zxbcdt = linear(h, p["in_proj_w"], _get(p, "in_proj_b"))
    z, xbc, dtr = zxbcdt[..., :inter], zxbcdt[..., inter:inter + sp.conv_dim], zxbcdt[..., inter + sp.conv_dim:]
    upd: dict = {}
    xbc, pend = _conv(p, sp, xbc, ctx, c, i, upd)
    x = xbc[..., :inter].reshape(Bt, T, H, d)
    B = xbc[..., inter:inter + G * n].reshape(Bt, T, G, n)
    C = xbc[..., inter + G * n:].reshape(Bt, T, G, n)
    dt = ops.softplus(dtr.astype(cdt) + p["dt_bias"].astype(cdt))
    if sp.dt_min > 0.0 or sp.dt_max != math.inf:
        dt = jnp.clip(dt, sp.dt_min, sp.dt_max)
    A = -jnp.exp(p["A_log"].astype(cdt))
    y, c, pend2 = _mamba_ssm(sp, x, dt, A, B, C, ctx, c, i, cdt, upd)
    y = (y + p["D"].astype(cdt)[:, None] * x.astype(cdt)).astype(x.dtype)
    y = ops.gated_rms_norm(y.reshape(Bt, T, inter).astype(dtype), z, p["norm_w"], sp.eps, sp.group_size, True)
    return linear(y, p["out_proj_w"], _get(p, "out_proj_b")), c, {**pend, **pend2}, upd


def _mamba_ssm(sp, x, dt, A, B, C, ctx: Ctx, c, i, cdt, upd: dict):
    Bt, T, H, d = x.shape
    xc, Bc, Cc = x.astype(cdt), B.astype(cdt), C.astype(cdt)
    if ctx.kind == "full":
        return ops.m2_chunked(xc, dt, A, Bc, Cc, jnp.zeros((Bt, H, d, sp.n), cdt), sp.chunk)[0], c, {}
    if ctx.kind == "prefill":
        dt = jnp.where(ctx.valid[..., None], dt, jnp.zeros((), cdt))   # padding leaves S unchanged
        y, S = ops.m2_chunked(xc, dt, A, Bc, Cc, jnp.zeros((Bt, H, d, sp.n), cdt), sp.chunk)
        upd["state"] = S
        return y, c, {}
    S0 = c["state"][i].astype(cdt)
    if ctx.mode == "recurrent":
        ys, snaps, S = [], [], S0
        for t in range(T):
            y, S = ops.m2_step(S, xc[:, t], dt[:, t], A, Bc[:, t], Cc[:, t])
            ys.append(y)
            snaps.append(S)
        y = jnp.stack(ys, 1)
        if ctx.kind == "decode":
            return y, _rewrite_state(c, i, S, y), {}
        return y, c, {"snap": jnp.stack(snaps, 1)}
    (hx, hB, hdt), valid = _history(c, ("rx", "rB", "rdt"), i, ctx, cdt)
    hl = A * hdt
    nl = A * dt
    xs, Bs = jnp.concatenate([hx, xc], 1), jnp.concatenate([hB, Bc], 1)
    dts, logs = jnp.concatenate([hdt, dt], 1), jnp.concatenate([hl, nl], 1)
    P = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (Bt, T, ctx.L)),
                         jnp.broadcast_to(_causal(T), (Bt, T, T))], 2)          # [Bt, T, L+T]
    y = ops.m2_attend(S0, xs, Bs, dts, logs, Cc, P)
    if ctx.kind == "decode":   # flush rows store S_{h+1} (the new entry included)
        make = lambda: ops.m2_build_state(S0, xs, Bs, dts, logs, P[:, 0])
    else:                      # flush rows store S_h (committed entries only)
        make = lambda: ops.m2_build_state(S0, hx, hB, hdt, hl, valid)
    _flush_state(upd, ctx, make)
    upd.update(rx=x, rB=B, rdt=dt)
    return y, c, {}


# ------------------------------------------------------------------------------ Gated DeltaNet
def gdn(p, sp, h, ctx: Ctx, c: dict, i):
    """Gated DeltaNet mixer (Qwen3-Next): ``[q|k|v|z]``, ``[b|a]`` projections, conv on
    ``q|k|v``, ``g = -exp(A_log) softplus(a + dt_bias)``, ``β = sigmoid(b)``, delta rule,
    ``out_proj(rms(y) · w · silu(z))``."""
    Bt, T, _ = h.shape
    dtype = h.dtype
    cdt = compute_dtype(dtype)
    H, HV, K, V = sp.H, sp.HV, sp.K, sp.V
    kd, vd = H * K, HV * V
    qkvz = linear(h, p["in_proj_qkvz_w"], _get(p, "in_proj_qkvz_b"))
    qkv, z = qkvz[..., :sp.conv_dim], qkvz[..., sp.conv_dim:]
    ba = linear(h, p["in_proj_ba_w"], _get(p, "in_proj_ba_b"))
    b, a = ba[..., :HV], ba[..., HV:]
    upd: dict = {}
    qkv, pend = _conv(p, sp, qkv, ctx, c, i, upd)
    q = qkv[..., :kd].reshape(Bt, T, H, K)
    k = qkv[..., kd:2 * kd].reshape(Bt, T, H, K)
    v = qkv[..., 2 * kd:].reshape(Bt, T, HV, V)
    g = -jnp.exp(p["A_log"].astype(cdt)) * ops.softplus(a.astype(cdt) + p["dt_bias"].astype(cdt))
    beta = jax.nn.sigmoid(b)
    y, c, pend2 = _gdn_ssm(sp, q, k, v, g, beta, ctx, c, i, cdt, upd)
    y = ops.gated_rms_norm(y.astype(dtype), z.reshape(Bt, T, HV, V), p["norm_w"], sp.eps, V, False)
    return linear(y.reshape(Bt, T, vd), p["out_proj_w"], _get(p, "out_proj_b")), c, {**pend, **pend2}, upd


def _gdn_ssm(sp, q, k, v, g, beta, ctx: Ctx, c, i, cdt, upd: dict):
    Bt, T = q.shape[:2]
    HV, K, V = sp.HV, sp.K, sp.V
    qn, kn = ops.gdn_prep_qk(q, k, cdt)
    vc, gc, bc = v.astype(cdt), g.astype(cdt), beta.astype(cdt)
    out_dtype = v.dtype
    if ctx.kind in ("full", "prefill"):
        if ctx.kind == "prefill":   # padding: g = β = 0 leaves the state unchanged
            m = ctx.valid[..., None]
            gc, bc = jnp.where(m, gc, jnp.zeros((), cdt)), jnp.where(m, bc, jnp.zeros((), cdt))
        y, S = ops.gdn_chunked(qn, kn, vc, gc, bc, jnp.zeros((Bt, HV, K, V), cdt), sp.chunk)
        if ctx.kind == "prefill":
            upd["state"] = S
        return y.astype(out_dtype), c, {}
    S0 = c["state"][i].astype(cdt)
    if ctx.mode == "recurrent":
        ys, snaps, S = [], [], S0
        for t in range(T):
            y, S = ops.gdn_step(S, qn[:, t], kn[:, t], vc[:, t], gc[:, t], bc[:, t])
            ys.append(y)
            snaps.append(S)
        y = jnp.stack(ys, 1).astype(out_dtype)
        if ctx.kind == "decode":
            return y, _rewrite_state(c, i, S, y), {}
        return y, c, {"snap": jnp.stack(snaps, 1)}
    (hu, hk, hg), valid = _history(c, ("ru", "rk", "rg"), i, ctx, cdt)
    w, tot = ops.gdn_hist_weights(hg, valid)
    r = ops.gdn_readout(S0, hu, hk, w, tot, jnp.concatenate([kn, qn], 1))   # S_h k_s, S_h q_s
    G = jnp.cumsum(gc, 1)
    U, y = ops.gdn_block(r[:, :T], r[:, T:], qn, kn, vc, G, bc, _causal(T))
    ring_dt = c["ru"].dtype
    if ctx.kind == "decode":   # flush rows store S_{h+1} = e^g S_h + k ⊗ u (u as the ring keeps it)
        def make():
            Sh = ops.gdn_build_state(S0, hu, hk, w, tot)
            u_s = U[:, 0].astype(ring_dt).astype(cdt)
            k_s = jnp.repeat(kn[:, 0].astype(c["rk"].dtype).astype(cdt), HV // sp.H, axis=1)
            return jnp.exp(gc[:, 0])[..., None, None] * Sh + k_s[..., :, None] * u_s[..., None, :]
    else:
        make = lambda: ops.gdn_build_state(S0, hu, hk, w, tot)
    _flush_state(upd, ctx, make)
    upd.update(ru=U, rk=kn, rg=gc)
    return y.astype(out_dtype), c, {}


def commit_snapshots(state, snap, accepted):
    """Snapshot-baseline commit: ``state = snap[a - 1]`` on rows with ``a > 0``
    (``state [Ly, Bt, ...]``, ``snap [Ly, Bt, T, ...]``)."""
    T = snap.shape[2]
    idx = jnp.clip(accepted - 1, 0, T - 1)
    pick = jnp.take_along_axis(snap, idx.reshape((1, -1, 1) + (1,) * (snap.ndim - 3)), axis=2)[:, :, 0]
    keep = (accepted > 0).reshape((1, -1) + (1,) * (state.ndim - 2))
    return jnp.where(keep, pick.astype(state.dtype), state)


# ------------------------------------------------------------------------------ attention
def _rope(x, positions, inv_freq, rdim: int):
    """Rotate-half RoPE on the first ``rdim`` channels; angles in >= fp32."""
    cdt = compute_dtype(x.dtype)
    inv = jnp.asarray(inv_freq, dtype=jnp.float32).astype(cdt)
    f = positions.astype(cdt)[..., None] * inv
    emb = jnp.concatenate([f, f], -1)
    cos, sin = jnp.cos(emb).astype(x.dtype)[:, :, None], jnp.sin(emb).astype(x.dtype)[:, :, None]
    xr, xp = x[..., :rdim], x[..., rdim:]
    x1, x2 = xr[..., :rdim // 2], xr[..., rdim // 2:]
    rot = jnp.concatenate([-x2, x1], -1)
    return jnp.concatenate([xr * cos + rot * sin, xp], -1)


def _attend(q, keys, mask, Hkv: int):
    """``softmax(q kᵀ / sqrt(D) + mask) v`` with GQA over key blocks ``keys = [(K, V), ...]``
    (each ``[Bt, S_i, Hkv, D]``) and ``mask [Bt, T, Σ S_i]``; one softmax over all blocks.
    Keys no query reads are zeroed (they may hold anything); a row with no key reads 0."""
    Bt, T, H, D = q.shape
    cdt = compute_dtype(q.dtype)
    qg = q.reshape(Bt, T, Hkv, H // Hkv, D).astype(cdt)
    s = jnp.concatenate([ein("btgrd,bsgd->bgrts", qg, K.astype(cdt)) for K, _ in keys], -1) * (D ** -0.5)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    pr = jnp.nan_to_num(jax.nn.softmax(s, axis=-1), nan=0.0)
    o, off = 0.0, 0
    for K, V in keys:
        S = K.shape[1]
        read = jnp.any(mask[:, :, off:off + S], 1)[:, :, None, None]
        o = o + ein("bgrts,bsgd->btgrd", pr[..., off:off + S], jnp.where(read, V, jnp.zeros((), V.dtype)).astype(cdt))
        off += S
    return o.reshape(Bt, T, H * D).astype(q.dtype)


def attention(p, sp, x, ctx: Ctx, c: dict, i):
    """Grouped-query attention with optional q/k RMSNorm, partial RoPE and output gate; the
    cache keeps ``k, v [Ly, Bt, S, Hkv, Dh]``, a row's tokens at ``0 .. seq_len-1``.  A step
    reads the committed keys from the cache and its own ``T`` keys from registers (the new
    entries are written after the layer scan, :func:`apply_updates`)."""
    Bt, T, _ = x.shape
    H, Hkv, Dh = sp.H, sp.Hkv, sp.Dh
    q = linear(x, p["q_proj_w"], _get(p, "q_proj_b"))
    gate = None
    if sp.output_gate:
        q = q.reshape(Bt, T, H, 2 * Dh)
        q, gate = q[..., :Dh], q[..., Dh:].reshape(Bt, T, H * Dh)
    q = q.reshape(Bt, T, H, Dh)
    k = linear(x, p["k_proj_w"], _get(p, "k_proj_b")).reshape(Bt, T, Hkv, Dh)
    v = linear(x, p["v_proj_w"], _get(p, "v_proj_b")).reshape(Bt, T, Hkv, Dh)
    if sp.qk_eps is not None:
        q = ops.rms_norm(q, p["q_norm"], sp.qk_eps, True)
        k = ops.rms_norm(k, p["k_norm"], sp.qk_eps, True)
    if sp.rotary_dim:
        q = _rope(q, ctx.positions, sp.inv_freq, sp.rotary_dim)
        k = _rope(k, ctx.positions, sp.inv_freq, sp.rotary_dim)
    t = jnp.arange(T)
    causal = jnp.broadcast_to(t[None, :] <= t[:, None], (Bt, T, T))
    upd: dict = {}
    if ctx.kind in ("full", "prefill"):
        if ctx.kind == "prefill":   # fresh rows: padded keys are never read
            causal = causal & (t[None, None, :] < ctx.lengths[:, None, None])
            upd = {"k": k, "v": v}
        o = _attend(q, [(k, v)], causal, Hkv)
    else:
        S = c["k"].shape[2]
        committed = jnp.broadcast_to(jnp.arange(S)[None, None, :] < ctx.seq_len[:, None, None], (Bt, T, S))
        o = _attend(q, [(c["k"][i], c["v"][i]), (k, v)], jnp.concatenate([committed, causal], 2), Hkv)
        upd = {"k": k, "v": v}
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    return linear(o, p["o_proj_w"], _get(p, "o_proj_b")), c, {}, upd


# ------------------------------------------------------------------------------ feed-forward
def mlp(p, sp, x, ctx, c, i):
    h = ops.activation(sp.act, linear(x, p["up_w"], _get(p, "up_b")))
    return linear(h, p["down_w"], _get(p, "down_b")), c, {}, {}


def gmlp(p, sp, x, ctx, c, i):
    g = ops.activation(sp.act, linear(x, p["gate_w"], _get(p, "gate_b")))
    return linear(g * linear(x, p["up_w"], _get(p, "up_b")), p["down_w"], _get(p, "down_b")), c, {}, {}


def _dispatch(x, idx, w, E: int, gathered, dense):
    """``Σ_k w[t,k] · expert(idx[t,k], x[t])`` accumulated in ``w``'s dtype: gather the chosen
    experts' weights when there are few token-expert pairs (decode), else every expert on every
    token weighted by its routing weight (static shapes either way)."""
    if idx.size <= E:
        return (gathered(x, idx).astype(w.dtype) * w[..., None]).sum(1)
    we = jnp.sum(jnp.where(idx[:, :, None] == jnp.arange(E)[None, None, :], w[..., None], 0), 1)  # [N, E]
    return jnp.einsum("ned,ne->nd", dense(x).astype(w.dtype), we)


def moe_sig(p, sp, x, ctx, c, i):
    """Nemotron-H MoE: sigmoid scores, grouped top-k on score + correction bias, weights
    renormalised (``+1e-20``) and scaled, non-gated experts, plus the shared MLP."""
    shp = x.shape
    xf = x.reshape(-1, shp[-1])
    cdt = compute_dtype(x.dtype)
    E, G = sp.E, sp.n_group
    s = jax.nn.sigmoid(linear(xf.astype(cdt), p["gate_w"].astype(cdt)))
    choice = s + p["e_bias"].astype(cdt)
    N = s.shape[0]
    grp = lax.top_k(choice.reshape(N, G, E // G), min(2, E // G))[0].sum(-1)
    gidx = lax.top_k(grp, sp.topk_group)[1]
    gmask = jnp.any(gidx[:, :, None] == jnp.arange(G)[None, None, :], 1)
    emask = jnp.repeat(gmask, E // G, axis=1)
    idx = lax.top_k(jnp.where(emask, choice, -jnp.inf), sp.k)[1]
    w = jnp.take_along_axis(s, idx, 1)
    if sp.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * sp.scaling
    hx = linear(xf, p["fc1_w"], _get(p, "fc1_b")) if sp.latent else xf
    up, down = p["up"], p["down"]

    def gathered(h, ix):
        a = ops.activation(sp.act, ein("nkid,nd->nki", up[ix], h))
        return ein("nkdi,nki->nkd", down[ix], a)

    def dense(h):
        a = ops.activation(sp.act, ein("nd,eid->nei", h, up))
        return ein("nei,edi->ned", a, down)

    out = _dispatch(hx, idx, w, E, gathered, dense).astype(x.dtype)
    if sp.latent:
        out = linear(out, p["fc2_w"], _get(p, "fc2_b"))
    shared = linear(ops.activation(sp.act, linear(xf, p["sh_up_w"], _get(p, "sh_up_b"))),
                    p["sh_down_w"], _get(p, "sh_down_b"))
    return (out + shared).reshape(shp), c, {}, {}


def moe_soft(p, sp, x, ctx, c, i):
    """Qwen3-Next MoE: softmax router, top-k (optionally renormalised), SwiGLU experts, plus a
    shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""
    shp = x.shape
    xf = x.reshape(-1, shp[-1])
    cdt = compute_dtype(x.dtype)
    probs = jax.nn.softmax(linear(xf, p["gate_w"]).astype(cdt), axis=-1)
    w, idx = lax.top_k(probs, sp.k)
    if sp.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    w = w.astype(x.dtype)
    gu, down = p["gate_up"], p["down"]
    I = down.shape[2]

    def gathered(h, ix):
        t = ein("nkod,nd->nko", gu[ix], h)
        return ein("nkdi,nki->nkd", down[ix], ops.activation(sp.act, t[..., :I]) * t[..., I:])

    def dense(h):
        t = ein("nd,eod->neo", h, gu)
        return ein("nei,edi->ned", ops.activation(sp.act, t[..., :I]) * t[..., I:], down)

    out = _dispatch(xf, idx, w, sp.E, gathered, dense).astype(x.dtype)
    if sp.shared:
        sh = linear(ops.activation(sp.act, linear(xf, p["sh_gate_w"])) * linear(xf, p["sh_up_w"]), p["sh_down_w"])
        out = out + jax.nn.sigmoid(linear(xf, p["sh_sig_w"])) * sh
    return out.reshape(shp), c, {}, {}


MIXERS = {"mamba": mamba, "gdn": gdn, "attn": attention, "mlp": mlp, "gmlp": gmlp,
          "moe_sig": moe_sig, "moe_soft": moe_soft}
