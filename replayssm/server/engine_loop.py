"""The async engine loop: one engine stepped on its own thread, fed by many HTTP requests.

The engine's compute blocks, so it runs on a dedicated thread.  HTTP handlers (on the
asyncio loop) never touch the engine: they put ``add`` and ``abort`` commands into an inbox
that the engine thread drains *between* steps, so new requests join the running batch at the
next step (continuous batching through the engine's own scheduler) and a cancelled request
leaves it — its cache slot freed — before the next step runs.  Every step's outputs are
handed back to the asyncio loop (``call_soon_threadsafe``) into the queue of the HTTP
request they belong to.

Shutting down (:meth:`AsyncEngine.drain`): new submits are refused
(:class:`ShuttingDown`), the requests in flight run on until they finish or a timeout
passes, and the rest end with ``finish_reason="abort"`` -- a final output like any other,
so streams close normally.

Failures stay local: a request the engine refuses (``add_request`` raising) or ends with an
error gets that error on its own queue; if a whole step raises, the requests in flight end
with the error, the engine is reset to an idle state, and the loop goes on serving.  The loop
never exits on a request's account.  An engine that cannot go on (a tensor-parallel worker
died: ``WorkerFailed``, or its reset raised) is *failed*: the requests in flight end with the
error, new submits are refused (:class:`ShuttingDown`, 503), :attr:`AsyncEngine.failed`
holds the reason, the loop's thread ends and ``on_failed`` (the server's exit) is called.

The engine is anything with the step-wise API (:class:`StepEngine`), e.g.
:class:`replayssm.LLM`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

log = logging.getLogger("replayssm.server")


@runtime_checkable
class StepEngine(Protocol):
    """The engine API the server drives (what :class:`replayssm.LLM` provides)."""

    tokenizer: Any

    def add_request(self, prompt, params, request_id=None) -> Any: ...

    def step(self) -> list: ...          # RequestOutputs (cumulative token_ids, text, finish_reason, error)

    def abort(self, request_id) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def occupancy(self) -> dict: ...     # running, waiting, free_slots, total_slots, free_kv_blocks

    def recover(self) -> None: ...       # after a step raised half-way


class QueueFull(Exception):
    """More sequences in flight than ``max_num_seqs + max_queue``."""


class ShuttingDown(Exception):
    """The server is draining for shutdown: no new requests."""


@dataclass
class AbortedOutput:
    """The final output of a sequence ended by shutdown: what it had so far, ``abort``."""

    request_id: Any
    index: int
    prompt_token_ids: list
    token_ids: list
    text: str
    logprobs: Optional[list] = None
    finish_reason: str = "abort"
    error: Optional[str] = None


@dataclass
class StreamEnd:
    """Sentinel: every sequence of the request has finished (or the request failed)."""

    error: Optional[str] = None


@dataclass
class RequestStream:
    """One HTTP request's view of its engine requests: an asyncio queue of outputs."""

    loop: asyncio.AbstractEventLoop
    request_ids: list
    num_seqs: int
    arrival: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set = field(default_factory=set)        # (request_id, index) done
    token_counts: dict = field(default_factory=dict)  # (request_id, index) -> tokens seen
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    closed: bool = False
    first_at: dict = field(default_factory=dict)      # (request_id, index) -> time of its first token
    last_out: dict = field(default_factory=dict)      # (request_id, index) -> its latest output
    prompts: dict = field(default_factory=dict)       # request_id -> prompt token ids
    samples: int = 1                                  # sequences per engine request (n)

    def put(self, item) -> None:
        """From the engine thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, StreamEnd):
            self.closed = True
            if item.error is not None:
                raise EngineError(item.error)
            raise StopAsyncIteration
        return item


class EngineError(RuntimeError):
    """The engine ended a request with an error."""


class AsyncEngine:
    """Steps ``engine`` on a thread; :meth:`submit` queues requests, :meth:`abort` cancels.

    ``max_running``: sequences the engine runs at once (its slots); ``max_queue``: how many
    more may wait.  A submit beyond ``max_running + max_queue`` sequences in flight raises
    :class:`QueueFull` (the server answers 503).  ``metrics`` (optional) gets
    ``on_step(engine, outputs, seconds)``, ``on_token(...)`` and ``on_finish(...)`` calls from
    the engine thread.
    """

    def __init__(self, engine: StepEngine, max_running: int, max_queue: int, metrics=None, idle_wait: float = 0.05,
                 slow_step_s: float = 1.0):
        if not isinstance(engine, StepEngine):
            raise TypeError(f"engine must provide add_request/step/abort/has_unfinished, got {type(engine).__name__}")
        self.engine = engine
        self.max_running, self.max_queue = int(max_running), int(max_queue)
        self.metrics = metrics
        self.idle_wait = idle_wait
        self.slow_step_s = slow_step_s    # steps longer than this are logged (a warning)
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict = {}          # engine request id -> RequestStream
        self._in_flight = 0               # sequences submitted and not finished
        self._stop = False
        self.draining = False             # shutting down: submits refused
        self._queued: dict = {}           # engine request id -> (its Sequence, arrival): not admitted yet
        self._thread: Optional[threading.Thread] = None
        self._ids = itertools.count()
        self.steps = 0
        self.step_failures = 0
        self.last_error: Optional[str] = None
        self.failed: Optional[str] = None   # the engine cannot go on: why
        self.on_failed = None               # called (from the engine thread) once the engine failed
        self._held: list | None = None      # while a step's outputs are delivered: (stream, item) to hand over

    # -- asyncio side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replayssm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, requests: list[tuple], loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue ``[(request_id, prompt_ids, SamplingParams), ...]`` (one HTTP request) and
        return the stream of their outputs.  All or nothing: raises :class:`QueueFull`."""
        loop = loop or asyncio.get_running_loop()
        seqs = sum(p.n for _, _, p in requests)
        if self.failed is not None:
            raise ShuttingDown(f"engine failed: {self.failed}; the server is shutting down")
        if self.draining:
            raise ShuttingDown("server is shutting down: not accepting new requests")
        with self._lock:
            limit = self.max_running + self.max_queue
            if self._in_flight + seqs > limit:
                raise QueueFull(f"server is at capacity: {self._in_flight} sequences in flight, at most {limit} "
                                f"(max_num_seqs {self.max_running} + max_queue {self.max_queue}); retry later")
            self._in_flight += seqs
            stream = RequestStream(loop, [r[0] for r in requests], seqs, samples=requests[0][2].n)
            stream.put = lambda item, s=stream: self._put(s, item)   # batched per step (below)
            for rid, ids, params in requests:
                self._streams[rid] = stream
                stream.prompts[rid] = list(ids)
                self._inbox.append(("add", rid, ids, params))
        self._wake.set()
        return stream

    def abort_all(self) -> None:
        """End every request in flight with ``finish_reason="abort"`` (between the next two
        steps); their streams get a final output and close normally."""
        with self._lock:
            self._inbox.append(("abort_all",))
        self._wake.set()

    async def drain(self, timeout: float, grace: float = 5.0) -> int:
        """Refuse new requests, let those in flight finish for up to ``timeout`` seconds, then
        abort the rest (:meth:`abort_all`) and wait up to ``grace`` seconds more for their
        final outputs.  Returns how many sequences were still in flight at the timeout."""
        self.draining = True
        deadline = time.monotonic() + max(timeout, 0.0)
        while self._in_flight > 0 and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.05)
        left = self._in_flight
        if left > 0:
            self.abort_all()
            end = time.monotonic() + grace
            while self._in_flight > 0 and time.monotonic() < end and self.alive:
                await asyncio.sleep(0.02)
        return left

    def abort(self, stream: RequestStream) -> None:
        """Cancel every unfinished request of ``stream`` (between the next two steps)."""
        with self._lock:
            for rid in stream.request_ids:
                if rid in self._streams:
                    self._inbox.append(("abort", rid))
        self._wake.set()

    # -- engine thread ---------------------------------------------------------------------
    def _put(self, stream: RequestStream, item) -> None:
        """A stream's item: held while a step's outputs are delivered (one wake-up of the event
        loop per step, not one per output: each wake-up is a write to its self-pipe that hands
        the GIL to the event loop's thread while the stepping thread still has work), else
        handed over at once."""
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

    def _run(self) -> None:
        dev = getattr(self.engine, "device", None)
        if getattr(dev, "type", None) == "cuda":   # a new thread starts on device 0
            import torch

            torch.cuda.set_device(dev)
        while not self._stop:
            self._drain()
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            stats = dict(getattr(self.engine, "stats", {}))
            t0 = time.perf_counter()
            try:
                outs = self.engine.step()
            except Exception as e:  # the step failed as a whole: end what was in flight, go on
                self._step_failed(e)
                continue
            dt = time.perf_counter() - t0
            self.steps += 1
            try:
                if self._queued:
                    self._note_admitted(t0)
                if dt > self.slow_step_s:
                    self._log_slow_step(dt, stats, len(outs))
                self._held = []
                try:
                    for out in outs:
                        self._deliver(out)
                finally:
                    self._release()
                if self.metrics is not None:
                    self.metrics.on_step(self.engine, outs, dt, self)
            except Exception as e:  # never let bookkeeping kill the engine thread
                self._step_failed(e)

    def _log_slow_step(self, dt: float, before: dict, outputs: int) -> None:
        """A warning naming where a slow step's time went (the engine's prefill / decode
        counters) and what the engine held, for stalls seen from the clients."""
        after = getattr(self.engine, "stats", {})
        split = ", ".join(f"{k[:-2]} {after[k] - before.get(k, 0):.2f} s" for k in ("prefill_s", "decode_s")
                          if isinstance(after.get(k), float))
        occ = self.engine.occupancy() if hasattr(self.engine, "occupancy") else {}
        log.warning("slow engine step %d: %.2f s (%s); %d outputs, %s running, %s waiting", self.steps, dt,
                    split or "no split", outputs, occ.get("running", "?"), occ.get("waiting", "?"))

    def _note_admitted(self, step_start: float) -> None:
        """Queue times of the requests the last step admitted (no longer waiting)."""
        for rid, (seq, arrival) in list(self._queued.items()):
            status = getattr(getattr(seq, "status", None), "name", "WAITING")
            if status != "WAITING":
                del self._queued[rid]
                if self.metrics is not None and status != "REJECTED":
                    self.metrics.on_queued(max(step_start - arrival, 0.0))

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, rid, ids, params = cmd
                try:
                    seq = self.engine.add_request(ids, params, request_id=rid)
                except Exception as e:   # refused (validated by the server first: rare)
                    self._end(rid, f"{type(e).__name__}: {e}")
                    continue
                stream = self._streams.get(rid)
                if seq is not None and hasattr(seq, "status") and stream is not None:
                    self._queued[rid] = (seq, stream.arrival)
            elif cmd[0] == "abort_all":
                self._abort_everything()
            else:
                rid = cmd[1]
                try:
                    self.engine.abort(rid)
                except Exception as e:  # pragma: no cover - a broken engine state
                    self.last_error = f"abort {rid}: {e}"
                self._queued.pop(rid, None)
                self._end(rid, None, aborted=True)

    def _abort_everything(self) -> None:
        """Shutdown's abort: every unfinished sequence gets a final ``abort`` output."""
        with self._lock:
            streams = {id(s): s for s in self._streams.values()}
        for stream in streams.values():
            for rid in stream.request_ids:
                self._queued.pop(rid, None)
                try:
                    self.engine.abort(rid)
                except Exception as e:  # pragma: no cover - a broken engine state
                    self.last_error = f"abort {rid}: {e}"
            for rid in stream.request_ids:
                for i in range(stream.samples):
                    k = (rid, i)
                    if k in stream.finished or self._streams.get(rid) is not stream:
                        continue
                    last = stream.last_out.get(k)
                    self._deliver(AbortedOutput(
                        rid, i, stream.prompts.get(rid, []), list(getattr(last, "token_ids", []) or []),
                        getattr(last, "text", "") or "", getattr(last, "logprobs", None)))

    def _deliver(self, out) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:   # aborted meanwhile
            return
        now = time.perf_counter()
        k = (out.request_id, getattr(out, "index", 0))
        new = len(out.token_ids) - stream.token_counts.get(k, 0)
        if new > 0:
            stream.token_counts[k] = len(out.token_ids)
            if self.metrics is not None:
                self.metrics.on_tokens(new)
        stream.last_out[k] = out
        if out.token_ids and k not in stream.first_at:
            stream.first_at[k] = now
            if k[1] == 0 and self.metrics is not None:   # its prompt was prefilled (counted once per request)
                self.metrics.on_prompt(len(getattr(out, "prompt_token_ids", ()) or ()))
            if stream.first_token is None:
                stream.first_token = now
                if self.metrics is not None:
                    self.metrics.on_first_token(now - stream.arrival)
            elif self.metrics is not None and stream.last_token is not None:
                self.metrics.on_inter_token(now - stream.last_token)
            stream.last_token = now
        stream.put(out)
        if out.finish_reason is not None:
            stream.finished.add(k)
            if self.metrics is not None:
                first = stream.first_at.get(k)
                self.metrics.on_finish(out, now - stream.arrival, None if first is None else first - stream.arrival)
            with self._lock:
                self._in_flight -= 1
            if len(stream.finished) == stream.num_seqs:
                for rid in stream.request_ids:
                    self._streams.pop(rid, None)
                stream.put(StreamEnd())

    def _end(self, rid, error: str | None, aborted: bool = False) -> None:
        """Drop ``rid``'s stream: its unfinished sequences leave the in-flight count."""
        with self._lock:
            stream = self._streams.get(rid)
            if stream is None:
                return
            left = stream.num_seqs - len(stream.finished)
            for r in stream.request_ids:
                self._streams.pop(r, None)
                self._queued.pop(r, None)
            self._in_flight -= left
        if self.metrics is not None:
            self.metrics.on_end(left, "abort" if aborted else "error")
        for r in stream.request_ids:     # the request's other engine requests leave too
            if r != rid:
                try:
                    self.engine.abort(r)
                except Exception:  # pragma: no cover
                    pass
        stream.put(StreamEnd(None if aborted else error))

    def _step_failed(self, e: Exception) -> None:
        self.step_failures += 1
        self.last_error = "".join(traceback.format_exception_only(type(e), e)).strip()
        fatal = fatal_error(e)
        if not fatal:
            try:
                self.engine.recover()
            except Exception as e2:
                fatal = True
                self.last_error += f" (then the engine's reset raised {type(e2).__name__}: {e2})"
        if fatal:
            self._engine_failed()
            return
        log.error("engine step failed; ending the %d requests in flight", len(self._streams), exc_info=e)
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            try:
                self.engine.abort(rid)
            except Exception:  # pragma: no cover - state beyond repair for this request
                pass
            self._end(rid, f"engine step failed: {self.last_error}")

    def _engine_failed(self) -> None:
        """The engine cannot go on: end every request with the reason, refuse new ones, stop."""
        self.failed = self.last_error
        with self._lock:
            rids = list(self._streams)
            self._inbox.clear()
        log.error("engine failed, ending the %d requests in flight and refusing new ones: %s", len(rids), self.failed)
        for rid in rids:
            self._end(rid, f"engine failed: {self.failed}")
        self._stop = True
        if self.on_failed is not None:
            try:
                self.on_failed()
            except Exception:  # pragma: no cover - the reason is logged above
                log.exception("on_failed raised")


def _hand_over(held: list) -> None:
    """On the event loop: put one step's items into their streams' queues, in order."""
    for stream, item in held:
        stream.queue.put_nowait(item)


def fatal_error(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the engine unusable (a tensor-parallel worker is gone)."""
    try:
        from ..distributed.group import WorkerFailed
    except ImportError:  # pragma: no cover - torch.distributed missing
        return False
    return isinstance(exc, WorkerFailed)
