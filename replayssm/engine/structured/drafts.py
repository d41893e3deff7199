"""Grammar masks for a speculative step's verify positions (constrained rows speculate).

For a constrained row with drafts ``d_1..d_T`` on its verified chain (a tree row: the chain
of first children from the root), the matcher is walked over the drafts:

* ``n_ok`` = the longest prefix the grammar (and the row's bans: bad words, ``min_tokens``)
  accepts; without draft distributions the chain is cut there (``valid`` shrinks), with
  them (``q``, sampled drafts) the rejected draft stays: the masked target gives it
  probability 0, so acceptance rejects it and samples the residual — cutting it would skew
  the distribution;
* ``mask[i]`` (``i = 0..n_ok``) = the allowed next tokens after ``d_1..d_i``: the verify
  logits of that node are masked before acceptance, so the accepted drafts and the bonus
  token are exactly what plain constrained decoding produces (greedy), or distributed as
  the masked target (sampled).  Positions past ``n_ok`` are never accepted and stay open.

The walk is llguidance's own (one parallel call over the rows that computes each row's
masks along its drafts and rolls the matcher back), so the matchers are unchanged: the
output processor then feeds them the accepted tokens and the bonus, as in plain decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .grammar import require_llguidance
from .logits import HostBitmask, fill_bitmask, to_device


def verified_chain(parent: list[int], valid: list[bool], tree: bool) -> list[int]:
    """Node indices ``[0, c_1, c_2, ...]`` a constrained row verifies: a chain's valid
    prefix, or a tree's chain of first (lowest-index) valid children from the root."""
    N = len(parent)
    if not tree:
        out = [0]
        while len(out) < N and valid[len(out)]:
            out.append(len(out))
        return out
    out, cur = [0], 0
    while True:
        nxt = next((j for j in range(cur + 1, N) if valid[j] and parent[j] == cur), None)
        if nxt is None:
            return out
        out.append(nxt)
        cur = nxt


def accepted_prefix(c, output_ids: list[int], drafts: list[int]) -> int:
    """How many of ``drafts`` the constraint ``c`` accepts in a row (grammar and bans)."""
    n = len(drafts) if c.matcher is None else int(c.matcher.validate_tokens(drafts))
    if c.bad_words or len(output_ids) < c.min_tokens:
        for i in range(n):
            if drafts[i] in c.banned(output_ids + drafts[:i]):
                return i
    return n


class DraftMasks:
    """Builds one speculative step's ``[B, N, V]`` bool mask (True = allowed) and the rows'
    new ``valid`` for the constrained rows; the host bitmask is reused between steps."""

    def __init__(self, masker):
        self.masker = masker   # the executor's LogitsMasker: its device, thread pool, unpacking
        self.device = masker.device
        self._host = HostBitmask(self.device)

    def build(self, seqs, tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool, has_q: bool, V: int):
        """``(mask [B, N, V] bool on the device, valid [B, N] bool)`` for proposal rows
        ``tokens/parent/valid [B, N]``; ``(None, valid)`` when no row is constrained.
        Reads the drafts on the host (a sync on a device-drafted proposal)."""
        if tokens.dim() != 2 or parent.shape != tokens.shape or valid.shape != tokens.shape or \
                tokens.shape[0] != len(seqs) or tokens.shape[1] < 1:
            raise ValueError(f"DraftMasks.build: tokens, parent and valid must be [B, N] (N >= 1) for B = "
                             f"{len(seqs)} sequences, got {tuple(tokens.shape)}, {tuple(parent.shape)}, "
                             f"{tuple(valid.shape)}")
        rows = [b for b, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return None, valid
        self.masker.wait()   # a plain step's fill still running borrows matchers and the llguidance pool
        B, N = tokens.shape
        host = torch.stack([tokens.long(), parent.long(), valid.long()]).cpu()   # one transfer
        tok_h, par_h, val_h = host[0].tolist(), host[1].tolist(), host[2].to(valid.dtype)
        plan = []   # (row b, chain nodes, drafts walked)
        for b in rows:
            s, c = seqs[b], seqs[b].constraint
            nodes = verified_chain(par_h[b], val_h[b].tolist(), tree)
            drafts = [tok_h[b][j] for j in nodes[1:]]
            n_ok = accepted_prefix(c, s.output_ids, drafts)
            keep = len(nodes) if has_q else n_ok + 1
            val_h[b] = False
            val_h[b, nodes[:keep]] = True
            plan.append((b, nodes, drafts[:n_ok]))
        vocab = max([seqs[b].constraint.mask_vocab for b in rows] + [0]) or V
        words = (vocab + 31) // 32
        D = N   # scratch rows per constrained row: positions 0..N-1 of its chain
        buf = self._host.rows(len(plan) * D, words)
        buf.fill_(-1)
        gram = [(seqs[b].constraint.matcher, j * D, d) for j, (b, _, d) in enumerate(plan)
                if seqs[b].constraint.matcher is not None]
        if gram:
            if self.masker._executor is None:
                self.masker._executor = require_llguidance().LLExecutor()
            ex = self.masker._executor
            walk = [g for g in gram if g[2]]   # llguidance walks non-empty drafts only
            if walk:
                fill_bitmask(ex, walk, buf, drafts=True)
            here = [(m, k) for m, k, d in gram if not d]
            if here:
                fill_bitmask(ex, here, buf)
        src, dst, ban_r, ban_t = [], [], [], []
        for j, (b, nodes, d) in enumerate(plan):
            s, c = seqs[b], seqs[b].constraint
            for i in range(len(d) + 1):   # positions 0..n_ok: after d_1..d_i
                src.append(j * D + i)
                dst.append(b * N + nodes[i])
                if not c.bad_words and len(s.output_ids) + i >= c.min_tokens:
                    continue   # nothing banned (skip copying the output)
                for t in c.banned(s.output_ids + d[:i]):
                    ban_r.append(b * N + nodes[i])
                    ban_t.append(t)
        dev = self.device
        bits = self.masker._unpack(buf.to(dev, non_blocking=True), V)
        if vocab < V:   # past the grammars' vocabulary: banned for grammar rows only
            bits[:, vocab:] = False
            free = [j * D + i for j, (b, _, _) in enumerate(plan) if seqs[b].constraint.matcher is None
                    for i in range(D)]
            if free:
                bits[to_device(free, torch.long, dev)] = True
        mask = torch.ones(B * N, V, dtype=torch.bool, device=dev)
        mask.index_copy_(0, to_device(dst, torch.long, dev), bits.index_select(0, to_device(src, torch.long, dev)))
        if ban_r:
            idx = to_device([ban_r, ban_t], torch.long, dev)
            mask.index_put_((idx[0], idx[1]), torch.zeros((), dtype=torch.bool, device=dev))
        return mask.view(B, N, V), val_h.to(valid.device)
