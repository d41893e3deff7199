"""How many tokens to draft in each step: ``T`` from a captured set, ``T = 0`` being a plain decode step.

A verify step with ``T`` drafts per row costs ``t(B, T)`` (``B``: the batch bucket the step
runs as) and yields, per row, ``E(α, T) = 1 + Σ_{i=1..T} Π_{j<=i} α_j`` tokens in expectation,
where ``α_j`` is the probability that draft ``j`` is accepted given drafts ``1..j-1`` were
(for trees: that the accepted path reaches depth ``j`` given it reached ``j - 1``).
:class:`AdaptiveLengths` picks, every step, the ``T`` that maximises expected tokens per
second over the batch::

    T* = argmax_T  Σ_rows E(α_row, T) / t(B, T)

* acceptance: :class:`~.acceptance.AcceptanceStats`, per-depth success counts pooled over
  every row of the drafter (a depth never reached takes the rate of the one above it) and
  per request (shrunk to the pool: a new request starts from it);
* cost: :class:`StepCosts`, a table ``t(B, T)`` over the batch buckets and draft lengths:
  measured when a CUDA engine starts, after graph capture, on distinct free slots
  (:func:`replayssm.engine.warmup.measure_step_costs`), and
  refined online by the step times the engine observes (they include the drafter's device
  work; a seed not yet refined takes its refined siblings' mean correction), supplied by
  the user (``SpeculativeConfig.step_costs``), or, on CPU, the deterministic roofline
  :func:`analytic_step_cost` (reproducible tests);
* flushes (replay form): a row whose ring is full writes its checkpoint state, a step of
  its own price (``StepCosts.flush``: the extra time of a step in which every row flushes).
  How often a row flushes depends on ``T`` and acceptance (:func:`flush_fraction`: a
  verify step of ``N`` inputs flushes when ``h + 2N > L``, so long drafts with high
  acceptance flush every other step on a 16-entry ring, plain steps every ``L``-th), so a
  step is priced ``t(B, T) + φ(L, N, E) · flush(B, T)``;
* the rule: ``T = 0`` unless some ``T > 0`` has strictly more expected tokens per second
  (ties go to the fewer drafts), so with a right table a step never predicts fewer tokens
  per second than a plain one.  One ``T`` serves the whole batch: a verify graph runs
  ``T + 1`` inputs on every row, so a row drafting fewer would save no device time;
* drafter catch-up (MTP with a window): plain steps defer the head's catch-up, so the step
  that resumes drafting first commits the deferred pairs, ``passes(seqs, T)`` passes of
  ``StepCosts.catchup_cost(B)`` each (a plain step only when a window fills); a step is
  priced with the passes it would run, so speculation resumes only when it pays for them;
* host work: the policy's own time (choosing, updating the estimates) is added to the step
  time it observes, so the bookkeeping of speculating is priced too; the drafter's
  ``propose`` (host time the device waits through: the verify launches after it returns)
  is measured by the engine and priced apart, ``StepCosts.host_cost(B, T)`` on every
  ``T > 0``, and taken out of the step time that refines ``t(B, T)`` (counted once);
* probing: a step of the longest length observes acceptance at every depth, so exploring
  means drafting the most: on the first step that would not (a cold start), and after
  ``probe_interval`` steps in a row below the longest length, one step drafts the longest
  -- but only out of a budget: every step adds ``probe_budget`` (default 1%) of its
  predicted time, and a probe spends its predicted loss (its time less the time the best
  choice needs for the same expected tokens), so probes lose at most that fraction of the
  predicted run time, plus the one probe of a cold start (borrowed: repaid before the
  next).  The interval doubles after each probe (up to 16x) and returns to
  ``probe_interval`` when the estimates favour a longer length than before.

Greedy output is the same for every ``T`` (verification accepts only the target's own
choices); sampled acceptance stays distribution-exact because ``T`` depends only on
earlier steps.  :class:`FixedLengths` always drafts the most; :class:`ScriptedLengths`
replays a given sequence of lengths (tests, experiments).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from typing import Sequence

from ..batching import bucket_for
from ..config import default_lengths
from .acceptance import AcceptanceStats, expected_tokens

__all__ = ["AcceptanceStats", "AdaptiveLengths", "FixedLengths", "ScriptedLengths", "StepCosts",
           "analytic_step_cost", "default_lengths", "expected_tokens", "flush_fraction", "length_policy"]


def analytic_step_cost(B: int, T: int) -> float:
    """A deterministic roofline of one step's time (arbitrary units) for batch bucket ``B``
    and ``T`` draft nodes per row: ``1 + max(1, B (T + 1) / 256)`` — a fixed launch cost,
    then the weights' read while the step is memory-bound, then linear in the tokens it
    computes.  Small batches speculate for free; large ones pay per draft."""
    return 1.0 + max(1.0, B * (T + 1) / 256.0)


def flush_fraction(L: int, nodes: int, tokens: float) -> float:
    """Steady-state share of steps on which a row flushes its ring of ``L`` entries, for a
    step of ``nodes`` inputs per row that keeps ``tokens`` of them in expectation.

    A plain step (``nodes = 1``) flushes when the ring fills: one step in ``L``.  A verify
    step flushes when ``h + 2 nodes > L`` and leaves ``h`` = the accepted count; between
    flushes ``h`` grows by ``tokens`` per step from ``tokens``, so about
    ``R / tokens`` steps (``R = L - 2 nodes``) pass without one:
    ``φ = tokens / (R + tokens)`` (exact for one accepted token per step; ``R < 0``: every
    step flushes)."""
    if L < 1 or nodes < 1 or not tokens > 0:
        raise ValueError(f"flush_fraction: need L >= 1, nodes >= 1 and tokens > 0, got {L}, {nodes}, {tokens}")
    if nodes == 1:
        return 1.0 / L
    R = L - 2 * nodes
    return 1.0 if R < 0 else tokens / (R + tokens)


class StepCosts:
    """Step times ``t(B, T)`` per batch bucket ``B`` and draft length ``T`` (0: a decode step).

    ``table``: ``{(batch, T): seconds}`` of a step in which no row flushes; a batch between
    keys uses the next larger key (the largest past the end).  Missing ``T``s fall back to
    ``fallback(B, T)``.  ``flush``: ``{(batch, T): seconds}``, what a step costs more when
    every row flushes its ring (replay form; empty: flushes are free or priced into
    ``table``), looked up like ``table`` (missing: 0); ``ring``: the ring capacity ``L``
    (None: no ring).  :meth:`step_time` prices a step with a share ``φ`` of rows flushing.

    With ``online``, :meth:`observe` refines ``table`` by an EMA of measured times, less
    the flush share the caller predicted (the first observation of a key is dropped — it may
    include a compile or a graph capture —; a key without an entry takes the next one as
    it is; later ones, clipped to 4x of the entry either way, make it the mean of the seed
    and the samples so far until that weighs a sample less than ``decay``, then an EMA of
    weight ``decay``: host work the start-up timing leaves out (the step's Python, the
    policy's own) comes in within a few steps, while one step that happened to flush does
    not replace a measured entry).

    ``host``: ``{(batch, T >= 1): seconds}``, the drafter's host time per step (its
    ``propose`` call: the device waits for it, the verify launches after it returns),
    :meth:`host_cost`, refined online by :meth:`observe_host` (the median of the last
    ``host_window`` samples of a key once it has ``host_min``: robust to pauses).  The caller observes the
    device table with the step's time *less* the measured ``propose`` time, so a step is
    priced ``t(B, T) + h(B, T)`` and the drafter's host time is counted once."""

    def __init__(self, table: dict | None = None, fallback=analytic_step_cost, online: bool = False,
                 decay: float = 0.2, flush: dict | None = None, ring: int | None = None,
                 catchup: dict | None = None, host: dict | None = None, host_window: int = 15,
                 host_min: int = 3):
        self.table = self._checked(table, "step cost table", positive=True)
        self.flush = self._checked(flush, "flush cost table", positive=False)
        self.host = self._checked(host, "drafter host time table", positive=False)
        if any(t == 0 for _, t in self.host):
            raise ValueError("drafter host time table: T = 0 does not draft, give keys with T >= 1")
        self._host_seen: dict = {}
        self._host_samples: dict = {}   # (B, T) -> deque of the last host_window samples
        if isinstance(host_window, bool) or not isinstance(host_window, int) or host_window < 1 \
                or isinstance(host_min, bool) or not isinstance(host_min, int) or not 1 <= host_min <= host_window:
            raise ValueError(f"StepCosts: need ints 1 <= host_min <= host_window, got {host_min!r}, {host_window!r}")
        self.host_window, self.host_min = host_window, host_min
        self.catchup: dict[tuple[int, int], float] = {}
        self.set_catchup(catchup or {})
        if ring is not None and (isinstance(ring, bool) or not isinstance(ring, int) or ring < 1):
            raise ValueError(f"StepCosts: ring must be a positive int (the ring capacity L) or None, got {ring!r}")
        self.fallback, self.online, self.decay, self.ring = fallback, online, decay, ring
        self._seen: dict = {}
        self._seed: dict = {}     # (B, T) -> its seed, for seeded keys refined online
        self._refined: set = set()   # keys refined online (seeded or not)
        self._offset: dict = {}   # (B, T > 0) -> mean (entry - seed) over the refined keys of that group

    @staticmethod
    def _checked(table, what: str, positive: bool) -> dict:
        out: dict[tuple[int, int], float] = {}
        for (b, t), v in (table or {}).items():
            ok_v = v > 0 if positive else v >= 0
            if not (isinstance(b, int) and isinstance(t, int) and b >= 1 and t >= 0) or not ok_v \
                    or v == float("inf"):
                raise ValueError(f"{what}: keys (batch >= 1, T >= 0) and {'positive' if positive else 'non-negative'}"
                                 f" finite times, got {(b, t)}: {v}")
            out[(b, t)] = float(v)
        return out

    @staticmethod
    def _lookup(table: dict, B: int, T: int):
        bs = sorted(b for b, t in table if t == T)
        if not bs:
            return None
        return table[(next((b for b in bs if b >= B), bs[-1]), T)]

    def get(self, B: int, T: int) -> float:
        """``t(B, T)``: a step in which no row flushes.  A seeded entry not yet refined
        online takes the mean correction its refined siblings got (same bucket, both
        plain or both drafting): what the start-up timing leaves out of one length (the
        speculative step's Python) it leaves out of the others, so an unexplored length
        does not look cheap only because its seed is still bare."""
        keys = [b for b, t in self.table if t == T]
        if not keys:
            return self.fallback(B, T)
        b = min((k for k in keys if k >= B), default=max(keys))
        v = self.table[(b, T)]
        if (b, T) not in self._refined:
            v = max(v + self._offset.get((b, T > 0), 0.0), 0.25 * v)
        return v

    def flush_cost(self, B: int, T: int) -> float:
        """What a step costs more when every row flushes (0 without an entry or a ring)."""
        if self.ring is None:
            return 0.0
        v = self._lookup(self.flush, B, T)
        return 0.0 if v is None else v

    def set_catchup(self, per_batch: dict) -> None:
        """``{batch: seconds}`` of one drafter catch-up pass (MTP: ``width`` deferred pairs
        per row), ValueError on a bad entry."""
        table = self._checked({(b, 0): v for b, v in per_batch.items()}, "catch-up cost table", positive=False)
        self.catchup.update(table)

    def catchup_cost(self, B: int) -> float:
        """One drafter catch-up pass at bucket ``B`` (0 without an entry)."""
        v = self._lookup(self.catchup, B, 0)
        return 0.0 if v is None else v

    def host_cost(self, B: int, T: int) -> float:
        """``h(B, T)``: the drafter's host time (its ``propose`` call) in a step of ``T``
        drafts at bucket ``B``; 0 for ``T = 0`` (a plain step proposes nothing) and before
        any measurement.  A bucket with entries answers from its nearest ``T`` (ties: the
        longer); a bucket without any from the nearest bucket that has some, scaled by
        ``B / b`` (host drafting is per-row work) until it has its own."""
        if T == 0 or not self.host:
            return 0.0
        buckets = sorted({b for b, _ in self.host})
        if B in buckets:
            b = B
        else:
            below = [b for b in buckets if b < B]
            b = below[-1] if below else buckets[0]
        t = min((t for bb, t in self.host if bb == b), key=lambda t: (abs(t - T), -t))
        return self.host[(b, t)] * (B / b)

    def observe_host(self, B: int, T: int, seconds: float) -> None:
        """A measured ``propose`` of ``T`` drafts at bucket ``B`` (online only).  The first of
        a key is dropped (it may capture or compile); the others go into a window of the
        last ``host_window`` samples, and once it holds ``host_min`` of them the entry is
        their median: host time has rare, large upward outliers (a full garbage collection,
        a page fault: 100 ms against 1), so one of them moves the price by at most one rank
        instead of pricing every draft length at the pause -- which would stop speculation
        and with it the samples that could correct the price.  Until then the key keeps its
        seed (if any) and :meth:`host_cost` answers from its neighbours."""
        if not self.online or T < 1 or not seconds >= 0:
            return
        n = self._host_seen.get((B, T), 0)
        self._host_seen[(B, T)] = n + 1
        if n == 0:
            return
        w = self._host_samples.get((B, T))
        if w is None:
            w = self._host_samples[(B, T)] = deque(maxlen=self.host_window)
        w.append(float(seconds))
        if len(w) >= self.host_min:
            self.host[(B, T)] = statistics.median(w)

    def flush_share(self, T: int, nodes: int, tokens: float) -> float:
        """``φ``: the share of rows flushing per step (:func:`flush_fraction`; 0 without a ring)."""
        return 0.0 if self.ring is None else flush_fraction(self.ring, nodes, max(tokens, 1.0))

    def step_time(self, B: int, T: int, nodes: int, tokens: float) -> float:
        """A step of ``T`` drafts (``nodes`` inputs per row) keeping ``tokens`` per row in
        expectation: ``t(B, T) + φ · flush(B, T)``."""
        return self.get(B, T) + self.flush_share(T, nodes, tokens) * self.flush_cost(B, T)

    def observe(self, B: int, T: int, seconds: float, flush_part: float = 0.0) -> None:
        """A measured step of key ``(B, T)``; ``flush_part``: the flush time predicted in it."""
        if not self.online or not seconds > 0:
            return
        n = self._seen.get((B, T), 0)
        self._seen[(B, T)] = n + 1
        if n == 0:
            return
        x = max(seconds - flush_part, 0.25 * seconds)
        est = self.table.get((B, T))
        if est is None:   # no seed: the first kept observation is the entry
            self.table[(B, T)] = x
            self._refined.add((B, T))
            return
        if (B, T) not in self._refined:   # first refinement: start from the seed as its siblings correct it
            est, self._seed[(B, T)] = self.get(B, T), est
            self._refined.add((B, T))
        x = min(max(x, est / 4), est * 4)
        w = max(self.decay, 1.0 / (n + 1))   # a running mean with the seed as one sample, then the EMA
        self.table[(B, T)] = est + w * (x - est)
        if (B, T) in self._seed:
            group = [k for k in self._seed if k[0] == B and (k[1] > 0) == (T > 0)]
            self._offset[(B, T > 0)] = sum(self.table[k] - self._seed[k] for k in group) / len(group)


class _Lengths:
    """What every length policy shares: the candidate lengths (``tree``: one, the whole
    tree's draft nodes), ``depth[T]`` (the deepest draft a step of ``T`` drafts reaches: a
    chain ``T``, a tree its depth), ``nodes[T]`` (verify inputs, ``T + 1``) and a histogram
    of the chosen lengths."""

    def __init__(self, lengths: Sequence[int], tree: bool = False, depth: dict | None = None):
        if not lengths or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in lengths):
            raise ValueError(f"draft lengths must be positive ints, got {lengths!r}")
        self.lengths = tuple(sorted(set(lengths)))
        if tree and len(self.lengths) != 1:
            raise ValueError(f"a tree drafter has one length (its draft nodes), got {self.lengths}")
        self.max, self.tree = self.lengths[-1], tree
        self.depth = dict(depth) if depth is not None else {t: t for t in self.lengths}
        if set(self.depth) != set(self.lengths) or any(not 1 <= d <= t for t, d in self.depth.items()):
            raise ValueError(f"depth must map each length {self.lengths} to a depth in [1, length], got {depth!r}")
        self.nodes = {t: t + 1 for t in self.lengths}
        self.histogram: Counter = Counter()

    def record(self, T: int) -> None:
        self.histogram[T] += 1

    def observe(self, seqs, T: int, accepted: list[int], seconds: float | None,
                host: float | None = None) -> None:
        """After a step of ``T`` drafts (0: plain) over ``seqs``: ``accepted`` per row
        (accepted drafts + 1; a row offered fewer than ``T`` drafts failed at the first
        missing one), the step's wall time (None: not a step of that cost), and the part of
        it the drafter's ``propose`` took on the host (None: not measured)."""


class FixedLengths(_Lengths):
    """Always the largest length (speculation as configured)."""

    def choose(self, seqs) -> int:
        return self.max


class ScriptedLengths(_Lengths):
    """The lengths of ``script`` in turn (cycled), each clipped to the candidates: 0 stays
    0, anything else becomes the largest candidate not above it (at least the smallest)."""

    def __init__(self, lengths: Sequence[int], script: Sequence[int], tree: bool = False, depth: dict | None = None):
        super().__init__(lengths, tree, depth)
        if not script or any(not isinstance(t, int) or t < 0 for t in script):
            raise ValueError(f"ScriptedLengths: script must be non-negative ints, got {script!r}")
        self.script, self._i = list(script), 0

    def choose(self, seqs) -> int:
        t = self.script[self._i % len(self.script)]
        self._i += 1
        if t == 0:
            return 0
        return max([c for c in self.lengths if c <= t] or [self.lengths[0]])


class AdaptiveLengths(_Lengths):
    """Expected tokens per second: ``argmax_T Σ_rows E(α_row, depth(T)) / time(B, T)`` over
    ``T in {0} ∪ lengths`` (module docstring), ``time`` being :meth:`StepCosts.step_time`
    (the step with its expected flushes); ``T = 0`` unless another ``T`` is strictly
    better.  ``depth``: ``T -> `` the deepest draft a step of ``T`` drafts reaches (a chain:
    ``T``; a tree of ``T`` nodes: its depth); ``buckets``: the runner's batch buckets;
    ``costs``: a :class:`StepCosts`; ``probe_budget``: the largest share of the predicted
    run time probes may lose (module docstring); ``prior`` and ``acceptance``: keyword
    arguments of :class:`~.acceptance.AcceptanceStats`."""

    def __init__(self, lengths: Sequence[int], costs: StepCosts, buckets: Sequence[int], tree: bool = False,
                 depth: dict | None = None, probe_interval: int = 16, prior: float = 0.5,
                 probe_budget: float = 0.01, acceptance: dict | None = None):
        super().__init__(lengths, tree, depth)
        if isinstance(probe_interval, bool) or not isinstance(probe_interval, int) or probe_interval < 1:
            raise ValueError(f"probe_interval must be an int >= 1, got {probe_interval!r}")
        if not 0.0 <= probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in [0, 1], got {probe_budget}")
        self.costs, self.buckets, self.probe_interval = costs, list(buckets), probe_interval
        self.probe_budget = probe_budget
        self.acceptance = AcceptanceStats(max(self.depth.values()), prior, **(acceptance or {}))
        self._below = 0       # steps in a row below the longest length
        self._interval = probe_interval   # steps between probes: doubles after each, up to 16x
        self._natural = self.max          # the last choice before probing
        self._credit = 0.0                # predicted seconds probes may still lose (< 0: a borrowed probe)
        self._flush_part: dict[int, float] = {}   # T -> the flush (+ catch-up) time predicted for its last choice
        # (seqs, T) -> drafter catch-up passes a step of T drafts runs first (MTP's deferred
        # pairs, :meth:`MTPDrafter.catchup_passes`), each priced ``costs.catchup_cost(B)``
        self.passes = None
        self._own = 0.0                   # host seconds of the last choose (not yet charged)
        self._drafted_top = False         # whether a step has drafted the longest length yet
        self.probes = 0
        self.probe_loss = 0.0             # predicted seconds all probes lost (vs the best choice)
        self.predicted = 0.0              # predicted seconds of every chosen best step

    def bucket(self, B: int) -> int:
        return bucket_for(self.buckets, B)

    def _rates(self, seqs) -> tuple[int, dict[int, float], dict[int, float]]:
        """``(bucket, {T: expected tokens over the batch}, {T: predicted step seconds})``."""
        Bp, n = self.bucket(len(seqs)), max(len(seqs), 1)
        acc = self.acceptance
        sums = acc.batch_expected(seqs)
        tokens, times = {0: float(len(seqs))}, {}
        for T in self.lengths:
            tokens[T] = sums[self.depth[T]]
        per_pass = self.costs.catchup_cost(Bp) if self.passes is not None else 0.0
        for T, tok in tokens.items():
            N = 1 if T == 0 else self.nodes[T]
            base = self.costs.get(Bp, T)
            flush = self.costs.flush_share(T, N, tok / n) * self.costs.flush_cost(Bp, T)
            if per_pass:
                flush += self.passes(seqs, T) * per_pass
            self._flush_part[T] = flush
            times[T] = base + flush + self.costs.host_cost(Bp, T)
        return Bp, tokens, times

    def scores(self, seqs) -> dict[int, float]:
        """Expected tokens per unit of time of each candidate ``T`` (0 included)."""
        _, tokens, times = self._rates(seqs)
        return {T: tokens[T] / times[T] for T in tokens}

    def choose(self, seqs) -> int:
        t0 = time.perf_counter()
        T = self._choose(seqs)
        self._own = time.perf_counter() - t0   # the policy's host time: charged to this step's cost
        return T

    def _choose(self, seqs) -> int:
        if len(self.acceptance._rows) > 2 * len(seqs) + 64:
            self.acceptance.prune(seqs)
        _, tokens, times = self._rates(seqs)
        sc = {T: tokens[T] / times[T] for T in tokens}
        best = 0
        for T in self.lengths:   # strictly better only: ties stay with the fewer drafts (T = 0 first)
            if sc[T] > sc[best]:
                best = T
        if best > self._natural:   # the estimates favour more drafting: probe at the base rate again
            self._interval = self.probe_interval
        self._natural = best
        self._credit += self.probe_budget * times[best]
        self.predicted += times[best]
        if best == self.max:
            self._below, self._drafted_top = 0, True
            return best
        self._below += 1
        top = self.max
        cold = not self._drafted_top and self.probe_budget > 0   # never drafted the longest: nothing known deep
        if not (cold or self._below >= self._interval):
            return best
        # a probe drafts the longest: one verify observes acceptance at every depth up to it
        loss = max(times[top] - tokens[top] / sc[best], 0.0)   # vs the same tokens at the best rate
        if loss > self._credit and not cold:
            return best
        self._credit -= loss
        self.probe_loss += loss
        self._below = 0
        if not cold:
            self._interval = min(2 * self._interval, 16 * self.probe_interval)   # back off
        self.probes += 1
        self._drafted_top = True
        return top

    def observe(self, seqs, T: int, accepted: list[int], seconds: float | None,
                host: float | None = None) -> None:
        """After a step (see :class:`_Lengths`): the acceptance estimates, the drafter's
        host time ``host`` (its ``propose`` call; None: not measured) into
        :meth:`StepCosts.observe_host`, then the step's cost less ``host`` (priced apart:
        counted once) with the policy's own host time (this call and the step's
        :meth:`choose`) added, so that a step that only just wins on device time is not
        chosen when the bookkeeping of speculating eats the gain."""
        t0 = time.perf_counter()
        Bp = self.bucket(len(seqs))
        if T:
            d = self.depth[T]
            self.acceptance.observe_batch(seqs, d, [min(a - 1, d) for a in accepted])
            if host is not None:
                self.costs.observe_host(Bp, T, host)
        if seconds is not None:
            own = self._own + (time.perf_counter() - t0)
            drafted = host if T and host is not None else 0.0
            self.costs.observe(Bp, T, seconds - drafted + own, self._flush_part.get(T, 0.0))
        self._own = 0.0


def length_policy(sp, runner) -> _Lengths:
    """The length policy of speculative config ``sp`` for the target's ``runner`` (its batch
    buckets and device): chains choose from ``sp.draft_lengths`` (default
    :func:`default_lengths`), trees between 0 and the whole tree (``sp.max_draft_nodes``
    nodes, ``sp.depth`` deep).  ``"fixed"``: always the most.  ``"adaptive"``: costs from
    ``sp.step_costs`` if given, else measured on CUDA (and refined online), else the
    deterministic :func:`analytic_step_cost`."""
    tree, lengths = sp.is_tree, sp.candidate_lengths
    depth = {lengths[0]: sp.depth} if tree else None
    if sp.spec_policy == "fixed":
        return FixedLengths(lengths if tree else (sp.num_tokens,), tree, depth)
    online = sp.step_costs is None and runner.device.type == "cuda"
    costs = StepCosts(sp.step_costs, online=online)   # flush prices: measure_step_costs, on CUDA
    return AdaptiveLengths(lengths, costs, runner.buckets, tree, depth, sp.probe_interval)
