"""What the engine (its block manager, runner, prefix cache and drafters) uses of a model
cache: :class:`ModelCacheLike`, a structural type (:class:`~replayssm.models.cache.ModelCache`
implements it; so do test doubles and the tensor-parallel :class:`ShardedCache`).

Every method is a *read* or, marked :func:`every_rank`, a *change* of the cache's slots,
pools or prefix store.  A cache split over ranks
(:class:`replayssm.distributed.model.ShardedCache`) runs each change on every rank — it
builds its forwarding from :func:`changes` — and answers reads from rank 0's copy, since
every rank's bookkeeping is identical after the same changes.  A method added here is
forwarded with no further code.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from ..cache.spec import CacheSpec

__all__ = ["ModelCacheLike", "every_rank", "changes", "reads"]


def every_rank(fn):
    """Mark a protocol method as a change of the cache (see the module docstring)."""
    fn.every_rank = True
    return fn


def _methods(protocol) -> dict:
    return {name: v for name, v in vars(protocol).items() if not name.startswith("_") and inspect.isfunction(v)}


def changes(protocol) -> frozenset[str]:
    """Names of ``protocol``'s methods marked :func:`every_rank`."""
    return frozenset(n for n, f in _methods(protocol).items() if getattr(f, "every_rank", False))


def reads(protocol) -> frozenset[str]:
    """Names of ``protocol``'s other methods (answered by any one rank)."""
    return frozenset(_methods(protocol)) - changes(protocol)


@runtime_checkable
class ModelCacheLike(Protocol):
    """Per-slot memory of one model (``model.make_cache``); slot ids are host ints (or
    lists / tensors of them), store block and checkpoint ids come from the engine's prefix
    index.  Shapes and semantics: :class:`~replayssm.models.cache.ModelCache`."""

    spec: CacheSpec           # what the cache holds (mode, sizes, pools, prefix store)
    device: torch.device
    uses_pages: bool          # slots draw blocks from paged pools (``reserve`` matters)
    pending: Any              # the verify awaiting its commit, or None
    attn: Any                 # the attention block pool (a PagedIndex) of hybrids, or None
    pidx: Any                 # the KV-only entries' block pool (a PagedIndex), or None

    # -- reads --------------------------------------------------------------------------------
    def mode_of(self, slot: int) -> str:
        """``slot``'s form: ``recurrent | replay | kv``."""

    def ssm_form(self) -> str:
        """The form a step runs in (``mixed``: KV-only and replay slots together)."""

    def nbytes(self) -> int:
        """Bytes the cache allocated (one rank's share when split)."""

    # -- slot lifecycle -----------------------------------------------------------------------
    @every_rank
    def reserve(self, slot: int, total_len: int, defer: bool = False) -> None:
        """Room for ``total_len`` tokens of ``slot`` in its paged pools."""

    @every_rank
    def write_pending(self) -> None:
        """The block-table writes of ``reserve(..., defer=True)``."""

    @every_rank
    def reserve_step(self, slots, totals) -> list:
        """A step's reservations (``totals[i]`` tokens for ``slots[i]``) then their block-table
        writes, in one call; per slot None or why it failed (that slot left unchanged)."""

    @every_rank
    def switch_to_state(self, slots) -> None:
        """KV-only ``slots`` -> replay form."""

    @every_rank
    def release(self, slots) -> None:
        """Free ``slots``."""

    @every_rank
    def clear_pending(self) -> None:
        """Forget a verify whose commit will never come."""

    @every_rank
    def fork(self, src: int, dst) -> None:
        """Copy slot ``src``'s sequence into the free slots ``dst``."""

    @every_rank
    def swap_out(self, slot: int, key) -> None:
        """Copy ``slot``'s whole sequence to host memory under ``key`` and free the slot
        (preemption; every rank keeps its own shard's copy)."""

    @every_rank
    def swap_in(self, slot: int, key) -> None:
        """Restore the sequence kept under ``key`` into the free ``slot`` (any slot)."""

    @every_rank
    def drop_swapped(self, key) -> None:
        """Forget the host copy kept under ``key`` (its request was aborted)."""

    # -- prefix store (``spec.prefix_blocks``) ------------------------------------------------
    @every_rank
    def prefix_assign(self, slot: int, pairs) -> None:
        """Capture ``slot``'s logical blocks ``k`` into store blocks ``b`` (``(k, b)`` pairs)."""

    @every_rank
    def prefix_copy(self, src: int, dst: int, count: int) -> None:
        """Copy ``count`` tokens of store block ``src`` into ``dst``."""

    @every_rank
    def prefix_copies(self, copies) -> None:
        """Several ``prefix_copy`` ``(src, dst, count)`` at once."""

    @every_rank
    def prefix_checkpoint(self, row: int, slot: int | None = None, chain=(), start: int = 0, stop: int = 0,
                          base: int | None = None) -> None:
        """Write checkpoint ``row`` from ``slot``'s state or by folding the chain's entries."""

    @every_rank
    def prefix_checkpoints(self, jobs: list[dict]) -> None:
        """Several ``prefix_checkpoint`` calls (dicts of its arguments) at once."""

    @every_rank
    def prefix_save_states(self, jobs) -> None:
        """State points: checkpoint rows take slots' states and conv windows (``(row, slot)``)."""

    @every_rank
    def load_prefix(self, slot: int, length: int, chain, attn=(), checkpoint=None) -> None:
        """Resume the free ``slot`` at token ``length`` of a cached prefix."""

    @every_rank
    def load_prefixes(self, requests) -> list:
        """Several ``load_prefix`` ``(slot, length, chain, attn, checkpoint)``; per request
        ``None`` or the exception that left its slot free."""

    @every_rank
    def prefix_retain_attn(self, blocks) -> None:
        """The prefix index takes a reference on attention ``blocks``."""

    @every_rank
    def prefix_drop_attn(self, blocks) -> None:
        """The prefix index gives back attention ``blocks``."""
