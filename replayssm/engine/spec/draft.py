"""Draft-model chains (``method="draft"``): a second, smaller model proposes ``num_tokens`` drafts.

The draft model keeps its own cache under the target's slot numbers (its
:meth:`~replayssm.cache.spec.CacheSpec.for_draft` spec).  Invariant: the draft cache holds
``seq.all_ids[:seq.draft_cached]``; the rest is fed at the next proposal.  Tentative draft
tokens are evaluated with ``verify``/``verify_tree`` and rolled back with ``commit`` (0
entries, or the accepted ones after the target has verified).  Greedy rows take the argmax;
sampling rows draw from the (transformed) draft distribution and hand it to the verifier as
``q``.  The draft model runs through a
:class:`~replayssm.engine.model_runner.ModelRunner` of its own (CUDA graphs for its decode
when the target uses them); a draft-model chain for an all-greedy batch is one CUDA graph
per batch bucket and length (:meth:`DraftModelDrafter._greedy_chain`: it feeds the accepted
tokens again at the next proposal, in one verify, instead of waiting for the target's verdict).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...runtime import canonical_device, host_to_device
from ..model_runner import ModelRunner
from ..sampler import Sampler, sample_from
from .base import Drafter, Proposal, chain_parent
from .mtp import MTPStepGraphs, _check_probe


#: most missing tokens a draft catch-up feeds as decode steps (more: one prefill chunk per row)
CATCH_UP_DECODES = 2


class DraftModelBase(Drafter):
    """What the draft-model drafters share: the draft model, its cache and runner, catch-up."""

    uses_draft_model = True
    samples_q = True

    def __init__(self, model, cache, sampler: Sampler, device, max_batch: int, cuda_graphs: bool = False):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.device = canonical_device(device)
        self.runner = ModelRunner(model, cache, device, max_batch, cuda_graphs=cuda_graphs)
        self._deferred = False  # a draft verify waits for the target's verdict

    @classmethod
    def own_layout(cls, setup):
        return setup.draft_model.cache_layout(setup.spec.for_draft())

    @staticmethod
    def draft_cache(setup, num_slots: int):
        """The draft model's cache: ``num_slots + 1`` slots (the null slot 0 included)."""
        return setup.draft_model.make_cache(num_slots + 1, setup.spec.for_draft(), device=setup.device)

    def capture(self, lengths=()) -> int:
        return self.runner.capture()

    def prefill(self, seqs):
        logits = self.runner.prefill([s.slot for s in seqs], [s.prompt_ids for s in seqs])
        del logits
        for s in seqs:
            s.draft_cached = len(s.prompt_ids)

    def release(self, seq):
        if seq.slot is not None:
            self.cache.release([seq.slot])

    def swap_out(self, seq):
        self.cache.swap_out(seq.slot, seq.swap_key)

    def swap_in(self, seq):
        self.cache.swap_in(seq.slot, seq.swap_key)

    def drop_swapped(self, seq):
        self.cache.drop_swapped(seq.swap_key)

    def reset(self) -> None:
        self.cache.clear_pending()
        self._deferred = False

    def _catch_up(self, seqs) -> Tensor:
        """Feed every sequence's tokens up to and including its last token; returns the
        draft logits after the last token ``[B, V]``.  Rows more than one token behind (after
        an accepted chain, or steps without speculation) first take the missing tokens but
        the last: a decode step per token while at most ``CATCH_UP_DECODES`` are missing
        (graph replays), else one prefill call with a chunk per row (after a run of plain
        steps: one call instead of one per step)."""
        behind = [s for s in seqs if s.num_tokens - s.draft_cached > 1]
        if behind and max(s.num_tokens - 1 - s.draft_cached for s in behind) > CATCH_UP_DECODES:
            chunks = [[s.token_at(i) for i in range(s.draft_cached, s.num_tokens - 1)] for s in behind]
            self.runner.prefill([s.slot for s in behind], chunks)
            for s in behind:
                s.draft_cached = s.num_tokens - 1
            behind = []
        while behind:
            toks = torch.tensor([s.token_at(s.draft_cached) for s in behind], dtype=torch.long)
            self.runner.decode([s.slot for s in behind], toks)
            for s in behind:
                s.draft_cached += 1
            behind = [s for s in behind if s.num_tokens - s.draft_cached > 1]
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        logits = self.runner.decode([s.slot for s in seqs], toks)
        for s in seqs:
            s.draft_cached += 1
        return logits

    def _any_sampling(self, seqs) -> bool:
        return any(not s.params.greedy for s in seqs)


class DraftModelDrafter(DraftModelBase):
    """A chain of ``num_tokens`` drafts, drawn from the (transformed) draft distribution.

    All-greedy batches run :meth:`_greedy_chain` — device work only, one CUDA graph per
    batch bucket and chain length (:class:`~replayssm.engine.spec.mtp.MTPStepGraphs`): the
    row's pending tokens (those since the draft cache's end, at most ``num_tokens + 1``) as
    one draft ``verify`` committed per row, then the chain's tentative ``verify`` steps, each
    rolled back, so nothing waits for the target's verdict.  Batches with sampled rows run
    eagerly (:meth:`propose`'s loop: one decode of the last token, tentative verify steps,
    the last one committed after the target has verified)."""

    method = "draft"

    def __init__(self, model, cache, sampler, device, max_batch, num_tokens: int, cuda_graphs: bool = False,
                 pad_batches: bool = False):
        super().__init__(model, cache, sampler, device, max_batch, cuda_graphs)
        self.k = num_tokens
        self.width = num_tokens + 1        # pending tokens a greedy step takes at once
        self.chain = MTPStepGraphs(self._greedy_chain, self.device, max_batch, self.width, cuda_graphs, pad_batches)

    @classmethod
    def create(cls, setup, *, target, cache, sampler, runner, num_slots):
        return cls(setup.draft_model, cls.draft_cache(setup, num_slots), sampler, setup.device, num_slots,
                   setup.config.num_tokens, cuda_graphs=runner.use_graphs, pad_batches=runner.pad_batches)

    def graph_shapes(self):
        return [(self.k + 1, False)]

    def capture(self, lengths=()) -> int:
        """The draft model's decode graphs and the greedy chain's, per bucket and length."""
        ns = sorted({min(int(t), self.k) + 1 for t in lengths} or {self.k + 1})
        return self.runner.capture() + self.chain.capture(ns)

    def null_step(self, batch: int, T: int):
        """The greedy chain of ``T`` drafts on ``batch`` null-slot rows (the length policy's
        start-up table adds it to a step's cost; ``warmup.measure_draft_costs``); None for
        ``T = 0`` (plain steps leave the draft model behind, it catches up when next asked)."""
        _check_probe(batch, T, self.k)
        if T == 0:
            return None
        ins = self.chain._inputs(batch)
        return lambda: self.chain.run(*ins, min(int(T), self.k) + 1)

    def _greedy_chain(self, slots: Tensor, toks: Tensor, nodes: Tensor, count: Tensor, n: int) -> Tensor:
        """``tokens [B, n]``: each row's last token and ``n - 1`` greedy drafts.  ``toks [B, W]``
        holds the row's ``count`` pending tokens (padded with copies of the last): one draft
        verify, ``count`` entries committed; then draft ``j + 1`` from a tentative verify of
        drafts ``1..j``, rolled back (``nodes`` is not used)."""
        B = slots.shape[0]
        ar = torch.arange(B, device=slots.device)
        zero = torch.zeros(B, dtype=torch.long, device=slots.device)
        lg = self.model.verify(self.cache, slots, toks)
        self.model.commit(self.cache, count)
        drafts = [lg[ar, count - 1].argmax(-1)]
        for j in range(1, n - 1):
            lg = self.model.verify(self.cache, slots, torch.stack(drafts, 1))
            self.model.commit(self.cache, zero)
            drafts.append(lg[:, -1].argmax(-1))
        return torch.stack([toks[ar, count - 1]] + drafts, 1)

    def _propose_greedy(self, seqs, k: int) -> Proposal:
        """:meth:`_greedy_chain` over ``seqs`` (rows more than ``width`` tokens behind first
        take all but their last pending token as one prefill chunk each)."""
        W, B = self.width, len(seqs)
        far = [s for s in seqs if s.num_tokens - s.draft_cached > W]
        if far:
            self.runner.prefill([s.slot for s in far],
                                [[s.token_at(i) for i in range(s.draft_cached, s.num_tokens - 1)] for s in far])
            for s in far:
                s.draft_cached = s.num_tokens - 1
        rows = []
        for s in seqs:
            p = s.num_tokens - s.draft_cached
            toks = s.last_ids(p)
            rows.append([s.slot, p] + toks + toks[-1:] * (W - p))
        t = host_to_device(torch.tensor(rows, dtype=torch.long), self.device)
        tokens = self.chain.run(t[:, 0], t[:, 2:], t[:, 2:], t[:, 1], k + 1)
        for s in seqs:
            s.draft_cached = s.num_tokens
        self._deferred = False
        valid = torch.ones(B, k + 1, dtype=torch.bool, device=self.device)
        return Proposal(tokens, chain_parent(B, k + 1, self.device), valid)

    def propose(self, seqs, k=None):
        """A chain of ``k`` drafts (default ``num_tokens``): ``k`` draft-model steps."""
        B, k = len(seqs), self.k if k is None else k
        if not self._any_sampling(seqs):
            return self._propose_greedy(seqs, k)
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
        self._deferred, self._k = k > 1, k
        last = host_to_device(torch.tensor([s.last_token for s in seqs], dtype=torch.long), self.device)
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
        keep = [min(a - 1, self._k - 1) for a in accepted]
        self.runner.commit(torch.tensor(keep, dtype=torch.long, device=self.device))
        for s, n in zip(seqs, keep):
            s.draft_cached += n
        self._deferred = False
