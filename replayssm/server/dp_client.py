"""The API process's side of one data-parallel replica (:mod:`replayssm.server.dp`).

:class:`RemoteEngine` is the handle of a replica process (commands down its pipe, its last
reported occupancy, its exit status); :class:`ReplicaClient` is the engine loop for it: an
:class:`~replayssm.server.engine_loop.AsyncEngine` whose thread forwards the inbox to the
replica and turns its step messages back into the request streams' outputs (one event-loop
wake-up per step), and which sees the replica die (its sentinel, its pipe's end, a ``fatal``
message, or silence past the step timeout), ends its requests with the reason and restarts it.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from multiprocessing import connection

from .dp_replica import ReplicaSpec, StepAssembler, replica_main
from .engine_loop import AsyncEngine

log = logging.getLogger("replayssm.server")

__all__ = ["RemoteEngine", "ReplicaClient", "ReplicaDied"]


class ReplicaDied(RuntimeError):
    """A replica process is gone (or could not start)."""


class _SocketWake:
    """A ``threading.Event``-like flag that also wakes ``connection.wait`` (a socket pair)."""

    def __init__(self):
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                self._w.send(b"x")
            except OSError:  # pragma: no cover - closed at shutdown
                pass

    def clear(self) -> None:
        """Drain the socket, then disarm: a :meth:`set` racing with this either finds the flag
        still up (its command is read by the caller's next inbox pass, which follows) or
        comes after and sends a byte that stays.  (Disarming first let a ``set`` in between
        send a byte that the drain then swallowed, leaving the flag up with nothing to wake
        the next wait: a command, or the stop, sat unseen until the replica spoke.)"""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._set = False

    def wait(self, timeout: float | None = None) -> bool:
        connection.wait([self._r], timeout)
        return self._set

    def fileno(self) -> int:
        return self._r.fileno()

    def close(self) -> None:
        self._r.close()
        self._w.close()


class RemoteEngine:
    """The API process's handle of one replica process: commands down the pipe, the last
    reported occupancy.  It never steps here: the replica steps itself and its client
    (:class:`ReplicaClient`) receives the outputs."""

    tokenizer = None

    def __init__(self, spec: ReplicaSpec, ctx):
        self.spec, self._ctx = spec, ctx
        self.proc = None
        self.conn = None
        self.info: dict = {}
        self.occ: dict = {}
        self.preemptions = 0
        self.fatal: str | None = None
        self.owed_since: float | None = None   # first command sent since its last message

    def spawn(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        self.proc = self._ctx.Process(target=replica_main, args=(self.spec, child), daemon=False,
                                      name=f"replayssm-dp-replica{self.spec.index}")
        self.proc.start()
        child.close()
        self.conn, self.fatal, self.occ = parent, None, {}

    def wait_ready(self, timeout: float, cancelled=lambda: False) -> dict:
        """Block until the replica reports ready; raises :class:`ReplicaDied` if it fails, does
        not start within ``timeout`` seconds or ``cancelled()`` turns true meanwhile."""
        t_end = time.monotonic() + timeout
        while True:
            left = t_end - time.monotonic()
            if left <= 0 or cancelled():
                self.kill()
                raise ReplicaDied(f"replica {self.spec.index} did not start within {timeout:.0f} s"
                                  if left <= 0 else f"replica {self.spec.index}: start cancelled (shutting down)")
            ready = connection.wait(self.waitables(), min(left, 1.0))
            if self.conn in ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    msg = ("start_failed", None)
                if msg[0] == "ready":
                    self.info = msg[1]
                    return self.info
                self.join(10)
                why = msg[1] or f"it {self.exit_text()}"
                raise ReplicaDied(f"replica {self.spec.index} could not start: {why}")
            if self.gone(ready):
                self.join(1)
                raise ReplicaDied(f"replica {self.spec.index} could not start: it {self.exit_text()}")

    # -- the process ---------------------------------------------------------------------------
    restartable = True   # a process of ours: started again after it dies

    def waitables(self) -> list:
        """What ``connection.wait`` watches: the pipe and the process."""
        return [self.conn, self.proc.sentinel]

    def gone(self, ready) -> bool:
        return self.proc.sentinel in ready

    @property
    def pid(self):
        return None if self.proc is None else self.proc.pid

    def join(self, timeout: float) -> None:
        if self.proc is not None:
            self.proc.join(timeout)

    def exit_text(self) -> str:
        code = None if self.proc is None else self.proc.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    # -- the StepEngine surface the engine loop uses ----------------------------------------
    def _send(self, msg) -> None:
        if self.owed_since is None:
            self.owed_since = time.monotonic()
        try:
            self.conn.send(msg)
        except (OSError, ValueError, AttributeError) as e:   # a dead pipe: the death is reported separately
            raise ReplicaDied(f"replica {self.spec.index} is down ({type(e).__name__})") from None

    def add_request(self, prompt, params, request_id=None):
        self._send(("add", request_id, list(prompt), params))

    def abort(self, request_id) -> bool:
        self._send(("abort", request_id))
        return True

    def step(self) -> list:
        raise RuntimeError("a replica steps in its own process; ReplicaClient receives its outputs")

    def has_unfinished(self) -> bool:
        return bool(self.occ.get("running", 0) or self.occ.get("waiting", 0))

    def occupancy(self) -> dict:
        return self.occ

    def recover(self) -> None:   # the replica recovers itself (or exits)
        pass

    def request_stop(self) -> None:
        """Ask the replica to stop (it closes its engine and exits); see :meth:`wait_stopped`."""
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (OSError, ValueError):
                pass

    def wait_stopped(self, timeout: float) -> None:
        if self.proc is not None:
            self.proc.join(timeout)
        self.kill()

    def stop(self, timeout: float) -> None:
        self.request_stop()
        self.wait_stopped(timeout)

    def kill(self) -> None:
        """SIGKILL (a replica ignores SIGTERM; its tensor-parallel workers exit when it is gone)."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self.conn is not None:
            self.conn.close()


class ReplicaClient(AsyncEngine):
    """The API process's engine loop for one replica: its thread forwards the inbox to the
    replica process and delivers the replica's step messages to the request streams."""

    def __init__(self, remote: RemoteEngine, pool, max_running: int, max_queue: int, metrics):
        super().__init__(remote, max_running, max_queue, metrics)
        self._wake = _SocketWake()
        self.pool, self.index = pool, remote.spec.index
        self.state = "up"            # up / restarting / failed (no restarts left) / stopped
        self.restarts = 0
        self._assembler = StepAssembler()
        self._last_msg = time.monotonic()
        self._tokens_counter = None if metrics is None else metrics.r_tokens.labels(metrics.model_name,
                                                                                     str(self.index))


    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        remote: RemoteEngine = self.engine
        while not self._stop:
            if self.state != "up":   # no restart left: what was queued meanwhile ends with the reason
                self._wake.wait(0.5)
                self._wake.clear()
                with self._lock:
                    rids = list(self._streams)
                    self._inbox.clear()
                for rid in rids:
                    self._end(rid, self.last_error or f"engine replica {self.index} is {self.state}")
                continue
            timeout, step_timeout = None, self.pool.config.step_timeout_s
            if step_timeout and self._in_flight > 0:   # it owes us a step: how long may it stay silent
                since = max(self._last_msg, remote.owed_since or 0.0)
                timeout = max(since + step_timeout - time.monotonic(), 0.0)
            ready = connection.wait(remote.waitables() + [self._wake], timeout)
            if self._wake in ready:
                self._wake.clear()
            try:
                self._drain()
            except Exception as e:  # pragma: no cover - bookkeeping must not end the thread
                self.last_error = f"{type(e).__name__}: {e}"
            if self._stop:
                break
            died = remote.gone(ready) and not remote.conn.poll(0)
            try:
                while not died and remote.conn.poll(0):
                    self._on_message(remote.conn.recv())
            except (EOFError, OSError):
                died = True
            except Exception as e:  # never let bookkeeping kill the thread
                log.exception("replica %d: message handling failed", self.index)
                self.last_error = f"{type(e).__name__}: {e}"
            if not died and timeout is not None and self._in_flight > 0:
                silent = time.monotonic() - max(self._last_msg, remote.owed_since or 0.0)
                if silent >= step_timeout:
                    remote.fatal = (f"stopped answering: no step for {silent:.0f} s with {self._in_flight} sequences "
                                    f"in flight (step timeout {step_timeout:g} s)")
                    remote.kill()   # hung: no exit to wait for
            died = died or remote.fatal is not None   # it said why and is exiting: no need to wait
            if died and not self._stop:
                self._replica_died()

    def _on_message(self, msg) -> None:
        self._last_msg = time.monotonic()
        self.engine.owed_since = None
        kind = msg[0]
        if kind == "step":
            _, dt, entries, admitted, occ, preempted = msg
            self.engine.occ, self.engine.preemptions = occ, preempted
            self.steps += 1
            if self.metrics is not None:
                for _, secs in admitted:
                    self.metrics.on_queued(secs)
            self._held = []
            try:
                for e in entries:
                    out = self._rebuild(e)
                    if out is not None:
                        self._deliver(out)
            finally:
                self._release()
            if self._tokens_counter is not None:
                n = sum(len(e[2]) for e in entries)
                if n:
                    self._tokens_counter.inc(n)
            if self.metrics is not None:
                self.metrics.on_step(self.pool.view, entries, dt, self.pool)
            if dt > self.slow_step_s:
                log.warning("replica %d: slow engine step: %.2f s; %d outputs, %s running, %s waiting", self.index,
                            dt, len(entries), occ.get("running", "?"), occ.get("waiting", "?"))
        elif kind == "idle":
            self.engine.occ, self.engine.preemptions = msg[1], msg[2]
        elif kind == "refused":
            self._end(msg[1], msg[2])
        elif kind == "failed":
            self.step_failures += 1
            self.last_error = msg[1]
            log.error("replica %d: engine step failed; ending its %d requests", self.index, len(self._streams))
            for rid in list(self._streams):
                self._end(rid, f"engine step failed: {msg[1]}")
        elif kind == "fatal":
            self.engine.fatal = msg[1]

    def _rebuild(self, e):
        rid = e[0]
        stream = self._streams.get(rid)
        if stream is None:   # ended here meanwhile (aborted, refused)
            self._assembler.forget(rid, e[1] + 1)
            return None
        return self._assembler.add(e, stream.prompts.get(rid, []))

    def _end(self, rid, error, aborted: bool = False) -> None:
        stream = self._streams.get(rid)
        super()._end(rid, error, aborted)
        if stream is not None:
            for r in stream.request_ids:
                self._assembler.forget(r, stream.samples)

    # -- failure and restart -------------------------------------------------------------------
    def _replica_died(self) -> None:
        remote: RemoteEngine = self.engine
        if remote.fatal is None:   # dead already: its exit status
            remote.join(2)
        why = f"failed: {remote.fatal}" if remote.fatal else remote.exit_text()
        msg = f"engine replica {self.index} (pid {remote.pid}) {why}"
        if self.pool.stopping or self.pool.draining:
            self.state = "stopped"
        elif self.restarts >= self.pool.config.max_restarts or not remote.restartable:
            self.state = "failed"   # set before its requests end: /health says so as they see the error
        else:
            self.state = "restarting"
        self.last_error = msg
        with self._lock:
            rids = list(self._streams)
            self._inbox.clear()
            self._queued.clear()
        log.error("%s; ending its %d requests in flight", msg, len(rids))
        for rid in rids:
            self._end(rid, f"{msg}; the request was running there and has ended")
        self._assembler.clear()
        remote.join(5)   # a failed replica closes its engine (its workers) and exits 1
        remote.kill()
        self.pool.router_forget(self.index)
        if self.state == "stopped":
            return
        if self.state == "failed":
            log.error("replica %d is not restarted (%s); the server runs degraded", self.index,
                      "not a process of this server" if not remote.restartable else
                      f"{self.restarts} restarts, --data-parallel-max-restarts {self.pool.config.max_restarts}")
            self.pool.replica_failed()
            return
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.r_restarts.labels(self.metrics.model_name, str(self.index)).inc()
        log.warning("restarting replica %d (restart %d of at most %d)", self.index, self.restarts,
                    self.pool.config.max_restarts)
        try:
            remote.spawn()
            info = remote.wait_ready(self.pool.config.start_timeout_s, lambda: self.pool.stopping or self._stop)
        except ReplicaDied as e:
            self.state = "failed"
            self.last_error = str(e)
            log.error("%s; the server runs degraded", e)
            self.pool.replica_failed()
            return
        if self.pool.stopping:   # shut down while it started
            remote.stop(5)
            self.state = "stopped"
            return
        self._last_msg = time.monotonic()
        self.state = "up"
        log.warning("replica %d is back (pid %d)", self.index, info["pid"])

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown(timeout)
        self.engine.stop(timeout)
        self.state = "stopped"
        self._wake.close()

