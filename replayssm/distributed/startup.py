"""Startup timings of a tensor-parallel group: how long each phase took on each rank.

Every rank keeps one :class:`StartupTimes` (seconds per named phase, in the order first
met; a phase met again adds up and counts its calls).  Rank 0 times the group's start
(spawning, waiting for the workers, joining the process groups), each worker its own
(process start, imports, device, rendezvous), and every rank its share of the startup
calls (``load``, ``make_cache``, ``capture`` ...: see :func:`is_startup_call`) with the
loader's own phases (``load.read``, ``load.to_device``, ``load.allreduce_setup`` ...).
:attr:`TensorParallelGroup.startup_times <replayssm.distributed.group.TensorParallelGroup.startup_times>`
gathers them as ``{rank: {phase: seconds}}``; :func:`format_times` prints them as a table.

Triton compiles count as a phase too (``triton_compile``): :func:`watch_triton_compiles`
wraps ``triton.compiler.compile`` once per process and adds each call's time to the timings
made current by :func:`activate` (a group's, or a worker's), so the time a rank spends
compiling kernel variants (disk-cache hits included: they go through the same call) is told
apart from the calls that met them.  Timing costs two clock reads per startup call; the
serving path (steps, cache changes) is not timed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

__all__ = ["StartupTimes", "activate", "format_times", "is_startup_call", "phase", "watch_triton_compiles"]

log = logging.getLogger("replayssm.distributed")

#: calls of these methods (on any object every rank holds) are timed as startup phases;
#: the serving path (steps, cache changes) is not
STARTUP_METHODS = frozenset({"make_cache", "capture"})
#: group operations timed as startup phases
STARTUP_OPS = frozenset({"load", "random", "make", "runner"})


def is_startup_call(op: str, method: str | None = None) -> bool:
    """Whether a group operation (``op``; ``method`` for ``op == "call"``) is timed."""
    return op in STARTUP_OPS or (op == "call" and method in STARTUP_METHODS)


class StartupTimes:
    """Seconds per phase of one rank (``times``), and how often each was met (``counts``)."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.times[name] = self.times.get(name, 0.0) + float(seconds)
            self.counts[name] = self.counts.get(name, 0) + 1

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the ``with`` body as phase ``name`` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self.times)

    def clear(self) -> None:
        with self._lock:
            self.times.clear()
            self.counts.clear()


_current: StartupTimes | None = None
_watching = False


def activate(times: StartupTimes | None) -> None:
    """Make ``times`` the one this process's Triton compiles add to (None: none)."""
    global _current
    _current = times


@contextlib.contextmanager
def phase(name: str):
    """Time the ``with`` body as phase ``name`` of the timings made current by
    :func:`activate` (nothing when none is: code shared with one-rank use)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if _current is not None:
            _current.add(name, time.perf_counter() - t0)


def watch_triton_compiles() -> None:
    """Time every ``triton.compiler.compile`` call of this process as phase
    ``triton_compile`` (idempotent; nothing when Triton is absent).  Kernels resolve the
    function when they first launch, so this must run before the first launch."""
    global _watching
    if _watching:
        return
    _watching = True
    try:
        import triton.compiler as tc
    except ImportError:  # pragma: no cover - no triton
        return
    inner = getattr(tc, "compile", None)
    if inner is None or getattr(inner, "_replayssm_timed", False):  # pragma: no cover
        return

    def compile(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if _current is not None:
                _current.add("triton_compile", time.perf_counter() - t0)

    compile._replayssm_timed = True
    tc.compile = compile


def format_times(times: dict, title: str = "tensor-parallel startup (s)") -> str:
    """``{rank: {phase: seconds}}`` as a table: one row per phase, one column per rank."""
    ranks = sorted(times)
    phases: list[str] = []
    for r in ranks:
        phases += [p for p in times[r] if p not in phases]
    w = max([len(p) for p in phases] + [5])
    lines = [title, f"{'phase':<{w}}" + "".join(f"{'rank ' + str(r):>10}" for r in ranks)]
    for p in phases:
        cells = "".join(f"{times[r][p]:>10.3f}" if p in times[r] else f"{'-':>10}" for r in ranks)
        lines.append(f"{p:<{w}}{cells}")
    return "\n".join(lines)
