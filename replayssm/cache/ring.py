"""Ring buffers of recent layer inputs: the bookkeeping every replay layer shares.

One :class:`RingIndex` serves all layers of a model: each sequence (a *slot*) has a
ring of capacity ``L`` holding the inputs since its checkpoint state.  ``start[slot]``
is the ring index of the oldest committed entry and ``length[slot]`` (``h``) is how
many entries are committed.  Entry ``j`` (0-based, oldest first) lives at ring index
``(start + j) % L``.  Slot 0 is the *null slot*: padding rows of a batch point at it,
its contents are garbage, and its bookkeeping is reset to zero at every commit.

A step is planned once per model (:meth:`RingIndex.plan_decode`,
:meth:`RingIndex.plan_verify`), every layer reads the same :class:`StepPlan`, and the
step is committed once (:meth:`RingIndex.commit`).  All per-sequence decisions (flush
flags, positions, accepted counts) are device tensors: no host synchronisation is
needed, so a step can be captured in a CUDA graph.

Flush policies (``docs/MATH.md``, "Flush"; ``h`` = committed entries before the step,
``T`` = new entries):

* ``decode`` (one token, always accepted): the new entry is appended at
  position ``h``; when the ring becomes full (``h + 1 == L``) the layer writes the
  state *including* the new entry, ``S_0 <- S_{h+1}``, and the ring is emptied.
* ``verify`` / ``tree`` (T tentative entries): flush one window early, when
  ``h + 2T > L``; the layer writes ``S_0 <- S_h`` (committed entries only), the new
  entries stay in the ring, and commit keeps the accepted ones.

  A row that does *not* flush has ``h + 2T <= L``, so its T new entries never touch a
  committed one.  There is no bound on ``h`` for a flushing row: a run of verify steps
  with one ``T`` keeps ``h <= L - T``, but after decode steps (``h`` up to ``L - 1``) or
  with a larger ``T``, ``h + T > L`` happens; such a row always flushes and its new
  entries overwrite the oldest committed ones, so a layer must read the history (and
  write ``S_h``) from what it gathered *before* :func:`write_new` (kernels: before the
  append).  Results stay exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..runtime import canonical_device, want_check

NULL_SLOT = 0
assert NULL_SLOT == 0, "the null slot is row 0 of every pool (commits reset it as [:1])"

_KINDS = ("decode", "verify", "tree")


@dataclass(frozen=True)
class StepPlan:
    """Per-row decisions for one step; every tensor is ``[B]`` on the cache's device.

    slot:  state/buffer slot of each row (``NULL_SLOT`` for padding rows).
    start: ring index of the first committed entry.
    hist:  committed entries ``h`` the step replays (before its new entries).
    flush: whether this row's layers write their checkpoint state this step
           (``decode``: ``S_{h+1}``; ``verify``/``tree``: ``S_h``).
    num_new: ``T``, entries appended this step (1 for decode, nodes for a tree).
    kind: ``"decode"``, ``"verify"`` or ``"tree"``.
    capacity: ring capacity ``L``.
    """

    slot: Tensor
    start: Tensor
    hist: Tensor
    flush: Tensor
    num_new: int
    kind: str
    capacity: int

    @property
    def batch(self) -> int:
        return self.slot.shape[0]

    def new_positions(self) -> Tensor:
        """Ring indices ``[B, T]`` of this step's new entries: ``(start + h + s) % L``."""
        s = torch.arange(self.num_new, device=self.slot.device)
        return (self.start[:, None] + self.hist[:, None] + s) % self.capacity

    def hist_positions(self) -> Tensor:
        """Ring indices ``[B, L]`` of entries ``j = 0..L-1`` counted from ``start``."""
        j = torch.arange(self.capacity, device=self.slot.device)
        return (self.start[:, None] + j) % self.capacity

    def hist_mask(self) -> Tensor:
        """``[B, L]`` bool: entry ``j`` (counted from ``start``) is committed (``j < h``)."""
        j = torch.arange(self.capacity, device=self.slot.device)
        return j[None, :] < self.hist[:, None]


def gather_history(buf: Tensor, plan: StepPlan) -> Tensor:
    """Entries of ``buf [P, L, ...]`` for each row, oldest first: ``[B, L, ...]``.

    Entries ``j >= plan.hist`` are whatever the ring holds there (possibly NaN in
    tests): mask them with ``torch.where``, never by multiplying with zero.
    """
    return buf[plan.slot[:, None], plan.hist_positions()]


def write_new(buf: Tensor, plan: StepPlan, values: Tensor) -> None:
    """Write this step's entries ``values [B, T, ...]`` at ``plan.new_positions()``."""
    if values.shape[:2] != (plan.batch, plan.num_new) or values.shape[2:] != buf.shape[2:]:
        raise ValueError(
            f"new entries have shape {tuple(values.shape)}, expected "
            f"{(plan.batch, plan.num_new) + tuple(buf.shape[2:])}"
        )
    buf[plan.slot[:, None], plan.new_positions()] = values.to(buf.dtype)


def check_speculative_capacity(buffer_size: int, num_new: int, what: str = "new entries", hint: str = "") -> None:
    """Speculation needs a ring of ``L >= 2T``: a step flushes early (``h + 2T > L``) so the
    next one always has ``T`` free slots.  Raises ``ValueError`` naming both numbers."""
    if num_new > 1 and buffer_size < 2 * num_new:
        raise ValueError(f"buffer_size {buffer_size} < 2 * {what} = {2 * num_new}: speculation needs a ring "
                         f"of L >= 2T so every step has T free slots{hint}")


class RingIndex:
    """Per-slot ring bookkeeping (``start``, ``length``) for a model's replay buffers.

    Args:
        num_slots: sequences that can be resident at once (slot 0 is extra, the null slot).
        capacity: ring capacity ``L`` (``buffer_size``), >= 1.
        device: where the bookkeeping lives (same device as the buffers).
    """

    def __init__(self, num_slots: int, capacity: int, device: torch.device | str = "cpu"):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"buffer capacity must be a positive int, got {capacity!r}")
        self.num_slots = num_slots
        self.capacity = capacity
        self.device = canonical_device(device)
        self.start = torch.zeros(num_slots + 1, dtype=torch.long, device=self.device)
        self.length = torch.zeros(num_slots + 1, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ checks
    def _check_slots(self, slots: Tensor) -> Tensor:
        if not isinstance(slots, Tensor) or slots.dim() != 1:
            raise ValueError("slots must be a 1-D integer tensor [B]")
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be int32/int64, got {slots.dtype}")
        if slots.device != self.device:
            raise ValueError(f"slots on {slots.device}, ring on {self.device}")
        if slots.numel() and want_check(None, slots):
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi > self.num_slots:
                raise ValueError(f"slot ids must be in [0, {self.num_slots}], got [{lo}, {hi}]")
        return slots.long()

    # ------------------------------------------------------------------ plans
    def plan_decode(self, slots: Tensor) -> StepPlan:
        """Plan one always-accepted token per row (the decode flush: when the ring fills)."""
        slots = self._check_slots(slots)
        start, hist = self.start[slots], self.length[slots]
        flush = (hist + 1) >= self.capacity
        return StepPlan(slots, start, hist, flush, 1, "decode", self.capacity)

    def plan_verify(self, slots: Tensor, num_new: int, kind: str = "verify") -> StepPlan:
        """Plan ``num_new`` tentative entries per row; flush early when ``h + 2T > L``."""
        if kind not in ("verify", "tree"):
            raise ValueError(f"kind must be 'verify' or 'tree', got {kind!r}")
        if not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"number of new entries must be a positive int, got {num_new!r}")
        check_speculative_capacity(self.capacity, num_new, f"{num_new} new entries")
        slots = self._check_slots(slots)
        start, hist = self.start[slots], self.length[slots]
        flush = (hist + 2 * num_new) > self.capacity
        return StepPlan(slots, start, hist, flush, num_new, kind, self.capacity)

    # ------------------------------------------------------------------ commit
    def check_accepted(self, plan: StepPlan, accepted: Tensor) -> Tensor:
        """Validate accepted counts ``[B]`` (host check; only called where a sync is fine)."""
        if not isinstance(accepted, Tensor) or accepted.shape != (plan.batch,):
            raise ValueError(f"accepted must be a tensor of shape [{plan.batch}]")
        if accepted.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"accepted must be an integer tensor, got {accepted.dtype}")
        if accepted.numel():
            lo, hi = int(accepted.min()), int(accepted.max())
            if lo < 0 or hi > plan.num_new:
                raise ValueError(
                    f"accepted counts must be in [0, {plan.num_new}] (entries drafted), "
                    f"got [{lo}, {hi}]"
                )
        return accepted.long()

    def commit(self, plan: StepPlan, accepted: Tensor | None = None, check: bool | None = None) -> None:
        """Advance each row's ring by its accepted count (a pointer move; no data copied).

        ``decode`` plans take no counts.  ``verify``/``tree`` plans take ``accepted [B]``
        (entries kept, ``0 <= a <= T``; for trees the accepted path must already have
        been gathered to the front by :func:`replayssm.cache.tree.gather_path`).
        ``check`` (default: on for CPU tensors; always off during CUDA-graph capture)
        validates on the host; CUDA-graph callers pass ``check=False`` and guarantee the
        range themselves.
        """
        L = self.capacity
        if plan.kind == "decode":
            if accepted is not None:
                raise ValueError("decode steps are always accepted; pass no accepted counts")
            new_start = torch.where(plan.flush, (plan.start + plan.hist + 1) % L, plan.start)
            new_len = torch.where(plan.flush, torch.zeros_like(plan.hist), plan.hist + 1)
        else:
            if accepted is None:
                raise ValueError(f"{plan.kind} steps need accepted counts")
            check = want_check(check, accepted)
            accepted = self.check_accepted(plan, accepted) if check else accepted.long()
            new_start = torch.where(plan.flush, (plan.start + plan.hist) % L, plan.start)
            new_len = torch.where(plan.flush, torch.zeros_like(plan.hist), plan.hist) + accepted
        self.start[plan.slot] = new_start
        self.length[plan.slot] = new_len
        # null slot back to empty: a kernel on a view (no host scalar, no sync; capturable)
        self.start[:1].zero_()
        self.length[:1].zero_()

    def reset(self, slots: Tensor) -> None:
        """Empty the rings of ``slots`` (a new sequence starts from its prefill state)."""
        slots = self._check_slots(slots)
        self.start[slots] = 0
        self.length[slots] = 0
