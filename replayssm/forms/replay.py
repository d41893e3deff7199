"""Replay form (ReplaySSM): a checkpoint state plus a ring of the last ``h`` layer inputs.

Outputs read the checkpoint and the ring; the state is written only when the ring flushes
(``h + 1 == L`` on decode, ``h + 2T > L`` on a speculative step, committed entries only);
rollback of rejected drafts is the ring pointer not moving.  A tree commit first gathers the
accepted root-to-leaf path to the front of the new entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.tree import gather_path as gather_ring_path
from ..runtime import compute_dtype
from .base import DecodeForm, FormLayer


def tree_bits(ctx) -> dict:
    """The step's ancestor bitmasks (computed once per model call; the reference ops drop them)."""
    return {} if ctx.tree_bits is None else {"bits": ctx.tree_bits}


class ReplayForm(DecodeForm):
    name = "replay"
    uses_ring = True

    def allocate(self, layer: FormLayer, num_slots: int, capacity: int, dtype, device, pages=None,
                 state_dtype=None) -> dict:
        return {"buf": layer.alloc_ring(num_slots - 1, capacity, dtype, device, state_dtype)}

    def prefill(self, layer, a, ctx, store) -> Tensor:
        """Packed chunked scan from each slot's state rebuilt from checkpoint and ring (zeros
        when fresh); the final state becomes the checkpoint (the model empties the ring)."""
        buf = store["buf"]
        init = layer.rebuild_state(buf, ctx.plan)
        # S_h stays in the compute dtype (a bf16/fp16 checkpoint is rounded once, below)
        init = torch.where(ctx.fresh.view(-1, 1, 1, 1), torch.zeros_like(init), init).to(compute_dtype(buf.state.dtype))
        kw = layer.entry_kwargs() if ctx.prefix_rows is not None else {}
        out = layer.op(self.op(ctx.kind), a=a, packed=True, cu_seqlens=ctx.cu_seqlens, initial_state=init,
                       chunk_size=layer.chunk_size, **kw)
        buf.state[ctx.state_slots] = out[1].to(buf.state.dtype)
        if ctx.prefix_rows is not None:   # prefix caching: every token's ring entry
            layer.capture(ctx, layer.prefill_entries(a, out), ctx.state_slots)
        return out[0][None]

    def decode(self, layer, a, ctx, store) -> Tensor:
        return layer.op(self.op(ctx.kind), store["buf"], ctx.plan, a=a, t0=True)[:, None]

    def verify(self, layer, a, ctx, store) -> Tensor:
        return layer.op(self.op(ctx.kind), store["buf"], ctx.plan, a=a)

    def tree(self, layer, a, ctx, store) -> Tensor:
        return layer.op(self.op(ctx.kind), store["buf"], ctx.plan, ctx.parent, a=a, **tree_bits(ctx))

    def gather_path(self, layer, ctx, store, accepted, path) -> None:
        """A tree's commit (table entry ``gather_path``): the accepted root-to-leaf path's ring
        entries move to the front of the new entries (then the ring pointer moves)."""
        gather_ring_path(store["buf"].ring_tensors(), ctx.plan, path, accepted)
