"""The prefix cache over one model cache: a lookup at admission, the resume before a
sequence's first prefill, the capture of the blocks its prefill computes, and the references
it gives back when it finishes (see :mod:`replayssm.engine.prefix`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .index import CachedBlock, Match, PrefixIndex


@dataclass
class SeqPrefix:
    """A running sequence's part in the prefix cache."""

    chain: list = field(default_factory=list)      # cached blocks 0..k-1 of its prompt (held)
    pending: dict = field(default_factory=dict)    # logical block -> store block being captured
    load: Match | None = None                      # the hit to resume before the first prefill
    hit: int = 0                                   # prompt tokens resumed from the cache
    stopped: bool = False                          # no further block of this prompt is captured
    ended: bool = False                            # its reply was captured (capture_ends)


class PrefixCache:
    """The engine's prefix cache over one model cache (see the module docstring).

    ``cache``: a model cache with a prefix store (``make_cache(prefix_blocks=...)``);
    ``interval``: checkpoint interval in tokens (a multiple of ``block_size``);
    ``on_transfer(seq, blocks)``: called when ``blocks`` of ``seq``'s own attention blocks
    become cached (the block manager moves their bytes from the sequence to the cache);
    ``cache_replies``: when a request finishes, cache its state after prompt and reply
    (:meth:`capture_end`).
    """

    #: counters kept in ``stats`` (the engine's stats dict: a benchmark resets them with the rest)
    COUNTERS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens", "prefix_blocks_saved",
                "prefix_blocks_inserted", "prefix_states_saved", "prefix_state_hits", "prefix_state_hit_tokens",
                "prefix_replies_skipped")

    def __init__(self, cache, block_size: int, num_blocks: int, num_checkpoints: int, interval: int,
                 on_transfer=None, stats: dict | None = None, cache_replies: bool = True):
        self.cache, self.block_size, self.interval = cache, block_size, interval
        self.cache_replies = bool(cache_replies)
        self.has_attn = cache.attn is not None
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
        # a hit at a state point captures nothing of its prompt (its blocks would follow
        # state-only ones): its end capture caches the rest
        st = SeqPrefix(chain=list(m.full), load=m if m.length else None, hit=m.length, stopped=m.state)
        self.index.acquire(m.blocks)
        seq.prefix = st
        seq.num_prefilled = m.length
        self.stats["prefix_queries"] += 1
        self.stats["prefix_query_tokens"] += seq.num_prompt_tokens
        if m.length:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_hit_tokens"] += m.length
            self.stats["prefix_blocks_saved"] += len(m.full)
        if m.state:
            self.stats["prefix_state_hits"] += 1
            self.stats["prefix_state_hit_tokens"] += m.length

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
            if m.state:                       # a state point: its state and conv window
                ckpt = (m.length, m.blocks[-1].ckpt, True)
            for b in () if m.state else reversed(m.full):   # nearest checkpoint at or before the hit
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
                if m.partial is not None and not m.state and (k + 1) * bs <= seq.num_prompt_tokens:
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

    def resume(self, chunks: list[tuple[object, int]]) -> list[tuple[object, int]]:
        """Before a step's prefill: resume the hits of sequences about to prefill their first
        chunk (one batched load) and assign the store blocks the chunks reach.  A hit that
        cannot be loaded (a pool ran dry) ends that request with an error; the chunks of the
        others are returned."""
        hits = [s for s, _ in chunks if s.prefix is not None and s.prefix.load is not None]
        failed = set()
        for s, e in zip(hits, self.load_many(hits)):
            if e is not None:
                s.error, s.finish_reason = f"prefix cache: resuming the cached prefix failed: {e}", "error"
                failed.add(id(s))
            else:
                s.mode = self.cache.mode_of(s.slot)
        ok = [(s, n) for s, n in chunks if id(s) not in failed]
        for s, n in ok:
            self.before_prefill(s, n)
        return ok

    def clear(self) -> None:
        """Evict every unreferenced block and checkpoint (an idle engine after its warm-up)."""
        while self.index.evict_one():
            pass
        self.index.evictions = 0

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
            if not b.entries:             # a finished request's reply holds these tokens, without
                self.index.free_block(store)   # entries: stop (its end capture continues it)
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
    def capture_end(self, seq) -> None:
        """:meth:`capture_ends` of one sequence."""
        self.capture_ends([seq])

    def capture_ends(self, seqs) -> None:
        """Cache each finishing sequence's state after its prompt and reply (before its slot
        is freed; all of a step's in one ``cache.prefix_save_states`` call): the ``L =
        prompt + output - 1`` tokens its cache holds (the last sampled token was never fed).
        Its chain is extended by state-only blocks (tokens and, hybrids, the slot's
        attention blocks; no entries: decode steps capture none) up to ``L``, and the state
        point at ``L`` (the state-only block ending there, or a tail of ``L mod bs`` tokens)
        gets a checkpoint row holding the slot's state and conv window.  Store blocks and
        checkpoint rows come from the index (evicting unreferenced leaves; none free: less or
        nothing is cached).  Skipped: a sequence captured already, whose prompt is not
        complete, that produced nothing or failed, or whose cache holds other tokens than
        its own (a speculative step ran past its end: counted in ``prefix_replies_skipped``)."""
        if not self.cache_replies:
            return
        seqs = [seq for seq in seqs if seq.prefix is not None and not seq.prefix.ended and seq.prefix.load is None
                and seq.slot is not None and not seq.prefilling and seq.output_ids and seq.finish_reason != "error"
                and seq.error is None]
        if not seqs:
            return
        lens = self.cache.seq_len
        held = lens[torch.tensor([s.slot for s in seqs], dtype=torch.long, device=lens.device)].tolist()   # one sync
        todo = []
        for seq, n in zip(seqs, held):
            seq.prefix.ended = True
            if n != seq.num_cached:            # a speculative step ran past the reply's end
                self.stats["prefix_replies_skipped"] += 1
                continue
            job = self._extend(seq, seq.prefix)
            if job is not None:
                todo.append(job)
        if not todo:
            return
        try:
            self.cache.prefix_save_states([(j["row"], j["seq"].slot) for j in todo])
        except Exception:
            for j in todo:
                self.index.free_checkpoint(j["row"])
                if j["store"] is not None:
                    self.index.free_block(j["store"])
            raise
        attn = []
        for j in todo:
            if j["host"] is not None:             # the last whole block ends at L
                if j["host"].ckpt is not None:    # an equal conversation of this step took it
                    self.index.free_checkpoint(j["row"])
                    continue
                j["host"].ckpt = j["row"]
            else:                                 # a tail (an equal one may have come meanwhile)
                try:
                    host, new = self.index.insert(j["parent"], j["tokens"], j["store"], j["attn"], entries=False)
                except ValueError:
                    new = False
                if not new:
                    self.index.free_block(j["store"])
                    self.index.free_checkpoint(j["row"])
                    continue
                host.ckpt = j["row"]
                if j["attn"] is not None:
                    attn.append(j["attn"])
                    if self.on_transfer is not None:
                        self.on_transfer(j["seq"], 1)
            self.stats["prefix_states_saved"] += 1
        if attn:
            self.cache.prefix_retain_attn(attn)

    def _extend(self, seq, st: SeqPrefix) -> dict | None:
        """Extend ``seq``'s chain by state-only whole blocks up to its ``L`` tokens and take
        the state point's checkpoint row (and a tail's store block); the job to write, or
        None when nothing is to be written."""
        L = seq.num_cached
        bs, ix = self.block_size, self.index
        Q, r = divmod(L, bs)
        if r == 0 and len(st.chain) >= Q and (st.chain[Q - 1].entries or st.chain[Q - 1].ckpt is not None):
            return None                           # resumable at L already
        ids = seq.all_ids
        attn_of = self.cache.attn.blocks_of(seq.slot) if self.has_attn else None
        new_attn = []
        try:
            while len(st.chain) < Q:              # the whole blocks up to L, state-only where new
                k = len(st.chain)
                parent = st.chain[-1] if st.chain else None
                toks = ids[k * bs:(k + 1) * bs]
                b = ix.child(parent, toks)
                if b is None:
                    store = ix.alloc_block()
                    if store is None:
                        return None
                    attn = attn_of[k] if attn_of is not None else None
                    try:
                        b, _ = ix.insert(parent, toks, store, attn, entries=False)
                    except ValueError:            # a hash collision
                        ix.free_block(store)
                        return None
                    self.stats["prefix_blocks_inserted"] += 1
                    if attn is not None:
                        new_attn.append(attn)
                ix.acquire([b])                   # held until the sequence's references go back
                st.chain.append(b)
            if r == 0:
                host = st.chain[Q - 1]
                if host.entries or host.ckpt is not None:
                    return None
                row = ix.alloc_checkpoint()
                return None if row is None else dict(seq=seq, row=row, host=host, store=None)
            parent = st.chain[Q - 1] if Q else None
            toks = ids[Q * bs:L]
            if ix.child(parent, toks) is not None:
                return None                       # cached by an equal conversation
            store = ix.alloc_block()
            if store is None:
                return None
            row = ix.alloc_checkpoint()
            if row is None:
                ix.free_block(store)
                return None
            return dict(seq=seq, row=row, host=None, store=store, parent=parent, tokens=toks,
                        attn=attn_of[Q] if attn_of is not None else None)
        finally:
            if new_attn:                          # the cache holds the slot's blocks from now on
                self.cache.prefix_retain_attn(new_attn)
                if self.on_transfer is not None:
                    self.on_transfer(seq, len(new_attn))

    def finish(self, seq) -> None:
        """``seq`` leaves: give back its references and the store blocks it never filled."""
        st: SeqPrefix = seq.prefix
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
