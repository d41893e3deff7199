"""A worker rank (1 .. N-1): holds its shards of the models, caches and runners rank 0
creates, and runs every call rank 0 sends on them, in the order sent.

A worker is passive: it computes no scheduling decision.  Everything it does follows from
the messages (the same calls rank 0 makes on its own shard, with the same arguments), so
its ring pointers, block tables, flushes, accepted counts and graph keys are rank 0's.

Errors: a ``ValueError`` is bad input that rank 0's identical call raised too, before any
collective (the models validate first); the worker drops the call and waits for the next.
Any other exception ends the worker: it reports the traceback to rank 0 and exits, which
closes its connections, so rank 0's pending collective fails instead of waiting forever.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import teardown
from .comm import CONTROL_TIMEOUT, Comm
from .loading import load_shard, random_shard
from .shm_channel import ShmChannel
from .startup import StartupTimes, activate, is_startup_call, watch_triton_compiles

__all__ = ["Worker", "WorkerSpec", "worker_main"]

REPORT_KEY = "replayssm/startup/{}/{}"   # a worker's startup times (rank, request number), JSON


class Worker:
    """``store``: the rendezvous store (startup reports go there; None under torchrun:
    the default group's); ``times``: this rank's startup timings so far."""

    def __init__(self, comm: Comm, store=None, times: StartupTimes | None = None):
        self.comm = comm
        self.objects: dict[int, object] = {}
        self.store = store
        self.times = times or StartupTimes()
        activate(self.times)

    def serve(self) -> None:
        """Run calls until rank 0 sends ``stop``."""
        while True:
            op, args, frees = self.comm.recv(self.objects)   # proxies arrive as this rank's objects
            for h in frees:
                self.objects.pop(h, None)
            if op == "stop":
                return
            timed = is_startup_call(op, args[1] if op == "call" else None)
            t0 = time.perf_counter() if timed else 0.0
            try:
                getattr(self, "op_" + op)(*args)
            except ValueError:
                continue  # rank 0's identical call raised it too (see the module docstring)
            finally:
                if timed:
                    self.times.add(op if op != "call" else args[1], time.perf_counter() - t0)

    # -- operations ---------------------------------------------------------------------
    def op_report(self, seq: int) -> None:
        """Post this rank's startup times to the store (rank 0 waits for the key)."""
        store = self.store if self.store is not None else dist.distributed_c10d._get_default_store()
        store.set(REPORT_KEY.format(self.comm.rank, seq), json.dumps(self.times.as_dict()))

    def op_load(self, handle: int, path: str, dtype: str, mtp: bool = False) -> None:
        c = self.comm
        self.objects[handle] = load_shard(path, c.rank, c.size, c.device, dtype, group=c.data, mtp=mtp,
                                          times=self.times)

    def op_random(self, handle: int, cfg: dict, dtype: str, seed: int, mtp: bool = False, margin: bool = False) -> None:
        c = self.comm
        self.objects[handle] = random_shard(cfg, c.rank, c.size, c.device, dtype, group=c.data, seed=seed, mtp=mtp,
                                            margin=margin)

    def op_make(self, handle: int, cls, args, kwargs) -> None:
        """An engine object every rank holds (``cls`` arrives pickled by reference, like a
        runner class), built from this rank's objects."""
        self.objects[handle] = cls(*args, **kwargs)

    def op_call(self, handle: int, method: str, args, kwargs, result: int | None) -> None:
        out = getattr(self.objects[handle], method)(*args, **kwargs)
        if result is not None:
            self.objects[result] = out

    def op_runner(self, handle: int, model: int, cache: int, runner_cls, kwargs: dict) -> None:
        """The engine's runner class arrives pickled by reference (its module imports on
        unpickling), so the workers never import the engine here."""
        m = self.objects[model]
        self.objects[handle] = runner_cls(m, self.objects[cache], m.device, **kwargs)


@dataclass(frozen=True)
class WorkerSpec:
    """How a spawned worker joins: rank of size, the rendezvous store, its device."""

    rank: int
    size: int
    host: str
    port: int
    backend: str
    device: str
    threads: int | None
    timeout_s: float
    control_shm: str | None = None     # the shared-memory control ring's name (None: gloo only)
    spawned_at: float | None = None    # rank 0's time.time() when it started this process


READY_KEY = "replayssm/ready/{}"   # a worker sets its key in the rendezvous store once it is up


def init_groups(backend: str, store, rank: int, size: int, device: torch.device, timeout_s: float,
                channel=None, times: StartupTimes | None = None) -> Comm:
    """Join the process group (``backend``, over ``store``) and a gloo control group
    (``channel``: this rank's end of the shared-memory control ring, if any); ``times``
    records both phases."""
    times = times or StartupTimes()
    # on GPUs the device is bound: NCCL's communicator is made here, on every rank at once,
    # not by the first collective (which would otherwise also guess the device)
    bound = {"device_id": device} if device.type == "cuda" else {}
    with times.phase("init_process_group"):
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s), **bound)
    with times.phase("control_group"):
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Comm(rank, size, device, None, control, channel)


def join(spec: WorkerSpec, times: StartupTimes):
    """A spawned worker joins the group described by ``spec``: ``(comm, store)``."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        with times.phase("cuda_init"):
            torch.cuda.set_device(device)
            torch.empty(1, device=device)        # the context, here rather than in the first call
    with times.phase("store_connect"):
        store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
    channel = None
    if spec.control_shm is not None:
        channel = ShmChannel.attach(spec.control_shm, spec.rank, spec.size - 1)
        parent = os.getppid()
        channel.alive = lambda: os.getppid() == parent      # the driver (our parent) still runs
    store.set(READY_KEY.format(spec.rank), "1")
    return init_groups(spec.backend, store, spec.rank, spec.size, device, spec.timeout_s, channel, times), store


def _boot_times(spec: WorkerSpec) -> StartupTimes:
    """The worker's first phases: process start (the interpreter, the parent's main module
    re-imported by ``spawn``) and the imports (torch, replayssm) up to ``worker_main``."""
    times = StartupTimes()
    now = time.time()
    imported = getattr(sys.modules.get("replayssm.distributed"), "IMPORT_STARTED", None)
    if spec.spawned_at is not None and imported is not None:
        times.add("process_start", max(0.0, imported - spec.spawned_at))
        times.add("imports", max(0.0, now - imported))
    elif spec.spawned_at is not None:
        times.add("process_start+imports", max(0.0, now - spec.spawned_at))
    return times


def _leave_bounded(timeout_s: float) -> None:
    """``destroy_process_group``, waited for at most ``timeout_s`` (a teardown with
    symmetric-memory buffers registered has hung on the GPU: rank 0 and a worker both
    blocked in it for over a minute): the process exits next, which releases whatever the
    teardown still holds."""
    teardown.bounded(dist.destroy_process_group, "replayssm-tp-leave", timeout_s)


def worker_main(spec: WorkerSpec, errors) -> None:  # pragma: no cover - runs in the spawned process
    """Entry point of a spawned worker process."""
    try:
        times = _boot_times(spec)
        watch_triton_compiles()
        if spec.threads:
            torch.set_num_threads(spec.threads)
        comm, store = join(spec, times)
        Worker(comm, store, times).serve()
        _leave_bounded(teardown.STEP_S)
    except BaseException:
        try:
            errors.put((spec.rank, traceback.format_exc()))
        finally:
            sys.stderr.flush()
            os._exit(1)
    # a clean stop: nothing is left to save, and the interpreter's own shutdown with torch
    # loaded took 1-2 s, which every close() waited for
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
