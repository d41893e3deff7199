"""Mixers of the JAX backend: Mamba-2, Gated DeltaNet, attention, MLPs and MoEs.

Every mixer has one signature, ``mixer(p, sp, x, ctx, c, i) -> (out, c, pending, updates)``:
``p`` its parameters, ``sp`` its :class:`~replayssm.jax.params.MixerSpec`, ``x [Bt, T, D]``
the normalised input, ``ctx`` the step's :class:`Ctx`, ``c`` the cache of its *stage*
(arrays with a leading layer axis) and ``i`` its layer index there.  A mixer reads its own
slices (``c[name][i]``) and returns what the step changes as ``updates`` (new ring entries,
K/V entries, conv window, flushed checkpoints), which the model writes after the stage's layer
scan (:func:`apply_updates`): read-then-write of one array inside the scan body would make
XLA copy the whole stacked cache every layer.  The state is the exception: the recurrent
form's, and the replay form's checkpoint on a flush step, is read and rewritten slice by slice,
in place.  ``pending`` holds what a verify step keeps until
the commit (pre-conv inputs, the snapshot baseline's states).

Step kinds (``ctx.kind``) and cache forms (``ctx.mode``) are those of the PyTorch forms, and
so are their decisions: one table, :mod:`replayssm.forms.table` (``KINDS``: what a kind does
to the conv window and the KV entries, whether its rows are padded, its entries tentative;
``STEPS``: per form and kind, the op entry that runs and what it does to the state and the
ring).  Each SSM family maps the op entries it implements to one function here, and its
per-``(form, kind)`` dispatch dict (:data:`M2_STEPS`, :data:`GDN_STEPS`) is built from the
table with each row's decisions bound; the functions read those decisions, never the kind's
name.  Of the table this backend runs the kinds ``full`` / ``prefill`` / ``decode`` /
``verify`` of the ``recurrent``, ``replay`` and ``kv`` forms (:data:`FORMS`); its prefill takes
fresh rows only (every row's cache is overwritten), so a prefill reads no state, ring or KV.
The KV-only form's ``kv_verify`` is the replay step with ``S0 = 0`` over an entry buffer of
``max_seq_len`` (a ring that never wraps or flushes); its prefill writes the prompt's entries.

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

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from ..forms.table import KINDS, STEPS, Kind, Step
from . import ops
from .ops import compute_dtype, ein, linear

__all__ = ["Ctx", "MIXERS", "FORMS", "KINDS_RUN", "M2_STEPS", "GDN_STEPS"]

#: the step kinds this backend runs (``tree`` is PyTorch-engine only)
KINDS_RUN = ("full", "prefill", "decode", "verify")


@dataclass
class Ctx:
    """What every layer of one model call reads (static ``kind``/``mode``/``T``, arrays else)."""

    kind: str                      # a step kind of :data:`KINDS_RUN`
    mode: str                      # a form of :data:`FORMS` ("full": any)
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
    unrolled: bool = False         # static: layers unrolled (per-layer weights): windows via updates
    auto_threshold: int = 0        # static: a KV-only prefill of ``auto`` rows also stores the final
    #                                state of rows with ``lengths >= auto_threshold`` (0 elsewhere)


def _get(p: dict, name: str):
    return p.get(name)


def _set(c: dict, name: str, value) -> dict:
    return {**c, name: value}


def _rows(Bt: int):
    return jnp.arange(Bt)[:, None]


def _fresh(kd: Kind) -> bool:
    """A step of this kind reads no past: no cache (``full``) or a prefill (padded rows; this
    backend's prefill takes fresh rows only)."""
    return not kd.cached or kd.padded


def _build_steps(impls: dict[str, Callable]) -> dict[tuple[str, str], Callable]:
    """``(form, kind) -> function`` for every row of the forms' table whose op entry ``impls``
    implements, the row's :class:`~replayssm.forms.table.Step` bound as the first argument."""
    return {key: functools.partial(impls[s.op], s) for key, s in STEPS.items() if s.op in impls}


def _form_step(steps: dict, ctx: "Ctx", family: str) -> Callable:
    try:
        return steps[(ctx.mode, ctx.kind)]
    except KeyError:
        raise ValueError(f"the JAX backend has no {family} step ({ctx.mode!r}, {ctx.kind!r}): "
                         f"it runs the forms {FORMS} and the kinds {KINDS_RUN}") from None


# ------------------------------------------------------------------------------ conv
def _conv(p, sp, part: str, xc, ctx: Ctx, c: dict, i, upd: dict):
    """Causal conv + silu of one channel block ``part`` of the pre-conv inputs
    ``xc [Bt, T, C_part]`` (weights ``conv_<part>_w``, window ``win_<part>``) for this step
    kind (its conv op entry in :data:`~replayssm.forms.table.KINDS`); returns
    ``(out, pending, c)``.  The new window of a kind that keeps it goes to
    ``upd["win_<part>"]`` (prefill: whole rows) or is written in place into layer ``i``'s
    slice of ``c`` (decode: no stacked copy of every window each step); a tentative kind's
    inputs go to the pending ``conv_<part>`` (for :func:`commit_conv`).  The conv is depthwise, so
    blocks (Mamba-2 ``x`` / ``bc``, GDN ``q`` / ``k`` / ``v``) are independent: each can be
    sharded on its own head axis."""
    kd = KINDS[ctx.kind]
    w, b = p[f"conv_{part}_w"], _get(p, f"conv_{part}_b")
    cdt = jnp.promote_types(compute_dtype(xc.dtype), w.dtype)
    return _CONV[kd.conv](kd, w, b, sp.W - 1, cdt, xc, ctx, c, i, upd, part)


def window_of(pending_name: str) -> str:
    """The conv window a pending ``conv_<part>`` entry commits into (``win_<part>``)."""
    return "win_" + pending_name[len("conv_"):]


def _conv_fresh(kd: Kind, w, b, Wm1: int, cdt, xc, ctx: Ctx, c: dict, i, upd: dict, part: str):
    """From a zero window (no cache, or fresh prefill rows); a padded kind keeps each row's
    last ``W-1`` valid inputs as its window."""
    Bt = xc.shape[0]
    xp = jnp.concatenate([jnp.zeros((Bt, Wm1, xc.shape[2]), cdt), xc.astype(cdt)], 1)
    out = ops.conv_over(xp, w, b, True).astype(xc.dtype)
    if kd.keeps_window:
        upd["win_" + part] = ops.last_window(xp, ctx.lengths, Wm1).astype(c["win_" + part].dtype)
    return out, {}, c


def _conv_window(kd: Kind, w, b, Wm1: int, cdt, xc, ctx: Ctx, c: dict, i, upd: dict, part: str):
    """After the row's cached window: the new window (a kind that keeps it), or the inputs
    pending until the commit (a tentative kind)."""
    win = c["win_" + part][i]
    xp = jnp.concatenate([win.astype(cdt), xc.astype(cdt)], 1)
    out = ops.conv_over(xp, w, b, True).astype(xc.dtype)
    if kd.keeps_window and ctx.unrolled:   # unrolled layers: written with the stage's updates
        upd["win_" + part] = xp[:, xp.shape[1] - Wm1:].astype(win.dtype)
        return out, {}, c
    if kd.keeps_window:   # in place, in layer i's slice, ordered after the conv's read (+ 0·Σout)
        new = xp[:, xp.shape[1] - Wm1:] + jnp.sum(out).astype(cdt) * 0.0
        return out, {}, _set(c, "win_" + part, _put_layer(c["win_" + part], i, new))
    return out, {"conv_" + part: xc.astype(win.dtype)}, c


#: conv op entries (``KINDS[kind].conv``) -> this backend's function
_CONV = {"conv_prefill": _conv_fresh, "conv_prefill_varlen": _conv_fresh,
         "conv_decode": _conv_window, "conv_verify": _conv_window}


def commit_conv(win, conv_x, accepted):
    """Stage-wide conv commit: each window becomes the last ``W-1`` of
    ``[window; x_new[:accepted]]`` (``win [Ly, Bt, W-1, C]`` or a list of per-layer
    ``[Bt, W-1, C]``, ``conv_x [Ly, Bt, T, C]``)."""
    if isinstance(win, list):
        return [commit_conv(w[None], conv_x[l][None], accepted)[0] for l, w in enumerate(win)]
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
    windows, and the flushing rows' checkpoints of a single-layer stage (a scatter whose other
    rows' indices are out of range, hence dropped; a stage of several layers writes them in
    place in the layer, :func:`_flush_state`).  Unrolled layers (``ctx.unrolled``) send their
    new conv windows here too (stacked; written whole: one copy of the windows per step,
    XLA fusing the new window's read of the old one into any in-place write)."""
    if not upd:
        return c
    c = dict(c)
    any_v = next(iter(upd.values()))
    Bt, T = any_v.shape[1], ctx.T
    rows = _rows(Bt)
    for name, v in upd.items():
        if isinstance(c.get(name), list):   # per-layer arrays (model.split_cache): each layer's buffer
            c[name] = [_write_layer(name, a, v[l], ctx, rows, T) for l, a in enumerate(c[name])]
            continue
        if name == "state" or name.startswith("win_"):     # every row's value is new
            c[name] = v.astype(c[name].dtype)
        elif name == "flush_state":                        # single-layer stage: flushing rows only
            drop = jnp.where(ctx.flush, jnp.arange(Bt), Bt)
            c["state"] = c["state"].at[:, drop].set(v.astype(c["state"].dtype), mode="drop")
        elif name in ("k", "v"):
            if _fresh(KINDS[ctx.kind]):                    # fresh rows: tokens 0 .. T-1
                c[name] = c[name].at[:, :, :T].set(v.astype(c[name].dtype))
            else:
                pos = jnp.minimum(ctx.seq_len[:, None] + jnp.arange(T)[None, :], c[name].shape[2] - 1)
                c[name] = c[name].at[:, rows, pos].set(v.astype(c[name].dtype), mode="promise_in_bounds")
        else:                                              # ring entries
            pos = (ctx.start[:, None] + ctx.hist[:, None] + jnp.arange(T)[None, :]) % ctx.L
            c[name] = c[name].at[:, rows, pos].set(v.astype(c[name].dtype), mode="promise_in_bounds")
    return c


def _write_layer(name: str, a, v, ctx: Ctx, rows, T: int):
    """One layer's array ``a [Bt, ...]`` after the step's update ``v`` (:func:`apply_updates`)."""
    if name == "state" or name.startswith("win_"):
        return v.astype(a.dtype)
    if name in ("k", "v"):
        if _fresh(KINDS[ctx.kind]):
            return a.at[:, :T].set(v.astype(a.dtype))
        pos = jnp.minimum(ctx.seq_len[:, None] + jnp.arange(T)[None, :], a.shape[1] - 1)
        return a.at[rows, pos].set(v.astype(a.dtype), mode="promise_in_bounds")
    pos = (ctx.start[:, None] + ctx.hist[:, None] + jnp.arange(T)[None, :]) % ctx.L
    return a.at[rows, pos].set(v.astype(a.dtype), mode="promise_in_bounds")


def _put_layer(stack, i, value):
    """``stack[i] = value`` in place as a plain dynamic-update-slice: ``i`` is a layer index,
    always in range (``.at[i].set`` keeps the drop-out-of-range rule, which XLA implements by
    reading the old slice for a select: one more pass over the state every step)."""
    if isinstance(stack, list):   # per-layer arrays (model.split_cache): the layer's own buffer
        return stack[:i] + [value.astype(stack[i].dtype)] + stack[i + 1:]
    return lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), i, 0)


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
    # a layer's own buffer (per-layer caches) needs the order only when y reads the old state
    if not isinstance(c["state"], list) or ops.step_readout() == "reduce":
        S = S + jnp.sum(y).astype(S.dtype) * 0.0
    return _set(c, "state", _put_layer(c["state"], i, S))


def _flush_state(c: dict, i, ctx: Ctx, st: Step, S0, y, with_new, committed, upd: dict) -> dict:
    """Write the new checkpoint of flushing rows: ``with_new()`` (``S_{h+1}``, the step's entry
    included) or ``committed()`` (``S_h``), as the table's flush of ``st`` says; other rows
    keep ``S0``.  In a stage of several layers it is written in place into layer ``i``'s slice
    (as the recurrent form's state), so a flush step moves each state once: no stacked
    per-layer copy of the new states and no batch-axis scatter (which XLA lowers with a
    transposed copy of the whole stack).  A single-layer stage (hybrids) scatters the flushing
    rows after the layer (``upd["flush_state"]``, :func:`apply_updates`): rewriting or
    selecting its whole array made XLA copy it.  Not traced at all in steps compiled for no flush
    (``ctx.write_flush`` False)."""
    if not (st.state.flush and ctx.write_flush):
        return c
    S = (with_new if st.state.with_new else committed)()
    if not isinstance(c["state"], list) and c["state"].shape[0] == 1:
        upd["flush_state"] = S
        return c
    keep = ctx.flush.reshape((-1,) + (1,) * (S.ndim - 1))
    return _rewrite_state(c, i, jnp.where(keep, S, S0), y)


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
    z = linear(h, p["in_z_w"], _get(p, "in_z_b"))
    dtr = linear(h, p["in_dt_w"], _get(p, "in_dt_b"))
    upd: dict = {}
    x, pend, c = _conv(p, sp, "x", linear(h, p["in_x_w"], _get(p, "in_x_b")), ctx, c, i, upd)
    bc, pend_bc, c = _conv(p, sp, "bc", linear(h, p["in_bc_w"], _get(p, "in_bc_b")), ctx, c, i, upd)
    pend = {**pend, **pend_bc}
    x = x.reshape(Bt, T, H, d)
    B = bc[..., :G * n].reshape(Bt, T, G, n)
    C = bc[..., G * n:].reshape(Bt, T, G, n)
    dt = ops.softplus(dtr.astype(cdt) + p["dt_bias"].astype(cdt))
    if sp.dt_min > 0.0 or sp.dt_max != math.inf:
        dt = jnp.clip(dt, sp.dt_min, sp.dt_max)
    A = -jnp.exp(p["A_log"].astype(cdt))
    y, c, pend2 = _mamba_ssm(sp, x, dt, A, B, C, ctx, c, i, cdt, upd)
    y = (y + p["D"].astype(cdt)[:, None] * x.astype(cdt)).astype(x.dtype)
    y = y.reshape(Bt, T, inter).astype(dtype)
    if dict(sp.opts).get("fold_norm") and sp.group_size == inter:
        # one norm group (sharded heads): out = r · W_out (w ⊙ g) + b with r = rms(g)⁻¹ a
        # per-token scalar, so the norm's sum of squares and out_proj's partial products
        # are reduced over devices together (one all-reduce per layer, not two)
        g = y.astype(cdt) * ops.silu(z.astype(cdt))
        r = lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + sp.eps)
        out = linear(p["norm_w"] * g.astype(dtype), p["out_proj_w"]).astype(cdt) * r
        b = _get(p, "out_proj_b")
        return (out if b is None else out + b).astype(dtype), c, {**pend, **pend2}, upd
    y = ops.gated_rms_norm(y, z, p["norm_w"], sp.eps, sp.group_size, True)
    return linear(y, p["out_proj_w"], _get(p, "out_proj_b")), c, {**pend, **pend2}, upd


def _mamba_ssm(sp, x, dt, A, B, C, ctx: Ctx, c, i, cdt, upd: dict):
    """The Mamba-2 recurrence of this step: :data:`M2_STEPS` of ``(ctx.mode, ctx.kind)``."""
    return _form_step(M2_STEPS, ctx, "Mamba-2")(sp, x, dt, A, B, C, ctx, c, i, cdt, upd)


def _m2_chunked(st: Step, sp, x, dt, A, B, C, ctx: Ctx, c, i, cdt, upd: dict):
    """``chunked_prefill`` / ``_varlen``: chunked SSD from a zero state (no cache or fresh
    rows); the final state is stored when the step writes the state."""
    Bt, T, H, d = x.shape
    xc, Bc, Cc = x.astype(cdt), B.astype(cdt), C.astype(cdt)
    if st.info.padded:
        dt = jnp.where(ctx.valid[..., None], dt, jnp.zeros((), cdt))   # padding leaves S unchanged
    y, S = ops.m2_chunked(xc, dt, A, Bc, Cc, jnp.zeros((Bt, H, d, sp.n), cdt), sp.chunk)
    if st.state.write:
        upd["state"] = S
    return y, c, {}


def _m2_serial(st: Step, sp, x, dt, A, B, C, ctx: Ctx, c, i, cdt, upd: dict):
    """``recurrent_update`` / ``snapshot_verify``: the recurrence token by token from the
    state; the last state rewrites it (a step that writes the state) or every state is kept
    for the commit (``pending``)."""
    Bt, T, H, d = x.shape
    xc, Bc, Cc = x.astype(cdt), B.astype(cdt), C.astype(cdt)
    S0 = c["state"][i].astype(cdt)
    ys, snaps, S = [], [], S0
    for t in range(T):
        y, S = ops.m2_step(S, xc[:, t], dt[:, t], A, Bc[:, t], Cc[:, t])
        ys.append(y)
        snaps.append(S)
    y = jnp.stack(ys, 1)
    if st.state.write:
        return y, _rewrite_state(c, i, S, y), {}
    return y, c, {st.pending: jnp.stack(snaps, 1)}


def _m2_replay(st: Step, sp, x, dt, A, B, C, ctx: Ctx, c, i, cdt, upd: dict):
    """``replay_decode`` / ``replay_verify``: every token reads S0 and the committed ring under
    a causal mask; flushing rows write the checkpoint, the new inputs go to the ring."""
    Bt, T, H, d = x.shape
    xc, Bc, Cc = x.astype(cdt), B.astype(cdt), C.astype(cdt)
    S0 = c["state"][i].astype(cdt) if st.state.read else jnp.zeros((Bt, H, d, sp.n), cdt)
    (hx, hB, hdt), valid = _history(c, ("rx", "rB", "rdt"), i, ctx, cdt)
    hl = A * hdt
    nl = A * dt
    xs, Bs = jnp.concatenate([hx, xc], 1), jnp.concatenate([hB, Bc], 1)
    dts, logs = jnp.concatenate([hdt, dt], 1), jnp.concatenate([hl, nl], 1)
    P = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (Bt, T, ctx.L)),
                         jnp.broadcast_to(_causal(T), (Bt, T, T))], 2)          # [Bt, T, L+T]
    y = ops.m2_attend(S0, (hx, xc), Bs, dts, logs, Cc, P)
    c = _flush_state(c, i, ctx, st, S0, y, lambda: ops.m2_build_state(S0, xs, Bs, dts, logs, P[:, 0]),
                     lambda: ops.m2_build_state(S0, hx, hB, hdt, hl, valid), upd)
    if st.ring.write or st.pages.write:
        upd.update(rx=x, rB=B, rdt=dt)
    return y, c, {}


def _m2_kv(st: Step, sp, x, dt, A, B, C, ctx: Ctx, c, i, cdt, upd: dict):
    """``kv_verify`` (KV-only form): the replay formula with ``S0 = 0`` over every entry of the
    row (the entry buffer is a ring that never wraps or flushes).  A fresh prefill computes the
    same outputs with the chunked SSD from a zero state and writes the prompt's entries
    ``(x, B, Δ)`` at ``0 .. T-1`` (padding past a row's length is never read)."""
    if not _fresh(st.info):
        return _m2_replay(st, sp, x, dt, A, B, C, ctx, c, i, cdt, upd)
    Bt, T, H, d = x.shape
    dtm = jnp.where(ctx.valid[..., None], dt, jnp.zeros((), cdt))   # padding leaves S unchanged
    y, S = ops.m2_chunked(x.astype(cdt), dtm, A, B.astype(cdt), C.astype(cdt), jnp.zeros((Bt, H, d, sp.n), cdt),
                          sp.chunk)
    upd.update(rx=x, rB=B, rdt=dt)
    _auto_state(ctx, S, upd)
    return y, c, {}


def _auto_state(ctx: Ctx, S, upd: dict) -> None:
    """``auto`` prefill: the final state of the rows that start past the threshold, 0 on the
    rows that start KV-only."""
    if ctx.auto_threshold:
        past = (ctx.lengths >= ctx.auto_threshold).reshape((-1,) + (1,) * (S.ndim - 1))
        upd["state"] = jnp.where(past, S, jnp.zeros((), S.dtype))


#: ``(form, kind) -> Mamba-2 step`` from the forms' table (the op entries implemented here)
M2_STEPS = _build_steps({"chunked_prefill": _m2_chunked, "chunked_prefill_varlen": _m2_chunked,
                         "recurrent_update": _m2_serial, "snapshot_verify": _m2_serial,
                         "replay_decode": _m2_replay, "replay_verify": _m2_replay, "kv_verify": _m2_kv})


# ------------------------------------------------------------------------------ Gated DeltaNet
def gdn(p, sp, h, ctx: Ctx, c: dict, i):
    """Gated DeltaNet mixer (Qwen3-Next): ``[q|k|v|z]``, ``[b|a]`` projections, conv on
    ``q|k|v``, ``g = -exp(A_log) softplus(a + dt_bias)``, ``β = sigmoid(b)``, delta rule,
    ``out_proj(rms(y) · w · silu(z))``."""
    Bt, T, _ = h.shape
    dtype = h.dtype
    cdt = compute_dtype(dtype)
    H, HV, K, V = sp.H, sp.HV, sp.K, sp.V
    vd = HV * V
    z = linear(h, p["in_z_w"], _get(p, "in_z_b"))
    b = linear(h, p["in_b_w"], _get(p, "in_b_b"))
    a = linear(h, p["in_a_w"], _get(p, "in_a_b"))
    upd: dict = {}
    pend: dict = {}
    qkv = []
    for part in ("q", "k", "v"):
        y, pp, c = _conv(p, sp, part, linear(h, p[f"in_{part}_w"], _get(p, f"in_{part}_b")), ctx, c, i, upd)
        qkv.append(y)
        pend.update(pp)
    q = qkv[0].reshape(Bt, T, H, K)
    k = qkv[1].reshape(Bt, T, H, K)
    v = qkv[2].reshape(Bt, T, HV, V)
    g = -jnp.exp(p["A_log"].astype(cdt)) * ops.softplus(a.astype(cdt) + p["dt_bias"].astype(cdt))
    beta = jax.nn.sigmoid(b)
    y, c, pend2 = _gdn_ssm(sp, q, k, v, g, beta, ctx, c, i, cdt, upd)
    y = ops.gated_rms_norm(y.astype(dtype), z.reshape(Bt, T, HV, V), p["norm_w"], sp.eps, V, False)
    return linear(y.reshape(Bt, T, vd), p["out_proj_w"], _get(p, "out_proj_b")), c, {**pend, **pend2}, upd


def _gdn_ssm(sp, q, k, v, g, beta, ctx: Ctx, c, i, cdt, upd: dict):
    """The delta-rule recurrence of this step: :data:`GDN_STEPS` of ``(ctx.mode, ctx.kind)``."""
    return _form_step(GDN_STEPS, ctx, "Gated DeltaNet")(sp, q, k, v, g, beta, ctx, c, i, cdt, upd)


def _gdn_args(q, k, v, g, beta, cdt):
    qn, kn = ops.gdn_prep_qk(q, k, cdt)
    return qn, kn, v.astype(cdt), g.astype(cdt), beta.astype(cdt)


def _gdn_chunked(st: Step, sp, q, k, v, g, beta, ctx: Ctx, c, i, cdt, upd: dict):
    """``chunked_prefill`` / ``_varlen``: the chunked delta rule from a zero state (no cache or
    fresh rows); the final state is stored when the step writes the state."""
    Bt = q.shape[0]
    qn, kn, vc, gc, bc = _gdn_args(q, k, v, g, beta, cdt)
    if st.info.padded:   # padding: g = β = 0 leaves the state unchanged
        m = ctx.valid[..., None]
        gc, bc = jnp.where(m, gc, jnp.zeros((), cdt)), jnp.where(m, bc, jnp.zeros((), cdt))
    y, S = ops.gdn_chunked(qn, kn, vc, gc, bc, jnp.zeros((Bt, sp.HV, sp.K, sp.V), cdt), sp.chunk)
    if st.state.write:
        upd["state"] = S
    return y.astype(v.dtype), c, {}


def _gdn_serial(st: Step, sp, q, k, v, g, beta, ctx: Ctx, c, i, cdt, upd: dict):
    """``recurrent_update`` / ``snapshot_verify``: the delta rule token by token from the state
    (as :func:`_m2_serial`)."""
    T = q.shape[1]
    qn, kn, vc, gc, bc = _gdn_args(q, k, v, g, beta, cdt)
    S0 = c["state"][i].astype(cdt)
    ys, snaps, S = [], [], S0
    for t in range(T):
        y, S = ops.gdn_step(S, qn[:, t], kn[:, t], vc[:, t], gc[:, t], bc[:, t])
        ys.append(y)
        snaps.append(S)
    y = jnp.stack(ys, 1).astype(v.dtype)
    if st.state.write:
        return y, _rewrite_state(c, i, S, y), {}
    return y, c, {st.pending: jnp.stack(snaps, 1)}


def _gdn_replay(st: Step, sp, q, k, v, g, beta, ctx: Ctx, c, i, cdt, upd: dict):
    """``replay_decode`` / ``replay_verify``: readouts of S0 and the committed ring, then the
    block of new tokens under a causal mask; flushing rows write the checkpoint, the new
    (``u``, ``k``, ``g``) go to the ring."""
    T = q.shape[1]
    HV = sp.HV
    qn, kn, vc, gc, bc = _gdn_args(q, k, v, g, beta, cdt)
    S0 = c["state"][i].astype(cdt) if st.state.read else jnp.zeros((q.shape[0], HV, sp.K, sp.V), cdt)
    (hu, hk, hg), valid = _history(c, ("ru", "rk", "rg"), i, ctx, cdt)
    w, tot = ops.gdn_hist_weights(hg, valid)
    r = ops.gdn_readout(S0, hu, hk, w, tot, jnp.concatenate([kn, qn], 1))   # S_h k_s, S_h q_s
    G = jnp.cumsum(gc, 1)
    U, y = ops.gdn_block(r[:, :T], r[:, T:], qn, kn, vc, G, bc, _causal(T))
    ring_dt = c["ru"][0].dtype

    def with_new():   # S_{h+1} = e^g S_h + k ⊗ u (u as the ring keeps it)
        Sh = ops.gdn_build_state(S0, hu, hk, w, tot)
        u_s = U[:, 0].astype(ring_dt).astype(cdt)
        k_s = jnp.repeat(kn[:, 0].astype(c["rk"][0].dtype).astype(cdt), HV // sp.H, axis=1)
        return jnp.exp(gc[:, 0])[..., None, None] * Sh + k_s[..., :, None] * u_s[..., None, :]

    c = _flush_state(c, i, ctx, st, S0, y, with_new, lambda: ops.gdn_build_state(S0, hu, hk, w, tot), upd)
    if st.ring.write or st.pages.write:
        upd.update(ru=U, rk=kn, rg=gc)
    return y.astype(v.dtype), c, {}


def _gdn_kv(st: Step, sp, q, k, v, g, beta, ctx: Ctx, c, i, cdt, upd: dict):
    """``kv_verify`` (KV-only form): the replay formula with ``S0 = 0`` over every entry of the
    row.  A fresh prefill runs the chunked delta rule from a zero state, which also yields each
    token's correction ``U_s`` (the ring's ``u``): the entries ``(U, k, g)`` go to ``0 .. T-1``."""
    if not _fresh(st.info):
        return _gdn_replay(st, sp, q, k, v, g, beta, ctx, c, i, cdt, upd)
    qn, kn, vc, gc, bc = _gdn_args(q, k, v, g, beta, cdt)
    m = ctx.valid[..., None]   # padding: g = β = 0 (U = 0 there; never read)
    gc, bc = jnp.where(m, gc, jnp.zeros((), cdt)), jnp.where(m, bc, jnp.zeros((), cdt))
    y, S, U = ops.gdn_chunked(qn, kn, vc, gc, bc, jnp.zeros((q.shape[0], sp.HV, sp.K, sp.V), cdt), sp.chunk,
                              with_u=True)
    upd.update(ru=U, rk=kn, rg=gc)
    _auto_state(ctx, S, upd)
    return y.astype(v.dtype), c, {}


#: ``(form, kind) -> Gated DeltaNet step`` from the forms' table (the op entries implemented here)
GDN_STEPS = _build_steps({"chunked_prefill": _gdn_chunked, "chunked_prefill_varlen": _gdn_chunked,
                          "recurrent_update": _gdn_serial, "snapshot_verify": _gdn_serial,
                          "replay_decode": _gdn_replay, "replay_verify": _gdn_replay, "kv_verify": _gdn_kv})

#: forms this backend runs: those with a Mamba-2 and a Gated DeltaNet step for every kind it runs
FORMS = tuple(f for f in dict.fromkeys(f for f, _ in STEPS)
              if all((f, k) in M2_STEPS and (f, k) in GDN_STEPS for k in KINDS_RUN))


def commit_snapshots(state, snap, accepted):
    """Snapshot-baseline commit: ``state = snap[a - 1]`` on rows with ``a > 0``
    (``state [Ly, Bt, ...]`` or a list of per-layer ``[Bt, ...]``, ``snap [Ly, Bt, T, ...]``)."""
    if isinstance(state, list):
        return [commit_snapshots(s_[None], snap[l][None], accepted)[0] for l, s_ in enumerate(state)]
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
    kd = KINDS[ctx.kind]
    if _fresh(kd):   # no past: the step's own keys only
        if kd.padded:   # padded keys are never read
            causal = causal & (t[None, None, :] < ctx.lengths[:, None, None])
        o = _attend(q, [(k, v)], causal, Hkv)
    else:
        S = c["k"][i].shape[1]
        committed = jnp.broadcast_to(jnp.arange(S)[None, None, :] < ctx.seq_len[:, None, None], (Bt, T, S))
        o = _attend(q, [(c["k"][i], c["v"][i]), (k, v)], jnp.concatenate([committed, causal], 2), Hkv)
    upd = {"k": k, "v": v} if kd.cached else {}
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
    eg, eu, down = p["e_gate"], p["e_up"], p["down"]

    def gathered(h, ix):
        g, u = ein("nkid,nd->nki", eg[ix], h), ein("nkid,nd->nki", eu[ix], h)
        return ein("nkdi,nki->nkd", down[ix], ops.activation(sp.act, g) * u)

    def dense(h):
        g, u = ein("nd,eid->nei", h, eg), ein("nd,eid->nei", h, eu)
        return ein("nei,edi->ned", ops.activation(sp.act, g) * u, down)

    out = _dispatch(xf, idx, w, sp.E, gathered, dense).astype(x.dtype)
    if sp.shared:
        sh = linear(ops.activation(sp.act, linear(xf, p["sh_gate_w"])) * linear(xf, p["sh_up_w"]), p["sh_down_w"])
        out = out + jax.nn.sigmoid(linear(xf, p["sh_sig_w"])) * sh
    return out.reshape(shp), c, {}, {}


MIXERS = {"mamba": mamba, "gdn": gdn, "attn": attention, "mlp": mlp, "gmlp": gmlp,
          "moe_sig": moe_sig, "moe_soft": moe_soft}
