"""The model-level cached API of the JAX backend (pure functions of ``(params, cache, ...)``).

::

    cache  = init_cache(spec, batch, mode="replay", buffer_size=16, max_seq_len=256)
    logits = forward(spec, params, ids[B, T])                          # [B, T, V], no cache
    logits, cache = prefill(spec, params, cache, ids[B, T], lengths[B])   # [B, V], fresh rows
    logits, cache = decode(spec, params, cache, ids[B], active=None)      # [B, V], commits
    logits, cache, pend = verify(spec, params, cache, ids[B, T])          # [B, T, V]
    cache = commit(spec, cache, pend, accepted[B])                        # keep a[b] of T

Every function is traceable (``jax.jit`` with ``spec`` static); all per-row decisions are
arrays.  A cache is a pytree: ``seq_len [B]`` (committed tokens), the ring pointers
``ring_start/ring_len [B]`` shared by every layer (as ``replayssm.cache.ring``: entry ``j``
of a row lives at ``(start + j) % L``), and per stage of the spec the stacked per-layer arrays: Mamba-2
``state [Ly,B,H,d,n]``, conv windows ``win_x [Ly,B,W-1,H·d]`` and ``win_bc [Ly,B,W-1,2Gn]``, ring ``rx [Ly,B,L,H,d]``, ``rB [Ly,B,L,G,n]``,
``rdt [Ly,B,L,H]``; GDN ``state [Ly,B,HV,K,V]``, ``win_q``, ``win_k``, ``win_v``, ring ``ru``, ``rk``, ``rg``;
attention ``k, v [Ly,B,S,Hkv,Dh]``.  States and decays are fp32 (fp64 for a float64
model); the rest is in the model dtype.  Flush rules: decode flushes when ``h + 1 == L``
(``S0 ← S_{h+1}``), verify when ``h + 2T > L`` (``S0 ← S_h``, committed entries only).
The KV-only form (``mode="kv"``) has no ``state`` (``S0 = 0``) and a ring of
``L = max_seq_len`` holding every token (``ring_start = 0``, ``ring_len == seq_len``; never
flushed).  ``mode="auto"``: a state and a ring of ``max_seq_len``; rows run the replay steps,
KV-only (state 0, every entry) until their switch, a flush at the threshold (:func:`flush_rows`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ..forms import table
from . import ops
from .layers import FORMS, MIXERS, Ctx, apply_updates, commit_conv, commit_snapshots, window_of
from .params import ModelSpec, jnp_dtype

__all__ = ["Cache", "AUTO", "flush_rows", "keeps_entries", "entry_capacity", "entry_bytes", "unstack_params", "group_params", "group_size", "split_cache", "ring_flush", "ring_commit", "init_cache", "forward", "prefill", "decode", "verify", "commit",
           "MODES", "uses_ring"]

#: cache modes (forms) of this backend, from the forms' table: ``("recurrent", "replay", "kv")``
MODES = FORMS


#: the per-row switch KV-only -> replay (the PyTorch engine's ``auto``): a composition, no form
AUTO = "auto"


def _stores(mode: str) -> frozenset:
    """Stores of a cache mode; ``auto`` holds a state and a ring (used as the KV-only buffer
    until the row's switch)."""
    return frozenset({"state", "ring"}) if mode == AUTO else table.form_stores(mode)


def uses_ring(mode: str) -> bool:
    """The form keeps a ring of inputs (ring pointers move, steps flush its checkpoints)."""
    return "ring" in _stores(mode)


def keeps_entries(mode: str) -> bool:
    """The form keeps per-token entries: the replay ring, or the KV-only form's entries of
    every token (held here as a ring of capacity ``max_seq_len`` that never wraps or flushes:
    ``ring_start`` stays 0 and ``ring_len == seq_len``)."""
    return bool({"ring", "pages"} & _stores(mode))


def entry_capacity(mode: str, buffer_size: int, max_seq_len: int) -> int:
    """Entries a row's buffer holds: ``buffer_size`` (replay ring), ``max_seq_len`` (KV-only,
    and ``auto``, whose rows start KV-only)."""
    return max_seq_len if mode == AUTO or "pages" in _stores(mode) else buffer_size


def entry_bytes(spec: ModelSpec, mode: str, batch: int, buffer_size: int, max_seq_len: int) -> int:
    """Bytes of the SSM layers' entry buffers of ``batch`` rows (0 for a form without entries):
    Mamba-2 ``x, B`` in the model dtype and ``Δ`` in the state dtype per token, GDN ``u, k``
    and ``g``."""
    if not keeps_entries(mode):
        return 0
    dt, cdt = _dtypes(spec)
    a, b = jnp.dtype(dt).itemsize, jnp.dtype(cdt).itemsize
    per = 0
    for sb, cnt in spec.stages:
        sp = sb.mixer
        if sp.kind == "mamba":
            per += cnt * ((sp.H * sp.d + sp.G * sp.n) * a + sp.H * b)
        elif sp.kind == "gdn":
            per += cnt * ((sp.HV * sp.V + sp.H * sp.K) * a + sp.HV * b)
    return per * batch * entry_capacity(mode, buffer_size, max_seq_len)


@jax.tree_util.register_pytree_node_class
class Cache:
    """Per-row caches of one batch: arrays are pytree leaves, ``mode``, ``L`` (ring
    capacity) and ``auto`` (``(buffer_size, threshold)`` of the ``auto`` mode, else None) are
    static (part of the compiled program)."""

    _FIELDS = ("seq_len", "ring_start", "ring_len", "stages")

    def __init__(self, seq_len, ring_start, ring_len, stages, mode: str, L: int, auto=None):
        self.seq_len, self.ring_start, self.ring_len, self.stages = seq_len, ring_start, ring_len, stages
        self.mode, self.L, self.auto = mode, L, auto

    def replace(self, **kw) -> "Cache":
        d = {f: getattr(self, f) for f in self._FIELDS}
        d.update(kw)
        return Cache(**d, mode=self.mode, L=self.L, auto=self.auto)

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in self._FIELDS), (self.mode, self.L, self.auto)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def _dtypes(spec: ModelSpec):
    dt = jnp_dtype(spec.dtype)
    return dt, ops.compute_dtype(dt)


def init_cache(spec: ModelSpec, batch: int, mode: str = "replay", buffer_size: int = 16,
               max_seq_len: int = 256, fill=0.0, auto_threshold: int = 0) -> Cache:
    """Zeroed caches for ``batch`` rows (``fill=nan`` poisons every float array: tests).
    ``mode="auto"``: rows start KV-only (state 0, entries in a buffer of ``max_seq_len``) and
    switch to replay (a ring of ``buffer_size``) once ``auto_threshold`` tokens are cached."""
    if mode not in MODES + (AUTO,):
        raise ValueError(f"decode_mode must be one of {MODES + (AUTO,)} for the JAX backend, got {mode!r}")
    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")
    if mode == AUTO and (not isinstance(auto_threshold, int) or auto_threshold < 1):
        raise ValueError(f"auto_threshold must be a positive int, got {auto_threshold!r}")
    dt, cdt = _dtypes(spec)
    L, B = entry_capacity(mode, buffer_size, max_seq_len), batch
    ring = keeps_entries(mode)
    state = "state" in _stores(mode)   # the KV-only form keeps none (S0 = 0)

    def full(shape, dtype):
        return jnp.full(shape, fill, dtype)

    stages = []
    for sb, cnt in spec.stages:
        sp = sb.mixer
        c = {}
        if sp.kind == "mamba":
            w = (cnt, B, sp.W - 1)
            c = {"win_x": full(w + (sp.H * sp.d,), dt), "win_bc": full(w + (2 * sp.G * sp.n,), dt)}
            if state:
                c["state"] = full((cnt, B, sp.H, sp.d, sp.n), cdt)
            if ring:
                c.update(rx=full((cnt, B, L, sp.H, sp.d), dt), rB=full((cnt, B, L, sp.G, sp.n), dt),
                         rdt=full((cnt, B, L, sp.H), cdt))
        elif sp.kind == "gdn":
            w = (cnt, B, sp.W - 1)
            c = {"win_q": full(w + (sp.H * sp.K,), dt), "win_k": full(w + (sp.H * sp.K,), dt),
                 "win_v": full(w + (sp.HV * sp.V,), dt)}
            if state:
                c["state"] = full((cnt, B, sp.HV, sp.K, sp.V), cdt)
            if ring:
                c.update(ru=full((cnt, B, L, sp.HV, sp.V), dt), rk=full((cnt, B, L, sp.H, sp.K), dt),
                         rg=full((cnt, B, L, sp.HV), cdt))
        elif sp.kind == "attn":
            c = {"k": full((cnt, B, max_seq_len, sp.Hkv, sp.Dh), dt), "v": full((cnt, B, max_seq_len, sp.Hkv, sp.Dh), dt)}
        stages.append(c)
    z = jnp.zeros((B,), jnp.int32)
    return Cache(z, z, z, stages, mode, L, (buffer_size, auto_threshold) if mode == AUTO else None)


def unstack_params(params):
    """``params`` with every stage as a list of per-layer parameter dicts.

    A ``lax.scan`` over stacked weights slices layer ``i``'s weights out of the stack
    (``dynamic-slice``); a backend that cannot feed a slice to its matrix unit in place
    (XLA:CPU; XLA:GPU without dynamic-slice fusion) copies every weight each step and then
    reads the copy: three passes over the weights where one would do.  With per-layer arrays,
    decode and verify unroll the layers and read each weight where it lies (at the price of a
    longer compile); prefill stacks them back into one scan (compute-bound, one copy)."""
    stages = []
    for p in params["stages"]:
        if isinstance(p, list):
            stages.append(list(p))
            continue
        if isinstance(p, tuple):   # grouped (group_params)
            p = _ungroup(p)
        n = jax.tree_util.tree_leaves(p)[0].shape[0]
        stages.append([jax.tree_util.tree_map(lambda a, i=i: a[i], p) for i in range(n)])
    return {**params, "stages": stages}


def group_size(cnt: int, k: int) -> int:
    """Layers per group for a stage of ``cnt`` layers and a requested ``k``: the largest
    divisor of ``cnt`` that is at most ``k`` (every group the same, so one loop body)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"layer group size must be a positive int, got {k!r}")
    return max(g for g in range(1, min(k, cnt) + 1) if cnt % g == 0)


def group_params(params, k: int):
    """``params`` with every stage as a *tuple* of ``g`` stacks (``g = group_size(cnt, k)``):
    stack ``j`` holds layers ``j, g + j, 2g + j, ...`` (leaves ``[cnt / g, ...]``).

    Decode and verify then run one ``lax.scan`` over the ``cnt / g`` groups whose body
    unrolls the ``g`` layers of a group: a compile of ``g`` layers instead of ``cnt``; each
    layer's weights are one slice of its own stack per iteration (whether a backend reads
    that slice in place or copies it is what ``python -m replayssm.jax.costs`` measures).
    Prefill interleaves the stacks back into one ``[cnt, ...]`` stack."""
    stages = []
    for p in params["stages"]:
        if isinstance(p, (list, tuple)):
            raise ValueError("group_params takes stacked stages (not per-layer or grouped ones)")
        n = jax.tree_util.tree_leaves(p)[0].shape[0]
        g = group_size(n, k)
        stages.append(tuple(jax.tree_util.tree_map(lambda a, j=j, g=g: a[j::g], p) for j in range(g)))
    return {**params, "stages": stages}


def _ungroup(p: tuple):
    """The ``[cnt, ...]`` stack of a grouped stage (:func:`group_params`), layer order."""
    def inter(*a):
        s = jnp.stack(a, 1)
        return s.reshape((s.shape[0] * s.shape[1],) + s.shape[2:])
    return jax.tree_util.tree_map(inter, *p)


def split_cache(cache: Cache) -> Cache:
    """``cache`` with every stacked per-layer array ``[Ly, ...]`` as a list of ``Ly`` arrays.

    For unrolled layers (:func:`unstack_params`): each layer reads and rewrites its own
    buffers, so no step slices a layer out of a stack (a slice a backend may copy before a
    matmul reads it) or writes one back into it.  Every function of this module takes such a
    cache from a decode or verify step on; a prefill needs the stacked one."""
    return cache.replace(stages=[{k: [a[l] for l in range(a.shape[0])] for k, a in c.items()}
                                 for c in cache.stages])


def _run_stage(sb, p, c, cnt: int, h, ctx: Ctx):
    """All layers of one stage: ``h = res(h) + mixer(norm(h))``, scanned when ``cnt > 1`` and
    the weights are stacked; unrolled over per-layer weights (:func:`unstack_params`); a scan
    over groups with each group unrolled for grouped weights (:func:`group_params`)."""
    dtype = (p[0] if isinstance(p, (list, tuple)) else p)["norm"].dtype   # the model dtype
    mixer = MIXERS[sb.mixer.kind]
    if sb.residual_fp32:
        h = h.astype(ops.compute_dtype(dtype))

    def body(carry, xs):
        hh, cc = carry
        pi, i = xs
        x = ops.rms_norm(hh.astype(dtype), pi["norm"], sb.norm_eps, sb.norm_zero_centered)
        out, cc, pend, upd = mixer(pi["mixer"], sb.mixer, x, ctx, cc, i)
        return ((hh + out).astype(hh.dtype), cc), (pend, upd)

    if isinstance(p, list) and ctx.kind in ("full", "prefill"):   # compute-bound: one scan
        p = jax.tree_util.tree_map(lambda *a: jnp.stack(a, 0), *p)
    if isinstance(p, tuple) and (ctx.kind in ("full", "prefill") or len(p) == 1):
        p = _ungroup(p)
    if isinstance(p, tuple):   # grouped (group_params): a scan over groups, g layers unrolled
        g = len(p)

        def group(carry, xs):
            pg, gi = xs
            outs = []
            for j in range(g):
                carry, o = body(carry, (pg[j], gi * g + j))
                outs.append(o)
            return carry, jax.tree_util.tree_map(lambda *a: jnp.stack(a, 0), *outs)

        (h, c), ys = lax.scan(group, (h, c), (p, jnp.arange(cnt // g)))
        pend, upd = jax.tree_util.tree_map(lambda a: a.reshape((cnt,) + a.shape[2:]), ys)
    elif isinstance(p, list):   # per-layer weights (unstack_params): layers unrolled
        ctx = dataclasses.replace(ctx, unrolled=True)
        outs, wins = [], []
        for i, pi in enumerate(p):
            (h, c), (pe, up) = body((h, c), (pi, i))
            if up and isinstance(c.get(next(iter(up))), list):   # per-layer caches: windows written here
                wins.append({k: up.pop(k) for k in [k for k in up if k.startswith("win_")]})
            outs.append((pe, up))
        pend, upd = jax.tree_util.tree_map(lambda *a: jnp.stack(a, 0), *outs)
        for i, w in enumerate(wins):   # each layer's own buffer: no stacked copy of every window
            for k, v in w.items():
                c = {**c, k: c[k][:i] + [v.astype(c[k][i].dtype)] + c[k][i + 1:]}
    elif cnt == 1:
        (h, c), (pend, upd) = body((h, c), (jax.tree_util.tree_map(lambda a: a[0], p), 0))
        pend, upd = jax.tree_util.tree_map(lambda a: a[None], (pend, upd))
    else:
        (h, c), (pend, upd) = lax.scan(body, (h, c), (p, jnp.arange(cnt)))
    return h, c, pend, upd


def _after(upd: dict, h) -> dict:
    """``upd`` made data-dependent on ``h`` (adds ``0 · Σh``): every read of the old cache feeds
    ``h``, so the writes of ``upd`` are ordered after all of them and XLA can update the cache
    in place.  A stage of several layers gets that order from its ``lax.scan``; a single-layer
    stage (hybrids) would otherwise get a copy of each cache array it writes, every step (XLA
    drops ``optimization_barrier`` before it places copies).  Unrolled layers likewise: nothing
orders layer ``i``'s reads before the writes of the stage's updates but ``h``."""
    zero = jnp.sum(h.astype(jnp.float32)) * 0.0
    return {k: v + zero.astype(v.dtype) for k, v in upd.items()}


def _trunk(spec: ModelSpec, params, stages_cache, ids, ctx: Ctx):
    """Embedding and every stage; each stage's cache updates are written after its layer scan
    (:func:`~replayssm.jax.layers.apply_updates`)."""
    h = jnp.take(params["embed"], ids, axis=0)
    new_cache, pends = [], []
    for s, (sb, cnt) in enumerate(spec.stages):
        c = stages_cache[s] if stages_cache is not None else {}
        p = params["stages"][s]
        unrolled = isinstance(p, list) and ctx.kind not in ("full", "prefill")
        h, c, pend, upd = _run_stage(sb, p, c, cnt, h, ctx)
        if upd and (cnt == 1 or unrolled):
            upd = _after(upd, h)
        new_cache.append(apply_updates(c, upd, ctx))
        pends.append(pend)
    return h, new_cache, pends


def _head(spec: ModelSpec, params, h):
    dt, cdt = _dtypes(spec)
    h = ops.rms_norm(h, params["final_norm"], spec.final_eps, spec.final_zero_centered)
    w = params["embed"] if spec.tied else params["head"]
    return ops.linear(h.astype(w.dtype), w).astype(cdt)


def forward(spec: ModelSpec, params, ids):
    """Full forward without a cache: ``ids [B, T] -> logits [B, T, V]`` (chunked forms)."""
    B, T = ids.shape
    ctx = Ctx(kind="full", mode="recurrent", T=T, positions=jnp.broadcast_to(jnp.arange(T), (B, T)))
    h, _, _ = _trunk(spec, params, None, ids, ctx)
    return _head(spec, params, h)


def prefill(spec: ModelSpec, params, cache: Cache, ids, lengths):
    """Fresh rows: right-padded prompts ``ids [B, T]`` with ``lengths [B]`` valid tokens
    (chunked SSD / chunked delta rule from a zero state).  Every row's cache is overwritten
    (state = final state, ring empty, conv window = last ``W-1`` inputs, KV at ``0..T-1``).
    Returns the logits after each row's last valid token ``[B, V]`` and the cache."""
    B, T = ids.shape
    t = jnp.arange(T)
    lengths = lengths.astype(jnp.int32)
    z = jnp.zeros((B,), jnp.int32)
    auto = cache.mode == AUTO
    pages = auto or "pages" in _stores(cache.mode)
    if pages and T > cache.L:
        raise ValueError(f"a padded prompt of {T} tokens does not fit the KV-only entry buffer of {cache.L}")
    # auto: the KV-only prefill, which also stores the final state of the rows already past
    # the threshold (they start in replay form: ring empty; the others keep S0 = 0)
    thr = cache.auto[1] if auto else 0
    ctx = Ctx(kind="prefill", mode="kv" if auto else cache.mode, T=T, positions=jnp.broadcast_to(t, (B, T)),
              valid=t[None, :] < lengths[:, None], lengths=lengths, L=cache.L, start=z, hist=z, auto_threshold=thr)
    h, stages, _ = _trunk(spec, params, cache.stages, ids, ctx)
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    # replay: the ring starts empty; KV-only: the prompt's entries are the buffer's first ones
    rl = jnp.where(lengths >= thr, 0, lengths) if auto else (lengths if pages else z)
    return _head(spec, params, last), cache.replace(seq_len=lengths, ring_start=z, ring_len=rl, stages=stages)


def ring_flush(hist, kind: str, T: int, L: int):
    """Rows whose layers write the checkpoint this step: decode when the ring fills
    (``h + 1 == L``), verify one window early (``h + 2T > L``); the forms' rule,
    :func:`replayssm.forms.table.ring_flush`."""
    return table.ring_flush(hist, kind, T, L)


def flush_rows(cache: Cache, kind: str, T: int):
    """Rows that write their checkpoint in a step of ``kind`` with ``T`` new entries: the
    replay ring's rule (:func:`ring_flush`); none in the KV-only form; in ``auto``, a row still
    KV-only (``ring_len == seq_len``: it never flushed) switches once ``threshold`` tokens are
    cached after a decode step (``S0 ← S_{h+1}``, all its entries folded) or before a verify
    step (``S0 ← S_h``) -- the state the PyTorch engine's switch folds after the step that
    reached the threshold -- and a switched row follows the ring rule at ``buffer_size``."""
    hist = cache.ring_len
    if cache.mode == AUTO:
        cap, thr = cache.auto
        switch = hist >= thr if table.KINDS[kind].tentative else hist + 1 >= thr
        return jnp.where(hist == cache.seq_len, switch, ring_flush(hist, kind, T, cap))
    if uses_ring(cache.mode):
        return ring_flush(hist, kind, T, cache.L)
    return jnp.zeros_like(hist, bool)


def ring_commit(start, hist, flush, L: int, accepted=None):
    """Ring pointers after a step: decode (``accepted=None``) keeps its entry (or empties the
    ring after a flush); verify keeps ``accepted`` entries after the committed ones (after a
    flush, the accepted entries are the whole ring).  Returns ``(start, length)``."""
    if accepted is None:
        return jnp.where(flush, (start + hist + 1) % L, start), jnp.where(flush, 0, hist + 1)
    return jnp.where(flush, (start + hist) % L, start), jnp.where(flush, 0, hist) + accepted


def _step_ctx(cache: Cache, kind: str, T: int, flush: bool = True) -> Ctx:
    L = cache.L
    seq = cache.seq_len
    start, hist = cache.ring_start, cache.ring_len
    write_flush, flush = flush, flush_rows(cache, kind, T)
    mode = "replay" if cache.mode == AUTO else cache.mode   # auto: replay steps (S0 = 0 until the switch)
    return Ctx(kind=kind, mode=mode, T=T, positions=seq[:, None] + jnp.arange(T)[None, :],
               seq_len=seq, start=start, hist=hist, flush=flush, L=L, write_flush=write_flush)


def decode(spec: ModelSpec, params, cache: Cache, ids, active=None, flush: bool = True):
    """One always-accepted token per row: ``ids [B] -> logits [B, V]``; commits itself
    (rows with ``active == False`` keep their ``seq_len``: finished rows of a batch).

    ``flush=False`` (static) compiles a step that writes no checkpoint: only for callers that
    know no row flushes (``ring_flush`` false for every row), like the generation loop's inner
    loop; the default step scatters the checkpoints of the rows that flush."""
    ctx = _step_ctx(cache, "decode", 1, flush)
    h, stages, _ = _trunk(spec, params, cache.stages, ids[:, None], ctx)
    L = cache.L
    step = jnp.ones_like(ctx.seq_len) if active is None else active.astype(jnp.int32)
    rs, rl = ring_commit(ctx.start, ctx.hist, ctx.flush, L)
    if "pages" in _stores(cache.mode):   # KV-only: one entry per committed token
        rs, rl = ctx.start, ctx.hist + step
    new = cache.replace(stages=stages, seq_len=ctx.seq_len + step, ring_start=rs, ring_len=rl)
    return _head(spec, params, h[:, 0]), new


def verify(spec: ModelSpec, params, cache: Cache, ids, flush: bool = True):
    """``T`` tentative tokens per row (a chain): ``ids [B, T] -> logits [B, T, V]``.  The
    entries are written (ring, KV, flush checkpoints) but nothing is committed until
    :func:`commit`; returns ``(logits, cache, pending)``.  ``flush=False``: as in
    :func:`decode`."""
    T = ids.shape[1]
    cap = cache.auto[0] if cache.mode == AUTO else cache.L
    if uses_ring(cache.mode) and cap < 2 * T:
        raise ValueError(f"buffer_size {cap} < 2 * {T} verify tokens: speculation needs L >= 2T")
    ctx = _step_ctx(cache, "verify", T, flush)
    h, stages, pends = _trunk(spec, params, cache.stages, ids, ctx)
    pending = {"stages": pends, "start": ctx.start, "hist": ctx.hist, "flush": ctx.flush}
    return _head(spec, params, h), cache.replace(stages=stages), pending


def commit(spec: ModelSpec, cache: Cache, pending: dict, accepted):
    """Keep ``accepted[b]`` (in ``[0, T]``) entries of the pending verify per row: ring
    pointers (replay), snapshot states (recurrent), conv windows, ``seq_len``."""
    a = accepted.astype(jnp.int32)
    L = cache.L
    st = table.step("replay" if cache.mode == AUTO else cache.mode, "verify")
    stages = []
    for s, (sb, cnt) in enumerate(spec.stages):
        c, pend = dict(cache.stages[s]), pending["stages"][s]
        for name in [k for k in pend if k.startswith("conv_")]:
            c[window_of(name)] = commit_conv(c[window_of(name)], pend[name], a)
        if st.state.at_commit and st.pending in pend:   # the snapshot baseline (recurrent form)
            c["state"] = commit_snapshots(c["state"], pend[st.pending], a)
        stages.append(c)
    start, hist, flush = pending["start"], pending["hist"], pending["flush"]
    new = cache.replace(stages=stages, seq_len=cache.seq_len + a)
    if st.ring.write:
        rs, rl = ring_commit(start, hist, flush, L, a)
        new = new.replace(ring_start=rs, ring_len=rl)
    elif st.pages.write:   # KV-only: the accepted entries follow the committed ones
        new = new.replace(ring_len=hist + a)
    return new
