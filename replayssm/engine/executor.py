"""The "run" of a step: prefill the admitted prompt chunks, then one decode step or one
speculative step (draft, verify, accept, commit) for the running sequences.

Per-sequence decisions inside a model call — fill levels, flushes, accepted counts — are
device data; the host syncs once per step to read the sampled tokens (and, speculating,
the accepted counts and drafts in the same transfer).  Returns, per sequence, the tokens it
produced: ``(sequence, new tokens, per-token logprobs or None)``.
"""

from __future__ import annotations

import inspect
import time
import warnings

import torch
from torch import Tensor

from .config import SamplingParams
from .output_processor import logprob_rows
from .overlap import InFlight
from .sampler import token_logprobs
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .spec.base import Proposal
from .spec.policy import AdaptiveLengths, length_policy
from .structured import DraftMasks, LogitsMasker
from .warmup import measure_catchup_costs, measure_draft_costs, measure_step_costs

#: one sequence's result of a step: (sequence, new tokens, per-token logprobs or None)
Step = tuple


def _plain(p: SamplingParams) -> bool:
    """Greedy with no penalties and no logprobs: the argmax fast path."""
    return p.greedy and not p.penalized and p.logprobs is None


def plain_rows(seqs: list[Sequence]) -> bool:
    """Every sequence plain greedy (:func:`_plain`) and unconstrained: its next token is the
    argmax alone (the runner's greedy decode; async scheduling's overlapped steps)."""
    return all(_plain(s.params) and s.constraint is None for s in seqs)


class StepExecutor:
    """Runs the model for a scheduled batch over the engine's parts: ``runner`` (model
    calls, CUDA graphs), ``sampler``, ``blocks`` (slots and paged blocks), ``cache`` (the
    model cache: forms of slots, forks), ``policy`` (decode-mode switches), ``drafter``
    (None without speculation; ``disable_by_batch_size`` from the speculative config) and
    ``prefix`` (the prefix cache or None)."""

    def __init__(self, runner, sampler, blocks, cache, policy, drafter=None, spec_config=None, prefix=None,
                 stats: dict | None = None):
        self.runner, self.sampler, self.blocks, self.cache = runner, sampler, blocks, cache
        self.policy, self.drafter, self.prefix = policy, drafter, prefix
        self.max_new = 1 if spec_config is None else spec_config.verify_tokens
        self.spec_limit = None if spec_config is None else spec_config.disable_by_batch_size
        self.stats = {} if stats is None else stats
        # the draft length of each step (spec.policy; None without speculation)
        self.lengths = None if spec_config is None else length_policy(spec_config, runner)
        for T in [0] + list(self.lengths.lengths if self.lengths else []):
            self.stats.setdefault(f"spec_T{T}_steps", 0)
        if isinstance(self.lengths, AdaptiveLengths) and hasattr(drafter, "catchup_passes"):
            self.lengths.passes = drafter.catchup_passes   # deferred MTP catch-up, priced per step
        self._tree_needs_state = False
        self.masker = LogitsMasker(sampler.device, self.stats)   # constrained rows' masks and biases
        self.draft_masks = DraftMasks(self.masker)     # ... at every verify position
        # runners whose verify steps take a token mask (others: constrained rows decode plainly)
        self._masked_verify = all("mask" in inspect.signature(f).parameters
                                  for f in (runner.greedy_verify_step, runner.sampled_verify_step))

    def verify_shapes(self) -> tuple[list, list]:
        """``(greedy, sampled)`` verify shapes to capture: the drafter's, and for chains one
        per draft length the length policy may choose (sampled ones: the longest only; the
        others are captured when first met)."""
        d = self.drafter
        if d is None:
            return [], []
        greedy, sampled = d.graph_shapes(), d.sampled_shapes()
        if greedy and not self.lengths.tree:
            greedy = [(T + 1, False) for T in self.lengths.lengths]
        return greedy, sampled

    def capture(self) -> None:
        """Capture every CUDA graph a step can need (the verify shapes of every draft length
        and the drafter's own graphs)."""
        d = self.drafter
        self.runner.capture(*self.verify_shapes())
        if d is not None:
            d.capture(self.lengths.lengths)

    def measure_step_costs(self, reps: int = 3) -> dict | None:
        """On CUDA, with the adaptive policy and no ``step_costs`` given: time a decode step
        and a verify step of every draft length at every batch bucket (after capture, on the
        idle engine's free slots, in replay form with and without ring flushes), each plus the
        drafter's own device work for it (:func:`measure_draft_costs`: the MTP head's or draft
        model's graph; for ``T = 0`` the MTP catch-up), as the policy's cost tables; returns
        the flush-free one (None when nothing was measured)."""
        L = self.lengths
        if not isinstance(L, AdaptiveLengths) or not L.costs.online or self.runner.device.type != "cuda":
            return None
        return self._cost_table(L, reps, slots=sorted(self.blocks.free_slots))

    def _cost_table(self, L, reps: int, slots=None) -> dict:
        """Measure and install the tables (``slots``: free slots to time on; None: the null
        slot, which leaves every other slot untouched, e.g. between live steps)."""
        table, flush = measure_step_costs(self.runner, [(T, L.nodes[T], L.tree) for T in L.lengths], reps,
                                          slots=slots)
        for key, s in measure_draft_costs(self.drafter, self.runner.buckets, L.lengths, self.runner.device,
                                          reps).items():
            if key in table:
                table[key] += s
        L.costs.set_catchup(measure_catchup_costs(self.drafter, self.runner.buckets, self.runner.device, reps))
        L.costs.table.update(table)
        if flush:
            L.costs.flush.update(flush)
            L.costs.ring = int(self.cache.ring.capacity)
        return table

    def run(self, batch: ScheduledBatch) -> tuple[list[Step], float]:
        """Prefill this step's prompt chunks, then one decode or speculative step.  Returns
        the new tokens per sequence and the time (``perf_counter``) the prefill part ended."""
        new = self.prefill(batch.prefill) if batch.prefill else []
        t1 = time.perf_counter()
        if batch.running:
            run = batch.running
            T = self.draft_length(run)
            if T == 0:
                new += self._timed_decode(run)
            else:   # rows that cannot speculate (logit_bias) decode plainly
                plain = [s for s in run if not self._can_speculate(s)]
                if plain:
                    new += self.decode(plain)
                    run = [s for s in run if self._can_speculate(s)]
                if run:
                    new += self.speculate(run, T)
        return new, t1

    def _can_speculate(self, s: Sequence) -> bool:
        """Free rows, and constrained rows whose constraints are per-position token masks
        (grammar, bad words, ``min_tokens``; not ``logit_bias``) on a runner that masks verify
        steps (engine.structured.drafts)."""
        c = s.constraint
        return c is None or (self._masked_verify and c.speculates)

    def draft_length(self, run: list[Sequence]) -> int:
        """Drafts per row this step (0: a plain decode step): the length policy's choice, 0
        without a drafter or past ``disable_by_batch_size``."""
        spec = [s for s in run if self._can_speculate(s)]
        if not spec or not self.speculates(len(run)):
            return 0
        return self.lengths.choose(spec)

    def _count(self, T: int) -> None:
        key = f"spec_T{T}_steps"
        self.stats[key] = self.stats.get(key, 0) + 1
        self.lengths.record(T)

    def _timed_decode(self, run: list[Sequence]) -> list[Step]:
        """A plain decode step; with a drafter, its time feeds the length policy's ``t(B, 0)``."""
        if self.drafter is None:
            return self.decode(run)
        t0 = time.perf_counter()
        out = self.decode(run)
        self._count(0)
        self.lengths.observe(run, 0, [], time.perf_counter() - t0)   # ends with the step's host sync
        return out

    def speculates(self, batch: int) -> bool:
        """Whether a step of ``batch`` running sequences speculates (``disable_by_batch_size``)."""
        return self.drafter is not None and (self.spec_limit is None or batch <= self.spec_limit)

    # -- prefill -----------------------------------------------------------------------------
    def prefill(self, items: list[tuple[Sequence, int]]) -> list[Step]:
        """Prefill this step's prompt chunks (each continues its sequence; a chunk of 0 tokens
        is a sample waiting for its first sample); sequences whose prompt is now complete
        sample their first token."""
        chunks = [(s, n) for s, n in items if n > 0]
        self.blocks.switch_to_state(self.policy.before_prefill(chunks))
        if self.prefix is not None:
            chunks = self.prefix.resume(chunks)
        fits = set(id(s) for s in self.blocks.reserve([(s, s.num_prefilled + n) for s, n in chunks]))
        chunks = [(s, n) for s, n in chunks if id(s) in fits]
        order, logits = [], []
        for g in self.policy.prefill_groups(chunks, self.cache):
            if g:
                self._prefill_group(g, order, logits)
        self._fork_waiting([s for s, n in items if n == 0], order, logits)
        if not order:
            return []
        return self._first_tokens(order, torch.stack(logits, 0))

    def _prefill_group(self, g: list[tuple[Sequence, int]], order: list, logits: list) -> None:
        """One prefill call for chunks of one form; completed prompts join ``order``."""
        lg = self.runner.prefill([s.slot for s, _ in g], [s.prompt_ids[s.num_prefilled:s.num_prefilled + n]
                                                          for s, n in g])
        for (s, n), row in zip(g, lg):
            s.num_prefilled += n
            s.mode = self.cache.mode_of(s.slot)
            if self.prefix is not None:
                self.prefix.after_prefill(s)
            if not s.prefilling:
                logits.append(row)
                order.append(s)
        if self.prefix is not None:
            self.prefix.write_checkpoints()

    def _fork_waiting(self, waiting: list[Sequence], order: list, logits: list) -> None:
        """The other samples of requests whose prompt completed this step copy its cache
        (``cache.fork``) and sample from its logits."""
        done = {id(s): i for i, s in enumerate(order)}
        forked = [s for s in waiting if id(s.group[0]) in done]
        by_head: dict = {}
        for s in forked:
            by_head.setdefault(id(s.group[0]), (s.group[0], []))[1].append(s)
        for head, sibs in by_head.values():
            self.cache.fork(head.slot, [s.slot for s in sibs])
        for s in forked:
            s.num_prefilled, s.mode = s.num_prompt_tokens, self.cache.mode_of(s.slot)
            logits.append(logits[done[id(s.group[0])]])
            order.append(s)

    def _first_tokens(self, order: list[Sequence], logits: Tensor) -> list[Step]:
        if self.drafter is not None:
            self.drafter.prefill(order)
        self.sampler.start(order)
        sb = self.sampler.batch(order)
        masked = self.masker.apply(logits, order)   # constrained rows (the raw logits give logprobs)
        return self._sampled(order, logits, self.sampler.sample(masked, order, sb), sb)

    def _sampled(self, seqs: list[Sequence], logits: Tensor, toks: Tensor, sb) -> list[Step]:
        """One new token per sequence (and its logprobs when asked)."""
        lps = None
        if sb is not None and sb.logprobs >= 0:
            chosen, vals, idx = token_logprobs(logits, toks, sb.logprobs)
            lps = logprob_rows(chosen.tolist(), vals.tolist(), idx.tolist())
        for s in seqs:
            s.num_steps += 1
        return [(s, [t], None if lps is None else [lps[b]]) for b, (s, t) in enumerate(zip(seqs, toks.tolist()))]

    # -- decode ------------------------------------------------------------------------------
    def decode(self, seqs: list[Sequence], reserve: bool = True) -> list[Step]:
        """One plain decode step (``reserve``: reserve its blocks first)."""
        if reserve:
            seqs = self.blocks.reserve_tokens(seqs, 1)
            if not seqs:
                return []
            if self.drafter is not None:   # speculation is off for this step (disable_by_batch_size)
                self.drafter.plain_step(seqs)
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        if getattr(self.runner, "greedy_decode", False) and all(_plain(s.params) and s.constraint is None
                                                                 for s in seqs):
            # greedy tokens straight from the model (tensor parallelism: no logits gather)
            return self._sampled(seqs, None, self.runner.decode([s.slot for s in seqs], toks, greedy=True), None)
        job = self.masker.prepare(seqs)   # grammar masks fill on a worker while the forward runs
        try:
            logits = self.runner.decode([s.slot for s in seqs], toks)
        except BaseException:
            self.masker.wait()   # the fill borrows the matchers: free them before the error goes up
            raise
        masked = self.masker.apply(logits, seqs, job)
        sb = None if all(_plain(s.params) for s in seqs) else self.sampler.batch(seqs)  # plain: argmax
        return self._sampled(seqs, logits, self.sampler.sample(masked, seqs, sb), sb)

    # -- overlapped decode (async scheduling: engine.overlap) ------------------------------------
    def overlaps_drafter(self, rows: int) -> bool:
        """Whether a plain step of ``rows`` sequences may overlap as far as speculation goes:
        no drafter, or one that catches up lazily from the token ids
        (:attr:`~replayssm.engine.spec.base.Drafter.lazy_catch_up`: nothing to run before a
        plain step) on a step speculation is off for (``disable_by_batch_size``).  Steps the
        length policy gives ``T = 0`` run synchronously (the policy times them)."""
        d = self.drafter
        return d is None or (getattr(d, "lazy_catch_up", False) and not self.speculates(rows))

    def launch(self, seqs: list[Sequence]) -> InFlight | None:
        """Reserve one token each and launch a greedy decode step of ``seqs`` (plain greedy
        rows, no speculation this step: :meth:`overlaps_drafter`) from the host's last
        tokens, without waiting for its tokens.  None when no row could reserve (those end
        with an error, as in :meth:`decode`)."""
        seqs = self.blocks.reserve_tokens(seqs, 1)
        if not seqs:
            return None
        if self.drafter is not None:
            self._count(0)
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        return InFlight.launched(seqs, self.runner.decode([s.slot for s in seqs], toks, greedy=True))

    def launch_rows(self, prev: InFlight, rows: list[Sequence]) -> InFlight:
        """Launch the greedy decode step after ``prev`` for ``rows`` (a subset of its
        sequences, in order, blocks reserved for the pending token and the new one), fed
        on the device from ``prev``'s tokens (``ModelRunner.decode_rows``)."""
        if self.drafter is not None:
            self._count(0)
        out = self.runner.decode_rows([s.slot for s in rows], prev.rows_of(rows))
        return InFlight.launched(rows, out, lagged=True)

    def collect(self, fl: InFlight) -> list[Step]:
        """Wait for ``fl``'s tokens: one per sequence still unfinished (a row whose sequence
        ended meanwhile — aborted, or finished by the previous step's token — is dropped)."""
        toks = fl.wait()
        out = []
        for s, t in zip(fl.seqs, toks):
            if s.is_finished:
                self.stats["async_dropped_rows"] = self.stats.get("async_dropped_rows", 0) + 1
                continue
            s.num_steps += 1
            out.append((s, [t], None))
        return out

    # -- speculation -------------------------------------------------------------------------
    def speculate(self, seqs: list[Sequence], T: int | None = None) -> list[Step]:
        """Draft ``T`` tokens per row (default: the most; trees: the whole tree), verify,
        accept, commit: one device step, one host sync."""
        t0 = time.perf_counter()
        T = self.lengths.max if T is None else T
        seqs = self.blocks.reserve_tokens(seqs, self.max_new)
        if not seqs:
            return []
        fused = self._fused(seqs, T)
        drafting = None   # the drafter's host time: the device idles through it (verify launches after)
        if fused is not None:
            prop = fused[0]
        else:
            th = time.perf_counter()
            prop = self.drafter.propose(seqs, T)
            drafting = time.perf_counter() - th
        if prop is None:  # nothing to draft anywhere: a plain decode step
            out = self.decode(seqs, reserve=False)
            for s in seqs:
                s.accepted_lengths.append(1)
            self._count(0)
            # as T drafts all rejected (so a drafter that finds nothing is asked less), no step
            # time; the proposing was spent all the same
            self.lengths.observe(seqs, T, [1] * len(seqs), None, drafting)
            return out
        if not prop.tree and prop.tokens.shape[1] > T + 1:   # a drafter that drafts a fixed chain
            prop = prop.truncate(T + 1)
        mask = None
        if fused is not None:    # drafted, verified, accepted and committed in one go
            accepted, bonus, path, lps = *fused[1:], None
        elif any(s.constraint is not None for s in seqs):   # walk the grammars over the drafts
            V = int(self.sampler.vocab_size)   # the logits width (also under tensor parallelism)
            tw = time.perf_counter()
            mask, valid = self.draft_masks.build(seqs, prop.tokens, prop.parent, prop.valid, prop.tree,
                                                 prop.q is not None, V)
            self.stats["grammar_walk_s"] = self.stats.get("grammar_walk_s", 0.0) + time.perf_counter() - tw
            prop = Proposal(prop.tokens, prop.parent, valid, prop.q, prop.tree)
        if fused is None:
            accepted, bonus, path, lps = self._verify(seqs, prop, mask)
        N = prop.tokens.shape[1]
        parts = [accepted[:, None], bonus[:, None], prop.num_drafts[:, None], prop.tokens]
        if path is not None:
            parts.append(path)
        host = torch.cat([x.long() for x in parts], 1).tolist()   # the step's one host sync
        lp_rows = None
        if lps is not None:
            lp_rows = [logprob_rows(c, v, i) for c, v, i in zip(*(x.tolist() for x in lps))]
        acc = [r[0] for r in host]
        self.drafter.accepted(seqs, acc, path)
        out = []
        for b, (s, row) in enumerate(zip(seqs, host)):
            a, bonus_b, ndraft, toks = row[0], row[1], row[2], row[3:3 + N]
            nodes = row[3 + N:3 + N + a][1:] if path is not None else range(1, a)
            s.num_steps += 1
            s.num_verify_steps += 1
            s.num_drafted += ndraft
            s.num_accepted_drafts += a - 1
            s.accepted_lengths.append(a)
            out.append((s, [toks[i] for i in nodes] + [bonus_b], None if lp_rows is None else lp_rows[b][:a]))
        self._count(T)
        self.lengths.observe(seqs, T, acc, time.perf_counter() - t0, drafting)
        return out

    def _fused(self, seqs: list[Sequence], T: int):
        """The drafter's fused draft-and-verify step (MTP with ``mtp_fused``) where it applies:
        plain greedy rows, no constraints, no tree over KV-only slots; else None."""
        fused = getattr(self.drafter, "fused_step", None)
        if fused is None or not all(_plain(s.params) and s.constraint is None for s in seqs):
            return None
        if getattr(self.drafter, "tree", False) and any(s.mode == "kv" for s in seqs):
            return None
        return fused(seqs, T)

    def _verify(self, seqs: list[Sequence], prop, mask=None):
        """Verify, accept and commit ``prop`` (KV-only slots get a state first when the model
        has no KV-only tree verify: it raises before touching the cache)."""
        if prop.tree and self._tree_needs_state:
            self.blocks.switch_to_state([s for s in seqs if s.mode == "kv"])
        try:
            return self._verify_accept_commit(seqs, prop, mask)
        except NotImplementedError as e:
            kv = [s for s in seqs if s.mode == "kv"]
            if not (prop.tree and kv):
                raise
            warnings.warn(f"tree speculation: KV-only slots switched to state form ({e})", stacklevel=3)
            self._tree_needs_state = True
            self.blocks.switch_to_state(kv)
            return self._verify_accept_commit(seqs, prop, mask)

    def _verify_accept_commit(self, seqs: list[Sequence], prop, mask=None):
        """One device-side step (a CUDA graph when enabled): verify, (mask,) accept, commit.
        Returns ``(accepted, bonus, path, logprobs | None)``."""
        slots = [s.slot for s in seqs]
        kw = {} if mask is None else {"mask": mask}
        if all(_plain(s.params) for s in seqs):   # the fast greedy step
            return (*self.runner.greedy_verify_step(slots, prop.tokens, prop.parent, prop.valid, prop.tree, **kw),
                    None)
        sb = self.sampler.batch(seqs)
        u = self.sampler.uniforms(seqs, prop.tokens.shape[1] + 1)
        return self.runner.sampled_verify_step(slots, prop.tokens, prop.parent, prop.valid, prop.tree, prop.q, sb, u,
                                               **kw)
