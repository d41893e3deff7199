"""Sampling: logits -> per-request distributions -> tokens, and speculative acceptance.

All randomness comes from uniforms drawn per request (each seeded request owns a
``torch.Generator``; the others share the engine's), so a seeded request reproduces its
output whatever else is in the batch.  Everything after the draw is batched tensor math on
the device: sampling is inverse-CDF on the transformed distribution, and speculative
acceptance is one pass over the draft nodes (:func:`accept_tree`), which covers linear
chains, token trees, deterministic drafts (n-gram, greedy draft, point-mass proposal) and
sampled drafts (multi-step speculative sampling, SpecInfer-style: children of one node
drawn i.i.d. from the draft distribution are tried in turn against the residual).
Greedy rows use a one-hot target distribution, which reduces all of this to "accept while
the draft equals the argmax", with no random draws.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime import canonical_device

from .sequence import Sequence


class Sampler:
    def __init__(self, device, seed: int = 0):
        self.device = canonical_device(device)
        self.generator = _make_generator(self.device, seed)

    # -- per-request parameters as tensors ---------------------------------------------------
    def params(self, seqs: list[Sequence]):
        temp = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
        return temp.to(self.device), top_k.to(self.device), top_p.to(self.device)

    def probs(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """Transformed distributions ``[B, (N,) V]`` (float32 at least); greedy rows one-hot."""
        temp, top_k, top_p = self.params(seqs)
        use_k = any(s.params.top_k > 0 for s in seqs)     # decided on the host: no device sync
        use_p = any(s.params.top_p < 1 for s in seqs)
        return transform(logits, temp, top_k, top_p, use_top_k=use_k, use_top_p=use_p)

    def uniforms(self, seqs: list[Sequence], n: int) -> Tensor:
        """``[B, n]`` uniforms, each row from its request's generator (greedy rows: 0.5)."""
        rows = []
        for s in seqs:
            if s.params.greedy:
                rows.append(torch.full((n,), 0.5, device=self.device))
                continue
            if s.params.seed is not None and s.generator is None:
                s.generator = _make_generator(self.device, s.params.seed)
            g = s.generator if s.generator is not None else self.generator
            rows.append(torch.rand(n, generator=g, device=self.device))
        return torch.stack(rows)

    def sample(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """One token per row from ``logits [B, V]``."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(-1)
        p = self.probs(logits, seqs)
        return sample_from(p, self.uniforms(seqs, 1)[:, 0])


def _make_generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def transform(logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor,
              use_top_k: bool | None = None, use_top_p: bool | None = None) -> Tensor:
    """Temperature, top-k, top-p -> probabilities.  Rows with ``temp == 0`` become one-hot at
    the argmax.  ``logits`` may be ``[B, V]`` or ``[B, N, V]`` (parameters are per row)."""
    squeeze = logits.dim() == 2
    x = logits[:, None] if squeeze else logits
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt)
    B, N, V = x.shape
    greedy = (temp == 0)[:, None, None]
    t = torch.where(temp > 0, temp, torch.ones_like(temp)).to(dt)[:, None, None]
    x = x / t
    neg = torch.tensor(float("-inf"), dtype=dt, device=x.device)
    if use_top_k is None:
        use_top_k = bool((top_k > 0).any())
    if use_top_p is None:
        use_top_p = bool((top_p < 1).any())
    if use_top_k:
        k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
        kth = x.sort(-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(B, N, 1))
        x = torch.where(x < kth, neg, x)
    p = torch.softmax(x, -1)
    if use_top_p:
        sp, si = p.sort(-1, descending=True)
        cum = sp.cumsum(-1)
        drop = (cum - sp) > top_p.to(dt)[:, None, None]   # keep the smallest prefix with mass >= top_p
        sp = torch.where(drop, torch.zeros_like(sp), sp)
        p = torch.zeros_like(p).scatter(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    onehot = torch.zeros_like(p).scatter(-1, logits.reshape(B, N, V).argmax(-1, keepdim=True), 1.0)
    p = torch.where(greedy, onehot, p)
    return p[:, 0] if squeeze else p


def sample_from(p: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sample from ``p [B, V]`` (rows need not be normalised) with ``u [B]``."""
    cdf = p.cumsum(-1)
    x = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    idx = (cdf <= x).sum(-1)
    # never land on a zero-probability token through rounding at the top end
    last_pos = (p > 0).to(torch.long).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_pos)


def accept_greedy(logits: Tensor, tokens: Tensor, parent: Tensor, valid: Tensor):
    """Greedy acceptance over a draft tree (a chain is ``parent[i] = i - 1``).

    ``logits [B, N, V]`` are the verifier's outputs for the ``N`` nodes (node 0 = the last
    accepted token, the root); ``tokens/parent/valid [B, N]``.  Returns ``(accepted [B],
    leaf [B], bonus [B])``: ``accepted`` counts the nodes on the accepted root path
    (root included), ``leaf`` is its last node, ``bonus`` the verifier's argmax after it.
    """
    g = logits.argmax(-1)                                     # [B, N]
    B, N = tokens.shape
    ar = torch.arange(B, device=tokens.device)
    alive = torch.zeros(B, N, dtype=torch.bool, device=tokens.device)
    depth = torch.zeros(B, N, dtype=torch.long, device=tokens.device)
    alive[:, 0].fill_(True)   # fill_ on a view: one kernel, no host scalar (graph-capturable)
    depth[:, 0].fill_(1)
    for i in range(1, N):
        par = parent[:, i].clamp(min=0)
        ok = valid[:, i] & (parent[:, i] >= 0) & alive[ar, par] & (tokens[:, i] == g[ar, par])
        alive[:, i] = ok
        depth[:, i] = torch.where(ok, depth[ar, par] + 1, torch.zeros_like(par))
    # deepest alive node, the earliest among equals
    key = depth * (N + 1) + (N - torch.arange(N, device=tokens.device))
    leaf = key.argmax(-1)
    accepted = depth[ar, leaf]
    return accepted, leaf, g[ar, leaf]


def accept_tree(p: Tensor, tokens: Tensor, parent: Tensor, valid: Tensor, q: Tensor | None, u: Tensor):
    """Lossless speculative sampling over a draft tree (multi-step speculative sampling).

    ``p [B, N, V]``: target distributions after each node (transformed; one-hot for greedy
    rows).  ``q [B, N, V]``: for node ``i >= 1``, the draft distribution its token was drawn
    from (``None``: every draft is deterministic, a point mass).  Children of one node must
    be either i.i.d. draws from their ``q`` or distinct deterministic tokens; they are tried
    in index order.  ``u [B, N + 1]`` uniforms (``u[:, i]`` for node ``i``, ``u[:, N]`` for
    the final draw).  Returns ``(accepted [B], leaf [B], bonus [B])`` as
    :func:`accept_greedy`; the generated tokens are the path's drafts then ``bonus``,
    distributed exactly as sampling the target token by token.
    """
    B, N, V = p.shape
    ar = torch.arange(B, device=p.device)
    cur = torch.zeros(B, dtype=torch.long, device=p.device)
    depth = torch.ones(B, dtype=torch.long, device=p.device)
    res = p[:, 0].clone()
    tiny = torch.finfo(res.dtype).tiny
    for i in range(1, N):
        x = tokens[:, i]
        live = valid[:, i] & (parent[:, i] == cur)
        px = res[ar, x]
        if q is None:
            qi = torch.zeros_like(res).scatter(-1, x[:, None], 1.0)
        else:
            qi = q[:, i].to(res.dtype)
        qx = qi[ar, x]
        ratio = torch.where(qx > 0, px / qx.clamp(min=tiny), torch.zeros_like(px))
        acc = live & (u[:, i].to(ratio.dtype) < ratio)
        rej = live & ~acc
        # rejected: residual max(res - q, 0), renormalised (fall back to res if it vanishes)
        r = (res - qi).clamp(min=0)
        rs = r.sum(-1, keepdim=True)
        r = torch.where(rs > 0, r / rs.clamp(min=tiny), res)
        res = torch.where(rej[:, None], r, res)
        res = torch.where(acc[:, None], p[:, i], res)
        cur = torch.where(acc, torch.full_like(cur, i), cur)
        depth = depth + acc.long()
    bonus = sample_from(res, u[:, N])
    return depth, cur, bonus
