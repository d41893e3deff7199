"""Recurrent form (the baseline vLLM/SGLang run): one state per slot, read and written every
token; speculation stores one state per draft (the *snapshot* baseline) until commit.

``S_t = a_t S_{t-1} + (update of token t)``; verify runs the recurrence over the T drafts
keeping every intermediate state, commit copies the state after the last accepted draft.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import DecodeForm, FormLayer
from .table import KINDS


class RecurrentForm(DecodeForm):
    name = "recurrent"

    def allocate(self, layer: FormLayer, num_slots: int, capacity: int, dtype, device, pages=None,
                 state_dtype=None) -> dict:
        # the state pool; its 1-entry ring is never read (one buffer type for every form)
        return {"buf": layer.alloc_ring(num_slots - 1, 1, dtype, device, state_dtype)}

    def prefill(self, layer, a, ctx, store) -> Tensor:
        """Packed chunked scan from each slot's state (zeros when fresh), final state written
        back in place (the pool form of ``chunked_prefill_varlen``)."""
        kw = layer.entry_kwargs() if ctx.prefix_rows is not None else {}
        out = layer.op(self.op(ctx.kind), a=a, packed=True, cu_seqlens=ctx.cu_seqlens,
                       state_pool=store["buf"].state, slots=ctx.state_slots, fresh=ctx.fresh,
                       chunk_size=layer.chunk_size, **kw)
        if ctx.prefix_rows is not None:   # prefix caching: every token's ring entry
            layer.capture(ctx, layer.prefill_entries(a, out), ctx.state_slots)
        return out[0][None]

    def decode(self, layer, a, ctx, store) -> Tensor:
        return layer.op(self.op(ctx.kind), store["buf"].state, a=a, t0=True, slot=ctx.state_slots)[:, None]

    def verify(self, layer, a, ctx, store) -> Tensor:
        y, snaps = layer.op(self.op(ctx.kind), store["buf"].state, ctx.state_slots, a=a)
        ctx.pending[(layer.layer_id, self.step(ctx.kind).pending)] = snaps
        return y

    def tree(self, layer, a, ctx, store) -> Tensor:
        """Per-node states from each node's parent (a root's parent: the slot's state)."""
        S0 = store["buf"].state[ctx.state_slots]
        B, N = ctx.parent.shape
        rows = torch.arange(B, device=S0.device)
        nodes = S0.new_zeros((B, N) + tuple(S0.shape[1:]))
        ys = []
        for i in range(N):
            p = ctx.parent[:, i]
            base = S0 if i == 0 else torch.where(
                (p < 0).view(-1, 1, 1, 1), S0, nodes[rows, p.clamp(min=0)])
            ai = {k: v[:, i:i + 1] for k, v in a.items()}
            y, S = layer.op(self.op(ctx.kind), base, a=ai, t0=True)
            nodes[:, i] = S.to(nodes.dtype)
            ys.append(y)
        ctx.pending[(layer.layer_id, self.step(ctx.kind).pending)] = nodes
        return torch.stack(ys, 1)

    def snapshot_commit(self, layer, ctx, store, accepted, path) -> None:
        """The commit (table entry ``snapshot_commit``): the state after the last accepted
        draft, from the kept snapshots (a tree's: the node states along the accepted path)."""
        snaps = ctx.pending.pop((layer.layer_id, self.step(ctx.kind).pending))
        if KINDS[ctx.kind].tree:
            rows = torch.arange(snaps.shape[0], device=snaps.device)
            snaps = snaps[rows[:, None], path.long()]                   # [B, N, ...] along the path
        layer.ops().snapshot_commit(store["buf"].state, ctx.state_slots, snaps, accepted)
