"""Drafters: propose draft chains or trees for a batch of running sequences.

A :class:`Proposal` packs, per row, ``N`` nodes where node 0 is the row's last accepted
token (not yet in the target cache) and nodes ``1..N-1`` are drafts, with ``parent [B, N]``
(``parent[:, 0] = -1``; a chain has ``parent[i] = i - 1``), ``valid [B, N]`` (padding
nodes are never accepted) and optional draft distributions ``q [B, N, V]`` for sampled
drafts (``None``: every draft is a deterministic choice).

* :class:`NgramDrafter` — prompt lookup, chains (no model).
* :class:`NgramTreeDrafter` — a trie of several prompt-lookup continuations.
* :class:`DraftModelDrafter` — a chain from a draft model.
* :class:`DraftTreeDrafter` — a static tree (rank paths) or a beam-search tree from a
  draft model.

Draft models keep their own cache with the same slot numbers as the target.  Invariant:
the draft cache holds ``seq.all_ids[:seq.draft_cached]``; the rest is fed at the next
proposal.  Tentative draft tokens are evaluated with ``verify``/``verify_tree`` and rolled
back with ``commit`` (0 entries, or the accepted ones after the target has verified), so
the draft never recomputes accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..runtime import canonical_device

from .model_runner import ModelRunner
from .sampler import Sampler, sample_from
from .sequence import Sequence


@dataclass
class Proposal:
    tokens: Tensor          # [B, N] long
    parent: Tensor          # [B, N] long
    valid: Tensor           # [B, N] bool
    q: Tensor | None = None  # [B, N, V] draft distributions of sampled drafts
    tree: bool = False      # verify with verify_tree (else a chain: verify)

    @property
    def num_drafts(self) -> Tensor:
        return self.valid[:, 1:].sum(-1)


def chain_parent(B: int, N: int, device) -> Tensor:
    return torch.arange(-1, N - 1, device=device).expand(B, N).contiguous()


class Drafter:
    method = "none"

    def prefill(self, seqs: list[Sequence]) -> None:
        pass

    def propose(self, seqs: list[Sequence]) -> Proposal | None:
        raise NotImplementedError

    def accepted(self, seqs: list[Sequence], accepted: list[int], path: Tensor | None) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def plain_step(self, seqs: list[Sequence]) -> None:
        """``seqs`` are about to decode one token without speculation (the engine's
        ``disable_by_batch_size``).  Drafters that catch up lazily from the token ids need
        nothing; the MTP head commits its pending pairs here."""

    def reset(self) -> None:
        """Forget a draft step left half-way by a failed engine step."""


# ---------------------------------------------------------------------------------------
# prompt lookup
# ---------------------------------------------------------------------------------------
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

    def propose(self, seqs):
        """Chains of up to ``k`` looked-up drafts; shorter rows are padded with invalid nodes
        (to ``k`` when ``pad``: one verify shape, hence one CUDA graph per batch bucket)."""
        drafts = []
        for s in seqs:
            c = self._lookup(s, min(self.k, max(s.remaining - 1, 0)), 1)
            drafts.append(c[0] if c else [])
        n = max(len(d) for d in drafts)
        if n == 0:
            return None
        if self.pad:
            n = self.k
        B, N = len(seqs), n + 1
        rows = [[s.last_token] + d + [0] * (n - len(d)) for s, d in zip(seqs, drafts)]
        lens = torch.tensor([1 + len(d) for d in drafts])
        tokens = torch.tensor(rows, dtype=torch.long)
        valid = torch.arange(N)[None, :] < lens[:, None]
        return Proposal(tokens.to(self.device), chain_parent(B, N, self.device), valid.to(self.device))


class NgramTreeDrafter(_NgramBase):
    """Merge up to ``width`` prompt-lookup continuations of ``depth`` tokens into a trie."""

    method = "tree"

    def __init__(self, width: int, depth: int, n_min: int, n_max: int, device):
        super().__init__(n_min, n_max)
        self.w, self.d = width, depth
        self.device = canonical_device(device)

    def propose(self, seqs):
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
        return Proposal(tokens.to(self.device), parent.to(self.device), valid.to(self.device), tree=True)


# ---------------------------------------------------------------------------------------
# draft models
# ---------------------------------------------------------------------------------------
class _DraftModelBase(Drafter):
    def __init__(self, model, cache, sampler: Sampler, device, max_batch: int, cuda_graphs: bool = False):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.device = canonical_device(device)
        self.runner = ModelRunner(model, cache, device, max_batch, cuda_graphs=cuda_graphs)
        self._deferred = False  # a draft verify waits for the target's verdict

    def prefill(self, seqs):
        logits = self.runner.prefill([s.slot for s in seqs], [s.prompt_ids for s in seqs])
        del logits
        for s in seqs:
            s.draft_cached = len(s.prompt_ids)

    def release(self, seq):
        if seq.slot is not None:
            self.cache.release([seq.slot])

    def reset(self) -> None:
        self.cache.clear_pending()
        self._deferred = False

    def _catch_up(self, seqs) -> Tensor:
        """Feed every sequence's tokens up to and including its last token; returns the
        draft logits after the last token ``[B, V]``."""
        while True:
            behind = [s for s in seqs if s.num_tokens - s.draft_cached > 1]
            if not behind:
                break
            toks = torch.tensor([s.token_at(s.draft_cached) for s in behind], dtype=torch.long)
            self.runner.decode([s.slot for s in behind], toks)
            for s in behind:
                s.draft_cached += 1
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        logits = self.runner.decode([s.slot for s in seqs], toks)
        for s in seqs:
            s.draft_cached += 1
        return logits

    def _any_sampling(self, seqs) -> bool:
        return any(not s.params.greedy for s in seqs)


class DraftModelDrafter(_DraftModelBase):
    """A chain of ``num_tokens`` drafts, drawn from the (transformed) draft distribution."""

    method = "draft"

    def __init__(self, model, cache, sampler, device, max_batch, num_tokens: int, cuda_graphs: bool = False):
        super().__init__(model, cache, sampler, device, max_batch, cuda_graphs)
        self.k = num_tokens

    def propose(self, seqs):
        B, k = len(seqs), self.k
        slots = [s.slot for s in seqs]
        sampling = self._any_sampling(seqs)
        logits = self._catch_up(seqs)
        drafts, qs = [], []
        u = self.sampler.uniforms(seqs, k) if sampling else None
        for j in range(k):
            if sampling:
                q = self.sampler.probs(logits, seqs)
                d = sample_from(q, u[:, j])
                qs.append(q)
            else:
                d = logits.argmax(-1)
            drafts.append(d)
            if j + 1 < k:
                lg = self.runner.verify(slots, torch.stack(drafts, 1))
                logits = lg[:, -1]
                if j + 2 < k:
                    self.runner.commit(torch.zeros(B, dtype=torch.long, device=self.device))
        self._deferred = k > 1
        last = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=self.device)
        tokens = torch.cat([last[:, None], torch.stack(drafts, 1)], 1)
        valid = torch.ones(B, k + 1, dtype=torch.bool, device=self.device)
        q = None
        if sampling:
            qz = torch.zeros_like(qs[0])
            q = torch.stack([qz] + qs, 1)
        return Proposal(tokens, chain_parent(B, k + 1, self.device), valid, q)

    def accepted(self, seqs, accepted, path):
        if not self._deferred:
            return
        keep = [min(a - 1, self.k - 1) for a in accepted]
        self.runner.commit(torch.tensor(keep, dtype=torch.long, device=self.device))
        for s, n in zip(seqs, keep):
            s.draft_cached += n
        self._deferred = False


class DraftTreeDrafter(_DraftModelBase):
    """Token trees from a draft model: ``shape="beam"`` (width x depth beam search) or a
    static tree of rank paths.  Greedy rows take the top-ranked tokens; sampling rows draw
    the children of each node i.i.d. from the draft distribution (so that multi-step
    speculative sampling stays lossless)."""

    method = "tree"

    def __init__(self, model, cache, sampler, device, max_batch, shape, width: int, depth: int,
                 cuda_graphs: bool = False):
        super().__init__(model, cache, sampler, device, max_batch, cuda_graphs)
        self.shape, self.w, self.d = shape, width, depth
        if shape != "beam":
            paths = list(shape)
            self.static_parent = [-1] + [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
            self.static_rank = [0] + [p[-1] for p in paths]
            self.static_depth = [0] + [len(p) for p in paths]

    @property
    def num_nodes(self) -> int:
        """Nodes per proposed tree, root included (fixed for beam and static shapes)."""
        return 1 + self.w * self.d if self.shape == "beam" else len(self.static_parent)

    # levels: list of node-index lists in target numbering (root = 0)
    def propose(self, seqs):
        B = len(seqs)
        slots = [s.slot for s in seqs]
        sampling = self._any_sampling(seqs)
        greedy_row = torch.tensor([s.params.greedy for s in seqs], device=self.device)
        logits = self._catch_up(seqs)
        V = logits.shape[-1]
        # per node: draft logits (filled level by level), tokens, parents, scores, q
        N = self.num_nodes
        tokens = torch.zeros(B, N, dtype=torch.long, device=self.device)
        parent = torch.full((B, N), -1, dtype=torch.long, device=self.device)
        tokens[:, 0] = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=self.device)
        q = torch.zeros(B, N, V, dtype=torch.float32, device=self.device) if sampling else None
        node_logits = torch.zeros(B, N, V, dtype=logits.dtype, device=self.device)
        node_logits[:, 0] = logits
        score = torch.zeros(B, N, dtype=torch.float32, device=self.device)
        u = self.sampler.uniforms(seqs, N) if sampling else None
        ar = torch.arange(B, device=self.device)
        depth = self.d if self.shape == "beam" else max(self.static_depth)
        level_nodes = [[0]]
        for lvl in range(1, depth + 1):
            if self.shape == "beam":
                new = list(range(1 + (lvl - 1) * self.w, 1 + lvl * self.w))
                self._beam_level(lvl, new, level_nodes[-1], tokens, parent, score, node_logits, q, u,
                                 greedy_row, seqs, ar)
            else:
                new = [i for i in range(N) if self.static_depth[i] == lvl]
                self._static_level(new, tokens, parent, node_logits, q, u, greedy_row, seqs, ar)
            level_nodes.append(new)
            if lvl < depth:
                upto = new[-1] + 1
                dpar = (parent[:, 1:upto] - 1).clamp(min=-1)
                lg = self.runner.verify_tree(slots, tokens[:, 1:upto], dpar)
                node_logits[:, 1:upto] = lg
                if lvl + 1 < depth:
                    self.runner.commit(torch.zeros(B, dtype=torch.long, device=self.device))
        self._deferred = depth > 1
        self._draft_nodes = 0 if depth <= 1 else level_nodes[depth - 1][-1]  # nodes 1..this evaluated
        self._depth = depth
        valid = torch.ones(B, N, dtype=torch.bool, device=self.device)
        return Proposal(tokens, parent, valid, q, tree=True)

    def _child_tokens(self, par_logits, seqs, greedy_row, rank, uu):
        """Token for a child: greedy rows the ``rank``-th top draft token; sampling rows an
        i.i.d. draw from the parent's draft distribution."""
        top = par_logits.topk(rank + 1, -1).indices[:, rank]
        if uu is None:
            return top, None
        qp = self.sampler.probs(par_logits, seqs)
        smp = sample_from(qp, uu)
        tok = torch.where(greedy_row, top, smp)
        onehot = torch.zeros_like(qp).scatter(-1, tok[:, None], 1.0)
        qn = torch.where(greedy_row[:, None], onehot, qp)
        return tok, qn

    def _static_level(self, new, tokens, parent, node_logits, q, u, greedy_row, seqs, ar):
        for i in new:
            p = self.static_parent[i]
            tok, qn = self._child_tokens(node_logits[:, p], seqs, greedy_row, self.static_rank[i],
                                         None if u is None else u[:, i])
            tokens[:, i] = tok
            parent[:, i] = p
            if q is not None:
                q[:, i] = qn

    def _beam_level(self, lvl, new, frontier, tokens, parent, score, node_logits, q, u, greedy_row, seqs, ar):
        w = self.w
        B = tokens.shape[0]
        fr = torch.tensor(frontier, device=self.device)
        lp = torch.log_softmax(node_logits[:, fr].float(), -1)             # [B, F, V]
        F = len(frontier)
        # greedy rows: global top-w over (frontier node, token) by joint log-prob
        kk = min(w, lp.shape[-1])
        cand = (score[:, fr][:, :, None] + lp).topk(kk, -1)                # [B, F, kk]
        flat_v = cand.values.reshape(B, -1)
        flat_i = cand.indices.reshape(B, -1)
        best = flat_v.topk(w, -1).indices if flat_v.shape[1] >= w else flat_v.argsort(-1, descending=True)
        g_par = fr[best // kk]
        g_tok = flat_i.gather(1, best)
        g_score = flat_v.gather(1, best)
        if q is None:
            tok, par, sc = g_tok, g_par, g_score
        else:
            # sampling rows: child c goes to the (c mod m)-th best frontier node, drawn i.i.d.
            m = max(1, (w + 1) // 2) if F > 1 else 1
            order = score[:, fr].argsort(-1, descending=True)                # [B, F]
            s_tok, s_par, s_sc = [], [], []
            for c in range(w):
                pr = fr[order[:, c % min(m, F)]]
                qp = self.sampler.probs(node_logits[ar, pr], seqs)
                t = sample_from(qp, u[:, new[c]])
                s_tok.append(t)
                s_par.append(pr)
                s_sc.append(score[ar, pr] + torch.log(qp[ar, t].clamp(min=1e-30)))
                q[:, new[c]] = qp
            s_tok, s_par, s_sc = torch.stack(s_tok, 1), torch.stack(s_par, 1), torch.stack(s_sc, 1)
            gr = greedy_row[:, None]
            tok = torch.where(gr, g_tok, s_tok)
            par = torch.where(gr, g_par, s_par)
            sc = torch.where(gr, g_score, s_sc)
            # greedy rows: deterministic distinct children -> point-mass proposals
            for c in range(w):
                onehot = torch.zeros_like(q[:, new[c]]).scatter(-1, tok[:, c:c + 1], 1.0)
                q[:, new[c]] = torch.where(greedy_row[:, None], onehot, q[:, new[c]])
        for c, i in enumerate(new):
            tokens[:, i] = tok[:, c]
            parent[:, i] = par[:, c]
            score[:, i] = sc[:, c]

    def accepted(self, seqs, accepted, path):
        if not self._deferred:
            return
        B = len(seqs)
        n = self._draft_nodes
        keep = []
        dpath = torch.zeros(B, n, dtype=torch.long)
        p = path.cpu() if path is not None else None
        for b, a in enumerate(accepted):
            k = min(a - 1, self._depth - 1)
            keep.append(k)
            if k > 0:
                dpath[b, :k] = p[b, 1:1 + k] - 1
        self.runner.commit(torch.tensor(keep, dtype=torch.long, device=self.device), dpath.to(self.device))
        for s, k in zip(seqs, keep):
            s.draft_cached += k
        self._deferred = False
