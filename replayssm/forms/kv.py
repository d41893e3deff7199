"""KV-only form (KVBuffer): no state at all; every input since the sequence start lives in
paged blocks (``S_0 = 0``), so a step attends over the whole short context.

Cheaper than any state form while the context is shorter than about ``n`` (or ``d``)
tokens; the engine then compresses the entries into a state (one flush,
``ModelCache.switch_to_state``) and the slot continues in the replay form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import paged
from ..cache.ring import StepPlan
from .base import DecodeForm, FormLayer
from .replay import tree_bits


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

    def allocate(self, layer: FormLayer, num_slots: int, capacity: int, dtype, device, pages=None) -> dict:
        if pages is None:
            raise ValueError("the KV-only form needs a paged pool: pages=(num_blocks, block_size)")
        return {"kv": layer.alloc_pages(pages[0], pages[1], dtype, device)}

    def _all(self, layer, a, ctx, store) -> Tensor:
        return layer.op("kv_verify", store["kv"], ctx.pplan, a=a)

    prefill = decode = verify = _all

    def tree(self, layer, a, ctx, store) -> Tensor:
        """Tree verify as replay with ``S0 = 0`` and every entry in the ring.

        Each row's paged entries are copied into a temporary ring (capacity ``max_len + N``,
        zero checkpoint, no flush), ``tree_verify`` runs there, and the N node entries are
        written to the paged pool at ``length .. length+N-1``; :meth:`commit` moves the
        accepted path to the front before the paged pointer moves.
        """
        kv, pplan, buf0 = store["kv"], ctx.pplan, store["buf"]
        B, N = ctx.parent.shape
        Lt = pplan.max_len + N
        dev = pplan.slot.device
        tmp = layer.alloc_ring(B, Lt, buf0.ring_tensors()[0].dtype, dev)
        tmp.state.zero_()
        for rt, pool in zip(tmp.ring_tensors(), kv.tensors()):
            rt[1:, : pplan.max_len] = paged.gather_kv(pool, pplan)
        rows = torch.arange(1, B + 1, device=dev)
        zero = torch.zeros(B, dtype=torch.long, device=dev)
        plan = StepPlan(rows, zero, pplan.length, torch.zeros(B, dtype=torch.bool, device=dev), N, "tree", Lt)
        y = layer.op("tree_verify", tmp, plan, ctx.parent, a=a, **tree_bits(ctx))
        pos = pplan.length[:, None] + torch.arange(N, device=dev)[None, :]
        for rt, pool in zip(tmp.ring_tensors(), kv.tensors()):
            paged.write_kv_new(pool, pplan, rt[rows[:, None], pos])
        return y

    def commit(self, layer, ctx, store, accepted, path) -> None:
        if ctx.kind == "tree":
            paged.gather_path(store["kv"].tensors(), ctx.pplan, path, accepted)
