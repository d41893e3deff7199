"""Prompt-lookup drafters (no model): the request's own earlier tokens propose the drafts.

* :class:`NgramDrafter` (``method="ngram"``) — the last ``prompt_lookup_max ..
  prompt_lookup_min`` tokens are looked up in the request's earlier tokens and the
  ``num_tokens`` tokens that followed the most recent match are proposed as a chain (padded
  to ``num_tokens`` when the target runs CUDA graphs: one verify shape per batch bucket).
* :class:`NgramTreeDrafter` (``method="tree"`` without a draft model) — a trie of up to
  ``tree_width`` distinct continuations of ``depth`` tokens; its size varies per step, so
  its verify graphs are captured when first met.

Lookups go through incremental per-request indexes (O(1) work per new token and ``n``, no
scan, no container object per n-gram for the garbage collector to walk):
:class:`NgramTailIndex` (chains: the most recent match of the tail, O(1)) and
:class:`NgramIndex` (tries: every earlier match, as chains of starts).  Prompts are indexed
at the prefill; :func:`ngram_continuations` is the plain reference both equal.
"""

from __future__ import annotations

from array import array

import torch

from ...runtime import canonical_device, host_to_device
from ..sequence import Sequence
from .base import Drafter, Proposal, chain_parent


def ngram_continuations(ids: list[int], n_min: int, n_max: int, length: int, max_count: int) -> list[list[int]]:
    """Up to ``max_count`` distinct continuations (each up to ``length`` tokens) that
    followed earlier occurrences of the sequence's last ``n`` tokens, longest ``n`` first,
    most recent match first."""
    out: list[list[int]] = []
    L = len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = ids[L - n:]
        first = tail[0]
        for start in range(L - n - 1, -1, -1):
            if ids[start] != first or ids[start:start + n] != tail:
                continue
            cont = ids[start + n:start + n + length]
            if cont and not any(c[: len(cont)] == cont for c in out):
                out = [c for c in out if cont[: len(c)] != c]  # a longer one replaces its prefix
                out.append(cont)
                if len(out) >= max_count:
                    return out
    return out


class _SequenceIndex:
    """What both n-gram indexes keep of one append-only sequence: its tokens as indexed, per
    ``n`` in ``n_min..n_max`` an int -> int dict from an n-gram's key to its latest start,
    the keys of the 1..n_max-grams ending at the last token, whether every id so far packs
    exactly, and the :class:`Sequence` it indexes (a request id may be used again)."""

    __slots__ = ("n_min", "n_max", "tokens", "last", "ends", "exact", "owner")

    def __init__(self, n_min: int, n_max: int):
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"{type(self).__name__}: need 1 <= n_min <= n_max, got {n_min!r}, {n_max!r}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens = array("q")                              # the sequence's tokens, as indexed
        self.last = [{} for _ in range(n_min, n_max + 1)]      # per n: key -> most recent start
        self.ends = [0] * n_max      # ends[j]: key of the (j + 1)-gram ending at the last token
        self.exact = True            # every id so far in [0, 2**32): keys are exact
        self.owner = None

    @property
    def indexed(self) -> int:
        return len(self.tokens)

    def sync(self, prompt: list[int], output: list[int]):
        """Index (the subclass's ``extend``) the tokens of the append-only sequence
        ``prompt + output`` the index lacks
        (a lookup costs the new tokens, not a copy of the whole context: ``Sequence.all_ids``
        concatenates, 32 K tokens x 256 rows per step); returns the index's tokens."""
        L, P = len(self.tokens), len(prompt)
        if L < P:
            self.extend(prompt[L:])
            L = P
        if L - P < len(output):
            self.extend(output[L - P:])
        return self.tokens


class NgramIndex(_SequenceIndex):
    """Incremental index of one sequence's n-grams (``n_min..n_max``), O(1) work per new
    token and n-gram length: a lookup costs the matches it visits, not a scan.

    Per ``n``: ``last[key]``, the most recent start of the n-gram ``key``, and
    ``prev[start]``, the start of the previous occurrence of the n-gram at ``start`` (-1:
    none), so the occurrences of an n-gram, most recent first, are a chain through ``prev``.
    A key packs the n-gram's tokens into one int, ``Σ_i t_i << 32 (n - 1 - i)`` (exact for
    ids in ``[0, 2**32)``; other ids may collide, then every match is verified against the
    tokens).  Tokens, chains and maps are arrays and int -> int dicts: no references for a
    full garbage collection to walk (no per-n-gram lists or tuples).
    :meth:`continuations` returns exactly what :func:`ngram_continuations` returns; token ids
    must fit in int64."""

    __slots__ = ("prev",)

    def __init__(self, n_min: int, n_max: int):
        super().__init__(n_min, n_max)
        self.prev = [array("q") for _ in range(n_min, n_max + 1)]   # per n: start -> previous start

    def extend(self, new) -> None:
        """Append and index ``new`` tokens: per token and ``n``, one key, one dict lookup and
        one store."""
        toks, ends, last, prev = self.tokens, self.ends, self.last, self.prev
        n_min, top = self.n_min, self.n_max - 1
        for t in new:
            if t >> 32:   # negative or >= 2**32: keys may collide from here on
                self.exact = False
            toks.append(t)
            L = len(toks)
            for j in range(top, 0, -1):
                ends[j] = (ends[j - 1] << 32) | t
            ends[0] = t
            for j in range(min(top, L - 1), n_min - 2, -1):   # n = j + 1 <= L
                d, key, start = last[j - n_min + 1], ends[j], L - 1 - j
                prev[j - n_min + 1].append(d.get(key, -1))
                d[key] = start

    def update(self, ids) -> None:
        """Index the tokens of ``ids`` (an append-only list) past :attr:`indexed`."""
        if ids is not None and ids is not self.tokens and len(ids) > len(self.tokens):
            self.extend(ids[len(self.tokens):])

    def _matches(self, n: int):
        """Starts of the earlier occurrences of the sequence's last ``n`` tokens (the tail
        itself excluded), most recent first."""
        toks, chain = self.tokens, self.prev[n - self.n_min]
        L = len(toks)
        start = chain[L - n]
        if self.exact:
            while start >= 0:
                yield start
                start = chain[start]
        else:
            tail = toks[L - n:]
            while start >= 0:
                if toks[start:start + n] == tail:
                    yield start
                start = chain[start]

    def first(self, length: int) -> list[int]:
        """``continuations(tokens, length, 1)[0]`` (or ``[]``): what followed the most recent
        earlier occurrence of the longest tail ``n``-gram that has one; O(1) with exact keys."""
        toks = self.tokens
        L = len(toks)
        if length <= 0:
            return []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            chain = self.prev[n - self.n_min]
            start = chain[L - n]
            if not self.exact:
                tail = toks[L - n:]
                while start >= 0 and toks[start:start + n] != tail:
                    start = chain[start]
            if start >= 0:   # start + n <= L - 1: at least one token follows
                return toks[start + n:start + n + length].tolist()
        return []

    def continuations(self, ids, length: int, max_count: int) -> list[list[int]]:
        """Up to ``max_count`` distinct continuations of ``ids`` (see
        :func:`ngram_continuations`); ``ids`` must extend what was indexed before."""
        self.update(ids)
        toks = self.tokens
        L = len(toks)
        out: list[list[int]] = []
        if length <= 0:
            return out
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            for start in self._matches(n):
                cont = toks[start + n:start + n + length].tolist()
                if not any(c[: len(cont)] == cont for c in out):
                    out = [c for c in out if cont[: len(c)] != c]   # a longer one replaces its prefix
                    out.append(cont)
                    if len(out) >= max_count:
                        return out
        return out


class NgramTailIndex(_SequenceIndex):
    """The chain drafter's index of one sequence: per ``n`` in ``n_min..n_max`` the most
    recent start of every n-gram (an int -> int dict; keys pack the tokens as in
    :class:`NgramIndex`), and for the tail (the last ``n`` tokens) the start of its previous
    occurrence, read while the tail is stored.  A new token costs one store per ``n``
    (plus one lookup per ``n`` for a step's last token); :meth:`first` is O(1) and equals
    ``ngram_continuations(tokens, n_min, n_max, length, 1)``.  Ids outside ``[0, 2**32)``
    (keys could collide) switch the index to that plain scan."""

    __slots__ = ("before",)

    def __init__(self, n_min: int, n_max: int):
        super().__init__(n_min, n_max)
        self.before = [-1] * (n_max - n_min + 1)     # per n: previous start of the tail n-gram

    def advance(self, prompt: list[int], output: list[int], length: int) -> list[int]:
        """:meth:`sync` then :meth:`first` (the drafter's per-row step)."""
        self.sync(prompt, output)
        return self.first(length)

    def extend(self, new) -> None:
        """Append and index ``new`` tokens (a list): per token and ``n``, the key of the
        n-gram ending at it (rolled from the previous token's keys) is looked up — the tail's
        previous start, kept in :attr:`before` — and stored as its latest start."""
        toks, ends, before, last, n_min = self.tokens, self.ends, self.before, self.last, self.n_min
        for t in new:
            L = len(toks)             # t's position
            toks.append(t)
            if t >> 32:               # negative or >= 2**32: keys may collide from here on
                self.exact = False
            for i in range(len(ends) - 1, 0, -1):   # ends[i]: the (i+1)-gram ending at t
                ends[i] = (ends[i - 1] << 32) | t
            ends[0] = t
            n = n_min
            for j, d in enumerate(last):
                if n > L + 1:         # the sequence is shorter than n
                    before[j] = -1
                else:
                    key = ends[n - 1]
                    before[j] = d.get(key, -1)
                    d[key] = L + 1 - n
                n += 1

    def first(self, length: int) -> list[int]:
        """The ``length`` tokens (or fewer) that followed the most recent earlier occurrence
        of the longest tail n-gram that has one (``[]``: none, or ``length <= 0``)."""
        if length <= 0:
            return []
        toks = self.tokens
        if not self.exact:
            c = ngram_continuations(toks.tolist(), self.n_min, self.n_max, length, 1)
            return c[0] if c else []
        L, before = len(toks), self.before
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            b = before[n - self.n_min]
            if b >= 0:
                return toks[b + n:b + n + length].tolist()
        return []


class HostStaging:
    """One int64 host buffer reused for every proposal's copy to the device (pinned on
    CUDA: the copy is asynchronous, the host does not wait for queued kernels).  A CUDA
    event recorded after each copy is waited on before the buffer is written again (the
    step's host sync has normally passed it: the wait returns at once)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._buf = self._np = self._event = None

    def to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` as a 1-D int64 tensor on the device (one copy)."""
        if not self.cuda:
            return torch.frombuffer(array("q", values), dtype=torch.long).to(self.device)
        m = len(values)
        if self._event is not None:
            self._event.synchronize()
        else:
            self._event = torch.cuda.Event()
        if self._buf is None or self._buf.numel() < m:
            self._buf = torch.empty(max(m, 4096), dtype=torch.long, pin_memory=True)
            self._np = self._buf.numpy()
        self._np[:m] = values
        out = self._buf[:m].to(self.device, non_blocking=True)   # on the device's current stream
        self._event.record(torch.cuda.current_stream(self.device))
        return out


class _NgramBase(Drafter):
    index_class = NgramIndex

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._index: dict = {}

    def _index_of(self, s: Sequence):
        """``s``'s index, synced to its tokens (a new one for a request id used again)."""
        idx = self._index.get(s.request_id)
        if idx is None or idx.owner is not s:
            idx = self._index[s.request_id] = self.index_class(self.n_min, self.n_max)
            idx.owner = s
        idx.sync(s.prompt_ids, s.output_ids)
        return idx

    def _lookup(self, s: Sequence, length: int, count: int) -> list[list[int]]:
        """Up to ``count`` continuations of up to ``length`` tokens (:func:`ngram_continuations`)."""
        if length <= 0:
            return []
        idx = self._index_of(s)
        if isinstance(idx, NgramTailIndex):
            if count != 1:
                raise ValueError(f"{type(self).__name__}: its index finds one continuation, asked for {count}")
            c = idx.first(length)
            return [c] if c else []
        return idx.continuations(None, length, count)

    def prefill(self, seqs):
        """Index the prompts now (a step's ``propose`` then indexes only its new tokens)."""
        for s in seqs:
            self._index_of(s)

    def release(self, seq):
        self._index.pop(seq.request_id, None)


class NgramDrafter(_NgramBase):
    method = "ngram"
    index_class = NgramTailIndex   # one continuation per row: no chains of earlier matches

    def __init__(self, num_tokens: int, n_min: int, n_max: int, device, pad: bool = False):
        super().__init__(n_min, n_max)
        self.k, self.device, self.pad = num_tokens, canonical_device(device), pad
        self._stage = HostStaging(self.device)

    @classmethod
    def create(cls, setup, *, target, cache, sampler, runner, num_slots):
        # with CUDA graphs, chains are padded to num_tokens drafts: one graph per batch bucket
        sp = setup.config
        return cls(sp.num_tokens, sp.prompt_lookup_min, sp.prompt_lookup_max, setup.device, pad=runner.use_graphs)

    def graph_shapes(self):
        return [(self.k + 1, False)]

    def propose(self, seqs, k=None):
        """Chains of up to ``k`` (default: ``num_tokens``) looked-up drafts; shorter rows are
        padded with invalid nodes (to ``k`` when ``pad``: one verify shape per draft length,
        hence one CUDA graph per batch bucket and length).  A row with ``remaining <= 1``
        drafts nothing (its index catches up when it next drafts).

        Host work per row: the new tokens' index entries and one lookup per n (no copy of
        the context); the tokens and their counts go to the device as one tensor (one copy,
        pinned on CUDA), ``valid`` is derived there."""
        k = self.k if k is None else k
        index, n_min, n_max = self._index, self.n_min, self.n_max
        drafts, lasts, n = [], [], 0
        for s in seqs:
            length = s.remaining - 1
            if length > k:
                length = k
            if length <= 0:
                drafts.append(())
                lasts.append(s.last_token)
                continue
            idx = index.get(s.request_id)
            if idx is None or idx.owner is not s:   # new, or a request id used again after its release
                idx = index[s.request_id] = self.index_class(n_min, n_max)
                idx.owner = s
            d = idx.advance(s.prompt_ids, s.output_ids, length)
            drafts.append(d)
            lasts.append(idx.tokens[-1])
            if len(d) > n:
                n = len(d)
        if n == 0:
            return None
        if self.pad:
            n = k
        B, N = len(seqs), n + 1
        flat = [0] * (B * N + B)    # [B, N] tokens (root, drafts, zeros), then the B counts
        for b, (t, d) in enumerate(zip(lasts, drafts)):
            o = b * N
            flat[o] = t
            flat[o + 1:o + 1 + len(d)] = d
            flat[B * N + b] = 1 + len(d)
        dev = self._stage.to_device(flat)
        tokens = dev[:B * N].view(B, N)
        valid = torch.arange(N, device=self.device)[None, :] < dev[B * N:, None]
        return Proposal(tokens, chain_parent(B, N, self.device), valid)


class NgramTreeDrafter(_NgramBase):
    """Merge up to ``width`` prompt-lookup continuations of ``depth`` tokens into a trie."""

    method = "tree"

    def __init__(self, width: int, depth: int, n_min: int, n_max: int, device):
        super().__init__(n_min, n_max)
        self.w, self.d = width, depth
        self.device = canonical_device(device)

    @classmethod
    def create(cls, setup, *, target, cache, sampler, runner, num_slots):
        sp = setup.config
        return cls(sp.tree_width, sp.depth, sp.prompt_lookup_min, sp.prompt_lookup_max, setup.device)

    # graph_shapes: [] (the trie's size varies per step; its graphs are captured when first met)

    def propose(self, seqs, k=None):
        """A trie per row (``k`` is not used: a tree is proposed whole)."""
        tries = []
        for s in seqs:
            conts = self._lookup(s, min(self.d, max(s.remaining - 1, 0)), self.w)
            nodes: list[tuple[int, int]] = []  # (token, parent) ; parent -1 = root (node 0)
            index: dict[tuple, int] = {}
            for c in conts:
                par = 0
                for depth in range(len(c)):
                    key = tuple(c[: depth + 1])
                    if key not in index:
                        nodes.append((c[depth], par))
                        index[key] = len(nodes)
                    par = index[key]
            tries.append(nodes)
        n = max(len(t) for t in tries)
        if n == 0:
            return None
        N = n + 1
        pad = [(0, 0)] * n
        tok_rows, par_rows = [], []
        for s, nodes in zip(seqs, tries):
            full = nodes + pad[len(nodes):]
            tok_rows.append([s.last_token] + [t for t, _ in full])
            par_rows.append([-1] + [p for _, p in full])
        lens = torch.tensor([1 + len(t) for t in tries])
        tokens = torch.tensor(tok_rows, dtype=torch.long)
        parent = torch.tensor(par_rows, dtype=torch.long)
        valid = torch.arange(N)[None, :] < lens[:, None]
        return Proposal(host_to_device(tokens, self.device), host_to_device(parent, self.device),
                        host_to_device(valid, self.device), tree=True)
