"""The prefix cache's host-side index (no tensors): blocks of ``block_size`` prompt tokens
identified by a hash chain, longest-prefix lookup at token granularity, reference counts
and LRU eviction of unreferenced leaves (see :mod:`replayssm.engine.prefix`)."""

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
    ``ref``: sequences holding it; ``end``: tokens up to and including it (set by the index);
    ``entries``: whether the store holds every token's entries and conv inputs (a prompt's
    block), else only tokens and attention blocks (a block of a finished request's reply,
    :meth:`PrefixCache.capture_end`): such a block is resumed only at a **state point** at its
    end (``ckpt``, a saved state and conv window).  A state-only block may be a **tail** of
    fewer than ``block_size`` tokens: a leaf whose only use is its state point.  On every
    chain, blocks with entries come first (a prompt capture never continues a state-only
    block), so folds never read a state-only block.
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
    end: int = 0
    entries: bool = True


@dataclass
class Match:
    """Result of :meth:`PrefixIndex.lookup`: whole blocks matched (``full``), the block the
    match continues into (``partial``, its first ``length - len(full)*bs`` tokens used), and
    the hit ``length`` in tokens.  ``state``: the hit is a state point (the end of
    ``blocks[-1]``, a state-only block: resume from its checkpoint, capture nothing after)."""

    full: list
    partial: CachedBlock | None
    length: int
    state: bool = False

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
    def child(self, parent: CachedBlock | None, tokens) -> CachedBlock | None:
        """The cached block of ``tokens`` right after ``parent`` (None: none)."""
        tokens = tuple(tokens)
        b = self._by_hash.get(block_hash(parent.hash if parent is not None else None, tokens))
        return b if b is not None and b.parent is parent and b.tokens == tokens else None

    def lookup(self, tokens, limit: int | None = None) -> Match:
        """Longest cached prefix of ``tokens``, at most ``limit`` tokens (default: all): whole
        blocks by hash, then the longest common token prefix with the children of the last
        whole block; where the chain has entries, at any token, past it only at a state point
        (the end of a state-only block with a checkpoint, or a tail matched whole).  Changes
        nothing (not even LRU order)."""
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
        kids = list((parent.children if parent is not None else self._roots).values()) if rest else []
        e = 0                                   # whole blocks with entries (a prefix of the chain)
        while e < len(full) and full[e].entries:
            e += 1
        hit = Match(full[:e], None, e * bs)
        if e == len(full):
            best, best_n = None, 0
            for c in kids:
                if not c.entries:
                    continue
                n = 0
                for a, t in zip(c.tokens, rest):
                    if a != t:
                        break
                    n += 1
                if n > best_n:
                    best, best_n = c, n
            hit = Match(full, best, start + best_n)
        # state points past the entries: a tail matched whole, else the last state-only block
        # with a checkpoint
        for c in kids:
            n = len(c.tokens)
            if not c.entries and c.ckpt is not None and n < bs and n <= len(rest) and c.end > hit.length \
                    and tuple(rest[:n]) == c.tokens:
                hit = Match(full, c, c.end, state=True)
        if not hit.state:
            for j in range(len(full) - 1, e - 1, -1):
                if full[j].ckpt is not None:
                    if full[j].end > hit.length:
                        hit = Match(full[:j + 1], None, full[j].end, state=True)
                    break
        return hit

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

    def free_checkpoint(self, row: int) -> None:
        """Give back a checkpoint row no block was given."""
        self._free_ckpts.append(row)

    def alloc_checkpoint(self) -> int | None:
        """A free checkpoint row (evicting unreferenced leaves until one frees up), or None."""
        while not self._free_ckpts:
            if not self.evict_one():
                return None
        return self._free_ckpts.pop()

    # -- insertion -------------------------------------------------------------------------
    def insert(self, parent: CachedBlock | None, tokens, store: int, attn: int | None = None,
               entries: bool = True) -> tuple[CachedBlock, bool]:
        """Add the block of ``tokens`` after ``parent`` (a cached block, or None for the first
        block) holding store block ``store``; ``entries=False``: a state-only block (a tail
        may hold fewer tokens).  Returns ``(block, True)``, or the block already cached for
        this prefix and False (``store`` is then the caller's to free)."""
        tokens = tuple(tokens)
        if not (len(tokens) == self.block_size or (not entries and 0 < len(tokens) < self.block_size)):
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(tokens)}")
        if parent is not None and parent not in self:
            raise ValueError("insert: the parent block is not cached")
        if parent is not None and (len(parent.tokens) != self.block_size or (entries and not parent.entries)):
            raise ValueError("insert: a tail has no children, and a block with entries never follows a "
                             "state-only one")
        h = block_hash(parent.hash if parent is not None else None, tokens)
        old = self._by_hash.get(h)
        if old is not None:
            if old.parent is parent and old.tokens == tokens:
                return old, False
            raise ValueError("prefix hash collision")   # practically never; refuse rather than alias
        b = CachedBlock(h, parent, tokens, 0 if parent is None else parent.index + 1, store, attn,
                        last_used=self._tick(), end=(0 if parent is None else parent.end) + len(tokens),
                        entries=bool(entries))
        self._by_hash[h] = b
        (parent.children if parent is not None else self._roots)[h] = b
        self._candidate(b)
        return b, True
