"""Bounded teardown of a tensor-parallel group: nothing here waits on a peer without a limit.

Leaving a process group can block on the other ranks: NCCL's ``destroy_process_group``
(with symmetric-memory buffers registered) waits for every rank, and an abort issued while
that destroy still runs waits for the destroy's lock — seen on two H100s, where ``close()``
sat for over a minute with one thread in each.  So every step that may block runs on a
daemon thread that the caller waits for at most a bound (:func:`bounded`); a step that does
not finish is given up and its thread remembered (:data:`STUCK`).  Worker processes are
stopped with ``SIGTERM`` and then ``SIGKILL`` (:func:`stop_processes`): a worker blocked in
a collective or ignoring ``SIGTERM`` can never outlive ``close()`` (``multiprocessing``
joins its daemonic children without a limit at interpreter exit).

At interpreter exit, while a given-up teardown thread is still blocked, :func:`guard_exit`
arms ``faulthandler``'s watchdog: if the interpreter's own shutdown (the module teardown
that drops the half-destroyed process group) has not finished within
:data:`EXIT_GRACE_S`, every thread's stack is printed and the process ends with status 1
instead of hanging.  A shutdown that finishes keeps its own exit status.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time

import torch.distributed as dist

log = logging.getLogger("replayssm.distributed")

__all__ = ["bounded", "leave_process_group", "abort_process_group", "stop_processes", "guard_exit", "STUCK",
           "STEP_S", "EXIT_GRACE_S"]

#: how long one teardown step that can block on peers (the stop message, leaving the process
#: group, aborting it) is waited for before it is given up
STEP_S = 5.0
#: how long the interpreter's shutdown may take once a teardown thread was given up
EXIT_GRACE_S = 20.0
#: teardown threads given up while still blocked (daemon threads: they never hold up exit)
STUCK: list[threading.Thread] = []


def bounded(fn, name: str, timeout_s: float) -> tuple[bool, object]:
    """``fn()`` on a daemon thread named ``name``, waited for at most ``timeout_s``:
    ``(finished, result or the exception it raised)``.  A thread still running is given up
    (added to :data:`STUCK`)."""
    box: list = [None]

    def run():
        try:
            box[0] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box[0] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    if t.is_alive():
        STUCK.append(t)
        return False, None
    return True, box[0]


def abort_process_group() -> None:
    """Drop the default process group without waiting for peers (after a failure)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        elif dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - best effort after a failure
        pass


def leave_process_group(clean: bool) -> None:
    """``destroy_process_group`` when the peers leave too (``clean``), else abort it."""
    if not clean:
        abort_process_group()
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - after a failure
        pass


def stop_processes(procs, grace_s: float = 2.0) -> list[int]:
    """Every process of ``procs`` still alive gets ``SIGTERM``, then ``SIGKILL`` after
    ``grace_s``; waits at most ``grace_s`` for each signal.  Returns the pids that had to
    be killed."""
    live = [p for p in procs if p.is_alive()]
    for p in live:
        p.terminate()
    _join_all(live, grace_s)
    killed = [p for p in live if p.is_alive()]
    for p in killed:
        p.kill()
    _join_all(killed, grace_s)
    return [p.pid for p in killed]


def _join_all(procs, timeout_s: float) -> None:
    t_end = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, t_end - time.monotonic()))


def guard_exit() -> bool:
    """At interpreter exit: arm ``faulthandler``'s watchdog (stacks, then exit status 1 after
    :data:`EXIT_GRACE_S`) when a given-up teardown thread is still blocked.  True if armed."""
    stuck = [t.name for t in STUCK if t.is_alive()]
    if not stuck:
        return False
    log.warning("tensor-parallel teardown still blocked in %s at exit: the process ends within %.0f s "
                "(status 1 if the interpreter's shutdown hangs)", ", ".join(stuck), EXIT_GRACE_S)
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
    return True
