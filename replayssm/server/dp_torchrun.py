"""Data parallelism across hosts through ``torchrun``: one torchrun process per replica.

::

    # on each of 2 hosts (one replica per host; the rendezvous host's address in --rdzv-endpoint)
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m replayssm serve MODEL --data-parallel-size 2 --host 0.0.0.0

``serve --data-parallel-size N`` under torchrun (``WORLD_SIZE == N``) makes rank 0 the API
process (it also starts replica 0 on its host, as without torchrun) and every other rank a
replica on its host's ``cuda:LOCAL_RANK*tp`` (its own tensor-parallel workers, if any, on
the next GPUs of that host).  The ranks meet once on torchrun's store: rank 0 listens on a
TCP port (``multiprocessing.connection``, an authentication key drawn per launch and handed
over through the store), the others connect, and from then on a remote replica speaks the
same pipe protocol as a local one (:mod:`replayssm.server.dp_replica`).  The process group
is left right after the meeting: replicas share nothing but the connection.

A remote replica is not restarted by the API process (it is not its process): when its
connection closes, its requests end with the error and the server runs degraded.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from multiprocessing import connection

from .dp_client import RemoteEngine, ReplicaDied

__all__ = ["ConnectedEngine", "meet", "serve_rank"]

KEY = "replayssm/dp-endpoint"


class ConnectedEngine(RemoteEngine):
    """A replica reached over a connection (another torchrun rank, maybe another host)."""

    restartable = False

    def __init__(self, spec, conn):
        super().__init__(spec, None)
        self.conn = conn

    def spawn(self) -> None:   # it runs already; launch() only waits for its engine
        pass

    def waitables(self) -> list:
        return [self.conn]

    def gone(self, ready) -> bool:
        return False   # seen as the connection's end

    @property
    def pid(self):
        return self.info.get("pid")

    def join(self, timeout: float) -> None:
        pass

    def exit_text(self) -> str:
        return "closed its connection (its process exited or its host is unreachable)"

    def request_stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (OSError, ValueError):
            pass

    def wait_stopped(self, timeout: float) -> None:
        t_end = time.monotonic() + timeout
        try:   # until it closes its end (it stopped) or the timeout
            while time.monotonic() < t_end:
                if self.conn.poll(min(0.2, max(t_end - time.monotonic(), 0))):
                    self.conn.recv()
        except (EOFError, OSError):
            pass
        self.kill()

    def kill(self) -> None:
        if self.conn is not None:
            self.conn.close()


def meet(rank: int, world: int, timeout_s: float = 600.0):
    """Connect the ranks once through torchrun's store.  Rank 0 returns ``{rank: connection}``
    for ranks ``1 .. world-1``; any other rank returns its connection to rank 0.  Raises
    :class:`ReplicaDied` when a rank does not connect within ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            key = secrets.token_bytes(32)
            listener = connection.Listener(("0.0.0.0", 0), authkey=key)
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            store.set(KEY, json.dumps({"addr": addr, "port": listener.address[1], "key": key.hex()}))
            conns: dict = {}

            def accept():
                while len(conns) < world - 1:
                    try:
                        c = listener.accept()
                    except OSError:   # closed on timeout
                        return
                    hello = c.recv()
                    conns[int(hello[1])] = c

            t = threading.Thread(target=accept, daemon=True)
            t.start()
            t.join(timeout_s)
            listener.close()
            if len(conns) < world - 1:
                missing = sorted(set(range(1, world)) - set(conns))
                raise ReplicaDied(f"torchrun ranks {missing} did not connect within {timeout_s:.0f} s")
            dist.barrier()
            return conns
        info = json.loads(store.get(KEY))
        conn = connection.Client((info["addr"], info["port"]), authkey=bytes.fromhex(info["key"]))
        conn.send(("hello", rank))
        dist.barrier()
        return conn
    finally:
        dist.destroy_process_group()


def serve_rank(rank: int, local_rank: int, args, conn, warm_up: bool) -> int:
    """Run replica ``rank`` in this process (its engine on this host's ``cuda:local_rank*tp``)
    for rank 0's server until it says stop; returns the exit status."""
    import copy

    import torch

    from .dp_replica import ReplicaSpec, replica_device, replica_main

    a = copy.copy(args)
    a.device = replica_device(local_rank, int(args.tensor_parallel_size or 1), args.device, torch.cuda.is_available())
    a.seed = int(args.seed or 0) + rank
    try:
        replica_main(ReplicaSpec(rank, args.model, a, warm_up, args.log_level), conn)
    except SystemExit as e:
        return int(e.code or 0)
    return 0
