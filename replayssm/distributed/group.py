"""A tensor-parallel group: rank 0 (this process, the driver) and its workers.

``TensorParallelGroup(size, device)`` starts ``size - 1`` worker processes with
``torch.multiprocessing``'s spawn context, rendezvous on a ``TCPStore`` bound to a free
loopback port, and joins them in a ``torch.distributed`` default group (NCCL on GPUs, rank
``r`` on ``cuda:<base + r>``; gloo on CPU) plus a gloo control group.
``TensorParallelGroup.from_torchrun()`` joins the group ``torchrun`` set up instead
(multi-node): ranks above 0 serve there and exit when rank 0 closes.

Rank 0 drives: :meth:`call` sends one message (the object's handle, the method, its
arguments) and then runs the same method on its own shard; the workers
(:mod:`~replayssm.distributed.worker`) run it on theirs.  Objects the workers hold are
named by handles; rank 0's proxies free them when garbage collected (the frees ride on the
next message, so a collection never interleaves with a call).

Failures: a worker that raises reports its traceback and exits; one that dies closes its
sockets.  Rank 0's pending collective then fails (gloo), or — NCCL waits on the device —
a monitor thread that watches the worker processes aborts the communicator.  Either way
the call raises :class:`WorkerFailed` naming the rank, its exit code and traceback, and the
group refuses further calls.  Workers are stopped by :meth:`close` (also a context manager
and at interpreter exit); a worker whose driver dies finds its control socket closed and
exits.
"""

from __future__ import annotations

import dataclasses

import atexit
import datetime
import json
import logging
import os
import threading
import time
import weakref
from multiprocessing import connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from ..models.registry import parse_config, read_config
from ..runtime import canonical_device
from .comm import CONTROL_TIMEOUT, Comm, HostTensor, Plain, Ref, TensorArg, scalars_only
from .loading import load_shard, random_shard
from .model import TensorParallelModel
from .sharding import check_tensor_parallel
from .shm_channel import ShmChannel
from . import teardown
from .startup import StartupTimes, activate, format_times, is_startup_call, watch_triton_compiles
from .worker import READY_KEY, REPORT_KEY, Worker, WorkerSpec, init_groups, worker_main

log = logging.getLogger("replayssm.distributed")

__all__ = ["TensorParallelGroup", "WorkerFailed"]


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or raised; the group cannot run further calls."""


def _check_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    return size


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return device if device.type == "cpu" else torch.device("cuda", device.index + rank)


def check_devices(size: int, device) -> torch.device:
    """The canonical device of rank 0; raises ``ValueError`` when ``size`` ranks do not fit."""
    size = _check_size(size)
    device = canonical_device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, got {device}")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available")
    n = torch.cuda.device_count()
    if device.index + size > n:
        raise ValueError(f"tensor_parallel_size={size} puts rank r on cuda:{device.index}+r, up to "
                         f"cuda:{device.index + size - 1}, but {n} GPU(s) are visible")
    return device


_LIVE: "weakref.WeakSet[TensorParallelGroup]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:  # pragma: no cover - interpreter exit
    for g in list(_LIVE):
        g.close(timeout_s=2 * teardown.STEP_S)   # a healthy worker stops within STEP_S (its own bound)
    teardown.guard_exit()


class TensorParallelGroup:
    """Rank 0's end of ``size`` processes that run one model step together.

    ``device``: rank 0's device (``"cpu"``, or ``"cuda:i"``: rank ``r`` uses ``cuda:i+r``).
    ``timeout_s``: the data group's collective timeout.  ``worker_threads``: intra-op
    threads of each worker (default: this process's setting divided by ``size``, and rank 0
    takes the same share until :meth:`close`: the ranks share the host's cores, and
    ``size`` processes of all-core thread pools oversubscribed them — loading ran several
    times slower per rank).  ``control``: how calls reach
    the workers — ``"shm"`` (a shared-memory ring, µs; default on GPUs), ``"gloo"`` (the
    control group, ~270 µs a call; default on CPU, where a polling worker would take a core
    from the computation); ``REPLAYSSM_TP_CONTROL`` overrides the default.  Use as a context manager or
    call :meth:`close`; models are loaded with :meth:`load_model` (or :meth:`random_model`)
    and passed to ``LLM``.
    """

    def __init__(self, size: int, device="cpu", *, timeout_s: float = 600.0, worker_threads: int | None = None,
                 start_timeout_s: float = 300.0, control: str | None = None):
        device = check_devices(size, device)
        control = control or os.environ.get("REPLAYSSM_TP_CONTROL") or ("shm" if device.type == "cuda" else "gloo")
        if control not in ("shm", "gloo"):
            raise ValueError(f"control must be 'shm' or 'gloo', got {control!r}")
        if dist.is_initialized():
            if any(t.is_alive() for t in teardown.STUCK):
                raise ValueError("torch.distributed is still initialised in this process: an earlier tensor-parallel "
                                 "group's teardown blocked and was given up (its warning was logged); start the "
                                 "next group in a new process")
            raise ValueError("torch.distributed is already initialised in this process: one tensor-parallel "
                             "group at a time (close the other first; under torchrun use "
                             "TensorParallelGroup.from_torchrun())")
        self.size, self.rank, self.device = size, 0, device
        self._procs: list = []
        self._init_state()
        times = self._times
        t_start = time.perf_counter()
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=start_timeout_s))
        ctx = mp.get_context("spawn")
        self._errors = ctx.SimpleQueue()
        threads = worker_threads or max(1, torch.get_num_threads() // size)
        if worker_threads is None and threads != torch.get_num_threads():
            self._threads_restore = (torch.get_num_threads(), threads)
            torch.set_num_threads(threads)
        self._channel = ShmChannel.create(size - 1) if control == "shm" and size > 1 else None
        if self._channel is not None:
            self._channel.alive = lambda: self._failure is None
        try:
            with times.phase("spawn"):
                for r in range(1, size):
                    spec = WorkerSpec(r, size, "127.0.0.1", store.port, backend, str(_rank_device(device, r)),
                                      threads, timeout_s, self._channel.name if self._channel is not None else None,
                                      spawned_at=time.time())
                    p = ctx.Process(target=worker_main, args=(spec, self._errors), daemon=True,
                                    name=f"replayssm-tp-rank{r}")
                    p.start()
                    self._procs.append(p)
            if device.type == "cuda":      # rank 0's context while the workers start
                with times.phase("cuda_init"):
                    torch.cuda.set_device(device)
                    torch.empty(1, device=device)
            with times.phase("wait_workers"):
                self._wait_ready(store, start_timeout_s)
            self.comm = init_groups(backend, store, 0, size, device, timeout_s, self._channel, times)
        except BaseException:
            self._terminate()
            self._close_channel()
            self._restore_threads()
            raise
        times.add("group_start", time.perf_counter() - t_start)
        self._store = store
        self._stop_r, self._stop_w = mp.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="replayssm-tp-monitor", daemon=True)
        self._monitor.start()
        _LIVE.add(self)
        log.info("tensor-parallel group of %d on %s started in %.2f s", size, device, times.times["group_start"])

    def _init_state(self) -> None:
        self._next_handle = 0
        self._frees: list[int] = []
        self._frees_lock = threading.RLock()   # finalisers may run in any thread, even mid-send
        self._failure: str | None = None
        self._closing = self._closed = False
        self._monitor = None
        self._errors = None
        self._channel = None
        self._store = None
        self._reports = 0
        self._threads_restore = None     # (rank 0's intra-op threads before, its share while open)
        self._times = StartupTimes()
        activate(self._times)
        watch_triton_compiles()

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def _restore_threads(self) -> None:
        """Rank 0's own intra-op thread count again (unless changed since the group set it)."""
        if self._threads_restore is not None:
            before, share = self._threads_restore
            if torch.get_num_threads() == share:
                torch.set_num_threads(before)
            self._threads_restore = None

    @classmethod
    def from_torchrun(cls, device_type: str | None = None, timeout_s: float = 600.0) -> "TensorParallelGroup":
        """Join the group ``torchrun`` launched (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` ...).

        On rank 0 returns the driver; on every other rank serves rank 0's calls and exits
        the process (status 0) when rank 0 closes the group — this call does not return there.
        """
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device("cuda", local) if kind == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        comm = Comm(rank, size, device, None, control)
        if rank != 0:
            watch_triton_compiles()
            Worker(comm).serve()
            dist.destroy_process_group()
            raise SystemExit(0)
        self = cls.__new__(cls)
        self.size, self.rank, self.device = size, 0, device
        self._procs = []
        self._init_state()
        self.comm = comm
        _LIVE.add(self)
        return self

    # -- lifecycle ---------------------------------------------------------------------------
    def _wait_ready(self, store, timeout_s: float) -> None:
        keys = [READY_KEY.format(r) for r in range(1, self.size)]
        t_end = time.monotonic() + timeout_s
        while not store.check(keys):
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                raise WorkerFailed(f"tensor-parallel worker failed to start: {self._describe(dead)}")
            if time.monotonic() > t_end:
                raise WorkerFailed(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
            time.sleep(0.005)   # (a 50 ms poll cost 25 ms of every start on average)

    def _watch(self) -> None:
        """Monitor thread: a worker that exits while the group is open is a failure; on NCCL
        the blocked device collectives are aborted so the driver's call can raise."""
        waits = [p.sentinel for p in self._procs] + [self._stop_r]
        ready = connection.wait(waits)
        if self._stop_r in ready or self._closing:
            return
        time.sleep(0.2)  # let the error report arrive
        self._failure = self._describe([p for p in self._procs if not p.is_alive()])
        if self.device.type == "cuda":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            try:
                if abort is not None:
                    abort()
            except Exception:  # pragma: no cover - best effort
                pass

    def _describe(self, dead) -> str:
        reports = {}
        while self._errors is not None and not self._errors.empty():
            r, tb = self._errors.get()
            reports[r] = tb
        parts = []
        for p in dead:
            r = int(p.name.rsplit("rank", 1)[1])
            line = f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            if r in reports:
                line += f":\n{reports.pop(r)}"
            parts.append(line)
        parts += [f"rank {r} raised:\n{tb}" for r, tb in reports.items()]
        return "; ".join(parts) or "a worker failed"

    def _terminate(self) -> None:
        """Every worker still running: SIGTERM, then SIGKILL (never left behind)."""
        killed = teardown.stop_processes(self._procs)
        if killed:
            log.warning("tensor-parallel workers %s ignored SIGTERM and were killed", killed)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they free everything) and leave the process group.  Idempotent.

        Bounded: the workers get ``timeout_s`` to stop, then are killed; each teardown step
        that can block on a peer (sending ``stop``, leaving the process group, aborting it)
        is given up after :data:`~.teardown.STEP_S` (see :mod:`~.teardown`), so ``close``
        returns within about ``timeout_s + 4 STEP_S`` whatever the peers do."""
        if self._closed:
            return
        self._closing = True
        t_end = time.monotonic() + timeout_s
        stopped = False
        if self._failure is None:
            done, err = teardown.bounded(lambda: self._send("stop", ()), "replayssm-tp-stop",
                                         min(timeout_s, teardown.STEP_S))
            stopped = done and err is None
        # Leave the process group while the workers leave it: NCCL's teardown (with
        # symmetric-memory buffers registered) waits for every rank, so rank 0 must not join
        # the workers first.  After a failure the peers are gone: abort instead of waiting.
        leave = None
        if dist.is_initialized():
            leave = threading.Thread(target=teardown.leave_process_group, args=(stopped,),
                                     name="replayssm-tp-leave", daemon=True)
            leave.start()
        for p in self._procs:
            p.join(max(0.0, t_end - time.monotonic()))
        self._terminate()
        if leave is not None:
            # the workers are gone by now: a teardown still waiting for them will not finish
            leave.join(teardown.STEP_S)
            if leave.is_alive():
                teardown.STUCK.append(leave)
                # an abort waits for the destroy's lock on NCCL: it may block too (bounded)
                aborted = stopped and teardown.bounded(teardown.abort_process_group, "replayssm-tp-abort",
                                                       teardown.STEP_S)[0]
                if not aborted:
                    log.warning("tensor-parallel close: leaving the process group did not finish; given up "
                                "(torch.distributed stays initialised in this process)")
        self._close_channel()
        self._restore_threads()
        if self._monitor is not None:
            self._stop_w.send(None)
            self._monitor.join(5)
        self._closed = True
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def alive(self) -> bool:
        return not (self._closed or self._failure)

    # -- calls -------------------------------------------------------------------------------
    def new_handle(self) -> int:
        self._next_handle += 1
        return self._next_handle

    def release(self, handle: int) -> None:
        """Free ``handle`` on the workers with the next message (safe from a finaliser)."""
        with self._frees_lock:
            self._frees.append(handle)

    def _take_frees(self) -> list[int]:
        with self._frees_lock:
            frees, self._frees = self._frees, []
        return frees

    def _send(self, op: str, args, tensors=()) -> None:
        self.comm.send((op, args, self._take_frees()), list(tensors))

    def _encode(self, x, tensors: list):
        """``(what the workers get, what rank 0 runs with)`` for one argument."""
        if type(x) is Plain:
            return x, x.value
        handle = getattr(x, "_tp_handle", None)
        if handle is not None:
            return Ref(handle), x.local
        if isinstance(x, Tensor):
            if self.comm.is_wire_tensor(x):
                tensors.append(x)
                return TensorArg(len(tensors) - 1), x
            return (HostTensor.wrap(x) if x.device.type == "cpu" else x), x
        if isinstance(x, (list, tuple)):
            if scalars_only(x):
                return x, x
            pairs = [self._encode(v, tensors) for v in x]
            return type(x)(p for p, _ in pairs), type(x)(v for _, v in pairs)
        if isinstance(x, dict):
            pairs = {k: self._encode(v, tensors) for k, v in x.items()}
            return {k: p for k, (p, _) in pairs.items()}, {k: v for k, (_, v) in pairs.items()}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):   # e.g. a step's SamplingBatch
            enc = {f.name: self._encode(getattr(x, f.name), tensors)[0] for f in dataclasses.fields(x)}
            return dataclasses.replace(x, **enc), x
        return x, x

    def _check_open(self) -> None:
        if self._failure:
            raise WorkerFailed(f"the tensor-parallel group failed earlier: {self._failure}")
        if self._closed:
            raise RuntimeError("the tensor-parallel group is closed")

    def run(self, op: str, args, local):
        """Send ``op(*args)`` to the workers, then return ``local()`` (rank 0's share)."""
        self._check_open()
        timed = is_startup_call(op)
        t0 = time.perf_counter() if timed else 0.0
        try:
            self._send(op, args)
            return local()
        except ValueError:
            raise  # bad input: the workers' identical call raised it too, before any collective
        except BaseException as e:
            self._broken(e)
        finally:
            if timed:
                self._times.add(op, time.perf_counter() - t0)

    def call(self, target: int, method: str, local, args=(), kwargs=None, result: int | None = None):
        """``local(*args, **kwargs)`` on rank 0 and ``objects[target].<method>(...)`` on
        every worker (proxies and device tensors in the arguments are translated)."""
        tensors: list = []
        wire_args, local_args = self._encode(tuple(args), tensors)
        wire_kw, local_kw = self._encode(dict(kwargs or {}), tensors)
        self._check_open()
        timed = is_startup_call("call", method)
        t0 = time.perf_counter() if timed else 0.0
        try:
            self._send("call", (target, method, wire_args, wire_kw, result), tensors)
            return local(*local_args, **local_kw)
        except ValueError:
            raise
        except BaseException as e:
            self._broken(e)
        finally:
            if timed:
                self._times.add(method, time.perf_counter() - t0)

    def _broken(self, exc: BaseException):
        """A call failed on rank 0 outside validation: name the worker that failed, if one
        did; the ranks are out of step either way, so the group is closed."""
        failure = self._failure
        t_end = time.monotonic() + 3.0
        while failure is None and self._procs and time.monotonic() < t_end:
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                time.sleep(0.2)
                failure = self._describe(dead)
            else:
                time.sleep(0.05)
        self._failure = failure or f"rank 0 raised {type(exc).__name__}: {exc}"
        self.close(timeout_s=1.0)
        if failure is not None:
            raise WorkerFailed(failure) from exc
        raise exc

    # -- startup report ----------------------------------------------------------------------
    @property
    def startup_times(self) -> dict[int, dict[str, float]]:
        """``{rank: {phase: seconds}}``: each rank's startup so far (see
        :mod:`~replayssm.distributed.startup`: the group's start, ``load`` and its phases,
        ``make_cache``, ``capture``, ``triton_compile`` ...).  Asks the workers (one message;
        they answer in order, after every call sent before)."""
        self._check_open()
        out = {0: self._times.as_dict()}
        if self.size == 1:
            return out
        self._reports += 1
        seq = self._reports
        store = self._store if self._store is not None else dist.distributed_c10d._get_default_store()
        self.run("report", (seq,), lambda: None)
        for r in range(1, self.size):
            key = REPORT_KEY.format(r, seq)
            t_end = time.monotonic() + 60.0
            while not store.check([key]):
                self._check_open()               # a worker that died fails the group (monitor)
                if time.monotonic() > t_end:
                    raise WorkerFailed(f"rank {r} did not report its startup times within 60 s")
                time.sleep(0.001)
            out[r] = json.loads(store.get(key))
            store.delete_key(key)
        return out

    def log_startup(self, level: int = logging.INFO) -> dict[int, dict[str, float]]:
        """Log :attr:`startup_times` as a table (at ``level``); returns them."""
        times = self.startup_times
        log.log(level, "%s", format_times(times, f"tensor-parallel startup of {self.size} ranks (s)"))
        return times

    # -- models ------------------------------------------------------------------------------
    def load_model(self, path, dtype="float32", mtp: bool = False):
        """Every rank loads its shard of the checkpoint in ``path`` (reading only that shard;
        ``mtp``: with the MTP head, sharded alike); returns rank 0's
        :class:`~replayssm.distributed.model.TensorParallelModel`."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: not a model directory")
        cfg = read_config(path)
        check_tensor_parallel(cfg, self.size, mtp=bool(mtp))
        h = self.new_handle()
        t0 = time.perf_counter()
        local = self.run("load", (h, path, dtype, bool(mtp)),
                         lambda: load_shard(path, 0, self.size, self.device, dtype, group=self.comm.data,
                                            mtp=bool(mtp), times=self._times))
        log.info("tensor-parallel model %s: rank 0's shard of %d loaded in %.2f s", path, self.size,
                 time.perf_counter() - t0)
        return TensorParallelModel(self, h, local)

    def random_model(self, config: dict, dtype="bfloat16", seed: int = 0, mtp: bool = False, margin: bool = False):
        """Every rank builds its shard of a random-weight model (``config``: a ``config.json``
        dict; ``mtp``: with a random MTP head; ``margin``: the benchmarks' greedy-margin
        recipe, :func:`~.loading.random_shard`) directly on its device; returns rank 0's
        model handle."""
        check_tensor_parallel(parse_config(dict(config), "config dict"), self.size, mtp=bool(mtp))
        h = self.new_handle()
        local = self.run("random", (h, dict(config), dtype, seed, bool(mtp), bool(margin)),
                         lambda: random_shard(config, 0, self.size, self.device, dtype, group=self.comm.data,
                                              seed=seed, mtp=bool(mtp), margin=bool(margin)))
        return TensorParallelModel(self, h, local)

    def make(self, handle: int, cls, args=(), kwargs=None):
        """``cls(*args, **kwargs)`` on every rank under ``handle`` (proxies in the arguments
        become each rank's own objects); returns rank 0's."""
        tensors: list = []
        wire_args, local_args = self._encode(tuple(args), tensors)
        wire_kw, local_kw = self._encode(dict(kwargs or {}), tensors)
        if tensors:
            raise ValueError("objects made on every rank take host values and proxies, not tensors")
        return self.run("make", (handle, cls, wire_args, wire_kw), lambda: cls(*local_args, **local_kw))
