"""Per-depth acceptance estimates for the draft-length policy (docs/MATH.md, "Choosing the draft length").

``α_j``: the probability that draft ``j`` is accepted given drafts ``1..j-1`` were (trees:
that the accepted path reaches depth ``j`` given it reached ``j - 1``).  One verify step of
``T`` drafts whose row accepted ``a`` of them observes every depth it reached: depths
``1..a`` succeeded, depth ``a + 1`` (if ``a < T``) failed, deeper ones say nothing.

* the pool (one per drafter, every row feeds it): counts ``H_j`` (successes) and ``N_j``
  (trials) over the last ``pool_memory`` trials of each depth, and the rates
  ``p_j = (H_j + s · p_{j-1}) / (N_j + s)`` with ``p_0 = prior``: a depth seldom or never
  reached takes the rate of the one above it (a geometric extrapolation, truncated where
  data exist), so a short draft tells the policy what a longer one would yield;
* a row: its own discounted counts ``h_j, n_j`` (each trial weighs ``1 - 1/row_memory``
  less per later trial of that depth) shrunk to the pool with ``k`` pseudo-trials,
  ``α_j = (h_j + k · p_j) / (n_j + k)`` against the current pool: a new request starts
  from the pool, and its own data take over after a few steps.
"""

from __future__ import annotations

from numbers import Integral
from typing import Iterable, Sequence

__all__ = ["AcceptanceStats", "expected_tokens", "prefix_expectations"]


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


def prefix_expectations(alpha: Sequence[float]) -> list[float]:
    """``[E(α, 0), E(α, 1), ..., E(α, D)]``."""
    out, e, p = [1.0], 1.0, 1.0
    for a in alpha:
        p *= a
        e += p
        out.append(e)
    return out


class AcceptanceStats:
    """Pooled and per-request acceptance rates ``α_1..α_D`` (module docstring).

    ``prior``: ``p_0``, what depth 1 is believed before any trial; ``strength``: ``s``, the
    pseudo-trials a depth's prior (the rate above it) weighs in the pool; ``pool_memory``:
    the trials per depth the pool remembers (older ones fade proportionally); ``row_weight``:
    ``k``, the pseudo-trials of the pool in a row's estimate; ``row_memory``: a row's own
    trials fade by ``1 - 1/row_memory`` per later trial.  :meth:`expected` reads a row's
    ``E(α, d)`` for ``d = 0..D`` (kept beside its counts, recomputed when the pool changed)."""

    def __init__(self, depth: int, prior: float = 0.5, strength: float = 2.0, pool_memory: float = 512.0,
                 row_weight: float = 4.0, row_memory: float = 32.0):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"AcceptanceStats: depth must be an int >= 1, got {depth!r}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"AcceptanceStats: prior must be in [0, 1], got {prior}")
        for name, v, lo in (("strength", strength, 0.0), ("row_weight", row_weight, 0.0),
                            ("pool_memory", pool_memory, 1.0), ("row_memory", row_memory, 1.0)):
            if not (v > lo if lo == 0.0 else v >= lo) or v == float("inf"):
                raise ValueError(f"AcceptanceStats: {name} must be finite and {'> 0' if lo == 0.0 else '>= 1'}, "
                                 f"got {v}")
        self.depth, self.prior, self.strength = depth, prior, strength
        self.pool_memory, self.row_weight, self.row_gamma = pool_memory, row_weight, 1.0 - 1.0 / row_memory
        self.hits = [0.0] * depth     # H_j: pooled successes at depth j (index j - 1)
        self.trials = [0.0] * depth   # N_j: pooled trials
        self.pooled: list[float] = []
        self._pooled_e: list[float] = []
        self._refresh_pool()
        self._version = 0                    # bumped whenever the pool changes
        self._rows: dict[int, list] = {}     # id(seq) -> [seq, h, n, rates, E, version of rates]

    # -- reading ---------------------------------------------------------------------------
    def _refresh_pool(self) -> None:
        p, s, out = self.prior, self.strength, []
        for h, n in zip(self.hits, self.trials):
            p = (h + s * p) / (n + s)
            out.append(p)
        self.pooled = out
        self._pooled_e = prefix_expectations(out)

    def _row(self, seq):
        """``seq``'s entry with its rates against the current pool (None: never observed)."""
        e = self._rows.get(id(seq))
        if e is None or e[0] is not seq:
            return None
        if e[5] != self._version:
            k, p = self.row_weight, self.pooled
            e[3] = [(h + k * q) / (n + k) for h, n, q in zip(e[1], e[2], p)]
            e[4] = prefix_expectations(e[3])
            e[5] = self._version
        return e

    def alpha(self, seq) -> list[float]:
        """The rates of ``seq`` (the pool's until it has been observed)."""
        e = self._row(seq)
        return list(self.pooled) if e is None else list(e[3])

    def expected(self, seq) -> list[float]:
        """``[E(α, 0), ..., E(α, D)]`` of ``seq``'s rates."""
        e = self._row(seq)
        return self._pooled_e if e is None else e[4]

    def pooled_expected(self) -> list[float]:
        """``[E(p, 0), ..., E(p, D)]`` of the pooled rates (what a new request starts from)."""
        return self._pooled_e

    def batch_expected(self, seqs) -> list[float]:
        """``[Σ_rows E(α_row, d) for d = 0..D]``: the batch's expected tokens from a step of
        depth ``d``, each row's rates against the current pool (one pass, no per-row caching:
        the pool moves every verify step)."""
        D, k, p, rows = self.depth, self.row_weight, self.pooled, self._rows
        sums = [0.0] * (D + 1)
        fresh = 0
        for s in seqs:
            e = rows.get(id(s))
            if e is None or e[0] is not s:
                fresh += 1
                continue
            h, n = e[1], e[2]
            acc, pr = 1.0, 1.0
            sums[0] += 1.0
            for j in range(D):
                pr *= (h[j] + k * p[j]) / (n[j] + k)
                acc += pr
                sums[j + 1] += acc
        if fresh:
            pe = self._pooled_e
            for d in range(D + 1):
                sums[d] += fresh * pe[d]
        return sums

    def trials_at(self, depth: int) -> float:
        """``N_depth``: the pool's remembered trials at ``depth`` (1-based)."""
        if not 1 <= depth <= self.depth:
            raise ValueError(f"AcceptanceStats.trials_at: depth must be in [1, {self.depth}], got {depth}")
        return self.trials[depth - 1]

    # -- updating --------------------------------------------------------------------------
    def observe(self, seq, tried: int, accepted: int) -> None:
        """One step of ``seq``: drafts at depths ``1..tried`` were offered, the first
        ``accepted`` of them accepted."""
        self.observe_batch((seq,), tried, (accepted,))

    def observe_batch(self, seqs, tried: int, accepted) -> None:
        """One verify step: row ``seqs[i]`` was offered ``tried`` drafts and accepted the first
        ``accepted[i]``.  Depth ``j <= min(tried, accepted + 1)`` was reached and succeeded iff
        ``j <= accepted``.  The pool takes every row's trials; rows' rates follow the updated
        pool when next read."""
        accepted = list(accepted)
        if isinstance(tried, bool) or not isinstance(tried, Integral) or tried < 0:
            raise ValueError(f"AcceptanceStats.observe: tried must be an int >= 0, got {tried!r}")
        bad = [a for a in accepted if isinstance(a, bool) or not isinstance(a, Integral) or not 0 <= a <= tried]
        if bad:
            raise ValueError(f"AcceptanceStats.observe: need 0 <= accepted ({bad[0]!r}) <= tried ({tried})")
        if len(accepted) != len(seqs):
            raise ValueError(f"AcceptanceStats.observe: {len(seqs)} rows but {len(accepted)} accepted counts")
        D, g, H, N, rows = self.depth, self.row_gamma, self.hits, self.trials, self._rows
        for seq, a in zip(seqs, accepted):
            reach = min(tried, a + 1, D)
            if reach == 0:
                continue
            e = rows.get(id(seq))
            if e is None or e[0] is not seq:
                e = rows[id(seq)] = [seq, [0.0] * D, [0.0] * D, None, None, -1]
            e[5] = -1
            h, n = e[1], e[2]
            for j in range(reach):
                hit = 1.0 if j < a else 0.0
                h[j] = g * h[j] + hit
                n[j] = g * n[j] + 1.0
                H[j] += hit
                N[j] += 1.0
        for j in range(D):   # the pool remembers its last pool_memory trials per depth
            if N[j] > self.pool_memory:
                f = self.pool_memory / N[j]
                H[j] *= f
                N[j] = self.pool_memory
        self._refresh_pool()
        self._version += 1

    def prune(self, live: Iterable) -> None:
        """Forget requests not in ``live`` (finished ones); the pool keeps what they taught."""
        keep = {id(s) for s in live}
        for key in [key for key in self._rows if key not in keep]:
            del self._rows[key]
