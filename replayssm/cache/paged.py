"""Paged (block) buffers for KV-only decoding: every input since the start, no state.

In KV-only mode a sequence keeps *all* of its layer inputs (``S_0 = 0``), so its buffer
grows.  Entries live in a shared pool of fixed-size blocks, flat over ``blocks × block_size``:
entry ``j`` of a slot sits at pool index ``block_table[slot, j // bs] * bs + j % bs``.

* Block allocation is host-side bookkeeping done *between* steps (:meth:`PagedIndex.reserve`
  / :meth:`PagedIndex.release`, like a block manager); a step itself reads only device
  tensors (:class:`PagedPlan`) and needs no host synchronisation.
* Block 0 is the reserved *null block*: unused ``block_table`` entries point at it, so a
  gather over a full row never goes out of range, and padding rows (the null slot 0) write
  their garbage there.  Usable blocks are ``1 .. num_blocks-1``.
* Blocks are reference counted (prefix caching shares attention blocks between sequences
  and the engine's prefix index): :meth:`PagedIndex.reserve` hands out blocks with one
  reference, :meth:`PagedIndex.share` lets an empty slot start with blocks others hold,
  :meth:`PagedIndex.retain` / :meth:`PagedIndex.drop` take and give back references from
  outside any slot, and a block returns to the free list when its last reference goes.
* ``length[slot]`` counts committed entries.  A step appends ``T`` tentative entries at
  ``length .. length+T-1`` (:func:`write_kv_new`); :meth:`PagedIndex.commit` keeps the
  accepted ones (a pointer move).  For trees, :func:`gather_path` first moves the accepted
  path to the front of the new entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..runtime import canonical_device, host_to_device, want_check
from .buffers import _empty

NULL_SLOT = 0
NULL_BLOCK = 0
assert NULL_SLOT == 0, "the null slot is row 0 (commits reset it as [:1])"


class PoolExhausted(ValueError):
    """Raised by :meth:`PagedIndex.reserve` when the pool has too few free blocks."""


@dataclass(frozen=True)
class PagedPlan:
    """One step's view of the paged index (all tensors on the index's device).

    slot:        ``[Bt]`` slot of each row (``NULL_SLOT`` for padding rows).
    length:      ``[Bt]`` committed entries before the step.
    block_table: ``[Bt, max_blocks]`` pool block of each logical block (0 = null block).
    num_new:     ``T``, entries appended this step.
    block_size:  ``bs``, entries per block.
    """

    slot: Tensor
    length: Tensor
    block_table: Tensor
    num_new: int
    block_size: int

    @property
    def batch(self) -> int:
        return self.slot.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_table.shape[1]

    @property
    def max_len(self) -> int:
        """Entries a gather returns per row: ``max_blocks * block_size``."""
        return self.max_blocks * self.block_size

    def positions(self, j: Tensor) -> Tensor:
        """Flat pool indices of logical entries ``j [Bt, J]`` (``0 <= j < max_len``).

        ``block_table[b, j // bs] * bs + j % bs``.  Out-of-range ``j`` (only possible with a
        bad unchecked plan) is routed to the null block instead of indexing out of bounds.
        """
        bs = self.block_size
        j = j.long()
        col = j // bs
        ok = (j >= 0) & (col < self.max_blocks)
        blk = self.block_table.gather(1, torch.where(ok, col, torch.zeros_like(col)))
        blk = torch.where(ok, blk, torch.full_like(blk, NULL_BLOCK))
        return blk * bs + torch.where(ok, j % bs, torch.zeros_like(j))

    def all_positions(self) -> Tensor:
        """Pool indices ``[Bt, max_len]`` of every logical entry of each row."""
        j = torch.arange(self.max_len, device=self.slot.device)
        return self.positions(j.expand(self.batch, -1))

    def new_positions(self) -> Tensor:
        """Pool indices ``[Bt, T]`` of this step's entries, ``length .. length+T-1``."""
        s = torch.arange(self.num_new, device=self.slot.device)
        return self.positions(self.length[:, None] + s[None, :])

    def hist_mask(self) -> Tensor:
        """``[Bt, max_len]`` bool: entry ``j`` is committed (``j < length``)."""
        j = torch.arange(self.max_len, device=self.slot.device)
        return j[None, :] < self.length[:, None]



def _check_pool(pool: Tensor, pplan: PagedPlan) -> None:
    if not isinstance(pool, Tensor) or pool.dim() < 1:
        raise ValueError("pool must be a tensor [num_blocks * block_size, ...]")
    if pool.shape[0] % pplan.block_size:
        raise ValueError(
            f"pool has {pool.shape[0]} entries, not a multiple of block_size {pplan.block_size}"
        )
    if pool.device != pplan.slot.device:
        raise ValueError(f"pool on {pool.device}, plan on {pplan.slot.device}")


def gather_kv(pool: Tensor, pplan: PagedPlan) -> Tensor:
    """Entries of ``pool [NB*bs, ...]`` per row, oldest first: ``[Bt, max_len, ...]``.

    Entry ``j`` is valid iff ``j < length`` (or ``j < length + T`` after
    :func:`write_kv_new`); the rest is whatever the pool holds (possibly NaN): mask with
    ``torch.where``, never by multiplying with zero.
    """
    _check_pool(pool, pplan)
    return pool[pplan.all_positions()]


def write_kv_new(pool: Tensor, pplan: PagedPlan, values: Tensor) -> None:
    """Write this step's entries ``values [Bt, T, ...]`` at logical ``length .. length+T-1``."""
    _check_pool(pool, pplan)
    want = (pplan.batch, pplan.num_new) + tuple(pool.shape[1:])
    if not isinstance(values, Tensor) or tuple(values.shape) != want:
        raise ValueError(
            f"new entries have shape {tuple(getattr(values, 'shape', ()))}, expected {want}"
        )
    pool[pplan.new_positions()] = values.to(pool.dtype)


def gather_path(buffers: list[Tensor], pplan: PagedPlan, path: Tensor, accepted: Tensor) -> None:
    """Tree commit in KV mode: move each row's accepted nodes to the front of its new entries.

    For ``i < accepted[b]``, logical entry ``length + path[b, i]`` is copied to
    ``length + i`` in every pool ``[NB*bs, ...]`` (all reads happen before any write).
    Call before :meth:`PagedIndex.commit`.  ``path [Bt, N]``, ``accepted [Bt]``; no host sync.
    """
    N = pplan.num_new
    if path.shape != (pplan.batch, N):
        raise ValueError(f"path must have shape {(pplan.batch, N)}, got {tuple(path.shape)}")
    if accepted.shape != (pplan.batch,):
        raise ValueError(f"accepted must have shape [{pplan.batch}], got {tuple(accepted.shape)}")
    for buf in buffers:
        _check_pool(buf, pplan)
    i = torch.arange(N, device=pplan.slot.device)[None, :]
    src = torch.where(i < accepted.long()[:, None], path.long(), i)
    dst_pos = pplan.positions(pplan.length[:, None] + i)
    src_pos = pplan.positions(pplan.length[:, None] + src)
    for buf in buffers:
        vals = buf[src_pos]
        buf[dst_pos] = vals


class PagedIndex:
    """Block tables and committed lengths of every slot's paged KV buffer.

    Args:
        num_slots: resident sequences (slot 0, the null slot, is extra: ``P = num_slots + 1``).
        block_size: entries per block ``bs`` (any positive int).
        num_blocks: blocks in the pool *including* the reserved null block 0 (so pools have
            ``num_blocks * block_size`` rows and ``num_blocks - 1`` blocks are allocatable).
        max_blocks_per_seq: columns of the block table (a slot holds at most
            ``max_blocks_per_seq * block_size`` entries).
        device: where ``block_table [P, max_blocks]`` and ``length [P]`` live.
    """

    def __init__(self, num_slots: int, block_size: int, num_blocks: int,
                 max_blocks_per_seq: int, device: torch.device | str = "cpu"):
        for name, v, lo in (("num_slots", num_slots, 1), ("block_size", block_size, 1),
                            ("num_blocks", num_blocks, 2),
                            ("max_blocks_per_seq", max_blocks_per_seq, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks = max_blocks_per_seq
        self.device = canonical_device(device)
        P = num_slots + 1
        self.block_table = torch.full((P, max_blocks_per_seq), NULL_BLOCK, dtype=torch.long,
                                      device=self.device)
        self.length = torch.zeros(P, dtype=torch.long, device=self.device)
        # host side: free list (pop from the end -> low block ids first) and blocks per slot
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._blocks: list[list[int]] = [[] for _ in range(P)]
        self._ref: list[int] = [0] * num_blocks     # holders of each block (slots + retains)
        self._pending: list[tuple[int, int, list[int]]] = []   # deferred table writes (slot, start, blocks)

    # ------------------------------------------------------------------ host bookkeeping
    @property
    def free_blocks(self) -> int:
        """Blocks available to :meth:`reserve`."""
        return len(self._free)

    @property
    def max_len(self) -> int:
        """Most entries one slot can hold: ``max_blocks_per_seq * block_size``."""
        return self.max_blocks * self.block_size

    def blocks_needed(self, total_len: int) -> int:
        """Blocks that hold ``total_len`` entries."""
        return -(-total_len // self.block_size)

    def num_allocated(self, slot: int) -> int:
        """Blocks currently held by ``slot``."""
        return len(self._blocks[self._check_slot(slot)])

    def capacity(self, slot: int) -> int:
        """Entries ``slot`` can hold with its current blocks."""
        return self.num_allocated(slot) * self.block_size

    def blocks_of(self, slot: int) -> list[int]:
        """Pool block ids held by ``slot``, in logical order (a copy)."""
        return list(self._blocks[self._check_slot(slot)])

    def _check_slot(self, slot) -> int:
        if isinstance(slot, Tensor):
            if slot.numel() != 1:
                raise ValueError("slot must be a single int")
            slot = int(slot)
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot <= self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}], got {slot!r}")
        return slot

    def can_reserve(self, slot: int, total_len: int) -> bool:
        """Whether :meth:`reserve` would succeed (no state change)."""
        slot = self._check_slot(slot)
        if slot == NULL_SLOT or not isinstance(total_len, int) or total_len < 0:
            return False
        need = self.blocks_needed(total_len)
        have = len(self._blocks[slot])
        return need <= self.max_blocks and need - have <= len(self._free)

    def reserve(self, slot: int, total_len: int, defer: bool = False) -> None:
        """Make ``slot`` hold at least ``total_len`` entries (allocates blocks; never shrinks).

        Raises :class:`PoolExhausted` when the pool has too few free blocks and
        ``ValueError`` when ``total_len`` exceeds ``max_blocks_per_seq * block_size``; in
        both cases nothing changes.  Call between steps (it writes ``block_table``).
        ``defer``: the host bookkeeping happens now, the ``block_table`` write waits for
        :meth:`write_pending` (a step's reservations in one transfer and one scatter instead of
        one small copy per sequence).
        """
        slot = self._check_slot(slot)
        if slot == NULL_SLOT:
            raise ValueError("cannot reserve blocks for the null slot 0")
        if not isinstance(total_len, int) or isinstance(total_len, bool) or total_len < 0:
            raise ValueError(f"total_len must be a non-negative int, got {total_len!r}")
        need = self.blocks_needed(total_len)
        if need > self.max_blocks:
            raise ValueError(
                f"slot {slot}: {total_len} entries need {need} blocks of {self.block_size}, "
                f"more than max_blocks_per_seq={self.max_blocks}"
            )
        have = len(self._blocks[slot])
        extra = need - have
        if extra <= 0:
            return
        if extra > len(self._free):
            raise PoolExhausted(
                f"slot {slot}: {total_len} entries need {extra} more blocks, only "
                f"{len(self._free)} of {self.num_blocks - 1} are free"
            )
        new = [self._free.pop() for _ in range(extra)]
        for b in new:
            self._ref[b] = 1
        self._blocks[slot].extend(new)
        if defer:
            self._pending.append((slot, have, new))
        else:
            self.write_pending()
            self.block_table[slot, have:need] = torch.tensor(new, dtype=torch.long, device=self.device)

    def write_pending(self) -> None:
        """Write the deferred reservations into ``block_table``: one host-to-device copy of
        ``[3, n]`` (row, column, block) triples and one scatter."""
        if not self._pending:
            return
        rows, cols, vals = [], [], []
        for slot, start, blocks in self._pending:
            rows += [slot] * len(blocks)
            cols += range(start, start + len(blocks))
            vals += blocks
        self._pending = []
        idx = host_to_device(torch.tensor([rows, cols, vals], dtype=torch.long), self.device)
        self.block_table[idx[0], idx[1]] = idx[2]

    def release(self, slot: int) -> None:
        """Drop ``slot``'s references to its blocks and empty it (length 0, table -> null
        block); blocks nobody else holds return to the pool."""
        self.write_pending()
        slot = self._check_slot(slot)
        if slot == NULL_SLOT:
            return
        blocks = self._blocks[slot]
        self._unref(reversed(blocks))
        self._blocks[slot] = []
        self.block_table[slot] = NULL_BLOCK
        self.length[slot] = 0

    # ------------------------------------------------------------------ shared blocks
    def refcount(self, block: int) -> int:
        """Holders of ``block`` (slots whose table lists it, plus :meth:`retain` calls)."""
        return self._ref[self._check_block(block)]

    def _check_block(self, block) -> int:
        if not isinstance(block, int) or isinstance(block, bool) or not NULL_BLOCK < block < self.num_blocks:
            raise ValueError(f"block must be an int in [1, {self.num_blocks - 1}], got {block!r}")
        return block

    def _check_held(self, blocks) -> list[int]:
        out = [self._check_block(b) for b in blocks]
        for b in out:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is free: only held blocks can be shared or retained")
        return out

    def _unref(self, blocks) -> None:
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def share(self, slot: int, blocks: list[int]) -> None:
        """Start the empty ``slot`` with ``blocks`` (held elsewhere) as its first logical
        blocks: one more reference each; nothing is copied.  A shared block must not be
        written while others hold it (the caller copies a block it will write into)."""
        self.write_pending()
        slot = self._check_slot(slot)
        if slot == NULL_SLOT:
            raise ValueError("cannot share blocks into the null slot 0")
        if self._blocks[slot]:
            raise ValueError(f"slot {slot} already holds {len(self._blocks[slot])} blocks; share into an empty slot")
        blocks = self._check_held(list(blocks))
        if len(blocks) > self.max_blocks:
            raise ValueError(f"{len(blocks)} blocks exceed max_blocks_per_seq={self.max_blocks}")
        for b in blocks:
            self._ref[b] += 1
        self._blocks[slot] = list(blocks)
        if blocks:
            self.block_table[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.long, device=self.device)

    def retain(self, blocks: list[int]) -> None:
        """Take one reference on each of ``blocks`` (held ones) from outside any slot."""
        for b in self._check_held(list(blocks)):
            self._ref[b] += 1

    def drop(self, blocks: list[int]) -> None:
        """Give back references taken with :meth:`retain`; blocks nobody holds are freed."""
        blocks = self._check_held(list(blocks))
        self._unref(blocks)

    # ------------------------------------------------------------------ steps
    def _check_slots(self, slots: Tensor) -> Tensor:
        if not isinstance(slots, Tensor) or slots.dim() != 1:
            raise ValueError("slots must be a 1-D integer tensor [Bt]")
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be int32/int64, got {slots.dtype}")
        if slots.device != self.device:
            raise ValueError(f"slots on {slots.device}, paged index on {self.device}")
        return slots.long()

    def plan(self, slots: Tensor, num_new: int, check: bool | None = None) -> PagedPlan:
        """Plan ``num_new`` entries per row of ``slots [Bt]`` (1 for decode).

        With ``check`` (default: on for CPU tensors, off during CUDA-graph capture) validates
        on the host that slot ids are in range, non-null slots are distinct, and every
        non-null row has blocks for ``length + num_new`` entries (reserve them first).
        """
        self.write_pending()
        if not isinstance(num_new, int) or isinstance(num_new, bool) or num_new < 1:
            raise ValueError(f"number of new entries must be a positive int, got {num_new!r}")
        if num_new > self.max_len:
            raise ValueError(f"{num_new} new entries exceed max_blocks_per_seq * block_size = "
                             f"{self.max_len}")
        slots = self._check_slots(slots)
        check = want_check(check, slots)
        if check and slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi > self.num_slots:
                raise ValueError(f"slot ids must be in [0, {self.num_slots}], got [{lo}, {hi}]")
            real = [s for s in slots.tolist() if s != NULL_SLOT]
            if len(set(real)) != len(real):
                raise ValueError(f"slots {slots.tolist()} repeat a non-null slot")
            lens = self.length[slots].tolist()
            for s, n in zip(slots.tolist(), lens):
                if s != NULL_SLOT and n + num_new > len(self._blocks[s]) * self.block_size:
                    raise ValueError(
                        f"slot {s}: {n} committed + {num_new} new entries exceed its "
                        f"{len(self._blocks[s])} blocks of {self.block_size}; reserve first"
                    )
        return PagedPlan(slots, self.length[slots], self.block_table[slots], num_new,
                         self.block_size)

    def check_accepted(self, pplan: PagedPlan, accepted: Tensor) -> Tensor:
        """Validate accepted counts ``[Bt]`` in ``[0, T]`` (host check)."""
        if not isinstance(accepted, Tensor) or tuple(accepted.shape) != (pplan.batch,):
            raise ValueError(f"accepted must be a tensor of shape [{pplan.batch}]")
        if accepted.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"accepted must be an integer tensor, got {accepted.dtype}")
        if accepted.device != self.device:
            raise ValueError(f"accepted on {accepted.device}, paged index on {self.device}")
        if accepted.numel():
            lo, hi = int(accepted.min()), int(accepted.max())
            if lo < 0 or hi > pplan.num_new:
                raise ValueError(f"accepted counts must be in [0, {pplan.num_new}], "
                                 f"got [{lo}, {hi}]")
        return accepted.long()

    def commit(self, pplan: PagedPlan, accepted: Tensor | None = None,
               check: bool | None = None) -> None:
        """``length[slot] += accepted`` per row (``None``: all ``T`` accepted, e.g. decode).

        ``check`` (default: on for CPU tensors, off during CUDA-graph capture) validates
        ``0 <= accepted <= T`` on the host before anything is written.  The null slot's
        length is reset to 0.
        """
        if accepted is None:
            accepted = torch.full((pplan.batch,), pplan.num_new, dtype=torch.long,
                                  device=self.device)
        if want_check(check, accepted):
            accepted = self.check_accepted(pplan, accepted)
        self.length[pplan.slot] = pplan.length + accepted.long()
        self.length[:1].zero_()   # null slot (a kernel on a view: no sync, capturable)

    # tree commit in KV mode (module function, exposed here for discoverability)
    gather_path = staticmethod(gather_path)

    def reset(self, slots: Tensor) -> None:
        """Set the committed length of ``slots`` to 0 (keeps their blocks)."""
        slots = self._check_slots(slots)
        self.length[slots] = 0


@dataclass
class Mamba2PagedBuffers:
    """Paged pools of one Mamba-2 layer's inputs (KV-only form, no state).

    x:  ``[NB*bs, H, d]`` post-conv values
    B:  ``[NB*bs, G, n]`` keys
    dt: ``[NB*bs, H]``    step sizes Δ (compute dtype: fp32, fp64 for fp64 models)
    """

    x: Tensor
    B: Tensor
    dt: Tensor

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, nheads: int, head_dim: int,
                 d_state: int, ngroups: int, dtype=torch.float32, state_dtype=torch.float32,
                 device="cpu", poison: bool = False) -> "Mamba2PagedBuffers":
        if nheads % ngroups:
            raise ValueError(f"nheads {nheads} is not a multiple of ngroups {ngroups}")
        R = num_blocks * block_size
        return cls(
            x=_empty((R, nheads, head_dim), dtype, device, poison),
            B=_empty((R, ngroups, d_state), dtype, device, poison),
            dt=_empty((R, nheads), state_dtype, device, poison),
        )

    def tensors(self) -> list[Tensor]:
        return [self.x, self.B, self.dt]


@dataclass
class _DeltaRulePagedBuffers:
    """Paged pools ``[NB*bs, ...]`` of one delta-rule layer's ``(u, k, g)`` entries (KV-only
    form, no state); ``g`` per value head (GDN) or per value head and key channel (KDA:
    ``per_channel_decay``)."""

    per_channel_decay: ClassVar[bool] = False

    u: Tensor
    k: Tensor
    g: Tensor

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_k_heads: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, dtype=torch.float32,
                 state_dtype=torch.float32, device="cpu", poison: bool = False):
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
        R = num_blocks * block_size
        return cls(
            u=_empty((R, num_v_heads, head_v_dim), dtype, device, poison),
            k=_empty((R, num_k_heads, head_k_dim), dtype, device, poison),
            g=_empty((R, num_v_heads) + ((head_k_dim,) if cls.per_channel_decay else ()), state_dtype, device,
                     poison),
        )

    def tensors(self) -> list[Tensor]:
        return [self.u, self.k, self.g]


@dataclass
class GDNPagedBuffers(_DeltaRulePagedBuffers):
    """Paged pools of one Gated DeltaNet layer's entries (KV-only form, no state).

    u: ``[NB*bs, HV, V]`` corrected values
    k: ``[NB*bs, H, K]``  keys after l2-norm
    g: ``[NB*bs, HV]``    log-decays (compute dtype)
    """


@dataclass
class KDAPagedBuffers(_DeltaRulePagedBuffers):
    """Paged pools of one KDA layer's entries (KV-only form, no state): :class:`GDNPagedBuffers`
    with a log-decay per key channel.

    u: ``[NB*bs, HV, V]`` corrected values
    k: ``[NB*bs, H, K]``  keys after l2-norm
    g: ``[NB*bs, HV, K]`` per-channel log-decays (compute dtype)
    """

    per_channel_decay: ClassVar[bool] = True
