"""``TensorParallelGroup.close()`` is bounded whatever the peers do (CPU, gloo).

The GPU hang it guards against: rank 0's ``destroy_process_group`` waited for the workers
forever and the abort meant to end it waited for the destroy (NCCL's lock), so ``close()``
never returned.  Here rank 0's destroy and abort are made to block the same way, and the
worker never answers teardown (stuck in a call, ``SIGTERM`` ignored): ``close()`` returns
within its bound, the worker is killed, the blocked steps are given up and reported; and a
script that leaves such a group open exits by itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

dist_mod = pytest.importorskip("replayssm.distributed")

import torch.distributed as dist  # noqa: E402

from replayssm.distributed import TensorParallelGroup, teardown  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Stuck:
    """Made on every rank: rank 0's returns, a worker's never does (and ignores SIGTERM)."""

    def __init__(self):
        if dist.get_rank() != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1.0)


def _stuck_worker(group) -> int:
    h = group.new_handle()
    group.make(h, Stuck)
    (worker,) = multiprocessing.active_children()
    time.sleep(0.3)                       # the worker is inside Stuck() by now
    return worker.pid


@pytest.mark.parametrize("worker", ["stuck", "stops"])
def test_close_is_bounded_when_teardown_blocks_everywhere(worker, monkeypatch, caplog, one_thread):
    """``stops``: the GPU case (the worker stops; rank 0's destroy, then its abort, block);
    ``stuck``: the worker never reads ``stop`` either (the stop message blocks too, gloo's
    broadcast waiting for the reader): rank 0 aborts instead of destroying, and kills it."""
    monkeypatch.setattr(teardown, "STEP_S", 0.5)
    release = threading.Event()
    entered = []
    real_destroy, real_abort = dist.destroy_process_group, dist.distributed_c10d._abort_process_group

    def blocked(name, real):
        def fn(*a, **kw):
            entered.append(name)
            release.wait()
            return real(*a, **kw)
        return fn

    group = TensorParallelGroup(2, "cpu", worker_threads=1)
    try:
        if worker == "stuck":
            pid = _stuck_worker(group)
        monkeypatch.setattr(dist, "destroy_process_group", blocked("destroy", real_destroy))
        monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", blocked("abort", real_abort))
        stuck_before = len(teardown.STUCK)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="replayssm.distributed"):
            group.close(timeout_s=1.0)
        took = time.monotonic() - t0
        assert took < 1.0 + 4 * 0.5 + 2 * 2.0 + 1.0, took       # timeout, the steps, TERM and KILL graces
        assert multiprocessing.active_children() == []
        names = {t.name for t in teardown.STUCK[stuck_before:] if t.is_alive()}
        if worker == "stuck":
            assert entered == ["abort"]                          # no stop sent: abort, not destroy
            assert str(pid) in caplog.text and "ignored SIGTERM" in caplog.text
            assert "replayssm-tp-leave" in names
        else:
            assert entered == ["destroy", "abort"]               # rank 0 tried both, waited for neither
            assert "ignored SIGTERM" not in caplog.text          # the worker left by itself
            assert {"replayssm-tp-leave", "replayssm-tp-abort"} <= names
        assert "given up" in caplog.text
        assert not group.alive
        group.close()                                             # idempotent, immediate
        with pytest.raises(ValueError, match="teardown blocked and was given up"):
            TensorParallelGroup(2, "cpu")                         # named, before any process starts
        assert multiprocessing.active_children() == []
    finally:
        release.set()                                             # the blocked steps finish now
        for t in list(teardown.STUCK):
            t.join(10)
        monkeypatch.undo()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not dist.is_initialized()


def test_guard_exit_arms_only_while_a_teardown_is_blocked(monkeypatch):
    import faulthandler

    monkeypatch.setattr(teardown, "STUCK", [])
    assert teardown.guard_exit() is False
    release = threading.Event()
    done, _ = teardown.bounded(release.wait, "replayssm-tp-test", 0.05)
    assert not done and [t.name for t in teardown.STUCK] == ["replayssm-tp-test"]
    try:
        assert teardown.guard_exit() is True
    finally:
        faulthandler.cancel_dump_traceback_later()
        release.set()
        teardown.STUCK[0].join(5)
    assert teardown.bounded(lambda: 7, "x", 1.0) == (True, 7)
    done, err = teardown.bounded(lambda: 1 / 0, "x", 1.0)
    assert done and isinstance(err, ZeroDivisionError)


SCRIPT = """
import os, signal, sys, threading, time
import torch, torch.distributed as dist
from replayssm.distributed import TensorParallelGroup, teardown

class Stuck:
    def __init__(self):
        if dist.get_rank() != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1.0)

if __name__ == "__main__":
    torch.set_num_threads(1)
    teardown.STEP_S = 0.5
    g = TensorParallelGroup(2, "cpu", worker_threads=1)
    g.make(g.new_handle(), Stuck)
    time.sleep(0.3)
    never = threading.Event()
    dist.destroy_process_group = lambda *a, **k: never.wait()     # rank 0's teardown never returns
    dist.distributed_c10d._abort_process_group = lambda *a, **k: never.wait()
    print("pid", g._procs[0].pid, flush=True)
    # no close(): the group is closed at interpreter exit
"""


def test_a_script_that_leaves_a_stuck_group_open_still_exits(tmp_path):
    """The old close() sent SIGTERM and went on; multiprocessing's exit handler then waited
    for the worker forever.  Now the worker is killed and the interpreter exits."""
    path = tmp_path / "leave_open.py"
    path.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                                           # the worker is gone
    assert "ignored SIGTERM" in proc.stderr and "blocked in replayssm-tp-leave" in proc.stderr
    assert took < 60, took
