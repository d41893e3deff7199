"""Automatic prefix caching at token granularity (``LLM(..., enable_prefix_caching=True)``).

Prompts are cut into blocks of ``block_size`` tokens.  A block is identified by a hash chain,
``hash(parent block's hash, its tokens)``, so equal hashes mean equal prefixes (the tokens
and the parent are compared too: a hash collision is a miss, never a wrong hit).  What a
cached block holds lives in the model cache (:mod:`replayssm.models.prefix`): per SSM layer
every token's ring entry and conv input, a checkpoint state when the block ends on a
multiple of the checkpoint interval, and (hybrids) the attention block, shared with the
sequences reading it.

* :class:`PrefixIndex` is the host-side index (no tensors): hash chain, longest-prefix lookup
  at token granularity (whole blocks by hash, then the longest common token prefix inside
  the best child of the last whole block), reference counts (blocks a running sequence
  reads or extends are never evicted) and LRU eviction of unreferenced leaves when a new
  block or checkpoint needs room.  Unit-tested on its own.
* :class:`PrefixCache` ties the index to the model cache and the sequences: a lookup at
  admission, the resume (``cache.load_prefix``) before a sequence's first prefill, the
  capture of the blocks its prefill computes (store blocks assigned before, blocks and
  checkpoints inserted after), and the references it gives back when it finishes.

Why a hit can end at any token: the model cache resumes exactly at any position from the
nearest checkpoint plus the stored entries since it, so a hit is never rounded down to a
block or checkpoint boundary (engines that store only states can resume only where a state
was saved).  The resumed sequence then prefills the rest of its prompt; a hit stops one
token short of the prompt's end, so that prefill is never empty (it gives the first
token's logits).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


def block_hash(parent: int | None, tokens) -> int:
    """Hash of a block from its parent's hash (``None`` for the first block) and its tokens."""
    return hash((parent, tuple(tokens)))


@dataclass(eq=False)
class CachedBlock:
    """One cached block of ``block_size`` tokens.

    ``index``: its position in the sequence (tokens ``index*bs .. (index+1)*bs-1``);
    ``store``: its prefix-store block; ``attn``: its attention block (hybrids, else None);
    ``ckpt``: the checkpoint row of the state after it (``None``: none);
    ``ref``: sequences holding it.
    """

    hash: int
    parent: "CachedBlock | None"
    tokens: tuple
    index: int
    store: int
    attn: int | None = None
    ckpt: int | None = None
    ref: int = 0
    last_used: int = 0
    children: dict = field(default_factory=dict)

    @property
    def end(self) -> int:
        """Tokens up to and including this block (set by the index)."""
        return (self.index + 1) * len(self.tokens)


@dataclass
class Match:
    """Result of :meth:`PrefixIndex.lookup`: whole blocks matched (``full``), the block the
    match continues into (``partial``, its first ``length - len(full)*bs`` tokens used), and
    the hit ``length`` in tokens."""

    full: list
    partial: CachedBlock | None
    length: int

    @property
    def blocks(self) -> list:
        """Every block the hit reads, in order."""
        return self.full + ([self.partial] if self.partial is not None else [])


class PrefixIndex:
    """Hash-chained index of cached blocks with reference counts and LRU eviction.

    Store blocks ``1 .. num_blocks`` and checkpoint rows ``1 .. num_checkpoints`` are handed
    out here (``alloc_block`` / ``alloc_checkpoint``), evicting the least recently used
    unreferenced leaf block when none is free; ``on_evict(block)`` tells the owner (which
    gives back the block's attention block).  Only leaves are evicted, so every cached block's
    parents are cached: a chain is always whole from its first block.
    """

    def __init__(self, block_size: int, num_blocks: int, num_checkpoints: int, checkpoint_interval: int,
                 on_evict=None):
        for name, v, lo in (("block_size", block_size, 1), ("num_blocks", num_blocks, 1),
                            ("num_checkpoints", num_checkpoints, 0), ("checkpoint_interval", checkpoint_interval, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if checkpoint_interval % block_size:
            raise ValueError(f"checkpoint_interval {checkpoint_interval} is not a multiple of block_size {block_size}")
        self.block_size, self.interval = block_size, checkpoint_interval
        self.num_blocks, self.num_checkpoints = num_blocks, num_checkpoints
        self.on_evict = on_evict
        self._free_blocks = list(range(num_blocks, 0, -1))
        self._free_ckpts = list(range(num_checkpoints, 0, -1))
        self._by_hash: dict[int, CachedBlock] = {}
        self._roots: dict[int, CachedBlock] = {}
        self._clock = 0
        self.evictions = 0
        # eviction candidates (unreferenced leaves) by last use: a heap whose stale entries
        # (since referenced, given a child, used again, evicted) are skipped when popped
        self._heap: list = []
        self._seq = itertools.count()

    # -- views -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block: CachedBlock) -> bool:
        return self._by_hash.get(block.hash) is block

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, tokens, limit: int | None = None) -> Match:
        """Longest cached prefix of ``tokens``, at most ``limit`` tokens (default: all): whole
        blocks by hash, then the longest common token prefix with the children of the last
        whole block.  Changes nothing (not even LRU order)."""
        bs = self.block_size
        limit = len(tokens) if limit is None else min(int(limit), len(tokens))
        full, parent, h = [], None, None
        while (len(full) + 1) * bs <= limit:
            k = len(full)
            chunk = tuple(tokens[k * bs:(k + 1) * bs])
            h = block_hash(h, chunk)
            b = self._by_hash.get(h)
            if b is None or b.parent is not parent or b.tokens != chunk:
                break
            full.append(b)
            parent = b
        start = len(full) * bs
        rest = tokens[start:limit]
        best, best_n = None, 0
        if rest:
            kids = (parent.children if parent is not None else self._roots).values()
            for c in kids:
                n = 0
                for a, t in zip(c.tokens, rest):
                    if a != t:
                        break
                    n += 1
                if n > best_n:
                    best, best_n = c, n
        return Match(full, best, start + best_n)

    # -- references ------------------------------------------------------------------------
    def acquire(self, blocks) -> None:
        """One more holder for each cached block (and a fresh LRU time)."""
        t = self._tick()
        for b in blocks:
            if b not in self:
                raise ValueError("acquire: block is not in the index")
            b.ref += 1
            b.last_used = t

    def release(self, blocks) -> None:
        """Give back references taken with :meth:`acquire`."""
        blocks = list(blocks)
        for b in blocks:
            if b.ref <= 0:
                raise ValueError("release: block holds no reference")
        t = self._tick()
        for b in blocks:
            b.ref -= 1
            b.last_used = t
            self._candidate(b)

    def _candidate(self, b: CachedBlock) -> None:
        """Queue ``b`` for eviction if it is an unreferenced leaf."""
        if b.ref == 0 and not b.children and b in self:
            heapq.heappush(self._heap, (b.last_used, next(self._seq), b))
            if len(self._heap) > 4 * len(self._by_hash) + 64:   # drop the stale entries
                self._heap = [(x.last_used, next(self._seq), x) for x in self._by_hash.values()
                              if x.ref == 0 and not x.children]
                heapq.heapify(self._heap)

    # -- space -----------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Evict the least recently used unreferenced leaf; False when there is none."""
        while self._heap:
            used, _, b = heapq.heappop(self._heap)
            if b in self and b.ref == 0 and not b.children and b.last_used == used:
                break
        else:
            return False
        del self._by_hash[b.hash]
        (b.parent.children if b.parent is not None else self._roots).pop(b.hash, None)
        if b.parent is not None:
            self._candidate(b.parent)   # may be a leaf now
        self._free_blocks.append(b.store)
        if b.ckpt is not None:
            self._free_ckpts.append(b.ckpt)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(b)
        return True

    def alloc_block(self) -> int | None:
        """A free store block (evicting if needed), or None when every block is in use."""
        while not self._free_blocks:
            if not self.evict_one():
                return None
        return self._free_blocks.pop()

    def free_block(self, store: int) -> None:
        """Give back a store block that was never inserted."""
        self._free_blocks.append(store)

    def alloc_checkpoint(self) -> int | None:
        """A free checkpoint row (evicting unreferenced leaves until one frees up), or None."""
        while not self._free_ckpts:
            if not self.evict_one():
                return None
        return self._free_ckpts.pop()

    # -- insertion -------------------------------------------------------------------------
    def insert(self, parent: CachedBlock | None, tokens, store: int, attn: int | None = None) -> tuple[CachedBlock, bool]:
        """Add the block of ``tokens`` after ``parent`` (a cached block, or None for the first
        block) holding store block ``store``.  Returns ``(block, True)``, or the block already
        cached for this prefix and False (``store`` is then the caller's to free)."""
        tokens = tuple(tokens)
        if len(tokens) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(tokens)}")
        if parent is not None and parent not in self:
            raise ValueError("insert: the parent block is not cached")
        h = block_hash(parent.hash if parent is not None else None, tokens)
        old = self._by_hash.get(h)
        if old is not None:
            if old.parent is parent and old.tokens == tokens:
                return old, False
            raise ValueError("prefix hash collision")   # practically never; refuse rather than alias
        b = CachedBlock(h, parent, tokens, 0 if parent is None else parent.index + 1, store, attn,
                        last_used=self._tick())
        self._by_hash[h] = b
        (parent.children if parent is not None else self._roots)[h] = b
        self._candidate(b)
        return b, True


@dataclass
class SeqPrefix:
    """A running sequence's part in the prefix cache."""

    chain: list = field(default_factory=list)      # cached blocks 0..k-1 of its prompt (held)
    pending: dict = field(default_factory=dict)    # logical block -> store block being captured
    load: Match | None = None                      # the hit to resume before the first prefill
    hit: int = 0                                   # prompt tokens resumed from the cache
    stopped: bool = False                          # no further block of this prompt is captured


class PrefixCache:
    """The engine's prefix cache over one model cache (see the module docstring).

    ``cache``: a model cache with a prefix store (``make_cache(prefix_blocks=...)``);
    ``interval``: checkpoint interval in tokens (a multiple of ``block_size``);
    ``on_transfer(seq, blocks)``: called when ``blocks`` of ``seq``'s own attention blocks
    become cached (the block manager moves their bytes from the sequence to the cache).
    """

    #: counters kept in ``stats`` (the engine's stats dict: a benchmark resets them with the rest)
    COUNTERS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens", "prefix_blocks_saved",
                "prefix_blocks_inserted")

    def __init__(self, cache, block_size: int, num_blocks: int, num_checkpoints: int, interval: int,
                 on_transfer=None, stats: dict | None = None):
        self.cache, self.block_size, self.interval = cache, block_size, interval
        self.has_attn = getattr(cache, "attn", None) is not None
        self.index = PrefixIndex(block_size, num_blocks, num_checkpoints, interval, on_evict=self._evicted)
        self.on_transfer = on_transfer
        self._jobs: list[dict] = []       # checkpoints taken, written by write_checkpoints
        self.stats = stats if stats is not None else {}
        for k in self.COUNTERS:
            self.stats.setdefault(k, 0)

    def _evicted(self, b: CachedBlock) -> None:
        if b.attn is not None:
            self.cache.prefix_drop_attn([b.attn])

    # -- admission ---------------------------------------------------------------------------
    def match(self, seq) -> Match:
        """The hit ``seq`` would get now (its prompt but the last token); no change."""
        return self.index.lookup(seq.prompt_ids, seq.num_prompt_tokens - 1)

    def admit(self, seq, m: Match) -> None:
        """``seq`` got a slot: hold the blocks of its hit until it finishes (the partial one
        until it is loaded) and start its prompt at the hit."""
        st = SeqPrefix(chain=list(m.full), load=m if m.length else None, hit=m.length)
        self.index.acquire(m.blocks)
        seq.prefix = st
        seq.num_prefilled = m.length
        self.stats["prefix_queries"] += 1
        self.stats["prefix_query_tokens"] += seq.num_prompt_tokens
        if m.length:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_hit_tokens"] += m.length
            self.stats["prefix_blocks_saved"] += len(m.full)

    def load(self, seq) -> None:
        """Resume ``seq``'s slot at its hit (before its first prefill chunk); raises what the
        cache raised when it could not (the slot is left free)."""
        err = self.load_many([seq])[0]
        if err is not None:
            raise err

    def load_many(self, seqs) -> list[Exception | None]:
        """Resume every sequence of ``seqs`` at its hit in one batched cache call (sequences
        without a pending hit are skipped); per sequence ``None`` or the exception that kept
        it from loading (its slot is left free, the others are loaded)."""
        bs = self.block_size
        todo, reqs = [], []
        for seq in seqs:
            m = seq.prefix.load
            if m is None:
                continue
            ckpt = None
            for b in reversed(m.full):        # nearest checkpoint at or before the hit
                if b.ckpt is not None:
                    ckpt = (b.end, b.ckpt)
                    break
            attn = [b.attn for b in m.blocks] if self.has_attn else ()
            todo.append(seq)
            reqs.append((seq.slot, m.length, [b.store for b in m.blocks], attn, ckpt))
        errors, copies = {}, []
        try:
            for seq, err in zip(todo, self.cache.load_prefixes(reqs) if reqs else []):
                errors[id(seq)] = err
                if err is not None:
                    continue
                st: SeqPrefix = seq.prefix
                m, k = st.load, len(st.load.full)
                if m.partial is not None and (k + 1) * bs <= seq.num_prompt_tokens:
                    # the sequence captures its own copy of the partly matched block: copy the used part
                    dst = self.index.alloc_block()
                    if dst is None:
                        st.stopped = True
                    else:
                        copies.append((m.partial.store, dst, m.length - k * bs))
                        st.pending[k] = dst
                        self.cache.prefix_assign(seq.slot, [(k, dst)])
            if copies:                        # before any partial block is released
                self.cache.prefix_copies(copies)
        finally:
            for seq in todo:
                m = seq.prefix.load
                seq.prefix.load = None
                if m.partial is not None:     # read (and copied): no longer held
                    self.index.release([m.partial])
        return [errors.get(id(seq)) for seq in seqs]

    # -- capture -----------------------------------------------------------------------------
    def before_prefill(self, seq, n: int) -> None:
        """Assign store blocks to the prompt blocks ``seq``'s next chunk of ``n`` tokens
        reaches (whole blocks of the prompt only)."""
        st: SeqPrefix = seq.prefix
        if st is None or st.stopped:
            return
        bs = self.block_size
        end = seq.num_prefilled + n
        last = min(-(-end // bs), seq.num_prompt_tokens // bs)   # blocks touched, whole ones only
        pairs = []
        for k in range(len(st.chain), last):
            if k in st.pending:
                continue
            b = self.index.alloc_block()
            if b is None:
                st.stopped = True
                break
            st.pending[k] = b
            pairs.append((k, b))
        if pairs:
            self.cache.prefix_assign(seq.slot, pairs)

    def after_prefill(self, seq) -> None:
        """Insert the blocks ``seq``'s prefill completed (in order), with their checkpoints
        (written for all sequences of the step by :meth:`write_checkpoints`) and (hybrids)
        attention blocks."""
        st: SeqPrefix = seq.prefix
        if st is None:
            return
        bs, C = self.block_size, self.interval
        transferred = 0
        while True:
            k = len(st.chain)
            store = st.pending.get(k)
            if store is None or (k + 1) * bs > seq.num_prefilled:
                break
            del st.pending[k]
            parent = st.chain[-1] if st.chain else None
            tokens = seq.prompt_ids[k * bs:(k + 1) * bs]
            attn = self.cache.attn.blocks_of(seq.slot)[k] if self.has_attn else None
            try:
                b, new = self.index.insert(parent, tokens, store, attn)
            except ValueError:            # a hash collision: stop caching this prompt
                self.index.free_block(store)
                st.stopped = True
                break
            self.index.acquire([b])
            st.chain.append(b)
            if not new:                   # cached meanwhile by another request: keep that one
                self.index.free_block(store)
                continue
            self.stats["prefix_blocks_inserted"] += 1
            if attn is not None:          # the cache holds the slot's block from now on
                self.cache.prefix_retain_attn([attn])
                transferred += 1
            if b.end % C == 0:
                self._checkpoint(seq, st, b)
        if transferred and self.on_transfer is not None:
            self.on_transfer(seq, transferred)

    def _checkpoint(self, seq, st: SeqPrefix, b: CachedBlock) -> None:
        """The state after block ``b`` (a multiple of the interval): the slot's own state when
        its prefill ended there in a state form, else the chain's entries folded into the
        previous checkpoint."""
        row = self.index.alloc_checkpoint()
        if row is None:
            return
        q = b.end
        if seq.num_prefilled == q and self.cache.mode_of(seq.slot) in ("replay", "recurrent"):
            self._jobs.append(dict(row=row, slot=seq.slot))
        else:
            base, start = None, 0
            for prev in reversed(st.chain[:b.index]):
                if prev.ckpt is not None:
                    base, start = prev.ckpt, prev.end
                    break
            self._jobs.append(dict(row=row, chain=[x.store for x in st.chain[:b.index + 1]], start=start, stop=q,
                                   base=base))
        b.ckpt = row

    def write_checkpoints(self) -> None:
        """Write the checkpoints this step's :meth:`after_prefill` calls took, in one batched
        cache call (before the slots' states move on: right after the prefill)."""
        if self._jobs:
            jobs, self._jobs = self._jobs, []
            self.cache.prefix_checkpoints(jobs)

    # -- end -------------------------------------------------------------------------------
    def finish(self, seq) -> None:
        """``seq`` leaves: give back its references and the store blocks it never filled."""
        st: SeqPrefix = getattr(seq, "prefix", None)
        if st is None:
            return
        if st.load is not None:           # never loaded: the partial block is still held
            if st.load.partial is not None:
                self.index.release([st.load.partial])
        self.index.release(st.chain)
        for b in st.pending.values():
            self.index.free_block(b)
        seq.prefix = None

    # -- numbers ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Counters (lookups, hits, prompt tokens looked up / resumed from the cache, whole
        blocks reused and inserted) plus the blocks cached now, free store blocks, evictions
        and the hit rate (resumed / looked-up prompt tokens)."""
        s = {k: self.stats.get(k, 0) for k in self.COUNTERS}
        s["prefix_cached_blocks"] = len(self.index)
        s["prefix_free_blocks"] = self.index.free_blocks
        s["prefix_evictions"] = self.index.evictions
        q = s["prefix_query_tokens"]
        s["prefix_hit_rate"] = s["prefix_hit_tokens"] / q if q else 0.0
        return s

    # -- scheduling ------------------------------------------------------------------------
    def align(self, seq, n: int) -> int:
        """A chunk of ``n`` prompt tokens that stops short of the prompt's end (the step's
        token budget) and crosses a checkpoint boundary ends on the last boundary it crosses,
        so that the state the prefill leaves there is that checkpoint (a copy) in a state
        form.  A chunk that reaches the prompt's end keeps its length: its checkpoints are
        folds of the chain's entries, one kernel launch per layer, far cheaper than the extra
        prefill step ending it on the boundary would cost (H100, 2026-11-25: a 2.7B prefill
        step of 16 chat turns ~150 ms).  KV-only slots hold no state to copy: every chunk keeps
        its length."""
        s0, C = seq.num_prefilled, self.interval
        if seq.prefix is None or seq.prefix.stopped or s0 + n >= seq.num_prompt_tokens:
            return n
        end = min(s0 + n, seq.num_prompt_tokens // self.block_size * self.block_size) // C * C
        return end - s0 if s0 < end < s0 + n else n


def default_checkpoint_interval(layout, max_seq_len: int) -> int:
    """Checkpoint interval ``C`` (tokens, a multiple of the block size): ``S / C ≈ E / 4``
    with ``S`` one checkpoint and ``E`` one token's whole ring entries and conv inputs over
    all SSM layers (``C ≈ 4 S / E``; what a resume reads per folded token, and what the store
    kept per token before Mamba-2 entries were rebuilt from the conv inputs, so the interval
    and a hit's fold length stay where they were measured).  Loading a hit folds fewer than
    ``C`` entries per layer."""
    bs = layout.block_size
    per_token = max(1, layout.fold_token_bytes or layout.prefix_block_bytes // bs)
    blocks = max(1, round(4 * layout.checkpoint_bytes / (per_token * bs)))
    return min(blocks, max(1, -(-max_seq_len // bs))) * bs


@dataclass(frozen=True)
class StorePlan:
    """Size of the prefix store: ``blocks`` store blocks, ``checkpoints`` checkpoint rows, the
    checkpoint ``interval`` and the ``bytes`` it takes (store, checkpoints, the attention
    blocks the cache may hold, null rows included)."""

    blocks: int
    checkpoints: int
    interval: int
    bytes: int


def plan_store(layout, *, budget: int | None, fraction: float, blocks: int | None, interval: int | None,
               num_slots: int, max_seq_len: int) -> StorePlan:
    """How big the prefix store is: ``blocks`` when given; else ``fraction`` of the memory
    ``budget``; without a budget, one full context per slot (``num_slots * max_seq_len``
    tokens).  Checkpoint rows: one per ``interval`` tokens of the store, plus two."""
    bs = layout.block_size
    C = interval or default_checkpoint_interval(layout, max_seq_len)
    per_block = layout.prefix_block_bytes + layout.attn_block_bytes + layout.checkpoint_bytes * bs / C
    fixed = layout.prefix_block_bytes + 3 * layout.checkpoint_bytes + (num_slots + 1) * layout.prefix_slot_bytes
    if blocks is None:
        if budget is None:
            blocks = num_slots * -(-max_seq_len // bs)
        else:
            blocks = int((fraction * budget - fixed) // per_block)
            if blocks < 1:
                raise ValueError(f"prefix_cache_fraction={fraction} of memory_budget {budget} B holds no block of the "
                                 f"prefix store ({int(per_block + fixed)} B); raise either, or set prefix_cache_blocks")
    ckpts = -(-blocks * bs // C) + 2
    total = ((blocks + 1) * layout.prefix_block_bytes + blocks * layout.attn_block_bytes
             + (ckpts + 1) * layout.checkpoint_bytes + (num_slots + 1) * layout.prefix_slot_bytes)
    return StorePlan(int(blocks), int(ckpts), int(C), int(total))
