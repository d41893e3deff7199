"""A one-writer, many-reader message ring in shared memory: rank 0's calls to workers on its host.

A decode step's control message (the slot list, host tokens, tensor placeholders) is a few
hundred bytes, yet a gloo ``broadcast_object_list`` of it takes ~270 µs on an H200 host
(two TCP round trips and a pickled size tensor), and every worker's step — hence every
all-reduce of rank 0's step — starts that much later.  Here the writer pickles the message
into the next of ``slots`` fixed-size slots and stamps the slot with the message's sequence
number; each reader polls the stamp of the slot it expects next, unpickles, and records the
sequence it has read, which is what tells the writer a slot is free again.

Layout (little-endian int64): a 64-byte line per rank holding its last read sequence (line
0 unused), then ``slots × slot_bytes`` slots of ``[stamp, length, payload]``.  The stamp is
stored after the payload; an aligned 8-byte store is one instruction on the hosts we run on
(x86-64, aarch64), and each store is seen in program order on x86 (on aarch64, CPython's
GIL release/acquire around the poll gives the ordering in practice), so a reader that sees
the stamp sees the payload.  A message larger than a slot stores length ``-1``: its payload
follows on the fallback (gloo) channel.

Waiting: a reader spins (polls without sleeping) for a window after its last message, then
sleeps 50 µs between polls, 1 ms once idle for a second.  The window follows the traffic:
``max(spin_s, 2 × the recent gap between messages)``, at most ``spin_max_s`` (50 ms), so a
decode loop whose steps are longer than ``spin_s`` (a 2.7B model's B=64 step is ~6 ms, its
B=256 step ~12 ms) still finds its worker spinning when the next call comes; with a fixed
5 ms window every such step woke the worker from a sleep (``time.sleep(5e-5)`` returns
after 60 µs or more), and that delay reached rank 0 at the step's first all-reduce.  An
idle engine's workers sleep once the window passes.  Readers and the writer call
``alive()`` every ~0.2 s while they wait and raise :class:`ChannelClosed` when it says
the other side is gone.
"""

from __future__ import annotations

import pickle
import struct
import time
from multiprocessing import shared_memory

__all__ = ["ShmChannel", "ChannelClosed"]

_LINE = 64
_Q = struct.Struct("<q")
_QQ = struct.Struct("<qq")


class ChannelClosed(RuntimeError):
    """The other end of the channel went away while this end waited."""


class ShmChannel:
    """``ShmChannel.create(readers)`` on the writer (rank 0); ``ShmChannel.attach(name, rank)``
    on reader ``rank`` (1 .. readers).  ``send(obj) -> bool`` (False: too large for a slot,
    the caller sends ``obj`` on its fallback channel); ``recv() -> (obj | None)`` (None: the
    message is on the fallback channel)."""

    def __init__(self, shm: shared_memory.SharedMemory, readers: int, rank: int, slots: int, slot_bytes: int,
                 owner: bool, spin_s: float = 0.005, spin_max_s: float = 0.05):
        if not 0 <= spin_s <= spin_max_s:
            raise ValueError(f"need 0 <= spin_s <= spin_max_s, got spin_s={spin_s!r}, spin_max_s={spin_max_s!r}")
        self.shm, self.buf = shm, shm.buf
        self.readers, self.rank, self.slots, self.slot_bytes = readers, rank, slots, slot_bytes
        self.owner, self.spin_s, self.spin_max_s = owner, spin_s, spin_max_s
        self.gap_s = 0.0            # reader: recent gap between messages (a moving average)
        self._last = None           # reader: when the last message arrived
        self._base = _LINE * (readers + 1)
        self.seq = 0          # writer: last sent; reader: last read
        self.alive = lambda: True

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, readers: int, slots: int = 64, slot_bytes: int = 1 << 16) -> "ShmChannel":
        size = _LINE * (readers + 1) + slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = bytes(size)
        return cls(shm, readers, 0, slots, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, rank: int, readers: int, slots: int = 64, slot_bytes: int = 1 << 16) -> "ShmChannel":
        # the writer owns (and unlinks) the segment; spawned readers share its resource
        # tracker, so their own registration of the name is the same entry
        return cls(shm=shared_memory.SharedMemory(name=name), readers=readers, rank=rank, slots=slots,
                   slot_bytes=slot_bytes, owner=False)

    # -- layout -------------------------------------------------------------------------------
    def _slot(self, seq: int) -> int:
        return self._base + (seq % self.slots) * self.slot_bytes

    def _read_seq(self, r: int) -> int:
        return _Q.unpack_from(self.buf, _LINE * r)[0]

    # -- writer -------------------------------------------------------------------------------
    def send(self, obj) -> bool:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        seq = self.seq + 1
        self._wait(lambda: min(self._read_seq(r) for r in range(1, self.readers + 1)) >= seq - self.slots)
        off = self._slot(seq)
        fits = len(data) <= self.slot_bytes - 16
        if fits:
            self.buf[off + 16: off + 16 + len(data)] = data
        _Q.pack_into(self.buf, off + 8, len(data) if fits else -1)
        _Q.pack_into(self.buf, off, seq)                       # publish: the stamp last
        self.seq = seq
        return fits

    # -- reader -------------------------------------------------------------------------------
    def spin_window(self) -> float:
        """How long a reader polls without sleeping after its last message (see the module doc)."""
        return min(self.spin_max_s, max(self.spin_s, 2.0 * self.gap_s))

    def recv(self):
        seq = self.seq + 1
        off = self._slot(seq)
        self._wait(lambda: _Q.unpack_from(self.buf, off)[0] == seq, self._last, self.spin_window())
        now = time.perf_counter()
        if self._last is not None:   # gaps past the cap (an idle engine) count as the cap
            gap = min(now - self._last, self.spin_max_s)
            self.gap_s = gap if self.gap_s == 0.0 else 0.75 * self.gap_s + 0.25 * gap
        self._last = now
        _, n = _QQ.unpack_from(self.buf, off)
        obj = pickle.loads(self.buf[off + 16: off + 16 + n]) if n >= 0 else None
        self.seq = seq
        _Q.pack_into(self.buf, _LINE * self.rank, seq)
        return obj

    # -- waiting ------------------------------------------------------------------------------
    def _wait(self, ready, since: float | None = None, spin_s: float | None = None) -> None:
        """Poll ``ready()``: spinning for ``spin_s`` (default ``self.spin_s``) counted from
        ``since`` (default: now), then sleeping between polls."""
        if ready():
            return
        now = time.perf_counter()
        t0 = now if since is None else min(since, now)
        spin = self.spin_s if spin_s is None else spin_s
        check = now + 0.2
        while not ready():
            now = time.perf_counter()
            if now - t0 > spin:
                time.sleep(5e-5 if now - t0 < 1.0 else 1e-3)
            if now > check:
                if not self.alive():
                    raise ChannelClosed("the other end of the tensor-parallel control channel is gone")
                check = now + 0.2

    def close(self) -> None:
        try:
            self.buf = None
            self.shm.close()
            if self.owner:
                self.shm.unlink()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
