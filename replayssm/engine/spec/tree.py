"""Draft-model token trees (``method="tree"`` with a draft model; STree): one verify of a whole tree.

:class:`DraftTreeDrafter` grows either a beam-search tree (``tree="beam"``: ``tree_width``
wide, ``depth`` deep, by joint draft log-probability) or a static tree of rank paths (node =
the ``rank``-th choice of its parent's draft distribution), one draft ``verify_tree`` per
level, rolled back like the chain drafter's (:mod:`replayssm.engine.spec.draft`).  Greedy
rows take the top-ranked tokens; sampling rows draw each node's children i.i.d. from the
draft distribution, so multi-step speculative sampling stays lossless.  The tree has a fixed
number of nodes, so its verify step is captured up front.
"""

from __future__ import annotations

import torch

from ...runtime import host_to_device
from ..sampler import sample_from
from .base import Proposal, static_tree
from .draft import DraftModelBase


class DraftTreeDrafter(DraftModelBase):
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
            self.static_parent, self.static_rank, self.static_depth = static_tree(shape)

    @classmethod
    def create(cls, setup, *, target, cache, sampler, runner, num_slots):
        sp = setup.config
        return cls(setup.draft_model, cls.draft_cache(setup, num_slots), sampler, setup.device, num_slots, sp.tree,
                   sp.tree_width, sp.depth, cuda_graphs=runner.use_graphs)

    def graph_shapes(self):
        return [(self.num_nodes, True)]

    @property
    def num_nodes(self) -> int:
        """Nodes per proposed tree, root included (fixed for beam and static shapes)."""
        return 1 + self.w * self.d if self.shape == "beam" else len(self.static_parent)

    # levels: list of node-index lists in target numbering (root = 0)
    def propose(self, seqs, k=None):
        """The whole tree (``k`` is not used)."""
        B = len(seqs)
        slots = [s.slot for s in seqs]
        sampling = self._any_sampling(seqs)
        greedy_row = host_to_device(torch.tensor([s.params.greedy for s in seqs]), self.device)
        logits = self._catch_up(seqs)
        V = logits.shape[-1]
        # per node: draft logits (filled level by level), tokens, parents, scores, q
        N = self.num_nodes
        tokens = torch.zeros(B, N, dtype=torch.long, device=self.device)
        parent = torch.full((B, N), -1, dtype=torch.long, device=self.device)
        tokens[:, 0] = host_to_device(torch.tensor([s.last_token for s in seqs], dtype=torch.long), self.device)
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
        fr = host_to_device(torch.tensor(frontier), self.device)   # no wait for the queued levels
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
        self.runner.commit(host_to_device(torch.tensor(keep, dtype=torch.long), self.device), host_to_device(dpath, self.device))
        for s, k in zip(seqs, keep):
            s.draft_cached += k
        self._deferred = False
