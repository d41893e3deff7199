"""Tensor parallelism over ``torch.distributed``: one model split by heads over N processes.

::

    from replayssm import LLM
    llm = LLM("model_dir", device="cuda", tensor_parallel_size=2)   # starts and owns 1 worker

    from replayssm.distributed import TensorParallelGroup               # several engines, one group
    with TensorParallelGroup(2, device="cpu") as tp:
        model = tp.load_model("model_dir", dtype="float64")             # each rank reads its shard
        llm = LLM(model, decode_mode="replay")                          # the model carries its group

Processes: rank 0 is the calling process: it owns the scheduler, the sampler and any
drafter (a draft model runs unsharded on rank 0's device; the MTP head is sharded like the
model's layers and every rank runs each draft step on its share); ranks ``1 .. N-1`` are workers
started with ``torch.multiprocessing`` (spawn; rendezvous on a free loopback port) or by
``torchrun`` (:meth:`TensorParallelGroup.from_torchrun`).  Each rank holds its share of the
weights and of every cache (its heads' checkpoint states, rings, KV-only blocks and conv
windows, its KV heads' attention cache) and runs every model step on it; the per-sub-block
all-reduces and the vocabulary gather are NCCL (GPU) or gloo (CPU) collectives.

Modules (each imports only from the layers below it: ``models``, ``layers``, ``runtime``; the engine
sits above and hands its runner class down):

* ``sharding.py`` — which slice of each weight a rank holds; config checks (``ValueError``
  naming the dimension, before any process starts); the local config;
* ``layers.py``   — a rank's model: local-size layers, all-reduce hooks, vocabulary-parallel
  embedding and head, the cross-rank gated norm;
* ``loading.py``  — a rank's shard read with ``safe_open(...).get_slice`` (or random weights);
* ``comm.py``     — the wire: one control message per call (gloo) + its tensors (data group);
* ``worker.py``   — the worker loop;
* ``group.py``    — :class:`TensorParallelGroup`: processes, calls, failures, shutdown;
* ``model.py``    — rank 0's proxies: :class:`TensorParallelModel`, ``ShardedCache``,
  ``ShardedRunner``, ``ShardedObject`` (an engine object every rank holds: the MTP drafter's
  device half).
"""

from __future__ import annotations

import os
import time

IMPORT_STARTED = time.time()   # a spawned worker's startup report tells process start from imports

from ..models.registry import read_config  # noqa: E402
from .group import TensorParallelGroup, WorkerFailed, check_devices  # noqa: E402
from .model import ShardedCache, ShardedObject, ShardedRunner, TensorParallelModel  # noqa: E402
from .sharding import check_tensor_parallel, local_config  # noqa: E402

__all__ = ["TensorParallelGroup", "TensorParallelModel", "ShardedCache", "ShardedObject", "ShardedRunner", "WorkerFailed",
           "check_tensor_parallel", "local_config", "load_tensor_parallel", "launched_by_torchrun"]


def launched_by_torchrun() -> bool:
    """Whether this process is one of several that ``torchrun`` started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def load_tensor_parallel(path, size: int, device="cpu", dtype="float32", mtp: bool = False) -> TensorParallelModel:
    """Check the model in ``path`` splits over ``size`` ranks (``ValueError`` naming the
    dimension, before any process starts), start a group of its own (or join torchrun's:
    ranks above 0 serve inside this call and exit), and load every rank's shard (``mtp``:
    with the MTP head).  The model owns the group: ``model.close()`` stops the workers."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"model directory not found: {path!r}")
    check_tensor_parallel(read_config(path), size, mtp=mtp)
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']} processes")
        group = TensorParallelGroup.from_torchrun(check_devices(1, device).type)
    else:
        check_devices(size, device)
        group = TensorParallelGroup(size, device)
    try:
        model = group.load_model(path, dtype, mtp=mtp)
    except BaseException:
        group.close()
        raise
    model.owns_group = True
    return model
