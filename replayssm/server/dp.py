"""Data parallelism: N engine replicas behind one OpenAI endpoint (``serve --data-parallel-size N``).

::

    API process (FastAPI, tokenizer, router)
      DataParallelPool ── PrefixRouter: prefix affinity within a load bound, else least loaded
        ReplicaClient 0 ── pipe ── replica process 0: engine on cuda:0 (.. cuda:tp-1 with TP)
        ReplicaClient 1 ── pipe ── replica process 1: engine on cuda:tp (..)
        ...

Each replica is a process (:mod:`replayssm.server.dp_replica`) running its own engine,
stepping freely and sending one message per step with every request's new tokens.  The
API process holds one :class:`ReplicaClient` per replica: an :class:`AsyncEngine` whose
thread forwards the replica's adds and aborts down the pipe and turns its step messages
back into outputs for the HTTP requests' streams (the streaming, cancellation, draining and
metrics code is the single-engine server's).  :class:`DataParallelPool` presents the
engine loop's interface to the app: ``submit`` routes the request (:mod:`.dp_router`),
``abort`` reaches the replica that holds it, ``drain`` drains them all, ``health`` reports
every replica.

Faults: a replica that dies (killed, a CUDA error, a tensor-parallel worker lost) is seen at
once (its process sentinel and pipe); the requests it held end with an error naming the
replica and how it died (HTTP 500 / a stream ``error`` event), the router forgets its
prefixes and it is restarted, up to ``max_restarts`` times.  Meanwhile the other replicas
serve; ``/health`` answers ``degraded`` (200) while some replica is down and 503 when none
is up.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing import connection
from types import SimpleNamespace
from typing import Optional

from .dp_replica import ReplicaSpec, StepAssembler, replica_main
from .dp_router import PrefixRouter, RouterConfig
from .engine_loop import AsyncEngine, QueueFull, ShuttingDown
from .metrics import ServerMetrics

log = logging.getLogger("replayssm.server")

__all__ = ["DataParallelConfig", "DataParallelPool", "ReplicaDied", "DPMetrics"]


@dataclass
class DataParallelConfig:
    """``size`` replicas; a dead one is restarted up to ``max_restarts`` times (0: never);
    ``start_timeout_s``: how long a replica may take to build its engine; ``step_timeout_s``:
    how long a replica holding requests may stay silent before it counts as hung (killed,
    restarted; 0: never)."""

    size: int
    max_restarts: int = 3
    start_timeout_s: float = 1800.0
    step_timeout_s: float = 600.0
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"data_parallel_size must be an int >= 1, got {self.size!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s!r}")
        if not self.step_timeout_s >= 0:
            raise ValueError(f"step_timeout_s must be >= 0 seconds, got {self.step_timeout_s!r}")


class ReplicaDied(RuntimeError):
    """A replica process is gone (or could not start)."""


class DPMetrics(ServerMetrics):
    """The server's metrics (summed over replicas) plus per-replica series labelled
    ``replica``: up, sequences in flight / running / waiting, requests routed (by reason:
    ``affinity`` or ``load``), generated tokens, restarts."""

    def __init__(self, model_name: str, size: int):
        super().__init__(model_name)
        from prometheus_client import Counter, Gauge

        r, lab = self.registry, ["model_name", "replica"]
        p = "replayssm:dp_replica_"
        self.r_up = Gauge(p + "up", "1 while the replica serves, 0 while it is down or restarting", lab, registry=r)
        self.r_in_flight = Gauge(p + "in_flight", "Sequences the replica holds (queued + running)", lab, registry=r)
        self.r_running = Gauge(p + "running", "Sequences holding a cache slot of the replica", lab, registry=r)
        self.r_waiting = Gauge(p + "waiting", "Sequences queued in the replica's engine", lab, registry=r)
        self.r_routed = Counter(p + "requests_routed", "Requests routed to the replica by reason (affinity: its "
                                "prefix went there before; load: least loaded)", lab + ["reason"], registry=r)
        self.r_tokens = Counter(p + "generation_tokens", "Tokens the replica generated", lab, registry=r)
        self.r_restarts = Counter(p + "restarts", "Times the replica was restarted after dying", lab, registry=r)
        self._metrics_lock = threading.RLock()   # one thread per replica steps the metrics
        self._pending_tokens = 0
        for i in range(size):   # every series exists from the start
            self.r_up.labels(model_name, str(i)).set(0)
            for reason in ("affinity", "load"):
                self.r_routed.labels(model_name, str(i), reason)
            self.r_tokens.labels(model_name, str(i))
            self.r_restarts.labels(model_name, str(i))

    def on_tokens(self, n: int) -> None:
        """Counted here, added to the Prometheus counter once per step (:meth:`refresh`): a
        counter increment costs more than the rest of an output's bookkeeping."""
        with self._metrics_lock:
            self._pending_tokens += n

    def on_step(self, engine, outs, seconds: float, loop) -> None:
        with self._metrics_lock:
            super().on_step(engine, outs, seconds, loop)

    def refresh(self, engine, loop) -> None:
        with self._metrics_lock:
            if self._pending_tokens:
                super().on_tokens(self._pending_tokens)
                self._pending_tokens = 0
            super().refresh(engine, loop)
            for c in getattr(loop, "clients", ()):
                lab = (self.model_name, str(c.index))
                occ = c.engine.occ if c.state == "up" else {}
                self.r_up.labels(*lab).set(1 if c.state == "up" else 0)
                self.r_in_flight.labels(*lab).set(c.in_flight)
                self.r_running.labels(*lab).set(occ.get("running", 0))
                self.r_waiting.labels(*lab).set(occ.get("waiting", 0))


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
        self._set = False
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

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
        self.fatal: Optional[str] = None
        self.owed_since: Optional[float] = None   # first command sent since its last message

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

    def __init__(self, remote: RemoteEngine, pool: "DataParallelPool", max_running: int, max_queue: int, metrics):
        super().__init__(remote, max_running, max_queue, metrics)
        self._wake = _SocketWake()
        self.pool, self.index = pool, remote.spec.index
        self.state = "up"            # up / restarting / failed (no restarts left) / stopped
        self.restarts = 0
        self._assembler = StepAssembler()
        self._last_msg = time.monotonic()
        self._held: Optional[list] = None   # while a step message is delivered: (stream, item) to hand over
        self._tokens_counter = None if metrics is None else metrics.r_tokens.labels(metrics.model_name,
                                                                                     str(self.index))

    def submit(self, requests: list[tuple], loop: asyncio.AbstractEventLoop | None = None):
        stream = super().submit(requests, loop)
        stream.put = lambda item, s=stream: self._put(s, item)   # batched per step (below)
        return stream

    def _put(self, stream, item) -> None:
        """A stream's item: held while a step message is delivered (one wake-up of the event
        loop per step, not one per request), else handed over at once."""
        if self._held is not None:
            self._held.append((stream, item))
        else:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _release(self) -> None:
        held, self._held = self._held, None
        by_loop: dict = {}
        for stream, item in held or ():
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_hand_over, items)

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
            log.error("%s; the server runs degraded", e)
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


def _hand_over(held: list) -> None:
    """On the event loop: put one step's items into their streams' queues, in order."""
    for stream, item in held:
        stream.queue.put_nowait(item)


_LIVE: "weakref.WeakSet[DataParallelPool]" = weakref.WeakSet()


@atexit.register
def _stop_live() -> None:  # pragma: no cover - interpreter exit (before multiprocessing joins children)
    for p in list(_LIVE):
        p.shutdown(2.0)


class DataParallelView:
    """What the app reads of "the engine" when there are replicas: the tokenizer (loaded in
    the API process), the replicas' context and vocabulary, and their summed occupancy."""

    def __init__(self, pool: "DataParallelPool", tokenizer, info: dict):
        self.pool, self.tokenizer = pool, tokenizer
        self.num_slots = info["num_slots"]
        self.vocab_size = info["vocab_size"]
        self.scheduler = SimpleNamespace(token_limit=info["token_limit"])
        self.device = info["device"]

    def occupancy(self) -> dict:
        occs = [c.engine.occ for c in self.pool.clients if c.state == "up" and c.engine.occ]
        tot: dict = {"running": 0, "waiting": 0, "free_slots": 0, "total_slots": 0, "free_kv_blocks": -1,
                     "total_kv_blocks": 0}
        for o in occs:
            for k, v in o.items():
                if k == "free_kv_blocks":
                    if v >= 0:
                        tot[k] = max(tot[k], 0) + v
                elif k != "prefix_hit_rate" and isinstance(v, (int, float)):
                    tot[k] = tot.get(k, 0) + v
        if any("prefix_hit_rate" in o for o in occs):
            q = tot.get("prefix_query_tokens", 0)
            tot["prefix_hit_rate"] = tot.get("prefix_hit_tokens", 0) / q if q else 0.0
        return tot

    @property
    def stats(self) -> dict:
        return {"preemptions": sum(c.engine.preemptions for c in self.pool.clients)}


class DataParallelPool:
    """N replicas behind the engine-loop interface the app uses (``submit``, ``abort``,
    ``drain``, ``in_flight`` ...).  :meth:`launch` starts the processes and waits until
    every engine is built; the app's lifespan calls :meth:`start` / :meth:`shutdown`."""

    def __init__(self, model_dir: str, args, config: DataParallelConfig, model_name: str, max_queue: int,
                 warm_up: bool = False, log_level: str = "info", connected: dict | None = None, local_rank: int = 0):
        """``connected``: ``{replica index: connection}`` of replicas that run elsewhere (other
        torchrun ranks, :mod:`.dp_torchrun`); the others are started here, replica ``i`` on
        ``cuda:slot*tp`` with ``slot = i`` (or ``local_rank`` under torchrun)."""
        import copy

        import torch
        import torch.multiprocessing as mp

        from .dp_replica import replica_device

        self.config = config
        self.model_dir = model_dir
        self.metrics = DPMetrics(model_name, config.size)
        self.router = PrefixRouter(config.size, config.router)
        self._route_lock = threading.Lock()
        self.max_queue = int(max_queue)
        self.draining = self.stopping = False
        ctx = mp.get_context("spawn")
        tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
        cuda = torch.cuda.is_available()
        connected = connected or {}
        self._remotes = []
        last_gpu = -1
        for i in range(config.size):
            a = copy.copy(args)
            a.seed = int(getattr(args, "seed", 0) or 0) + i   # unseeded sampling differs between replicas
            if i in connected:
                from .dp_torchrun import ConnectedEngine

                self._remotes.append(ConnectedEngine(ReplicaSpec(i, model_dir, a, warm_up, log_level), connected[i]))
                continue
            slot = local_rank if connected else i
            a.device = replica_device(slot, tp, args.device, cuda)
            if a.device != "cpu":
                last_gpu = max(last_gpu, slot * tp + tp - 1)
            self._remotes.append(RemoteEngine(ReplicaSpec(i, model_dir, a, warm_up, log_level), ctx))
        if last_gpu >= 0 and last_gpu >= torch.cuda.device_count():
            raise ValueError(f"--data-parallel-size {config.size} x --tensor-parallel-size {tp} needs GPUs up to "
                             f"cuda:{last_gpu} on this host, {torch.cuda.device_count()} visible")
        self.clients: list[ReplicaClient] = []
        self.view: Optional[DataParallelView] = None
        self.infos: list[dict] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def launch(self, tokenizer=None) -> list[dict]:
        """Start every replica (in parallel) and wait for its engine; raises
        :class:`ReplicaDied` (all stopped) if one fails.  Returns their ready infos."""
        for r in self._remotes:
            r.spawn()
        _LIVE.add(self)
        try:
            self.infos = [r.wait_ready(self.config.start_timeout_s) for r in self._remotes]
        except BaseException:
            for r in self._remotes:
                r.kill()
            _LIVE.discard(self)
            raise
        first = self.infos[0]
        first = dict(first, num_slots=min(i["num_slots"] for i in self.infos),
                     token_limit=min(i["token_limit"] for i in self.infos))
        self.view = DataParallelView(self, tokenizer, first)
        self.clients = [ReplicaClient(r, self, first["num_slots"], self.max_queue, self.metrics)
                        for r in self._remotes]
        for c in self.clients:
            self.metrics.r_up.labels(self.metrics.model_name, str(c.index)).set(1)
        return self.infos

    def start(self) -> None:
        for c in self.clients:
            c.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica, all at once (idempotent): the client threads first (so that
        nothing else writes to the pipes), then the processes."""
        self.stopping = True
        live = [c for c in self.clients if c.state != "stopped"]
        for c in live:
            c._stop = True
            c._wake.set()
        for c in live:
            if c._thread is not None:
                c._thread.join(timeout)
        remotes = [c.engine for c in live] if self.clients else self._remotes
        for r in remotes:
            r.request_stop()
        for r in remotes:
            r.wait_stopped(timeout)
        for c in live:
            c.state = "stopped"
            c._wake.close()
        _LIVE.discard(self)

    # -- the engine-loop interface -------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return any(c.alive and c.state in ("up", "restarting") for c in self.clients)

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.clients)

    @property
    def steps(self) -> int:
        return sum(c.steps for c in self.clients)

    @property
    def step_failures(self) -> int:
        return sum(c.step_failures for c in self.clients)

    @property
    def max_running(self) -> int:
        return self.view.num_slots

    def router_forget(self, index: int) -> None:
        with self._route_lock:
            self.router.forget(index)

    def submit(self, requests: list[tuple], loop: asyncio.AbstractEventLoop | None = None):
        """Route one HTTP request's ``[(request_id, prompt_ids, SamplingParams), ...]`` (by its
        first prompt) to a replica and return its stream (``stream.replica``: the replica)."""
        loop = loop or asyncio.get_running_loop()
        if self.draining:
            raise ShuttingDown("server is shutting down: not accepting new requests")
        seqs = sum(p.n for _, _, p in requests)
        with self._route_lock:
            loads = [c.in_flight for c in self.clients]
            up = [c.state == "up" and c.alive for c in self.clients]
            usable = [u and c.in_flight + seqs <= c.max_running + c.max_queue for u, c in zip(up, self.clients)]
            if not any(usable):
                if not any(up):
                    down = ", ".join(f"replica {c.index} {c.state}" for c in self.clients)
                    raise QueueFull(f"no engine replica is up ({down}); retry later")
                raise QueueFull(f"server is at capacity: every replica holds its max_num_seqs {self.max_running} "
                                f"+ max_queue {self.max_queue} sequences; retry later")
            r, reason = self.router.route(requests[0][1], loads, usable)
            stream = self.clients[r].submit(requests, loop)
        stream.replica = r
        self.metrics.r_routed.labels(self.metrics.model_name, str(r), reason).inc()
        return stream

    def abort(self, stream) -> None:
        self.clients[stream.replica].abort(stream)

    def abort_all(self) -> None:
        for c in self.clients:
            c.abort_all()

    async def drain(self, timeout: float, grace: float = 5.0) -> int:
        """Every replica's :meth:`AsyncEngine.drain` at once; returns the sequences aborted."""
        self.draining = True
        left = await asyncio.gather(*(c.drain(timeout, grace) for c in self.clients if c.state == "up"))
        return sum(left)

    def health(self) -> tuple[int, dict]:
        """``(HTTP status, body)``: 200 ``ok`` with every replica up, 200 ``degraded`` with
        some down, 503 with none up or while draining."""
        reps = [{"replica": c.index, "state": c.state, "in_flight": c.in_flight, "steps": c.steps,
                 "restarts": c.restarts, **({"error": c.last_error} if c.state != "up" and c.last_error else {})}
                for c in self.clients]
        up = sum(c.state == "up" and c.alive for c in self.clients)
        body = {"status": "ok" if up == len(self.clients) else "degraded" if up else "unavailable",
                "in_flight": self.in_flight, "steps": self.steps, "replicas": reps}
        if self.draining:
            body["status"] = "shutting down"
            return 503, body
        return (200 if up else 503), body
