"""How many tokens to draft in each step: ``T`` from a captured set, ``T = 0`` being a plain decode step.

A verify step with ``T`` drafts per row costs ``t(B, T)`` (``B``: the batch bucket the step
runs as) and yields, per row, ``E(α, T) = 1 + Σ_{i=1..T} Π_{j<=i} α_j`` tokens in expectation,
where ``α_j`` is the probability that draft ``j`` is accepted given drafts ``1..j-1`` were
(for trees: that the accepted path reaches depth ``j`` given it reached ``j - 1``).
:class:`AdaptiveLengths` picks, every step, the ``T`` that maximises expected tokens per
second over the batch::

    T* = argmax_T  Σ_rows E(α_row, T) / t(B, T)

* acceptance: :class:`AcceptanceStats`, an exponential moving average of ``α_j`` per
  request, new requests starting from the pooled average of all requests;
* cost: :class:`StepCosts`, a table ``t(B, T)`` over the batch buckets and draft lengths:
  measured when a CUDA engine starts, after graph capture
  (:func:`replayssm.engine.warmup.measure_step_costs`), and
  refined online by the step times the engine observes (they include the drafter's own
  work), supplied by the user (``SpeculativeConfig.step_costs``), or, on CPU, the
  deterministic roofline :func:`analytic_step_cost` (reproducible tests);
* probing: after ``probe_interval`` steps in a row below the largest length, one step uses
  the next larger one, so acceptance estimates stay alive while speculation is off and a
  request can come back to it.  The interval doubles after each probe (up to 16x, bounding
  what probes cost where speculation keeps losing) and returns to ``probe_interval`` when
  the estimates favour a longer length than before.

Greedy output is the same for every ``T`` (verification accepts only the target's own
choices); sampled acceptance stays distribution-exact because ``T`` depends only on
earlier steps.  :class:`FixedLengths` always drafts the most; :class:`ScriptedLengths`
replays a given sequence of lengths (tests, experiments).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from ..batching import bucket_for
from ..config import default_lengths

__all__ = ["AcceptanceStats", "AdaptiveLengths", "FixedLengths", "ScriptedLengths", "StepCosts",
           "analytic_step_cost", "default_lengths", "expected_tokens", "length_policy"]


def expected_tokens(alpha: Sequence[float], T: int) -> float:
    """``1 + Σ_{i=1..T} Π_{j<=i} α_j``: tokens a row yields in expectation from a step of
    ``T`` drafts (``T = 0``: exactly one); ``alpha`` must hold at least ``T`` rates."""
    if T > len(alpha):
        raise ValueError(f"expected_tokens: {T} drafts need {T} acceptance rates, got {len(alpha)}")
    e, p = 1.0, 1.0
    for i in range(T):
        p *= alpha[i]
        e += p
    return e


def analytic_step_cost(B: int, T: int) -> float:
    """A deterministic roofline of one step's time (arbitrary units) for batch bucket ``B``
    and ``T`` draft nodes per row: ``1 + max(1, B (T + 1) / 256)`` — a fixed launch cost,
    then the weights' read while the step is memory-bound, then linear in the tokens it
    computes.  Small batches speculate for free; large ones pay per draft."""
    return 1.0 + max(1.0, B * (T + 1) / 256.0)


def _prefix_expectations(alpha: list[float]) -> list[float]:
    """``[E(α, 0), E(α, 1), ..., E(α, D)]``."""
    out, e, p = [1.0], 1.0, 1.0
    for a in alpha:
        p *= a
        e += p
        out.append(e)
    return out


class AcceptanceStats:
    """Per-request acceptance rates ``α_1..α_D`` (EMA, weight ``decay`` for the newest step),
    and the pooled rates every new request starts from (``prior`` before any step).  Each
    request's expected tokens ``E(α, d)`` for ``d = 0..D`` are kept beside its rates
    (:meth:`expected`: a step's choice reads them, it does not recompute them)."""

    def __init__(self, depth: int, prior: float = 0.5, decay: float = 0.25):
        if depth < 1:
            raise ValueError(f"AcceptanceStats: depth must be >= 1, got {depth}")
        if not 0.0 <= prior <= 1.0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"AcceptanceStats: prior in [0, 1] and decay in (0, 1] needed, got {prior}, {decay}")
        self.depth, self.decay = depth, decay
        self.pooled = [prior] * depth
        self._pooled_e = _prefix_expectations(self.pooled)
        self._rows: dict[int, tuple[object, list[float], list[float]]] = {}   # id(seq) -> (seq, rates, E)

    def alpha(self, seq) -> list[float]:
        """The rates of ``seq`` (the pooled ones until it has speculated)."""
        e = self._rows.get(id(seq))
        return e[1] if e is not None and e[0] is seq else self.pooled

    def expected(self, seq) -> list[float]:
        """``[E(α, 0), ..., E(α, D)]`` of ``seq``'s rates."""
        e = self._rows.get(id(seq))
        if e is not None and e[0] is seq:
            return e[2]
        if self._pooled_e is None:
            self._pooled_e = _prefix_expectations(self.pooled)
        return self._pooled_e

    def observe(self, seq, tried: int, accepted: int) -> None:
        """One step of ``seq``: drafts at depths ``1..tried`` were offered, the first
        ``accepted`` of them accepted.  Depth ``j <= min(tried, accepted + 1)`` was reached;
        it succeeded iff ``j <= accepted``."""
        if not 0 <= accepted <= tried:
            raise ValueError(f"AcceptanceStats.observe: need 0 <= accepted ({accepted}) <= tried ({tried})")
        e = self._rows.get(id(seq))
        if e is None or e[0] is not seq:
            e = self._rows[id(seq)] = (seq, list(self.pooled), [])
        rates, pooled, w = e[1], self.pooled, self.decay
        for j in range(min(tried, accepted + 1, self.depth)):
            hit = 1.0 if j < accepted else 0.0
            rates[j] += w * (hit - rates[j])
            pooled[j] += (w / 8) * (hit - pooled[j])   # slower: many requests feed it
        e[2][:] = _prefix_expectations(rates)
        self._pooled_e = None   # recomputed when next read

    def prune(self, live: Iterable) -> None:
        """Forget requests not in ``live`` (finished ones)."""
        keep = {id(s) for s in live}
        for k in [k for k in self._rows if k not in keep]:
            del self._rows[k]


class StepCosts:
    """Step times ``t(B, T)`` per batch bucket ``B`` and draft length ``T`` (0: a decode step).

    ``table``: ``{(batch, T): seconds}``; a batch between keys uses the next larger key (the
    largest past the end).  Missing ``T``s fall back to ``fallback(B, T)``.  With ``online``,
    :meth:`observe` refines the entry of a step's key by an EMA of the measured times
    (the first observation of a key is dropped — it may include a compile or a graph
    capture —, the second replaces the seed, later ones move it by ``decay`` after clipping
    to 4x of it either way)."""

    def __init__(self, table: dict | None = None, fallback=analytic_step_cost, online: bool = False,
                 decay: float = 0.2):
        self.table: dict[tuple[int, int], float] = {}
        for (b, t), v in (table or {}).items():
            if not (isinstance(b, int) and isinstance(t, int) and b >= 1 and t >= 0) or not v > 0:
                raise ValueError(f"step cost table: keys (batch >= 1, T >= 0) and positive times, got {(b, t)}: {v}")
            self.table[(b, t)] = float(v)
        self.fallback, self.online, self.decay = fallback, online, decay
        self._seen: dict = {}

    def get(self, B: int, T: int) -> float:
        bs = sorted(b for b, t in self.table if t == T)
        if not bs:
            return self.fallback(B, T)
        return self.table[(next((b for b in bs if b >= B), bs[-1]), T)]

    def observe(self, B: int, T: int, seconds: float) -> None:
        if not self.online or not seconds > 0:
            return
        n = self._seen.get((B, T), 0)
        self._seen[(B, T)] = n + 1
        if n == 0:
            return
        est = self.table.get((B, T))
        if est is None or n == 1:   # the first kept observation replaces the seed
            self.table[(B, T)] = seconds
            return
        x = min(max(seconds, est / 4), est * 4)
        self.table[(B, T)] = est + self.decay * (x - est)


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

    def observe(self, seqs, T: int, accepted: list[int], seconds: float | None) -> None:
        """After a step of ``T`` drafts (0: plain) over ``seqs``: ``accepted`` per row
        (accepted drafts + 1; a row offered fewer than ``T`` drafts failed at the first
        missing one), the step's wall time (None: not a step of that cost)."""


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
    """Expected tokens per second: ``argmax_T Σ_rows E(α_row, depth(T)) / t(B, T)`` over
    ``T in {0} ∪ lengths`` (module docstring).  ``depth``: ``T -> `` the deepest draft a
    step of ``T`` drafts reaches (a chain: ``T``; a tree of ``T`` nodes: its depth);
    ``buckets``: the runner's batch buckets; ``costs``: a :class:`StepCosts`."""

    def __init__(self, lengths: Sequence[int], costs: StepCosts, buckets: Sequence[int], tree: bool = False,
                 depth: dict | None = None, probe_interval: int = 16, prior: float = 0.5):
        super().__init__(lengths, tree, depth)
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
        self.costs, self.buckets, self.probe_interval = costs, list(buckets), probe_interval
        self.acceptance = AcceptanceStats(max(self.depth.values()), prior)
        self._below = 0       # steps in a row below the largest length
        self._interval = probe_interval   # steps between probes: doubles after each, up to 16x
        self._natural = self.max          # the last choice before probing

    def bucket(self, B: int) -> int:
        return bucket_for(self.buckets, B)

    def scores(self, seqs) -> dict[int, float]:
        """Expected tokens per unit of time of each candidate ``T`` (0 included)."""
        Bp = self.bucket(len(seqs))
        es = [self.acceptance.expected(s) for s in seqs]
        out = {0: len(seqs) / self.costs.get(Bp, 0)}
        for T in self.lengths:
            d = self.depth[T]
            out[T] = sum(e[d] for e in es) / self.costs.get(Bp, T)
        return out

    def choose(self, seqs) -> int:
        if len(self.acceptance._rows) > 2 * len(seqs) + 64:
            self.acceptance.prune(seqs)
        sc = self.scores(seqs)
        best = max(sc, key=lambda t: (sc[t], -t))   # ties: the fewer drafts
        if best > self._natural:   # the estimates favour more drafting: probe at the base rate again
            self._interval = self.probe_interval
        self._natural = best
        if best < self.max:
            self._below += 1
            if self._below >= self._interval:   # probe the next larger length
                self._below = 0
                self._interval = min(2 * self._interval, 16 * self.probe_interval)   # back off
                best = min(t for t in self.lengths if t > best)
        else:
            self._below = 0
        return best

    def observe(self, seqs, T: int, accepted: list[int], seconds: float | None) -> None:
        if seconds is not None:
            self.costs.observe(self.bucket(len(seqs)), T, seconds)
        if T == 0:
            return
        d = self.depth[T]
        for s, a in zip(seqs, accepted):
            self.acceptance.observe(s, d, min(a - 1, d))


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
    costs = StepCosts(sp.step_costs, online=online)
    return AdaptiveLengths(lengths, costs, runner.buckets, tree, depth, sp.probe_interval)
