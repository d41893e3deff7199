"""Prefix caching on a :class:`~replayssm.models.cache.ModelCache`: fill the prefix store, and
resume a slot exactly at any token of a cached prefix.

The store (:mod:`replayssm.cache.prefix`) keeps per SSM layer every token's conv input and
the rest of its ring entry (GDN: the whole entry; Mamba-2: ``Δ``, its ``x`` and ``B`` being
rebuilt from the conv inputs where a resume or checkpoint reads them) plus checkpoint states
at fixed positions; attention layers share their key /
value blocks through the attention pool's reference counts.  Which store block and
checkpoint row belong to which cached prefix is the engine's business
(:mod:`replayssm.engine.prefix_cache`); the functions here take those ids as plain ints, so
every tensor-parallel rank runs them on the same arguments.

**Resume at token p** (:func:`load`) with the nearest checkpoint ``S_c`` at ``c <= p``
(``c = 0``, ``S_0 = 0`` when none): per SSM layer and the slot's form

* replay and recurrent: ``S_p = fold(S_c, entries c .. p-1)`` (``ops.kv_fold``: one kernel
  launch per layer on the GPU), the ring empty (a prefill follows a resume, and a replay
  prefill starts from the state rebuilt from checkpoint and ring: folding every entry here
  leaves it nothing to rebuild);
* KV-only: entries ``0 .. p-1`` copied into the slot's pages (no state);

the conv window is the conv inputs ``p-W+1 .. p-1`` (zeros before the sequence start), and
the attention blocks holding whole tokens ``0 .. ⌊p/bs⌋·bs-1`` are shared (no copy); the block
holding the tokens past the last whole block is copied (copy on write: the slot writes its
next tokens into it).  Then ``seq_len = p``, and a prefill continues from there.

Every step of this is exact up to rounding: the replay form's state *is* the checkpoint
folded with its entries (``docs/MATH.md``).

**State points** (a finished request's prompt and reply, :func:`save_states`): a checkpoint
row holding the state of a slot after all the tokens it holds (checkpoint folded with the
ring's committed entries; a KV-only slot is compressed to a state first) and its conv window
(``ckpt_window``), at any position.  No per-token entries are stored for the tokens before
it, so a state point is resumed only exactly where it was saved (``load`` with a checkpoint
``(p, row, True)``): the state and conv window copied, the attention blocks shared as above.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.paged import PoolExhausted


def _ssm_layers(cache):
    return [layer for layer in cache.model.stateful_layers() if hasattr(layer, "conv_dim")]


def _attn_layers(cache):
    return [layer for layer in cache.model.stateful_layers() if not hasattr(layer, "conv_dim")]


def _need_store(cache):
    if cache.prefix is None:
        raise ValueError("this cache has no prefix store (make_cache(..., prefix_blocks=N))")
    return cache.prefix


def assign(cache, slot: int, pairs) -> None:
    """Capture the slot's logical blocks ``k`` into store blocks ``b`` (``pairs`` of ``(k, b)``)
    during its next prefills."""
    table = _need_store(cache)
    slot = int(slot)
    if not 0 < slot < cache.P:
        raise ValueError(f"slot must be in [1, {cache.P - 1}], got {slot}")
    table.assign(slot, pairs)


def copy_block(cache, src: int, dst: int, count: int) -> None:
    """Copy the first ``count`` tokens' entries and conv inputs of store block ``src`` into
    store block ``dst`` (copy on write of a partly matched block)."""
    copy_blocks(cache, [(src, dst, count)])


def copy_blocks(cache, copies) -> None:
    """:func:`copy_block` for several ``(src, dst, count)`` at once (all validated first; one
    gather/scatter per stored tensor per layer)."""
    table = _need_store(cache)
    bs = table.block_size
    rows_src, rows_dst = [], []
    for src, dst, count in copies:
        src, dst, count = int(src), int(dst), int(count)
        table.check_block(src, "source block")
        table.check_block(dst, "target block")
        if not 0 <= count <= bs:
            raise ValueError(f"count must be in [0, {bs}], got {count}")
        rows_src += range(src * bs, src * bs + count)
        rows_dst += range(dst * bs, dst * bs + count)
    if len(set(rows_dst)) != len(rows_dst) or set(rows_dst) & set(rows_src):
        raise ValueError("prefix block copies overlap (a target written twice, or read by another copy)")
    if not rows_src:
        return
    src_t = torch.tensor(rows_src, dtype=torch.long, device=cache.device)
    dst_t = torch.tensor(rows_dst, dtype=torch.long, device=cache.device)
    for layer in _ssm_layers(cache):
        for t in cache.layers[layer.layer_id]["prefix"].token_tensors():
            t[dst_t] = t[src_t]


def checkpoint(cache, row: int, *, slot: int | None = None, chain=(), start: int = 0, stop: int = 0,
               base: int | None = None) -> None:
    """Write checkpoint ``row`` of every SSM layer: the state of ``slot`` (a state-form slot
    whose prefill just ended at the checkpoint's position), or the fold of the chain's entries
    ``start .. stop-1`` into checkpoint ``base`` (zeros when None)."""
    checkpoint_many(cache, [dict(row=row, slot=slot, chain=chain, start=start, stop=stop, base=base)])


def checkpoint_many(cache, jobs: list[dict]) -> None:
    """:func:`checkpoint` for several jobs (dicts of its keyword arguments plus ``row``), all
    validated before any is written, then written per layer in batches: one copy for the
    slot jobs and one fold over all rows for the fold jobs (a job whose ``base`` is written
    by another job of the list waits for the batch that writes it)."""
    table = _need_store(cache)
    jobs = [dict(row=int(j["row"]), slot=None if j.get("slot") is None else int(j["slot"]),
                 chain=[int(b) for b in j.get("chain", ())], start=int(j.get("start", 0)), stop=int(j.get("stop", 0)),
                 base=None if j.get("base") is None else int(j["base"])) for j in jobs]
    rows = [j["row"] for j in jobs]
    if len(set(rows)) != len(rows):
        raise ValueError(f"checkpoint rows written twice in one call: {rows}")
    slots = [j["slot"] for j in jobs if j["slot"] is not None]
    ring_len = cache.ring.length[torch.tensor(slots, dtype=torch.long, device=cache.device)].tolist() if slots else []
    held = dict(zip(slots, ring_len))
    for j in jobs:
        table.check_checkpoint(j["row"])
        if j["base"] is not None:
            table.check_checkpoint(j["base"])
        if j["slot"] is not None:
            slot = j["slot"]
            if not 0 < slot < cache.P or cache.mode_of(slot) not in ("replay", "recurrent"):
                raise ValueError(f"slot {slot} holds no state to checkpoint (form {cache.mode_of(slot)!r})")
            if cache.mode_of(slot) == "replay" and held[slot]:
                raise ValueError(f"slot {slot} has ring entries past its checkpoint; checkpoint right after a prefill")
        else:
            if j["start"] % table.block_size or not 0 <= j["start"] <= j["stop"]:
                raise ValueError(f"fold range [{j['start']}, {j['stop']}) must start on a block boundary")
            need = -(-(j["stop"] - j["start"]) // table.block_size)
            if len(j["chain"]) - j["start"] // table.block_size < need:
                raise ValueError(f"fold range [{j['start']}, {j['stop']}) runs past a chain of {len(j['chain'])} blocks")
            for blk in j["chain"]:
                table.check_block(blk)
    todo = list(jobs)
    while todo:                                            # batches in the order bases are written
        waiting = {j["row"] for j in todo}
        wave = [j for j in todo if j["base"] is None or j["base"] not in waiting]
        if not wave:
            raise ValueError("checkpoint jobs wait on each other's bases in a cycle")
        todo = [j for j in todo if j not in wave]
        _checkpoint_wave(cache, wave)


def _checkpoint_wave(cache, jobs: list[dict]) -> None:
    dev = cache.device
    sj = [j for j in jobs if j["slot"] is not None]
    fj = [j for j in jobs if j["slot"] is None]
    if sj:
        s_rows = torch.tensor([j["row"] for j in sj], dtype=torch.long, device=dev)
        s_slots = torch.tensor([j["slot"] for j in sj], dtype=torch.long, device=dev)
    if fj:
        f_rows = torch.tensor([j["row"] for j in fj], dtype=torch.long, device=dev)
        spans = [(j["chain"], j["start"], j["stop"]) for j in fj]
        has_base = torch.tensor([j["base"] is not None for j in fj], device=dev)
        bases = torch.tensor([j["base"] or 0 for j in fj], dtype=torch.long, device=dev)
    memo: dict = {}
    for layer in _ssm_layers(cache):
        store = cache.layers[layer.layer_id]
        pools = store["prefix"]
        if sj:
            pools.ckpt[s_rows] = store["buf"].state[s_slots].to(pools.ckpt.dtype)
        if fj:
            S0 = torch.where(has_base.view(-1, *[1] * (pools.ckpt.dim() - 1)), pools.ckpt[bases],
                             torch.zeros((), dtype=pools.ckpt.dtype, device=dev))
            pools.ckpt[f_rows] = _fold(cache.prefix, layer, pools, spans, memo, S0).to(pools.ckpt.dtype)


def save_states(cache, jobs) -> None:
    """Write state points: for each ``(row, slot)`` of ``jobs``, checkpoint ``row`` of every SSM
    layer takes the state of ``slot`` after every token it holds (replay: its checkpoint
    folded with the ring's committed entries, ``rebuild_state``; recurrent: the state; KV-only:
    the slot is compressed to a state first, ``switch_to_state`` — its sequence ends next),
    and ``ckpt_window[row]`` its conv window.  All validated before anything is written."""
    table = _need_store(cache)
    cache._check_idle()
    jobs = [(int(r), int(s)) for r, s in jobs]
    rows, slots = [r for r, _ in jobs], [s for _, s in jobs]
    if len(set(rows)) != len(rows) or len(set(slots)) != len(slots):
        raise ValueError(f"save_states: checkpoint rows or slots given twice: {jobs}")
    for r, s in jobs:
        table.check_checkpoint(r)
        if not 0 < s < cache.P or s not in cache._in_use:
            raise ValueError(f"save_states: slot {s} holds no sequence")
    if not jobs:
        return
    kv = [s for s in slots if cache.mode_of(s) == "kv"]
    if kv:
        cache.switch_to_state(kv)
    dev = cache.device
    r_t = torch.tensor(rows, dtype=torch.long, device=dev)
    s_t = torch.tensor(slots, dtype=torch.long, device=dev)
    replay = torch.tensor([cache.mode_of(s) == "replay" for s in slots], device=dev)
    plan = cache.ring.plan_decode(s_t) if bool(replay.any()) else None
    for layer in _ssm_layers(cache):
        store = cache.layers[layer.layer_id]
        pools, buf = store["prefix"], store["buf"]
        state = buf.state[s_t]
        if plan is not None:
            rebuilt = layer.rebuild_state(buf, plan).to(state.dtype)
            state = torch.where(replay.view(-1, *[1] * (state.dim() - 1)), rebuilt, state)
        pools.ckpt[r_t] = state.to(pools.ckpt.dtype)
        if pools.ckpt_window.shape[2]:
            pools.ckpt_window[r_t] = store["conv"].window[s_t].to(pools.ckpt_window.dtype)


def _windows(table, spans, width: int, memo: dict, name: str) -> tuple[Tensor, Tensor]:
    """``PrefixTable.window_rows`` of every ``(chain, start, stop)`` span, concatenated;
    computed once per span list ``name`` and conv width (``memo``)."""
    key = (name, width)
    if key not in memo:
        parts = [table.window_rows(chain, start, stop, width) for chain, start, stop in spans]
        dev = table.device
        memo[key] = (torch.cat([r for r, _ in parts]) if parts else torch.zeros(0, width, dtype=torch.long, device=dev),
                     torch.cat([v for _, v in parts]) if parts else torch.zeros(0, width, dtype=torch.bool, device=dev))
    return memo[key]


def _fold(table, layer, pools, spans, memo: dict, S0: Tensor) -> Tensor:
    """``S0`` folded with the entries of ``spans`` of ``(chain, start, stop)`` (positions
    ``start .. stop-1`` of the chain, ``start`` a block boundary), one row per span, in one
    op per layer: ``layer.fold`` over the stored entries where the layer keeps whole ones,
    else ``layer.fold_stored`` (Mamba-2: ``x, B`` computed from the conv inputs inside the
    fold).  ``memo`` (one per batch of folds over the same spans) keeps the plans every layer
    shares."""
    bs = table.block_size
    if layer.stores_entries:
        if "chains_plan" not in memo:
            memo["chains_plan"] = table.chains_plan([(chain[start // bs:], stop - start) for chain, start, stop in spans])
        return layer.fold(pools.entries, memo["chains_plan"], S0)
    if "stored_plan" not in memo:
        memo["stored_plan"] = (table.chains_plan([(chain, stop - start) for chain, start, stop in spans]),
                               torch.tensor([start for _, start, _ in spans], dtype=torch.long, device=table.device))
    plan, starts = memo["stored_plan"]
    return layer.fold_stored(pools, plan, starts, S0)


def _window_rows(table, chain: list[int], length: int, width: int) -> tuple[Tensor, Tensor]:
    """Store rows of the conv inputs ``length-width .. length-1`` and which exist (``>= 0``)."""
    start = max(0, length - width)
    rows = table.chain_rows(chain, start, length)            # only the positions the window needs
    pad = torch.zeros(width - (length - start), dtype=torch.long, device=rows.device)   # the null block's row
    valid = torch.arange(length - width, length, dtype=torch.long) >= 0
    return torch.cat([pad, rows]), valid.to(table.device)


def load(cache, slot: int, length: int, chain, attn=(), checkpoint=None) -> None:
    """Resume the free ``slot`` at token ``length`` of a cached prefix (see the module docstring).

    ``chain``: store blocks of the prefix in order, covering positions ``0 .. length-1``
    (``ceil(length / bs)`` blocks; the last may hold more tokens than are used);
    ``attn``: the attention blocks of the same logical blocks (hybrids; the whole ones are
    shared, a partly used last one is copied); ``checkpoint``: ``(c, row)`` with ``c`` a
    multiple of the block size, ``c <= length``, or None (fold from the sequence start); or
    ``(length, row, True)``: the state point saved in ``row`` (:func:`save_states`; a
    KV-only slot resumes it in the replay form).  Everything is validated before the cache
    changes; :class:`PoolExhausted` (no blocks for the copied attention block or the KV-only
    pages) leaves the slot free.
    """
    err = load_many(cache, [(slot, length, chain, attn, checkpoint)])[0]
    if err is not None:
        raise err


def load_many(cache, requests) -> list[Exception | None]:
    """:func:`load` for several requests ``(slot, length, chain, attn, checkpoint)`` at once:
    each is validated and given its pool blocks alone (a failing one leaves its slot free and
    gets its exception in the returned list, ``None`` for the others), then the state, ring,
    KV-only pages and conv windows of all of them are written per layer in one batch (a
    fold over all rows, one gather/scatter per tensor), not request by request."""
    _need_store(cache)
    cache._check_idle()
    plans, errors, taken = [], [], set()
    for req in requests:
        try:
            plan = _prepare(cache, *req, taken=taken)
        except (PoolExhausted, ValueError) as e:
            errors.append(e)
            continue
        taken.add(plan["slot"])
        plans.append(plan)
        errors.append(None)
    if plans:
        _apply(cache, plans)
    return errors


def _prepare(cache, slot: int, length: int, chain, attn=(), checkpoint=None, *, taken=()) -> dict:
    """Validate one request, share its attention blocks, reserve its pools and copy its
    partly used attention block; returns what :func:`_apply` writes for it."""
    table = cache.prefix
    slot, length = int(slot), int(length)
    chain, attn = [int(b) for b in chain], [int(b) for b in attn]
    bs = table.block_size
    if not 0 < slot < cache.P or slot in cache._in_use or slot in taken:
        raise ValueError(f"load_prefix needs a free slot in [1, {cache.P - 1}], got {slot}")
    if not 0 < length <= cache.spec.max_seq_len:
        raise ValueError(f"prefix length must be in [1, {cache.spec.max_seq_len}], got {length}")
    nblk = -(-length // bs)
    if len(chain) != nblk:
        raise ValueError(f"a prefix of {length} tokens spans {nblk} blocks of {bs}, got {len(chain)} store blocks")
    for b in chain:
        table.check_block(b)
    c, row = (0, None) if checkpoint is None else (int(checkpoint[0]), None if checkpoint[1] is None
                                                   else int(checkpoint[1]))
    point = checkpoint is not None and len(checkpoint) > 2 and bool(checkpoint[2])
    if point:
        if c != length:
            raise ValueError(f"a state point resumes only where it was saved: checkpoint at {c}, prefix {length}")
    elif c % bs or not 0 <= c <= length:
        raise ValueError(f"checkpoint position {c} must be a multiple of {bs} in [0, {length}]")
    if row is not None:
        table.check_checkpoint(row)
    elif point or c:
        raise ValueError(f"a checkpoint at {c} needs its row")
    full = length // bs
    if cache.attn is not None:
        if len(attn) != nblk:
            raise ValueError(f"a prefix of {length} tokens needs {nblk} attention blocks, got {len(attn)}")
        if cache.attn.num_allocated(slot):
            raise ValueError(f"slot {slot} still holds attention blocks")
        cache.attn.share(slot, attn[:full])                # raises before any change if a block is free
    # a state point has no entries to fill KV-only pages with: a KV-only slot resumes it in
    # the replay form (a free slot: nothing to compress)
    switched = point and cache.mode_of(slot) == "kv"
    if switched:
        cache._modes[slot] = "replay"
        cache.kv_slot[slot] = False
    try:
        cache.reserve(slot, length)                        # the copied attention block, KV-only pages
    except (PoolExhausted, ValueError):
        if cache.attn is not None:
            cache.attn.release(slot)
        if switched:
            cache._modes[slot] = "kv"
            cache.kv_slot[slot] = True
        raise
    form = cache.mode_of(slot)
    if cache.attn is not None and full < nblk:             # copy on write: the slot's own block
        dst, r = cache.attn.blocks_of(slot)[full], length - full * bs
        for layer in _attn_layers(cache):
            for name in ("k", "v"):
                pool = cache.layers[layer.layer_id][name]
                pool[dst, :r] = pool[attn[full], :r]
    return dict(slot=slot, length=length, chain=chain, c=c, row=row, form=form, point=point)


def _apply(cache, plans: list[dict]) -> None:
    """Write the SSM layers' part of every prepared request, batched over requests:

    * KV-only rows: entries ``0 .. p-1`` gathered into their pages;
    * state rows: ``S = fold(S_c, entries c .. p-1)`` for all rows in one fold, once per
      distinct (chain, checkpoint, end) (``S_c = 0`` without a checkpoint), ring empty;
    * every row: the conv window = conv inputs ``p-W+1 .. p-1`` (zeros before the start).
    """
    table, bs, dev = cache.prefix, cache.prefix.block_size, cache.device
    pts = [q for q in plans if q["point"]]
    plans_w = [q for q in plans if not q["point"]]          # conv windows from the stored conv inputs
    kvs = [q for q in plans_w if q["form"] == "kv"]
    sts = [q for q in plans_w if q["form"] != "kv"]
    if pts:
        pt_slots = torch.tensor([q["slot"] for q in pts], dtype=torch.long, device=dev)
        pt_rows = torch.tensor([q["row"] for q in pts], dtype=torch.long, device=dev)
    # index work shared by every SSM layer, done once
    if kvs:
        kv_spans = [(q["chain"], 0, q["length"]) for q in kvs]
        dst = []
        for q in kvs:
            blocks = torch.tensor(cache.pidx.blocks_of(q["slot"]), dtype=torch.long)
            j = torch.arange(q["length"])
            dst.append(blocks[j // bs] * bs + j % bs)
        kv_dst = torch.cat(dst).to(dev)
    if sts:
        st_slots = torch.tensor([q["slot"] for q in sts], dtype=torch.long, device=dev)
        # rows resuming at the same point of the same chain (a shared system prompt) fold once
        folds, which = {}, []
        for q in sts:
            stop = q["length"]
            key = (tuple(q["chain"][:-(-stop // bs)]), q["c"], q["row"], stop)
            which.append(folds.setdefault(key, len(folds)))
        keys = list(folds)
        fold_spans = [(list(k[0]), k[1], k[3]) for k in keys]
        has_ckpt = torch.tensor([k[2] is not None for k in keys], device=dev)
        ckpt_rows = torch.tensor([0 if k[2] is None else k[2] for k in keys], dtype=torch.long, device=dev)
        which = torch.tensor(which, dtype=torch.long, device=dev)
    all_slots = torch.tensor([q["slot"] for q in plans], dtype=torch.long, device=dev)
    w_slots = torch.tensor([q["slot"] for q in plans_w], dtype=torch.long, device=dev)
    windows = {}                                           # conv width - 1 -> (store rows, valid) [R, W-1]
    memo: dict = {}                                        # (spans, conv width) -> window rows
    for layer in _ssm_layers(cache):
        store = cache.layers[layer.layer_id]
        pools = store["prefix"]
        W = layer.conv_kernel
        if kvs:
            rows, valid = _windows(table, kv_spans, W, memo, "kv")
            for t_dst, v in zip(store["kv"].tensors(), layer.prefix_entries(pools, rows, valid)):
                t_dst[kv_dst] = v.to(t_dst.dtype)
        if sts:
            S0 = torch.where(has_ckpt.view(-1, *[1] * (pools.ckpt.dim() - 1)), pools.ckpt[ckpt_rows],
                             torch.zeros((), dtype=pools.ckpt.dtype, device=dev))
            buf = store["buf"]
            buf.state[st_slots] = _fold(table, layer, pools, fold_spans, memo, S0).to(buf.state.dtype)[which]
        if pts:
            buf = store["buf"]
            buf.state[pt_slots] = pools.ckpt[pt_rows].to(buf.state.dtype)
        win = store["conv"].window
        W1 = win.shape[2]
        if W1 and pts:
            win[pt_slots] = pools.ckpt_window[pt_rows].to(win.dtype)
        if W1 and plans_w:
            if W1 not in windows:
                rv = [_window_rows(table, q["chain"], q["length"], W1) for q in plans_w]
                windows[W1] = (torch.stack([r for r, _ in rv]), torch.stack([v for _, v in rv]))
            rows, valid = windows[W1]
            vals = pools.preconv[rows].to(win.dtype)                         # [R, W-1, C]
            vals = torch.where(valid[..., None], vals, torch.zeros((), dtype=win.dtype, device=win.device))
            win[w_slots] = vals.transpose(1, 2)
    cache.ring.start[all_slots] = 0
    cache.ring.length[all_slots] = 0
    if kvs:
        kv_slots = torch.tensor([q["slot"] for q in kvs], dtype=torch.long, device=dev)
        cache.pidx.length[kv_slots] = torch.tensor([q["length"] for q in kvs], dtype=cache.pidx.length.dtype,
                                                   device=dev)
    cache.seq_len[all_slots] = torch.tensor([q["length"] for q in plans], dtype=cache.seq_len.dtype, device=dev)
    cache._in_use.update(q["slot"] for q in plans)
