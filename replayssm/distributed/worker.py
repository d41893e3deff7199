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
import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import CONTROL_TIMEOUT, Comm, Ref, scalars_only
from .loading import load_shard, random_shard
from .shm_channel import ShmChannel

__all__ = ["Worker", "WorkerSpec", "worker_main"]


def _resolve(x, objects: dict):
    if isinstance(x, Ref):
        return objects[x.handle]
    if isinstance(x, (list, tuple)):
        if scalars_only(x):
            return x
        return type(x)(_resolve(v, objects) for v in x)
    if isinstance(x, dict):
        return {k: _resolve(v, objects) for k, v in x.items()}
    return x


class Worker:
    def __init__(self, comm: Comm):
        self.comm = comm
        self.objects: dict[int, object] = {}

    def serve(self) -> None:
        """Run calls until rank 0 sends ``stop``."""
        while True:
            op, args, frees = self.comm.recv()
            for h in frees:
                self.objects.pop(h, None)
            if op == "stop":
                return
            try:
                getattr(self, "op_" + op)(*args)
            except ValueError:
                continue  # rank 0's identical call raised it too (see the module docstring)

    # -- operations ---------------------------------------------------------------------
    def op_load(self, handle: int, path: str, dtype: str, mtp: bool = False) -> None:
        c = self.comm
        self.objects[handle] = load_shard(path, c.rank, c.size, c.device, dtype, group=c.data, mtp=mtp)

    def op_random(self, handle: int, cfg: dict, dtype: str, seed: int, mtp: bool = False, margin: bool = False) -> None:
        c = self.comm
        self.objects[handle] = random_shard(cfg, c.rank, c.size, c.device, dtype, group=c.data, seed=seed, mtp=mtp,
                                            margin=margin)

    def op_make(self, handle: int, cls, args, kwargs) -> None:
        """An engine object every rank holds (``cls`` arrives pickled by reference, like a
        runner class), built from this rank's objects."""
        self.objects[handle] = cls(*_resolve(args, self.objects), **_resolve(kwargs, self.objects))

    def op_call(self, handle: int, method: str, args, kwargs, result: int | None) -> None:
        out = getattr(self.objects[handle], method)(*_resolve(args, self.objects), **_resolve(kwargs, self.objects))
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


READY_KEY = "replayssm/ready/{}"   # a worker sets its key in the rendezvous store once it is up


def init_groups(backend: str, store, rank: int, size: int, device: torch.device, timeout_s: float,
                channel=None) -> Comm:
    """Join the process group (``backend``, over ``store``) and a gloo control group
    (``channel``: this rank's end of the shared-memory control ring, if any)."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Comm(rank, size, device, None, control, channel)


def join(spec: WorkerSpec) -> Comm:
    """A spawned worker joins the group described by ``spec``."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False,
                          timeout=datetime.timedelta(seconds=spec.timeout_s))
    channel = None
    if spec.control_shm is not None:
        channel = ShmChannel.attach(spec.control_shm, spec.rank, spec.size - 1)
        parent = os.getppid()
        channel.alive = lambda: os.getppid() == parent      # the driver (our parent) still runs
    store.set(READY_KEY.format(spec.rank), "1")
    return init_groups(spec.backend, store, spec.rank, spec.size, device, spec.timeout_s, channel)


def worker_main(spec: WorkerSpec, errors) -> None:  # pragma: no cover - runs in the spawned process
    """Entry point of a spawned worker process."""
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        comm = join(spec)
        Worker(comm).serve()
        dist.destroy_process_group()
    except BaseException:
        try:
            errors.put((spec.rank, traceback.format_exc()))
        finally:
            sys.stderr.flush()
            os._exit(1)
