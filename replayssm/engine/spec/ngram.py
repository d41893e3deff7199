"""Prompt-lookup drafters (no model): the request's own earlier tokens propose the drafts.

* :class:`NgramDrafter` (``method="ngram"``) — the last ``prompt_lookup_max ..
  prompt_lookup_min`` tokens are looked up in the request's earlier tokens and the
  ``num_tokens`` tokens that followed the most recent match are proposed as a chain (padded
  to ``num_tokens`` when the target runs CUDA graphs: one verify shape per batch bucket).
* :class:`NgramTreeDrafter` (``method="tree"`` without a draft model) — a trie of up to
  ``tree_width`` distinct continuations of ``depth`` tokens; its size varies per step, so
  its verify graphs are captured when first met.

Lookups go through :class:`NgramIndex`, an incremental per-request index of n-gram start
positions (a lookup costs the matches it visits and the new tokens, not a scan).
"""

from __future__ import annotations

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


class NgramIndex:
    """Incremental index of one sequence's n-grams (``n_min..n_max``): start positions per
    n-gram, so a lookup costs the matches it visits, not a scan of the whole sequence.
    :meth:`continuations` returns exactly what :func:`ngram_continuations` returns."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.maps: dict[int, dict[tuple, list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0
        self.tokens: list[int] = []   # :meth:`sync`'s copy of the sequence's tokens

    def sync(self, prompt: list[int], output: list[int]) -> list[int]:
        """The index's own copy of an append-only sequence (``prompt + output``), extended by
        the tokens it lacks: a lookup costs the new tokens, not a copy of the whole context
        (``Sequence.all_ids`` concatenates, 32 K tokens x 256 rows per step)."""
        ids, P = self.tokens, len(prompt)
        if len(ids) < P:
            ids.extend(prompt[len(ids):])
        ids.extend(output[len(ids) - P:])
        return ids

    def update(self, ids: list[int]) -> None:
        L, first = len(ids), self.indexed
        if L <= first:
            return
        for n, m in self.maps.items():
            get = m.get
            for start in range(max(0, first - n + 1), L - n + 1):
                key = tuple(ids[start:start + n])
                lst = get(key)
                if lst is None:
                    m[key] = [start]
                else:
                    lst.append(start)
        self.indexed = L

    def continuations(self, ids: list[int], length: int, max_count: int) -> list[list[int]]:
        self.update(ids)
        out: list[list[int]] = []
        L = len(ids)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            for start in reversed(self.maps[n].get(tuple(ids[L - n:]), ())):
                if start + n >= L:
                    continue  # the tail itself
                cont = ids[start + n:start + n + length]
                if cont and not any(c[: len(cont)] == cont for c in out):
                    out = [c for c in out if cont[: len(c)] != c]
                    out.append(cont)
                    if len(out) >= max_count:
                        return out
        return out


class _NgramBase(Drafter):
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[int, NgramIndex] = {}

    def _lookup(self, s: Sequence, length: int, count: int) -> list[list[int]]:
        idx = self._index.get(s.request_id)
        if idx is None or idx.owner is not s:   # a request id used again after its release
            idx = self._index[s.request_id] = NgramIndex(self.n_min, self.n_max)
            idx.owner = s
        return idx.continuations(idx.sync(s.prompt_ids, s.output_ids), length, count) if length > 0 else []

    def release(self, seq):
        self._index.pop(seq.request_id, None)


class NgramDrafter(_NgramBase):
    method = "ngram"

    def __init__(self, num_tokens: int, n_min: int, n_max: int, device, pad: bool = False):
        super().__init__(n_min, n_max)
        self.k, self.device, self.pad = num_tokens, canonical_device(device), pad

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
        hence one CUDA graph per batch bucket and length)."""
        k = self.k if k is None else k
        drafts = []
        for s in seqs:
            c = self._lookup(s, min(k, max(s.remaining - 1, 0)), 1)
            drafts.append(c[0] if c else [])
        n = max(len(d) for d in drafts)
        if n == 0:
            return None
        if self.pad:
            n = k
        B, N = len(seqs), n + 1
        rows = [[s.last_token] + d + [0] * (n - len(d)) for s, d in zip(seqs, drafts)]
        lens = torch.tensor([1 + len(d) for d in drafts])
        tokens = torch.tensor(rows, dtype=torch.long)
        valid = torch.arange(N)[None, :] < lens[:, None]
        # staged through pinned memory: a pageable `.to` waits for the previous step's kernels
        # (7.6 ms of host time a step at B=256 on an H200), so the host could not run ahead
        return Proposal(host_to_device(tokens, self.device), chain_parent(B, N, self.device),
                        host_to_device(valid, self.device))


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
