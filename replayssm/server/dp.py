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

With one replica this is the single-engine server's engine process (``serve
--engine-process``, the default on CUDA): HTTP work in the API process never holds its GIL.

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
import threading
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

from .dp_client import RemoteEngine, ReplicaClient, ReplicaDied
from .dp_metrics import DPMetrics
from .dp_replica import ReplicaSpec
from .dp_router import PrefixRouter, RouterConfig
from .engine_loop import QueueFull, ShuttingDown

log = logging.getLogger("replayssm.server")

__all__ = ["DPMetrics", "DataParallelConfig", "DataParallelPool", "ReplicaDied"]

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

_LIVE: weakref.WeakSet[DataParallelPool] = weakref.WeakSet()


@atexit.register
def _stop_live() -> None:  # pragma: no cover - interpreter exit (before multiprocessing joins children)
    for p in list(_LIVE):
        p.shutdown(2.0)


class DataParallelView:
    """What the app reads of "the engine" when there are replicas: the tokenizer (loaded in
    the API process), the replicas' context and vocabulary, and their summed occupancy."""

    def __init__(self, pool: DataParallelPool, tokenizer, info: dict):
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
            a.device = replica_device(slot, tp, args.device, cuda, single=config.size == 1 and not connected)
            if a.device != "cpu":
                last_gpu = max(last_gpu, int(a.device.partition(":")[2] or 0) + tp - 1)
            self._remotes.append(RemoteEngine(ReplicaSpec(i, model_dir, a, warm_up, log_level), ctx))
        if last_gpu >= 0 and last_gpu >= torch.cuda.device_count():
            raise ValueError(f"--data-parallel-size {config.size} x --tensor-parallel-size {tp} needs GPUs up to "
                             f"cuda:{last_gpu} on this host, {torch.cuda.device_count()} visible")
        self.clients: list[ReplicaClient] = []
        self.view: DataParallelView | None = None
        self.infos: list[dict] = []
        self.failed: str | None = None   # every replica failed for good: why (the last one's error)
        self.on_failed = None             # called once then (the server exits 1, as with one engine in-process)

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

    def replica_failed(self) -> None:
        """A replica failed for good (no restart left): when none is left to serve, the pool
        is :attr:`failed` and ``on_failed`` is called (from that replica's client thread)."""
        if self.failed is not None or self.stopping or any(c.state in ("up", "restarting") for c in self.clients):
            return
        self.failed = next((c.last_error for c in reversed(self.clients) if c.last_error), "every replica failed")
        log.error("no engine replica is left to serve: %s", self.failed)
        if self.on_failed is not None:
            try:
                self.on_failed()
            except Exception:  # pragma: no cover - the reason is logged above
                log.exception("on_failed raised")

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
                if len(self.clients) == 1:   # one engine process: the in-process server's words
                    c = self.clients[0]
                    raise QueueFull(f"server is at capacity: {c.in_flight} sequences in flight, at most "
                                    f"{c.max_running + c.max_queue} (max_num_seqs {c.max_running} + max_queue "
                                    f"{c.max_queue}); retry later")
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
