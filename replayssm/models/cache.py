"""ModelCache: everything one model keeps per resident sequence (slot).

Slots ``0 .. num_slots-1``; slot 0 is the null slot (padding rows read and write it; it
holds garbage).  Per layer (``layers[layer_id]``):

* Mamba-2 / GDN: ``buf`` (checkpoint state + input ring, ``cache.buffers``), ``conv``
  (``cache.conv.ConvWindow``), ``kv`` (paged KV-only pools, ``cache.paged``; only in
  modes ``kv`` and ``auto``).
* attention: ``k``, ``v`` ``[P, max_seq_len, Hkv, Dh]``.

What the cache holds is one :class:`~replayssm.cache.spec.CacheSpec` (``cache.spec``).
Shared bookkeeping: ``ring`` (``RingIndex``, replay form), ``pidx`` (``PagedIndex``, KV-only
form), ``seq_len [P]`` (committed tokens per slot, device), the per-slot form (host list,
changed only between steps by :meth:`switch_to_state` / :meth:`release`) and the pending
verify (a :class:`~replayssm.layers.context.StepContext` awaiting ``model.commit``).

Optionally (:meth:`keep_hidden`, for a drafter that conditions on the model, e.g. MTP):
``hidden [P, max_new, D]``, the final-normed hidden state (the LM head's input) of each token
of every slot's latest call, written on the device inside the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.paged import PagedIndex, PoolExhausted
from ..cache.prefix import PrefixPools, PrefixTable
from ..cache.ring import RingIndex, check_speculative_capacity
from ..cache.spec import CacheSpec
from ..forms import CACHE_FORMS, get_form
from . import prefix as prefix_ops
from ..runtime import canonical_device  # noqa: F401  (re-exported: models code imports it here)
from ..runtime import host_to_device


def _as_list(slots) -> list[int]:
    if isinstance(slots, Tensor):
        return [int(v) for v in slots.reshape(-1).tolist()]
    if isinstance(slots, int):
        return [slots]
    return [int(v) for v in slots]


def _tensors(store: dict) -> list[Tensor]:
    """The floating-point tensors of a layer store (what ``poison`` fills with NaN)."""
    return [t for t in _owned(store) if t.is_floating_point()]


def _owned(obj) -> list[Tensor]:
    """Every tensor held by ``obj``: itself, a dict's values, an object's attributes
    (buffers, pools, indices), recursively one level of containers deep."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _owned(v)]
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return []
    if isinstance(obj, PrefixPools):
        return obj.tensors()
    return [t for t in vars(obj).values() if isinstance(t, Tensor)]


@dataclass(frozen=True)
class CacheLayout:
    """Bytes a :class:`ModelCache` allocates, measured by running its own allocation on the
    ``meta`` device (no memory is touched), so admission budgets what the cache really holds.

    ``mode``: the spec's decode mode it was measured for (``auto`` measures as ``kv``).
    ``slot_bytes``: one usable slot (checkpoint states, rings, conv windows, per-slot
    bookkeeping).  ``block_bytes``: one block of the KV-only pool over all SSM layers (0
    outside modes ``kv`` / ``auto``), ``block_size`` entries each; ``attn_block_bytes``: one
    block of the attention KV pool over all attention layers (0 without attention).  ``state_bytes`` /
    ``entry_bytes``: one slot's checkpoint states and one input entry (ring or KV-only) over
    all SSM layers: the two sizes that decide when the KV-only form stops paying
    (:func:`replayssm.forms.kv.kv_only_threshold`).
    """

    mode: str
    slot_bytes: int
    block_bytes: int
    block_size: int
    state_bytes: int
    entry_bytes: int
    attn_block_bytes: int = 0   # one block of the attention KV pool over all attention layers
    prefix_block_bytes: int = 0  # one prefix-store block over all SSM layers (entries + conv inputs)
    checkpoint_bytes: int = 0    # one prefix-store checkpoint over all SSM layers
    prefix_slot_bytes: int = 0   # the prefix store's per-slot bookkeeping (capture table row)
    fold_token_bytes: int = 0    # one token's whole ring entry and conv input over all SSM layers
                                 # (what a resume reads per folded token)

    @property
    def kv_token_bytes(self) -> int:
        """Bytes of one KV-only token (its share of a block)."""
        return self.block_bytes // self.block_size

    @property
    def attn_token_bytes(self) -> int:
        """Bytes of one token's attention keys and values (its share of a block)."""
        return self.attn_block_bytes // self.block_size


class ModelCache:
    """The per-slot memory of ``model`` for ``num_slots`` slots (slot 0 the null slot), laid
    out by ``spec`` (validated by :class:`CacheSpec`): a fresh slot starts in
    ``spec.initial_form`` (``auto`` starts KV-only, as ``kv`` does).  ``poison`` (tests)
    fills every tensor with NaN instead of zeros."""

    def __init__(self, model, num_slots: int, spec: CacheSpec, device=None, poison: bool = False):
        if not isinstance(spec, CacheSpec):
            raise ValueError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 2:
            raise ValueError(f"num_slots must be an int >= 2, got {num_slots!r} (slot 0 is the null slot)")
        mode = spec.initial_form
        forms = [get_form(f) for f in CACHE_FORMS[mode]]
        uses_ring = any(f.uses_ring for f in forms)
        uses_pages = any(f.uses_pages for f in forms)
        if uses_ring:
            check_speculative_capacity(spec.buffer_size, spec.max_new, "max_new")
        self.model, self.spec = model, spec
        self.num_slots, self.mode = num_slots, mode   # mode: the form a fresh slot starts in
        self.device = canonical_device(device) if device is not None else model.device
        self.dtype = model.dtype
        self.state_dtype = spec.state_dtype(self.dtype)   # checkpoint states (and prefix checkpoints)
        P = num_slots
        self.P = P
        self.seq_len = torch.zeros(P, dtype=torch.long, device=self.device)
        self._modes = ["none"] + [mode] * (P - 1)
        self._in_use: set[int] = set()      # slots holding a sequence (host mirror)
        self.kv_slot = torch.zeros(P, dtype=torch.bool, device=self.device)
        cap = spec.buffer_size if uses_ring else 1
        self.ring = RingIndex(P - 1, cap, self.device)
        has_attention = any(not hasattr(layer, "conv_dim") for layer in model.stateful_layers())
        # KV-only SSM entries (kv / auto) and attention KV (hybrids) live in paged pools whose
        # blocks a slot draws as its context grows (None: a static pool, max_seq_len per slot)
        self.pidx, self._static_kv = self._pool(spec.kv_num_blocks, uses_pages)
        self.attn, self._static_attn = self._pool(spec.attn_num_blocks, has_attention)
        self.uses_pages = self.pidx is not None or self.attn is not None
        if self.pidx is not None:
            self.kv_slot[1:] = True
        # prefix caching (replayssm.models.prefix): a store of token blocks and checkpoints
        bs = spec.block_size
        self.prefix = None
        if spec.prefix_blocks is not None:
            self.prefix = PrefixTable(P, bs, spec.prefix_blocks + 1, (spec.prefix_checkpoints or 0) + 1,
                                      spec.max_blocks, self.device)
        self.layers: dict[int, dict] = {}
        for layer in model.stateful_layers():
            if hasattr(layer, "conv_dim"):
                pages = (self.pidx.num_blocks, bs) if self.pidx is not None else None
                store = layer.allocate(P, cap, self.dtype, self.device, pages, mode=mode, state_dtype=self.state_dtype)
                if self.prefix is not None:
                    store["prefix"] = layer.alloc_prefix(self.prefix.num_blocks, bs, self.prefix.num_checkpoints,
                                                         self.dtype, self.device, state_dtype=self.state_dtype)
            else:
                store = layer.allocate(self.attn.num_blocks, bs, self.dtype, self.device)
            if poison:  # tests: every byte a step may not read is NaN
                for t in _tensors(store):
                    t.fill_(float("nan"))
            self.layers[layer.layer_id] = store
        self.pending = None
        self.hidden: Tensor | None = None                # keep_hidden(): [P, max_new, D]
        self.prompt_hidden: dict[int, list[Tensor]] = {}  # slot -> prefilled hidden states
        self._swapped: dict = {}                         # swap_out key -> the slot's host copy

    # ------------------------------------------------------------------ hidden states
    def keep_hidden(self, width: int) -> None:
        """From now on keep the final-normed hidden state ``hn`` (the LM head's input) of the
        tokens each call processes, for a drafter that reads it (MTP):

        * ``hidden [P, max_new, width]`` (static, so CUDA graphs write it in place): after a
          ``decode`` / ``verify`` / ``verify_tree`` of ``T`` tokens, ``hidden[slot, i]`` is
          token (node) ``i``'s; after a ``prefill``, ``hidden[slot, 0]`` is the last prompt
          token's.  Written by the call on the device (no host round trip).
        * ``prompt_hidden[slot]``: each prefill's ``[n, width]`` rows (every valid prompt
          token), kept until :meth:`take_prompt_hidden` or :meth:`release`.
        """
        if self.hidden is None:
            self.hidden = torch.zeros(self.P, self.spec.max_new, int(width), dtype=self.dtype, device=self.device)

    def record_hidden(self, slots: Tensor, hn: Tensor) -> None:
        """``hidden[slots, :T] = hn [B, T, D]`` (no-op unless :meth:`keep_hidden`)."""
        if self.hidden is not None:
            self.hidden[slots, : hn.shape[1]] = hn.to(self.hidden.dtype)

    def record_prompt_hidden(self, slots: Tensor, hn: Tensor, cu_seqlens: Tensor) -> None:
        """After a packed prefill of ``hn [Nt, D]`` (row ``b``'s tokens at
        ``cu_seqlens[b]:cu_seqlens[b + 1]``): each row's last token to ``hidden[slot, 0]``,
        its tokens appended to ``prompt_hidden[slot]`` (a chunked prompt adds one part per
        chunk)."""
        last = hn[(cu_seqlens[1:] - 1).clamp(min=0)]
        self.hidden[slots, 0] = last.to(self.hidden.dtype)
        bounds = cu_seqlens.tolist()
        for b, s in enumerate(slots.tolist()):
            if s and bounds[b + 1] > bounds[b]:
                self.prompt_hidden.setdefault(s, []).append(hn[bounds[b]:bounds[b + 1]])

    def take_prompt_hidden(self, slot: int) -> Tensor | None:
        """The prefilled hidden states of ``slot`` since the last take ``[n, D]`` (or None)."""
        parts = self.prompt_hidden.pop(int(slot), None)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def _pool(self, num_blocks: int | None, needed: bool) -> tuple[PagedIndex | None, bool]:
        """A paged index of ``num_blocks`` usable blocks (plus the null block 0), or ``None``
        when ``needed`` is False; ``num_blocks=None`` reserves ``max_seq_len`` per slot up
        front (a static pool).  Returns ``(index, static)``."""
        if not needed:
            return None, False
        spec = self.spec
        static = num_blocks is None
        if static:
            num_blocks = (self.P - 1) * spec.max_blocks
        index = PagedIndex(self.P - 1, spec.block_size, num_blocks + 1, spec.max_blocks, self.device)
        if static:
            for s in range(1, self.P):
                index.reserve(s, spec.max_seq_len)
        return index, static

    # ------------------------------------------------------------------ memory
    def tensors(self) -> list[Tensor]:
        """Every tensor this cache holds (layer stores and the shared bookkeeping)."""
        out = [self.seq_len, self.kv_slot] + _owned(self.ring) + _owned(self.pidx) + _owned(self.attn)
        out += _owned(self.prefix)
        if self.hidden is not None:
            out.append(self.hidden)
        for store in self.layers.values():
            out += _owned(store)
        return out

    def nbytes(self) -> int:
        """Bytes of every tensor, each counted once (a layer may hold one tensor under two
        names: MLA's key and value pools)."""
        return sum(t.nbytes for t in {id(t): t for t in self.tensors()}.values())

    @classmethod
    def layout(cls, model, spec: CacheSpec) -> CacheLayout:
        """What a cache of ``spec``'s sizing (:meth:`CacheSpec.sizing`: pools and prefix store
        are measured, not taken from the spec) allocates per slot and per block, measured by
        building it on the ``meta`` device with one and two slots (one and two blocks)."""
        meta = torch.device("meta")
        spec = spec.sizing()

        def build(P: int, kv_blocks: int = 1, attn_blocks: int = 1, prefix=(None, None)) -> "ModelCache":
            return cls(model, P, CacheSpec.of(spec, kv_num_blocks=kv_blocks if spec.paged else None,
                                              attn_num_blocks=attn_blocks, prefix_blocks=prefix[0],
                                              prefix_checkpoints=prefix[1]), device=meta)

        one = build(2)
        slot = build(3).nbytes() - one.nbytes()
        block = build(2, kv_blocks=2).nbytes() - one.nbytes() if one.pidx is not None else 0
        attn_block = build(2, attn_blocks=2).nbytes() - one.nbytes() if one.attn is not None else 0
        bufs = [st["buf"] for st in one.layers.values() if "buf" in st]
        state = sum(b.state.nbytes for b in bufs) // one.P
        entry = sum(t.nbytes // (t.shape[0] * t.shape[1]) for b in bufs for t in b.ring_tensors())
        pre = build(2, prefix=(1, 1)).nbytes()
        pre_block = build(2, prefix=(2, 1)).nbytes() - pre
        ckpt = build(2, prefix=(1, 2)).nbytes() - pre
        pre_slot = build(3, prefix=(1, 1)).nbytes() - pre - slot
        wins = [st["conv"].window for st in one.layers.values() if "conv" in st]
        conv_in = sum(w.nbytes // (w.shape[0] * w.shape[2]) for w in wins if w.shape[2])
        return CacheLayout(spec.mode, slot, block, spec.block_size, state, entry, attn_block, pre_block, ckpt,
                           pre_slot, entry + conv_in)

    # ------------------------------------------------------------------ queries
    def mode_of(self, slot: int) -> str:
        """Form of ``slot``'s recurrent layers: ``"recurrent"``, ``"replay"`` or ``"kv"`` (slot 0:
        the form a fresh slot starts in)."""
        slot = int(slot)
        if not 0 <= slot < self.P:
            raise ValueError(f"slot must be in [0, {self.P - 1}], got {slot}")
        return self._modes[slot] if slot else self.mode

    def ssm_form(self) -> str:
        """Form a step runs in: the slots' form, or ``"mixed"`` when KV and replay slots coexist."""
        if self.mode != "kv":
            return self.mode
        kinds = {self._modes[s] for s in self._in_use} or {self.mode}
        return "kv" if kinds == {"kv"} else ("mixed" if "kv" in kinds else "replay")

    def clear_pending(self) -> None:
        """Forget a verify whose commit will never come (a step that failed half-way)."""
        self.pending = None

    def _check_idle(self):
        if self.pending is not None:
            raise RuntimeError("a verify is waiting for its commit (call model.commit first)")

    def reserve(self, slot: int, total_len: int, defer: bool = False) -> None:
        """Make room for ``total_len`` tokens of ``slot`` in the paged pools it uses: its
        attention KV (hybrids) and, in the KV-only form, its SSM entries (a no-op for pools
        already holding that many, and for static pools).  :class:`PoolExhausted` or
        ``ValueError`` leave everything unchanged."""
        if total_len > self.spec.max_seq_len:
            raise ValueError(f"slot {slot}: {total_len} tokens > max_seq_len {self.spec.max_seq_len}")
        slot = int(slot)
        kv = self.pidx is not None and self._modes[slot] == "kv"
        pools = [p for p in (self.attn, self.pidx if kv else None) if p is not None]
        if len(pools) == 2 and not all(p.can_reserve(slot, total_len) for p in pools):
            raise PoolExhausted(f"slot {slot}: no room for {total_len} tokens in the paged pools")
        for p in pools:
            p.reserve(slot, total_len, defer=defer)

    def write_pending(self) -> None:
        """Write the block tables of deferred reservations (``reserve(..., defer=True)``):
        one transfer per paged pool for a whole step."""
        for p in (self.attn, self.pidx):
            if p is not None:
                p.write_pending()

    def reserve_step(self, slots, totals) -> list:
        """A step's reservations: ``reserve(slots[i], totals[i], defer=True)`` for each ``i``
        (lists of ints), then :meth:`write_pending` (also when one fails).  Returns per slot
        None, or the message of the :class:`PoolExhausted` / ``ValueError`` /
        ``RuntimeError`` that left that slot unchanged.  One call for the whole batch: under
        tensor parallelism one message to the workers, not one per row."""
        if len(slots) != len(totals):
            raise ValueError(f"reserve_step: {len(slots)} slots but {len(totals)} totals")
        out: list = []
        try:
            for slot, total in zip(slots, totals):
                try:
                    self.reserve(slot, total, defer=True)
                    out.append(None)
                except (RuntimeError, ValueError) as e:
                    out.append(str(e))
        finally:
            self.write_pending()
        return out

    # ------------------------------------------------------------------ slot lifecycle
    def start(self, slot: int) -> None:
        """Hold an empty sequence in the free ``slot`` without a prefill (an MTP head's slot
        whose prompt left it no pairs: its first pairs come by ``verify``), so that it swaps
        out and back like a prefilled one."""
        slot = int(slot)
        if not 0 < slot < self.P or slot in self._in_use:
            raise ValueError(f"start: slot must be a free slot in [1, {self.P - 1}], got {slot}")
        self._in_use.add(slot)

    def release(self, slots) -> None:
        """Free ``slots`` (their next prefill starts a new sequence in :attr:`mode`)."""
        self._check_idle()
        ids = [s for s in _as_list(slots) if s != 0]
        for s in ids:
            if not 0 < s < self.P:
                raise ValueError(f"slot must be in [1, {self.P - 1}], got {s}")
        if not ids:
            return
        t = host_to_device(torch.tensor(ids, dtype=torch.long), self.device)   # no wait for queued steps
        self.seq_len[t] = 0
        self.ring.reset(t)
        for s in ids:
            self._modes[s] = self.mode
            self._in_use.discard(s)
            self.prompt_hidden.pop(s, None)
            for pool, static in ((self.pidx, self._static_kv), (self.attn, self._static_attn)):
                if pool is not None:
                    pool.release(s)
                    if static:
                        pool.reserve(s, self.spec.max_seq_len)
        if self.pidx is not None:
            self.kv_slot[t] = True
        if self.prefix is not None:
            self.prefix.clear(t)

    def fork(self, src: int, dst) -> None:
        """Copy slot ``src``'s sequence into every slot of ``dst`` (``n`` samples of one
        prompt share its prefill): every per-slot tensor — checkpoint states, rings, conv
        windows, attention KV — the KV-only pages (``dst`` slots get blocks of their own),
        ``seq_len``, ring pointers, paged lengths and the slot's form.  Between steps only;
        ``dst`` slots must be free.  Validated before anything is written
        (:class:`~replayssm.cache.paged.PoolExhausted` when the block pool is too small)."""
        self._check_idle()
        src = int(src)
        dsts = _as_list(dst)
        if not 0 < src < self.P or src not in self._in_use:
            raise ValueError(f"fork source must be a slot in use in [1, {self.P - 1}], got {src}")
        if len(set(dsts)) != len(dsts) or any(not 0 < d < self.P or d == src or d in self._in_use for d in dsts):
            raise ValueError(f"fork targets must be distinct free slots in [1, {self.P - 1}] other than "
                             f"{src}, got {dsts}")
        if not dsts:
            return
        kv = self.pidx is not None and self._modes[src] == "kv"
        pools = [p for p in (self.pidx if kv else None, self.attn) if p is not None]
        extra = {id(p): sum(max(0, p.num_allocated(src) - p.num_allocated(d)) for d in dsts) for p in pools}
        for p in pools:
            if extra[id(p)] > p.free_blocks:
                raise PoolExhausted(f"fork of slot {src}: {len(dsts)} copies of its {p.num_allocated(src)} blocks "
                                    f"need {extra[id(p)]} more, only {p.free_blocks} are free")
        kv_rows = self._copy_rows(self.pidx, src, dsts, int(self.pidx.length[src])) if kv else None
        attn_rows = self._copy_rows(self.attn, src, dsts, int(self.seq_len[src])) if self.attn is not None else None
        d_t = torch.tensor(dsts, dtype=torch.long, device=self.device)
        for store in self.layers.values():
            for key, v in store.items():
                if v is None or key == "prefix":   # the prefix store belongs to no slot
                    continue
                if isinstance(v, Tensor):          # attention k / v pools [blocks, block_size, ...]
                    flat = v.view(-1, *v.shape[2:])
                    flat[attn_rows[1]] = flat[attn_rows[0]]
                    continue
                for t in vars(v).values():
                    if not isinstance(t, Tensor):
                        continue
                    if key == "kv":                # KV-only pools [blocks * block_size, ...]
                        if kv:
                            t[kv_rows[1]] = t[kv_rows[0]]
                    else:                          # checkpoint state, ring, conv window [P, ...]
                        t[d_t] = t[src].clone()
        for t in (self.seq_len, self.ring.start, self.ring.length, self.kv_slot):
            t[d_t] = t[src].clone()
        if self.pidx is not None:
            self.pidx.length[d_t] = self.pidx.length[src].clone() if kv else 0
        if self.hidden is not None:                # kept hidden states (MTP) travel with the slot
            self.hidden[d_t] = self.hidden[src].clone()
            if src in self.prompt_hidden:
                for d in dsts:
                    self.prompt_hidden[d] = list(self.prompt_hidden[src])
        for d in dsts:
            self._modes[d] = self._modes[src]
            self._in_use.add(d)

    def _copy_rows(self, pool: PagedIndex, src: int, dsts: list[int], n: int) -> tuple[Tensor, Tensor]:
        """Give every ``dst`` as many blocks as ``src`` holds; returns the flat pool rows
        ``(from, to)`` that copy ``src``'s first ``n`` entries to each of them."""
        held = pool.num_allocated(src)
        for d in dsts:
            pool.reserve(d, held * pool.block_size)
        need, bs = pool.blocks_needed(n), pool.block_size
        off = torch.arange(bs)
        src_rows = (torch.tensor(pool.blocks_of(src)[:need], dtype=torch.long)[:, None] * bs + off).reshape(-1)
        dst_rows = torch.cat([(torch.tensor(pool.blocks_of(d)[:need], dtype=torch.long)[:, None] * bs + off).reshape(-1)
                              for d in dsts])
        return src_rows.repeat(len(dsts)).to(self.device), dst_rows.to(self.device)

    def _slot_rows(self, pool: PagedIndex, slot: int, n: int) -> Tensor:
        """Flat pool rows of ``slot``'s first ``n`` entries (device)."""
        bs = pool.block_size
        blocks = torch.tensor(pool.blocks_of(slot)[:pool.blocks_needed(n)], dtype=torch.long)
        return (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n].to(self.device)

    def swap_out(self, slot: int, key) -> None:
        """Copy everything ``slot`` holds to host memory under ``key`` — checkpoint states,
        rings and their pointers, conv windows, ``seq_len``, the form, its KV-only entries
        and attention keys/values (the blocks' contents), kept hidden states — then free the
        slot and its blocks (:meth:`release`).  :meth:`swap_in` restores it into any free
        slot.  Between steps only; ``key`` (hashable) must not hold a copy already."""
        self._check_idle()
        slot = int(slot)
        if not 0 < slot < self.P or slot not in self._in_use:
            raise ValueError(f"swap_out: slot must be a slot in use in [1, {self.P - 1}], got {slot}")
        if key in self._swapped:
            raise ValueError(f"swap_out: key {key!r} already holds a swapped-out slot")
        host = torch.device("cpu")
        kv = self.pidx is not None and self._modes[slot] == "kv"
        n_kv = int(self.pidx.length[slot]) if kv else 0
        n_attn = int(self.seq_len[slot]) if self.attn is not None else 0
        kv_rows = self._slot_rows(self.pidx, slot, n_kv) if kv else None
        attn_rows = self._slot_rows(self.attn, slot, n_attn) if self.attn is not None else None
        layers = {}
        for lid, store in self.layers.items():
            out = {}
            for name, v in store.items():
                if v is None or name == "prefix":   # the prefix store belongs to no slot
                    continue
                if isinstance(v, Tensor):           # attention k / v pools [blocks, block_size, ...]
                    out[name] = v.view(-1, *v.shape[2:])[attn_rows].to(host, copy=True)
                    continue
                for a, t in vars(v).items():
                    if not isinstance(t, Tensor):
                        continue
                    if name == "kv":                # KV-only pools [blocks * block_size, ...]
                        if kv:
                            out[(name, a)] = t[kv_rows].to(host, copy=True)
                    else:                           # checkpoint state, ring, conv window [P, ...]
                        out[(name, a)] = t[slot].to(host, copy=True)
            layers[lid] = out
        rec = dict(mode=self._modes[slot], n_kv=n_kv, n_attn=n_attn, layers=layers,
                   index=[int(t[slot]) for t in (self.seq_len, self.ring.start, self.ring.length, self.kv_slot)],
                   hidden=None if self.hidden is None else self.hidden[slot].to(host, copy=True),
                   prompt_hidden=[h.to(host, copy=True) for h in self.prompt_hidden.get(slot, [])])
        self._swapped[key] = rec
        self.release([slot])

    def swap_in(self, slot: int, key) -> None:
        """Restore the sequence :meth:`swap_out` kept under ``key`` into the free ``slot``
        (any slot: its blocks are drawn anew) exactly as it was; the host copy is dropped.
        Validated before anything is written (:class:`~replayssm.cache.paged.PoolExhausted`
        when the block pools are too small)."""
        self._check_idle()
        slot = int(slot)
        rec = self._swapped.get(key)
        if rec is None:
            raise ValueError(f"swap_in: no swapped-out slot under key {key!r}")
        if not 0 < slot < self.P or slot in self._in_use:
            raise ValueError(f"swap_in: slot must be a free slot in [1, {self.P - 1}], got {slot}")
        kv = rec["mode"] == "kv"
        need = [(p, n) for p, n in ((self.pidx if kv else None, rec["n_kv"]), (self.attn, rec["n_attn"]))
                if p is not None]
        for p, n in need:
            if not p.can_reserve(slot, n):
                raise PoolExhausted(f"swap_in into slot {slot}: {n} entries need "
                                    f"{p.blocks_needed(n) - p.num_allocated(slot)} blocks, only {p.free_blocks} free")
        for p, n in need:
            p.reserve(slot, n)
        kv_rows = self._slot_rows(self.pidx, slot, rec["n_kv"]) if kv else None
        attn_rows = self._slot_rows(self.attn, slot, rec["n_attn"]) if self.attn is not None else None
        for lid, store in self.layers.items():
            saved = rec["layers"][lid]
            for name, v in store.items():
                if v is None or name == "prefix":
                    continue
                if isinstance(v, Tensor):
                    v.view(-1, *v.shape[2:])[attn_rows] = saved[name].to(self.device)
                    continue
                for a, t in vars(v).items():
                    if not isinstance(t, Tensor) or (name, a) not in saved:
                        continue
                    if name == "kv":
                        t[kv_rows] = saved[(name, a)].to(self.device)
                    else:
                        t[slot] = saved[(name, a)].to(self.device)
        for t, val in zip((self.seq_len, self.ring.start, self.ring.length, self.kv_slot), rec["index"]):
            t[slot] = val
        if self.pidx is not None:
            self.pidx.length[slot] = rec["n_kv"]
        if self.hidden is not None and rec["hidden"] is not None:
            self.hidden[slot] = rec["hidden"].to(self.device)
        if rec["prompt_hidden"]:
            self.prompt_hidden[slot] = [h.to(self.device) for h in rec["prompt_hidden"]]
        self._modes[slot] = rec["mode"]
        self._in_use.add(slot)
        del self._swapped[key]

    def drop_swapped(self, key) -> None:
        """Forget the host copy kept under ``key`` (a swapped-out request that was aborted)."""
        self._swapped.pop(key, None)

    def switch_to_state(self, slots) -> None:
        """KV-only slots -> replay form: compress each layer's KV entries into its checkpoint
        state (one flush, ``kv_to_state``), empty the ring, free the slot's blocks."""
        self._check_idle()
        ids = [s for s in _as_list(slots) if s != 0 and self._modes[s] == "kv"]
        if not ids:
            return
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pplan = self.pidx.plan(t, 1, check=False)
        for layer in self.model.stateful_layers():
            if hasattr(layer, "kv_to_state"):
                layer.kv_to_state(self.layers[layer.layer_id], pplan, t)
        self.ring.reset(t)
        for s in ids:
            self._modes[s] = "replay"
            self.pidx.release(s)
        self.kv_slot[t] = False

    # ------------------------------------------------------------------ prefix caching
    # (replayssm.models.prefix; the engine's prefix index decides every id passed here)
    def prefix_assign(self, slot: int, pairs) -> None:
        """Capture ``slot``'s logical blocks ``k`` into prefix-store blocks ``b`` during its
        next prefills (``pairs`` of ``(k, b)``)."""
        prefix_ops.assign(self, slot, pairs)

    def prefix_copy(self, src: int, dst: int, count: int) -> None:
        """Copy ``count`` tokens of prefix-store block ``src`` into ``dst`` (copy on write)."""
        prefix_ops.copy_block(self, src, dst, count)

    def prefix_copies(self, copies) -> None:
        """Several :meth:`prefix_copy` ``(src, dst, count)`` at once (one gather/scatter per
        stored tensor per layer)."""
        prefix_ops.copy_blocks(self, copies)

    def prefix_checkpoint(self, row: int, slot: int | None = None, chain=(), start: int = 0, stop: int = 0,
                          base: int | None = None) -> None:
        """Write prefix checkpoint ``row``: ``slot``'s state, or the chain's entries
        ``start .. stop-1`` folded into checkpoint ``base`` (zeros when None)."""
        prefix_ops.checkpoint(self, row, slot=slot, chain=chain, start=start, stop=stop, base=base)

    def prefix_checkpoints(self, jobs: list[dict]) -> None:
        """Several :meth:`prefix_checkpoint` calls (dicts of its arguments), validated
        together and written in batches per layer."""
        prefix_ops.checkpoint_many(self, jobs)

    def prefix_save_states(self, jobs) -> None:
        """State points: checkpoint ``row`` (and its conv window) takes the state of ``slot``
        after every token it holds, for each ``(row, slot)`` of ``jobs`` (a KV-only slot is
        compressed to a state first)."""
        prefix_ops.save_states(self, jobs)

    def load_prefix(self, slot: int, length: int, chain, attn=(), checkpoint=None) -> None:
        """Resume the free ``slot`` exactly at token ``length`` of a cached prefix (checkpoint
        + entries, conv inputs, shared attention blocks); a prefill continues from there."""
        prefix_ops.load(self, slot, length, chain, attn, checkpoint)

    def load_prefixes(self, requests) -> list:
        """:meth:`load_prefix` for several ``(slot, length, chain, attn, checkpoint)`` at once,
        written in one batch per layer; returns per request ``None`` or the exception that
        left its slot free (the others are loaded)."""
        return prefix_ops.load_many(self, requests)

    def prefix_retain_attn(self, blocks) -> None:
        """The prefix index takes a reference on attention blocks it caches."""
        self.attn.retain([int(b) for b in blocks])

    def prefix_drop_attn(self, blocks) -> None:
        """The prefix index gives back attention blocks it evicted (freed when unused)."""
        self.attn.drop([int(b) for b in blocks])
