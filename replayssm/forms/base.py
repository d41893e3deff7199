"""What a decode form is: the memory one SSM layer keeps per sequence, and each step on it.

A *form* (``recurrent``, ``replay``, ``kv``; ``docs/MATH.md`` gives the equations) is a
stateless object.  For one layer it owns

* its **allocation**: :meth:`DecodeForm.allocate` returns this form's part of the layer's
  per-sequence store (a dict merged with the other forms' parts by the model cache),
* its **steps**: :meth:`prefill`, :meth:`decode`, :meth:`verify`, :meth:`tree` take the
  layer's time-major inputs ``a`` (each ``[B, T, ...]``) and the call's
  :class:`~replayssm.layers.context.StepContext` and return ``y [B, T, ...]``;
  :meth:`commit` keeps the accepted entries of a pending verify / tree step,
* which shared bookkeeping its steps read: a ring plan (``uses_ring``) and/or a paged plan
  (``uses_pages``), built once per model call.

What a form decides per step kind (the op entry, the stores read / written / flushed, what
the step keeps and what its commit runs) is its rows of :mod:`replayssm.forms.table`, shared
with the JAX backend: :meth:`DecodeForm.step` reads them, the step methods call the op the
table names and :meth:`DecodeForm.commit` runs the table's commit entry.

The layer family (Mamba-2, Gated DeltaNet) is reached through :class:`FormLayer`: the forms
never know which family they run, so a new form is one new module plus a registration in
:mod:`replayssm.forms`, and a new family implements :class:`FormLayer` once.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from .table import KINDS, STEP_KINDS, Step, form_stores, step

__all__ = ["STEP_KINDS", "DecodeForm", "FormLayer", "ring_plan", "paged_plan"]


def ring_plan(ring, kind: str, slots: Tensor, T: int):
    """The ring plan of a step: ``T`` tentative entries (verify, tree: flush a window early)
    or one new entry (prefill and decode)."""
    if KINDS[kind].tentative:
        return ring.plan_verify(slots, T, kind)
    return ring.plan_decode(slots)


def paged_plan(pidx, kind: str, slots: Tensor, T: int):
    """The paged plan of a step (a padded step's tail past a row's reserved blocks lands in
    the null block, so its length check is off)."""
    return pidx.plan(slots, T, check=False if KINDS[kind].padded else None)


class FormLayer(Protocol):
    """What a form needs from an SSM layer family (implemented by
    :class:`~replayssm.layers.ssm_base.SSMLayer`)."""

    layer_id: int
    chunk_size: int

    def op(self, name: str, *prefix, a: dict, t0: bool = False, **kw) -> Any:
        """Call op ``name`` of the family (``ops_for(family).<name>``) with ``prefix`` and
        the family's arguments taken from ``a`` (``t0``: drop the time axis)."""

    def ops(self) -> Any:
        """The family's routed ops object (``kernels.dispatch.ops_for(family)``)."""

    def rebuild_state(self, buf, plan) -> Tensor:
        """``S_h`` of each plan row from its checkpoint and committed ring entries."""

    def alloc_ring(self, num_slots: int, capacity: int, dtype, device, state_dtype=None):
        """Checkpoint states (in ``state_dtype``; default the compute dtype) + input ring
        (``Mamba2Buffers`` / ``GDNBuffers``)."""

    def alloc_pages(self, num_blocks: int, block_size: int, dtype, device):
        """Paged KV-only pools (``Mamba2PagedBuffers`` / ``GDNPagedBuffers``)."""

    def kv_to_state(self, store: dict, pplan, slots: Tensor) -> None:
        """Compress the slots' KV-only entries into their checkpoint states."""


class DecodeForm:
    """Base of the decode forms (see the module docstring)."""

    name = ""

    @property
    def uses_ring(self) -> bool:
        """Steps read a ring plan (``ctx.plan``): some row of the table uses the ring."""
        return "ring" in form_stores(self.name)

    @property
    def uses_pages(self) -> bool:
        """Steps read a paged plan (``ctx.pplan``): some row of the table uses the pages."""
        return "pages" in form_stores(self.name)

    def step(self, kind: str) -> Step:
        """This form's row of the table for ``kind``."""
        return step(self.name, kind)

    def op(self, kind: str) -> str:
        """The op family entry a step of ``kind`` runs."""
        return step(self.name, kind).op

    def allocate(self, layer: FormLayer, num_slots: int, capacity: int, dtype, device,
                 pages: tuple[int, int] | None = None, state_dtype=None) -> dict:
        """This form's part of the layer store for ``num_slots`` slots (null slot included);
        ``capacity`` is the ring size, ``pages`` ``(num_blocks, block_size)`` of a paged pool,
        ``state_dtype`` the checkpoint states' storage dtype (None: the compute dtype)."""
        raise NotImplementedError

    def bind(self, ctx, cache) -> None:
        """Set the rows and plans this form's steps read on the model call's context (once
        per call, for all layers): ``ctx.state_slots`` and a ring plan (``uses_ring``) over
        them, a paged plan (``uses_pages``) over ``ctx.slots``."""
        ctx.state_slots = ctx.slots
        if self.uses_ring:
            ctx.plan = ring_plan(cache.ring, ctx.kind, ctx.state_slots, ctx.T)
        if self.uses_pages:
            ctx.pplan = paged_plan(cache.pidx, ctx.kind, ctx.slots, ctx.T)

    def run(self, layer: FormLayer, a: dict, ctx, store: dict) -> Tensor:
        """Dispatch to the method named by the step kind."""
        if ctx.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {ctx.kind!r}: expected one of {STEP_KINDS}")
        return getattr(self, ctx.kind)(layer, a, ctx, store)

    def prefill(self, layer: FormLayer, a: dict, ctx, store: dict) -> Tensor:
        raise NotImplementedError

    def decode(self, layer: FormLayer, a: dict, ctx, store: dict) -> Tensor:
        raise NotImplementedError

    def verify(self, layer: FormLayer, a: dict, ctx, store: dict) -> Tensor:
        raise NotImplementedError

    def tree(self, layer: FormLayer, a: dict, ctx, store: dict) -> Tensor:
        raise NotImplementedError

    def commit(self, layer: FormLayer, ctx, store: dict, accepted: Tensor, path: Tensor | None) -> None:
        """Keep ``accepted`` entries of the pending step: the method named by the table's
        commit entry of the pending kind (the shared ring / paged pointers move in the model,
        once for all layers; none: nothing form-specific to do)."""
        name = self.step(ctx.kind).commit
        if name:
            getattr(self, name)(layer, ctx, store, accepted, path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
