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

Penalties (presence, frequency, repetition) read per-slot token statistics kept on the
device (:class:`PenaltyState`), so a step copies no history to the device.  In a speculative
step the penalties at draft node ``i`` also count the drafts on the path from the root to
``i`` (:func:`apply_penalties`): the verifier's distribution at every node is exactly the
one plain decoding would use there, so speculation stays lossless with every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..runtime import canonical_device

from .batching import pad_rows
from .sequence import Sequence

_PARAM_NAMES = ("temp", "top_k", "top_p", "min_p", "presence", "frequency", "repetition")
_PAD_VALUES = {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence": 0.0, "frequency": 0.0,
               "repetition": 1.0, "counts": 0.0, "seen": False}


@dataclass
class SamplingBatch:
    """One step's sampling parameters as device tensors ``[B]`` (a row per request), the
    rows' penalty statistics, and the host-side switches that decide which code runs (part
    of a CUDA graph's key: the tensors change between replays, the switches do not)."""

    temp: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    presence: Tensor
    frequency: Tensor
    repetition: Tensor
    counts: Tensor | None = None     # [B, V] float: output tokens so far (penalised rows)
    seen: Tensor | None = None       # [B, V] bool: prompt and output tokens (penalised rows)
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False
    use_penalties: bool = False
    logprobs: int = -1               # alternatives to report per token (-1: no logprobs)

    @property
    def batch(self) -> int:
        return self.temp.shape[0]

    def key(self) -> tuple:
        return (self.use_top_k, self.use_top_p, self.use_min_p, self.use_penalties, self.logprobs)

    def _names(self) -> tuple:
        return _PARAM_NAMES + (("counts", "seen") if self.use_penalties else ())

    def tensors(self) -> list[Tensor]:
        """Per-row tensors in a fixed order (CUDA graphs copy them into static inputs)."""
        return [getattr(self, n) for n in self._names()]

    def blank(self, B: int) -> "SamplingBatch":
        """``B`` padding rows with this batch's switches (static inputs of a CUDA graph)."""
        return blank_batch(B, self.counts.shape[-1] if self.use_penalties else 0, self.temp.device, *self.key())

    def pad(self, Bp: int) -> "SamplingBatch":
        """Append ``Bp - B`` padding rows: greedy, no filters, no penalties."""
        if Bp == self.batch:
            return self
        return replace(self, **{n: pad_rows(getattr(self, n), Bp, _PAD_VALUES[n]) for n in self._names()})


def blank_batch(B: int, vocab_size: int, device, use_top_k: bool = False, use_top_p: bool = False,
                use_min_p: bool = False, use_penalties: bool = False, logprobs: int = -1) -> SamplingBatch:
    """A :class:`SamplingBatch` of ``B`` padding rows (greedy, no filters, no penalties)."""
    def full(n, shape, dtype):
        return torch.full(shape, _PAD_VALUES[n], dtype=dtype, device=device)

    f, i = torch.float32, torch.long
    t = {n: full(n, (B,), i if n == "top_k" else f) for n in _PARAM_NAMES}
    if use_penalties:
        t["counts"] = full("counts", (B, vocab_size), f)
        t["seen"] = full("seen", (B, vocab_size), torch.bool)
    return SamplingBatch(**t, use_top_k=use_top_k, use_top_p=use_top_p, use_min_p=use_min_p,
                         use_penalties=use_penalties, logprobs=logprobs)


class PenaltyState:
    """Per-slot token statistics for penalties, on the device: ``counts [P, V]`` (output
    tokens, float32) and ``seen [P, V]`` (token in the prompt or the output).  A slot's rows
    are reset when a request starts on it; new tokens are added in one scatter per step."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        self.device = canonical_device(device)
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=self.device)
        self._new: list[tuple[int, int]] = []   # (slot, token) not yet added

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        self._new = [(s, t) for s, t in self._new if s != slot]
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        if prompt_ids:
            self.seen[slot, torch.tensor(prompt_ids, dtype=torch.long, device=self.device)] = True

    def add(self, slot: int, tokens: list[int]) -> None:
        self._new.extend((slot, int(t)) for t in tokens)

    def flush(self) -> None:
        if not self._new:
            return
        idx = torch.tensor(self._new, dtype=torch.long).to(self.device, non_blocking=True)
        self._new = []
        self.counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(idx.shape[0], device=self.device),
                               accumulate=True)
        self.seen[idx[:, 0], idx[:, 1]] = True


class Sampler:
    """Per-request parameters -> device tensors, random draws, token selection.

    ``num_slots``/``vocab_size`` size the penalty state (allocated when the first penalised
    request starts); a sampler without them (a draft model's) cannot serve penalties.
    """

    def __init__(self, device, seed: int = 0, num_slots: int | None = None, vocab_size: int | None = None):
        self.device = canonical_device(device)
        self.generator = _make_generator(self.device, seed)
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.penalty: PenaltyState | None = None

    # -- penalty statistics (between steps) --------------------------------------------------
    def start(self, seqs: list[Sequence]) -> None:
        """Requests prefilled on their slots: reset those slots' penalty statistics."""
        for s in seqs:
            if not s.params.penalized:
                continue
            if self.penalty is None:
                if self.num_slots is None or self.vocab_size is None:
                    raise ValueError("penalties need a sampler with num_slots and vocab_size")
                self.penalty = PenaltyState(self.num_slots, self.vocab_size, self.device)
            self.penalty.start(s.slot, s.prompt_ids)

    def observe(self, seq: Sequence, tokens: list[int]) -> None:
        """Tokens appended to ``seq``'s output (added before its next step)."""
        if tokens and seq.params.penalized and self.penalty is not None:
            self.penalty.add(seq.slot, tokens)

    # -- per-request parameters as tensors ---------------------------------------------------
    def params(self, seqs: list[Sequence]):
        sb = self.batch(seqs, penalties=False)
        return sb.temp, sb.top_k, sb.top_p

    def batch(self, seqs: list[Sequence], penalties: bool = True) -> SamplingBatch:
        """The step's :class:`SamplingBatch` (one host->device copy of the parameters).
        ``penalties=False`` leaves the penalties out (draft proposals)."""
        ps = [s.params for s in seqs]
        vals = torch.tensor([[p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                              p.repetition_penalty] for p in ps], dtype=torch.float64)
        vals = vals.to(self.device, non_blocking=True)
        f32 = vals.float()
        use_pen = penalties and any(p.penalized for p in ps)
        counts = seen = None
        if use_pen:
            if self.penalty is None:
                raise RuntimeError("a penalised request's slot was never started (Sampler.start)")
            self.penalty.flush()
            slots = torch.tensor([s.slot for s in seqs], dtype=torch.long).to(self.device, non_blocking=True)
            pen = torch.tensor([p.penalized for p in ps]).to(self.device, non_blocking=True)
            counts = torch.where(pen[:, None], self.penalty.counts[slots], 0.0)
            seen = self.penalty.seen[slots] & pen[:, None]
        lp = [p.logprobs for p in ps if p.logprobs is not None]
        return SamplingBatch(
            temp=f32[:, 0], top_k=vals[:, 1].long(), top_p=f32[:, 2], min_p=f32[:, 3], presence=f32[:, 4],
            frequency=f32[:, 5], repetition=f32[:, 6], counts=counts, seen=seen,
            use_top_k=any(p.top_k > 0 for p in ps), use_top_p=any(p.top_p < 1 for p in ps),
            use_min_p=any(p.min_p > 0 for p in ps), use_penalties=use_pen, logprobs=max(lp) if lp else -1)

    def probs(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """Transformed distributions ``[B, (N,) V]`` without penalties (what draft models
        propose from: any proposal keeps speculation lossless); greedy rows one-hot."""
        return process(logits, self.batch(seqs, penalties=False))

    def uniforms(self, seqs: list[Sequence], n: int) -> Tensor:
        """``[B, n]`` uniforms: seeded rows from their request's generator (one draw each),
        the other sampled rows in one draw from the engine's generator, greedy rows 0.5."""
        out = torch.full((len(seqs), n), 0.5, device=self.device)
        shared = [i for i, s in enumerate(seqs) if not s.params.greedy and s.params.seed is None]
        if shared:
            rows = torch.tensor(shared, dtype=torch.long).to(self.device, non_blocking=True)
            out[rows] = torch.rand(len(shared), n, generator=self.generator, device=self.device)
        for i, s in enumerate(seqs):
            if s.params.greedy or s.params.seed is None:
                continue
            if s.generator is None:
                s.generator = _make_generator(self.device, s.params.seed)
            out[i] = torch.rand(n, generator=s.generator, device=self.device)
        return out

    def sample(self, logits: Tensor, seqs: list[Sequence], sb: SamplingBatch | None = None) -> Tensor:
        """One token per row from ``logits [B, V]`` (penalties, temperature, filters)."""
        if sb is None and all(s.params.greedy and not s.params.penalized for s in seqs):
            return logits.argmax(-1)
        sb = sb or self.batch(seqs)
        if all(s.params.greedy for s in seqs):
            return process_logits(logits, sb).argmax(-1)
        p = process(logits, sb)
        return sample_from(p, self.uniforms(seqs, 1)[:, 0])


def _make_generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def apply_penalties(logits: Tensor, sb: SamplingBatch, tokens: Tensor | None = None,
                    anc: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
    """Repetition, frequency and presence penalties on ``logits [B, V]`` or ``[B, N, V]``.

    ``x' = (seen ? (x > 0 ? x / r : x * r) : x) - f * count - p * (count > 0)`` with ``count``
    the row's output tokens and ``seen`` its prompt and output tokens.  In a verify step
    (``tokens [B, N]``, ancestor-or-self mask ``anc [B, N, N]``, ``valid [B, N]``) node ``i``
    predicts the token after the path root..i, so its statistics also hold the drafts on that
    path (nodes ``j >= 1`` with ``anc[:, i, j]``; node 0, the last accepted token, is already
    counted).  Device tensor math only (graph-capturable).
    """
    squeeze = logits.dim() == 2
    x = logits[:, None] if squeeze else logits
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    B, N, V = x.shape
    cnt = sb.counts[:, None, :].to(x.dtype)
    seen = sb.seen[:, None, :]
    if tokens is not None and N > 1:
        w = anc.clone()
        w[:, :, 0] = False
        if valid is not None:
            w &= valid[:, None, :]
        extra = torch.zeros(B, N, V, dtype=x.dtype, device=x.device)
        extra.scatter_add_(2, tokens[:, None, :].expand(B, N, N), w.to(x.dtype))
        cnt = cnt + extra
        seen = seen | (extra > 0)
    r = sb.repetition.to(x.dtype)[:, None, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    f = sb.frequency.to(x.dtype)[:, None, None]
    pr = sb.presence.to(x.dtype)[:, None, None]
    x = x - f * cnt - pr * (cnt > 0).to(x.dtype)
    return x[:, 0] if squeeze else x


def process_logits(logits: Tensor, sb: SamplingBatch, tokens: Tensor | None = None, anc: Tensor | None = None,
                   valid: Tensor | None = None) -> Tensor:
    """The logits after the penalties (unchanged without any)."""
    if sb.use_penalties:
        return apply_penalties(logits, sb, tokens, anc, valid)
    return logits


def process(logits: Tensor, sb: SamplingBatch, tokens: Tensor | None = None, anc: Tensor | None = None,
            valid: Tensor | None = None) -> Tensor:
    """Penalties, then :func:`transform`: the distributions a step samples from."""
    x = process_logits(logits, sb, tokens, anc, valid)
    return transform(x, sb.temp, sb.top_k, sb.top_p, sb.min_p, use_top_k=sb.use_top_k,
                     use_top_p=sb.use_top_p, use_min_p=sb.use_min_p)


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities under the raw model distribution (log-softmax of the logits, before
    penalties and temperature): of ``tokens [B, (N)]`` given ``logits [B, (N,) V]``, and the
    ``k`` most likely tokens as ``(values, ids)``, each ``[B, (N,) k]``."""
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    chosen = lp.gather(-1, tokens[..., None].long()).squeeze(-1)
    if k <= 0:
        return chosen, lp[..., :0], lp[..., :0].long()
    top = lp.topk(k, -1)
    return chosen, top.values, top.indices


def transform(logits: Tensor, temp: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None,
              use_top_k: bool | None = None, use_top_p: bool | None = None,
              use_min_p: bool | None = None) -> Tensor:
    """Temperature, top-k, top-p, min-p -> probabilities.  Rows with ``temp == 0`` become
    one-hot at the argmax.  ``logits`` may be ``[B, V]`` or ``[B, N, V]`` (parameters are per
    row).  min-p keeps the tokens with at least ``min_p`` times the largest probability
    (after top-k and top-p) and renormalises."""
    squeeze = logits.dim() == 2
    x = logits[:, None] if squeeze else logits
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt)
    B, N, V = x.shape
    greedy = (temp == 0)[:, None, None]
    t = torch.where(temp > 0, temp, torch.ones_like(temp)).to(dt)[:, None, None]
    x = x / t
    neg = x.new_full((), float("-inf"))   # a fill kernel, not a host copy (graph-capturable)
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
    if use_min_p is None:
        use_min_p = min_p is not None and bool((min_p > 0).any())
    if use_min_p:
        floor = min_p.to(dt)[:, None, None] * p.amax(-1, keepdim=True)
        p = torch.where(p < floor, torch.zeros_like(p), p)
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


def accept_greedy(logits: Tensor | None, tokens: Tensor, parent: Tensor, valid: Tensor, g: Tensor | None = None):
    """Greedy acceptance over a draft tree (a chain is ``parent[i] = i - 1``).

    ``logits [B, N, V]`` are the verifier's outputs for the ``N`` nodes (node 0 = the last
    accepted token, the root); ``tokens/parent/valid [B, N]``; ``g [B, N]``: their argmaxes
    when already known (``logits`` then unused: a model that returns greedy tokens).
    Returns ``(accepted [B], leaf [B], bonus [B])``: ``accepted`` counts the nodes on the
    accepted root path (root included), ``leaf`` is its last node, ``bonus`` the
    verifier's argmax after it.
    """
    if g is None:
        g = logits.argmax(-1)                                 # [B, N]
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
