"""The worker's side of the TP wire in one process: a message's tensor placeholders, host
arrays and object references become tensors and objects in one walk, through every
container the wire carries, and a worker runs ``make`` / ``call`` on its own objects."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from replayssm.distributed.comm import Comm, HostTensor, Ref, TensorArg, fill
from replayssm.distributed.worker import Worker


@dataclasses.dataclass
class Batch:
    temp: object
    rows: list
    flag: bool = False


def _message():
    inner = Batch(TensorArg(1), [Ref(4), 2, (TensorArg(0), HostTensor(np.arange(3)))], True)
    slots = [5, 1, 7]
    return ("call", (9, "step", (slots, TensorArg(0), Ref(7), {"b": inner, "c": [None, 1.5, "x"]}), {"h": Ref(4)}, None),
            [3]), slots


def test_fill_replaces_tensors_host_arrays_and_refs_in_one_walk():
    msg, slots = _message()
    tensors = [torch.arange(4), torch.ones(2, dtype=torch.float64)]
    objects = {4: object(), 7: object()}
    op, (h, method, args, kwargs, result), frees = fill(msg, tensors, objects)
    assert (op, h, method, result, frees) == ("call", 9, "step", None, [3])
    assert args[0] is slots                               # scalars only: passed through, not copied
    assert args[1] is tensors[0] and args[2] is objects[7] and kwargs == {"h": objects[4]}
    b = args[3]["b"]
    assert isinstance(b, Batch) and b.flag is True and b.temp is tensors[1]
    assert b.rows[0] is objects[4] and b.rows[1] == 2 and isinstance(b.rows[2], tuple)
    assert b.rows[2][0] is tensors[0]
    assert torch.equal(b.rows[2][1], torch.arange(3)) and b.rows[2][1].device.type == "cpu"
    assert args[3]["c"] == [None, 1.5, "x"]
    assert msg[1][2][3]["b"].rows[0] == Ref(4)            # the received message is left as it was


def test_fill_without_objects_keeps_refs_and_unknown_handles_are_named():
    msg, _ = _message()
    tensors = [torch.arange(4), torch.ones(2)]
    out = fill(msg, tensors)
    assert out[1][2][2] == Ref(7) and out[1][3] == {"h": Ref(4)}
    with pytest.raises(KeyError, match="7"):
        fill(msg, tensors, {4: object()})


class _Channel:
    """A control ring that hands out queued messages (no tensors, so no data group)."""

    def __init__(self, msgs):
        self.msgs = list(msgs)

    def recv(self):
        return self.msgs.pop(0), []


class _Target:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def pair(self, a, b=None):
        return (a, b)


def test_worker_makes_and_calls_with_its_own_objects():
    """``make`` and ``call`` receive the worker's objects where rank 0 sent references;
    ``frees`` drop handles before the call runs; a call's result is kept by handle."""
    comm = Comm(1, 2, torch.device("cpu"), channel=None)
    w = Worker(comm)
    w.objects[1] = "model"
    comm.channel = _Channel([
        ("make", (2, _Target, (Ref(1), [Ref(1), 3]), {"k": Ref(1)}), []),
        ("call", (2, "pair", (Ref(2),), {"b": [Ref(1)]}, 5), []),
        ("stop", (), [1]),
    ])
    w.serve()
    t = w.objects[2]
    assert t.args == ("model", ["model", 3]) and t.kwargs == {"k": "model"}
    assert w.objects[5] == (t, ["model"])
    assert 1 not in w.objects                              # freed by the last message


def test_plain_values_travel_unwalked_on_both_sides():
    """A step's slot list wrapped in ``Plain``: rank 0 runs with the bare list, the message
    keeps the wrapper, and the worker's fill unwraps it without looking inside."""
    import pickle
    import threading

    from replayssm.distributed.comm import INLINE_HOST_BYTES, Plain
    from replayssm.distributed.group import TensorParallelGroup

    g = TensorParallelGroup.__new__(TensorParallelGroup)
    g._frees, g._frees_lock = [], threading.RLock()
    g.comm = Comm(0, 2, torch.device("cpu"), None, None, None)
    slots = [3, 0, 11]
    tensors: list = []
    big = torch.arange(INLINE_HOST_BYTES // 8 + 1)          # past the inline size: the data group
    wire, local = g._encode((Plain(slots), big, torch.arange(3)), tensors)
    assert local[0] is slots and isinstance(wire[0], Plain) and wire[0].value is slots
    assert isinstance(wire[1], TensorArg) and len(tensors) == 1
    # a small CPU tensor rides in the message (no gloo broadcast, which waits for every worker)
    assert isinstance(wire[2], HostTensor) and local[2] is not None
    got = fill(pickle.loads(pickle.dumps(wire)), tensors)
    assert got[0] == slots and type(got[0]) is list and got[1] is tensors[0]
    assert torch.equal(got[2], torch.arange(3)) and got[2].dtype == torch.long
    odd = Plain([TensorArg(0)])                            # not walked: what is inside stays as sent
    assert fill(odd, tensors) == [TensorArg(0)]
