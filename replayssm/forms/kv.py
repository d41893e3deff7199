"""KV-only form (KVBuffer): no state at all; every input since the sequence start lives in
paged blocks (``S_0 = 0``), so a step attends over the whole short context.

Cheaper than any state form while the context is shorter than about ``n`` (or ``d``)
tokens; the engine then compresses the entries into a state (one flush,
``ModelCache.switch_to_state``) and the slot continues in the replay form.
"""

from __future__ import annotations

from torch import Tensor

from ..cache import paged
from .base import DecodeForm, FormLayer


def kv_only_threshold(state_bytes: int, entry_bytes: int, buffer_size: int) -> int:
    """First context length ``c`` at which a KV-only step reads more bytes than a replay step
    averaged over its flush cycle (``docs/MATH.md``, traffic model).

    KV-only reads ``c`` entries ``E``; replay reads the state ``S``, on average ``(L-1)/2``
    ring entries and stores ``S`` once per ``L`` steps (the per-token inputs cancel), so
    ``c = floor((S (1 + 1/L) + E (L-1)/2) / E) + 1``.  Sizes are one slot's, over all layers.
    """
    S, E, L = int(state_bytes), int(entry_bytes), int(buffer_size)
    if S < 0 or E <= 0 or L < 1:
        raise ValueError(f"need state_bytes >= 0, entry_bytes > 0, buffer_size >= 1; got {S}, {E}, {L}")
    return (2 * L * S + 2 * S + E * L * (L - 1)) // (2 * L * E) + 1


class KVForm(DecodeForm):
    name = "kv"
    uses_pages = True

    def allocate(self, layer: FormLayer, num_slots: int, capacity: int, dtype, device, pages=None,
                 state_dtype=None) -> dict:
        if pages is None:
            raise ValueError("the KV-only form needs a paged pool: pages=(num_blocks, block_size)")
        return {"kv": layer.alloc_pages(pages[0], pages[1], dtype, device)}

    def _all(self, layer, a, ctx, store) -> Tensor:
        return layer.op(self.op(ctx.kind), store["kv"], ctx.pplan, a=a)

    decode = verify = _all

    def prefill(self, layer, a, ctx, store) -> Tensor:
        """The packed rows, padded back to ``[B, T]`` (padding leaves no trace: ``Δ = 0`` /
        ``g = β = 0``), appended to each slot's pages after its held entries."""
        a = layer.mask_padding({k: ctx.unpack(v) for k, v in a.items()}, ctx.valid)
        y = ctx.pack(self._all(layer, a, ctx, store))
        if ctx.prefix_rows is not None:   # prefix caching: the entries just written to the pages
            pos = ctx.pplan.new_positions()
            layer.capture(ctx, [ctx.pack(t[pos])[0] for t in store["kv"].tensors()], ctx.pplan.slot)
        return y

    def tree(self, layer, a, ctx, store) -> Tensor:
        """Each node's recurrence along its root path from the state the row's held entries
        fold into; the N node entries land in the pool at ``length .. length+N-1`` and
        :meth:`commit` moves the accepted path to the front before the paged pointer moves."""
        return layer.op(self.op(ctx.kind), store["kv"], ctx.pplan, ctx.parent, a=a)

    def gather_path(self, layer, ctx, store, accepted, path) -> None:
        """A tree's commit (table entry ``gather_path``): the accepted path's entries move to
        the front of the new ones (then the paged pointer moves)."""
        paged.gather_path(store["kv"].tensors(), ctx.pplan, path, accepted)
