"""KV-only rows and replay rows in one step (``decode_mode="auto"`` after some requests
switched to a state): both forms run, each on its own rows (the other rows point at the
null slot), and ``torch.where`` keeps each row's own result."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import DecodeForm, FormLayer, paged_plan, ring_plan
from .kv import KVForm
from .replay import ReplayForm


class MixedForm(DecodeForm):
    name = "mixed"

    def __init__(self, kv: DecodeForm | None = None, state: DecodeForm | None = None):
        self.kv, self.state = kv or KVForm(), state or ReplayForm()

    @property
    def uses_ring(self) -> bool:
        return self.kv.uses_ring or self.state.uses_ring

    @property
    def uses_pages(self) -> bool:
        return self.kv.uses_pages or self.state.uses_pages

    def allocate(self, layer: FormLayer, num_slots: int, capacity: int, dtype, device, pages=None,
                 state_dtype=None) -> dict:
        return {**self.state.allocate(layer, num_slots, capacity, dtype, device, pages, state_dtype),
                **self.kv.allocate(layer, num_slots, capacity, dtype, device, pages)}

    def bind(self, ctx, cache) -> None:
        """KV rows run on the paged plan, the others on the ring plan; each form's rows of
        the other point at the null slot."""
        zero = torch.zeros_like(ctx.slots)
        ctx.kv_rows = cache.kv_slot[ctx.slots]
        ctx.state_slots = torch.where(ctx.kv_rows, zero, ctx.slots)
        ctx.plan = ring_plan(cache.ring, ctx.kind, ctx.state_slots, ctx.T)
        ctx.pplan = paged_plan(cache.pidx, ctx.kind, torch.where(ctx.kv_rows, ctx.slots, zero), ctx.T)

    def run(self, layer, a, ctx, store) -> Tensor:
        y_state = self.state.run(layer, a, ctx, store)
        y_kv = self.kv.run(layer, a, ctx, store)
        return torch.where(ctx.rows(ctx.kv_rows, y_kv), y_kv, y_state)

    def commit(self, layer, ctx, store, accepted, path) -> None:
        self.state.commit(layer, ctx, store, accepted, path)
        self.kv.commit(layer, ctx, store, accepted, path)
