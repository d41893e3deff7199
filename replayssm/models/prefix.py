"""Prefix caching on a :class:`~replayssm.models.cache.ModelCache`: fill the prefix store, and
resume a slot exactly at any token of a cached prefix.

The store (:mod:`replayssm.cache.prefix`) keeps per SSM layer every token's ring entry and
conv input plus checkpoint states at fixed positions; attention layers share their key /
value blocks through the attention pool's reference counts.  Which store block and
checkpoint row belong to which cached prefix is the engine's business
(:mod:`replayssm.engine.prefix_cache`); the functions here take those ids as plain ints, so
every tensor-parallel rank runs them on the same arguments.

**Resume at token p** (:func:`load`) with the nearest checkpoint ``S_c`` at ``c <= p``
(``c = 0``, ``S_0 = 0`` when none): per SSM layer and the slot's form

* replay: ``h = min(p - c, L)`` entries stay in the ring (``p-h .. p-1``), the ones before are
  folded into the checkpoint, ``S = fold(S_c, entries c .. p-h-1)`` (``ops.kv_fold``);
* recurrent: ``S_p = fold(S_c, entries c .. p-1)``;
* KV-only: entries ``0 .. p-1`` copied into the slot's pages (no state);

the conv window is the conv inputs ``p-W+1 .. p-1`` (zeros before the sequence start), and
the attention blocks holding whole tokens ``0 .. ⌊p/bs⌋·bs-1`` are shared (no copy); the block
holding the tokens past the last whole block is copied (copy on write: the slot writes its
next tokens into it).  Then ``seq_len = p``, and a prefill continues from there.

Every step of this is exact up to rounding: the replay form's state *is* the checkpoint
folded with its entries (``docs/MATH.md``).
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
    table = _need_store(cache)
    table.check_block(src, "source block")
    table.check_block(dst, "target block")
    bs = table.block_size
    if not 0 <= count <= bs:
        raise ValueError(f"count must be in [0, {bs}], got {count}")
    for layer in _ssm_layers(cache):
        for t in cache.layers[layer.layer_id]["prefix"].token_tensors():
            t[dst * bs:dst * bs + count] = t[src * bs:src * bs + count]


def _chain_state(cache, layer, chain: list[int], start: int, stop: int, base: Tensor | None) -> Tensor:
    """State after entries ``start .. stop-1`` of the chain folded into ``base`` (zeros when
    None): ``[1, *state]`` in the state dtype."""
    table = cache.prefix
    pools = cache.layers[layer.layer_id]["prefix"]
    bs = table.block_size
    if stop == start:
        S = torch.zeros((1,) + tuple(pools.ckpt.shape[1:]), dtype=pools.ckpt.dtype, device=pools.ckpt.device) \
            if base is None else base
        return S.to(pools.ckpt.dtype)
    plan = table.chain_plan(chain[start // bs:], stop - start)
    return layer.fold(pools.entries, plan, base).to(pools.ckpt.dtype)


def checkpoint(cache, row: int, *, slot: int | None = None, chain=(), start: int = 0, stop: int = 0,
               base: int | None = None) -> None:
    """Write checkpoint ``row`` of every SSM layer: the state of ``slot`` (a state-form slot
    whose prefill just ended at the checkpoint's position), or the fold of the chain's entries
    ``start .. stop-1`` into checkpoint ``base`` (zeros when None)."""
    table = _need_store(cache)
    table.check_checkpoint(row)
    if base is not None:
        table.check_checkpoint(base)
    if slot is not None:
        slot = int(slot)
        if not 0 < slot < cache.P or cache.mode_of(slot) not in ("replay", "recurrent"):
            raise ValueError(f"slot {slot} holds no state to checkpoint (form {cache.mode_of(slot)!r})")
        if cache.mode_of(slot) == "replay" and int(cache.ring.length[slot]):
            raise ValueError(f"slot {slot} has ring entries past its checkpoint; checkpoint right after a prefill")
    else:
        if start % table.block_size or not 0 <= start <= stop:
            raise ValueError(f"fold range [{start}, {stop}) must start on a block boundary")
    for layer in _ssm_layers(cache):
        store = cache.layers[layer.layer_id]
        pools = store["prefix"]
        if slot is not None:
            pools.ckpt[row] = store["buf"].state[slot].to(pools.ckpt.dtype)
        else:
            S0 = None if base is None else pools.ckpt[base:base + 1]
            pools.ckpt[row] = _chain_state(cache, layer, list(chain), start, stop, S0)[0]


def _window_rows(table, chain: list[int], length: int, width: int) -> tuple[Tensor, Tensor]:
    """Store rows of the conv inputs ``length-width .. length-1`` and which exist (``>= 0``)."""
    pos = torch.arange(length - width, length, dtype=torch.long)
    valid = pos >= 0
    rows = table.chain_rows(chain, 0, length)
    safe = rows[pos.clamp(min=0).to(rows.device)] if length else torch.zeros(width, dtype=torch.long,
                                                                            device=table.device)
    return safe, valid.to(table.device)


def load(cache, slot: int, length: int, chain, attn=(), checkpoint=None) -> None:
    """Resume the free ``slot`` at token ``length`` of a cached prefix (see the module docstring).

    ``chain``: store blocks of the prefix in order, covering positions ``0 .. length-1``
    (``ceil(length / bs)`` blocks; the last may hold more tokens than are used);
    ``attn``: the attention blocks of the same logical blocks (hybrids; the whole ones are
    shared, a partly used last one is copied); ``checkpoint``: ``(c, row)`` with ``c`` a
    multiple of the block size, ``c <= length``, or None (fold from the sequence start).
    Everything is validated before the cache changes; :class:`PoolExhausted` (no blocks for
    the copied attention block or the KV-only pages) leaves the slot free.
    """
    table = _need_store(cache)
    cache._check_idle()
    slot, length = int(slot), int(length)
    chain, attn = [int(b) for b in chain], [int(b) for b in attn]
    bs = table.block_size
    if not 0 < slot < cache.P or slot in cache._in_use:
        raise ValueError(f"load_prefix needs a free slot in [1, {cache.P - 1}], got {slot}")
    if not 0 < length <= cache.max_seq_len:
        raise ValueError(f"prefix length must be in [1, {cache.max_seq_len}], got {length}")
    nblk = -(-length // bs)
    if len(chain) != nblk:
        raise ValueError(f"a prefix of {length} tokens spans {nblk} blocks of {bs}, got {len(chain)} store blocks")
    for b in chain:
        table.check_block(b)
    c, row = (0, None) if checkpoint is None else (int(checkpoint[0]), int(checkpoint[1]))
    if c % bs or not 0 <= c <= length:
        raise ValueError(f"checkpoint position {c} must be a multiple of {bs} in [0, {length}]")
    if row is not None:
        table.check_checkpoint(row)
    full = length // bs
    if cache.attn is not None:
        if len(attn) != nblk:
            raise ValueError(f"a prefix of {length} tokens needs {nblk} attention blocks, got {len(attn)}")
        if cache.attn.num_allocated(slot):
            raise ValueError(f"slot {slot} still holds attention blocks")
        cache.attn.share(slot, attn[:full])                # raises before any change if a block is free
    try:
        cache.reserve(slot, length)                        # the copied attention block, KV-only pages
    except (PoolExhausted, ValueError):
        if cache.attn is not None:
            cache.attn.release(slot)
        raise
    form = cache.mode_of(slot)
    if cache.attn is not None and full < nblk:             # copy on write: the slot's own block
        dst, r = cache.attn.blocks_of(slot)[full], length - full * bs
        for layer in _attn_layers(cache):
            for name in ("k", "v"):
                pool = cache.layers[layer.layer_id][name]
                pool[dst, :r] = pool[attn[full], :r]
    L = cache.ring.capacity
    h = min(length - c, L) if form == "replay" else 0
    for layer in _ssm_layers(cache):
        store = cache.layers[layer.layer_id]
        pools = store["prefix"]
        if form == "kv":                                   # every entry since the start, in its pages
            src = table.chain_rows(chain, 0, length)
            blocks = torch.tensor(cache.pidx.blocks_of(slot), dtype=torch.long)
            j = torch.arange(length)
            dst = (blocks[j // bs] * bs + j % bs).to(cache.device)
            for t_dst, t_src in zip(store["kv"].tensors(), pools.entries.tensors()):
                t_dst[dst] = t_src[src]
        else:                                              # checkpoint + entries folded (+ ring)
            S0 = None if row is None else pools.ckpt[row:row + 1]
            S = _chain_state(cache, layer, chain, c, length - h, S0)
            buf = store["buf"]
            buf.state[slot] = S[0].to(buf.state.dtype)
            if h:
                src = table.chain_rows(chain, length - h, length)
                for t_ring, t_src in zip(buf.ring_tensors(), pools.entries.tensors()):
                    t_ring[slot, :h] = t_src[src].to(t_ring.dtype)
        win = store["conv"].window
        W1 = win.shape[2]
        if W1:
            rows, valid = _window_rows(table, chain, length, W1)
            vals = pools.preconv[rows].to(win.dtype)        # [W-1, C]
            vals = torch.where(valid[:, None], vals, torch.zeros((), dtype=win.dtype, device=win.device))
            win[slot] = vals.T
    t = torch.tensor([slot], dtype=torch.long, device=cache.device)
    cache.ring.start[t] = 0
    cache.ring.length[t] = h
    if form == "kv":
        cache.pidx.length[t] = length
    cache.seq_len[t] = length
    cache._in_use.add(slot)
