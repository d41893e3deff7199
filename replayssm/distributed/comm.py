"""The wire between rank 0 and the workers: one control message per call, plus its tensors.

Two process groups over the same ranks:

* the **data group** (the default group: NCCL on GPUs, gloo on CPU) carries the model's
  collectives and the call's device tensors;
* the **control channel** carries the call itself — a small picklable message naming the
  object, the method and its host arguments: a shared-memory ring
  (:class:`~.shm_channel.ShmChannel`, ~µs) when the workers are rank 0's own processes on
  its host, else (``torchrun`` across hosts, or ``control="gloo"``) the **control group**
  (gloo, CPU; ~270 µs a message) with an unbounded timeout, so a worker may wait for the
  next call as long as the engine idles.  Messages too large for a ring slot (long prompts)
  take the control group too.

A call's device tensors (draft tokens, parents, accepted counts, ...) travel as one packed
broadcast per dtype family on the data group (integers as one int64 buffer; booleans and
bytes, such as grammar masks, as one uint8 buffer),
asynchronously on the stream: sending a call never waits for the device.  Host values
(slot lists, prompt ids, CPU tensors when the device is a GPU) travel inside the message.
"""

from __future__ import annotations

import dataclasses

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Comm", "HostTensor", "Plain", "TensorArg", "Ref", "scalars_only"]

#: the control group never times out (a worker waits for the next call while the engine idles)
CONTROL_TIMEOUT = datetime.timedelta(days=365)

#: CPU ranks: tensors up to this size travel inside the control message (see :meth:`Comm.is_wire_tensor`)
INLINE_HOST_BYTES = 8192


@dataclass(frozen=True)
class TensorArg:
    """Placeholder for the ``index``-th tensor broadcast with a message."""

    index: int


@dataclass(frozen=True)
class Ref:
    """Placeholder for an object a worker holds (a model, cache or runner) by handle."""

    handle: int


@dataclass(frozen=True)
class Plain:
    """A value that travels and arrives as it is: neither rank 0's encoding nor the
    worker's :func:`fill` walks into it (a step's slot list: checking each of 256 slots for
    something to translate cost ~10 µs a side per step)."""

    value: object


def _wire_dtype(dt: torch.dtype) -> torch.dtype:
    """Floats travel as themselves, booleans and bytes (grammar masks) as one byte each,
    other integers as int64."""
    if dt.is_floating_point or dt.is_complex:
        return dt
    return torch.uint8 if dt in (torch.bool, torch.uint8) else torch.int64


_SCALARS = (int, float, bool, str, type(None))


def scalars_only(x) -> bool:
    """Whether list/tuple ``x`` holds plain scalars only (nothing inside to translate: a
    step's slot list); such a list travels and arrives as it is, without a walk per item."""
    return all(type(v) in _SCALARS for v in x)


@dataclass
class HostTensor:
    """A host (CPU) tensor on the wire as a NumPy array: pickling a ``torch.Tensor`` costs
    ~0.5 ms a message (its storage reduction), an array ~20 µs.  Dtypes NumPy lacks
    (bfloat16, ...) travel as the tensor itself."""

    array: object

    @staticmethod
    def wrap(t: Tensor):
        try:
            return HostTensor(t.detach().contiguous().numpy())
        except TypeError:   # no NumPy dtype for it
            return t

    def tensor(self) -> Tensor:
        return torch.from_numpy(self.array)


def fill(x, tensors: list[Tensor], objects: dict | None = None):
    """``x`` with every :class:`TensorArg` replaced by its tensor, every :class:`HostTensor`
    by a CPU tensor and, given ``objects`` (a worker's objects by handle), every :class:`Ref`
    by its object, in one walk (lists, tuples, dicts, and the fields of dataclass instances
    such as a step's ``SamplingBatch``)."""
    if isinstance(x, Plain):
        return x.value
    if isinstance(x, TensorArg):
        return tensors[x.index]
    if isinstance(x, HostTensor):
        return x.tensor()
    if isinstance(x, Ref):
        return x if objects is None else objects[x.handle]
    if isinstance(x, (list, tuple)):
        if scalars_only(x):
            return x
        return type(x)(fill(v, tensors, objects) for v in x)
    if isinstance(x, dict):
        return {k: fill(v, tensors, objects) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: fill(getattr(x, f.name), tensors, objects)
                                         for f in dataclasses.fields(x)})
    return x


class Comm:
    """One rank's end of the wire.  Rank 0 :meth:`send` s, the others :meth:`recv`."""

    def __init__(self, rank: int, size: int, device: torch.device, data_group=None, control_group=None,
                 channel=None):
        self.rank, self.size, self.device = rank, size, device
        self.data, self.control, self.channel = data_group, control_group, channel

    def is_wire_tensor(self, x) -> bool:
        """Tensors that travel on the data group: those on this rank's device, except, on
        CPU ranks, small ones (up to :data:`INLINE_HOST_BYTES`: a step's tokens, slots,
        accepted counts), which ride in the message as host values like a GPU rank's host
        tensors: gloo's broadcast waits for every worker to arrive, the ring does not."""
        if not isinstance(x, Tensor) or x.device.type != self.device.type:
            return False
        return x.device.type != "cpu" or x.numel() * x.element_size() > INLINE_HOST_BYTES

    # -- rank 0 -----------------------------------------------------------------------------
    def send(self, msg, tensors: list[Tensor]) -> None:
        """Broadcast ``msg`` (picklable, :class:`TensorArg` placeholders for ``tensors``)
        on the control group, then ``tensors`` on the data group."""
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        if self.channel is None or not self.channel.send((msg, specs)):
            dist.broadcast_object_list([(msg, specs)], src=0, group=self.control)
        for wire, idx in self._families(specs):
            buf = torch.cat([tensors[i].reshape(-1).to(wire) for i in idx])
            dist.broadcast(buf, src=0, group=self.data)

    # -- workers ----------------------------------------------------------------------------
    def recv(self, objects: dict | None = None):
        """The next message from rank 0, placeholders filled with the received tensors and,
        given ``objects`` (this worker's objects by handle), :class:`Ref` s with the objects."""
        got = self.channel.recv() if self.channel is not None else None
        if got is None:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            got = box[0]
        msg, specs = got
        tensors: list = [None] * len(specs)
        for wire, idx in self._families(specs):
            sizes = [_numel(specs[i][0]) for i in idx]
            buf = torch.empty(sum(sizes), dtype=wire, device=self.device)
            dist.broadcast(buf, src=0, group=self.data)
            for i, part in zip(idx, buf.split(sizes)):
                shape, dtype = specs[i]
                tensors[i] = part.view(shape).to(dtype)
        return fill(msg, tensors, objects)

    @staticmethod
    def _families(specs):
        """``[(wire dtype, tensor indices)]`` in a fixed order (one broadcast each)."""
        fams: dict = {}
        for i, (_, dt) in enumerate(specs):
            fams.setdefault(_wire_dtype(dt), []).append(i)
        return sorted(fams.items(), key=lambda kv: str(kv[0]))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
