"""A length policy on a synthetic acceptance trace: known per-depth acceptance, known step costs.

:func:`simulate` runs ``policy`` (anything with ``choose(seqs)`` and ``observe(seqs, T,
accepted, seconds)``) over ``batch`` rows for ``steps`` steps, or until every request is
done.  Each step of ``T`` drafts accepts, per row, draft ``j`` with probability ``alpha[j-1]``
while the drafts before it were accepted (``T = 0``: one token), and takes
``cost(B, T)`` seconds of device work (the true table, which the policy may know only in
part) plus, for ``T > 0``, ``host(B, T)`` seconds of the drafter's ``propose`` on the host
(the device idles through it; the policy is told it as the engine tells it).  Requests
of ``tokens`` tokens are replaced by new ones as they finish when ``refill`` (a server under
steady load), else the batch drains (a benchmark's batch submitted at once).  Used by the
tests and to compare policies off the GPU; :func:`best_length` is the length an oracle that
knows ``alpha`` and the costs would choose.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .acceptance import expected_tokens

__all__ = ["Request", "SimResult", "best_length", "simulate"]


class Request:
    """A stand-in sequence: ``remaining`` tokens (None: unbounded; policies key rows on identity)."""

    def __init__(self, tokens: int | None):
        self.remaining = tokens


@dataclass
class SimResult:
    """``tokens`` generated, ``seconds`` spent, ``chosen``: the length of every step, ``batch``:
    the rows of every step, ``plain_seconds``: the time plain steps (the table's ``T = 0``)
    would have needed for the same tokens, step by step at the same batch."""

    tokens: int = 0
    seconds: float = 0.0
    chosen: list = field(default_factory=list)
    batch: list = field(default_factory=list)
    plain_seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def best_length(alpha: Sequence[float], cost: Callable[[int, int], float], B: int, lengths: Sequence[int],
                depth: dict | None = None, host: Callable[[int, int], float] | None = None) -> int:
    """``argmax_T E(α, depth(T)) / (cost(B, T) + host(B, T))`` over ``{0} ∪ lengths``
    (``host``: 0 at ``T = 0``; ties: the fewer drafts)."""
    depth = depth or {t: t for t in lengths}
    best, rate = 0, 1.0 / cost(B, 0)
    for T in sorted(lengths):
        r = expected_tokens(alpha, depth[T]) / (cost(B, T) + (host(B, T) if host else 0.0))
        if r > rate:
            best, rate = T, r
    return best


def simulate(policy, alpha: Sequence[float], cost: Callable[[int, int], float], batch: int, steps: int,
             tokens: int | None = None, refill: bool = False, seed: int = 0,
             host: Callable[[int, int], float] | None = None) -> SimResult:
    """Run ``policy`` on the trace (module docstring); ``depth`` of each length comes from
    ``policy.depth`` (trees) and ``alpha`` must cover the deepest."""
    if batch < 1 or steps < 0:
        raise ValueError(f"simulate: need batch >= 1 and steps >= 0, got {batch}, {steps}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"simulate: tokens must be >= 1 or None, got {tokens}")
    if not all(0.0 <= a <= 1.0 for a in alpha) or len(alpha) < max(policy.depth.values()):
        raise ValueError(f"simulate: alpha must hold a probability per depth up to {max(policy.depth.values())}, "
                         f"got {list(alpha)}")
    rng = random.Random(seed)
    rows = [Request(tokens) for _ in range(batch)]
    out = SimResult()
    for _ in range(steps):
        if not rows:
            break
        T = policy.choose(rows)
        d = policy.depth[T] if T else 0
        acc = []
        for _r in rows:
            a = 0
            while a < d and rng.random() < alpha[a]:
                a += 1
            acc.append(a + 1)
        h = host(len(rows), T) if host is not None and T else None
        if h is not None and not h >= 0:
            raise ValueError(f"simulate: host({len(rows)}, {T}) must be >= 0 seconds, got {h}")
        sec = cost(len(rows), T) + (h or 0.0)
        policy.observe(rows, T, acc, sec, h)
        out.seconds += sec
        out.chosen.append(T)
        out.batch.append(len(rows))
        keep, made = [], 0
        for r, a in zip(rows, acc):
            got = a if r.remaining is None else min(a, r.remaining)
            made += got
            if r.remaining is not None:
                r.remaining -= got
                if r.remaining == 0:
                    if refill:
                        keep.append(Request(tokens))
                    continue
            keep.append(r)
        out.tokens += made
        out.plain_seconds += cost(len(rows), 0) * made / len(rows)
        rows = keep
    return out
