"""Shared cache plumbing of the two recurrent mixers (Mamba-2, Gated DeltaNet).

A subclass projects its input, calls :meth:`SSMLayer._conv` (the short causal conv through
``ops_for("conv")``) and :meth:`SSMLayer._ssm` (the recurrence), then gates / normalises /
projects.  The recurrence of a cached call is the job of the step's decode form
(:mod:`replayssm.forms`: ``ctx.ssm_form`` names it): the form picks the op for the step kind
and owns the form's cache tensors; this class is the :class:`~replayssm.forms.base.FormLayer`
the forms call back into (the family's ops, argument layout, state rebuild and allocation).

Prefill padding is data: masked tokens get ``dt = 0`` / ``g = 0, β = 0`` (state unchanged).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cache.conv import ConvWindow
from ..forms import CACHE_FORMS, get_form
from ..kernels.dispatch import ops_for
from .context import StepContext


class SSMLayer(nn.Module):
    """Base of :class:`Mamba2Mixer` and :class:`GatedDeltaNet` (see module docstring)."""

    family: str          # "mamba2" | "gdn": the op family (``kernels.dispatch.ops_for``)
    layer_id: int
    conv_dim: int
    conv_kernel: int
    chunk_size: int
    activation = "silu"

    # ---- family hooks (FormLayer) -------------------------------------------------------
    def ops(self):
        """The family's ops: Triton kernels for CUDA tensors, the reference otherwise."""
        return ops_for(self.family)

    def op(self, name: str, *prefix, a: dict, t0: bool = False, packed: bool = False, **kw):
        """Call ``ops().<name>(*prefix, <the family's arguments from a>, **kw)``; ``t0``
        drops the time axis, ``packed`` the batch axis of a packed ``[1, Nt, ...]`` stream."""
        raise NotImplementedError

    @staticmethod
    def _args(a: dict, names: tuple, t0: bool, packed: bool) -> list:
        return [a[n][:, 0] if t0 else a[n][0] if packed else a[n] for n in names]

    def mask_padding(self, a: dict, valid: Tensor) -> dict:
        """Make padded tokens leave the state unchanged."""
        raise NotImplementedError

    def rebuild_state(self, buf, plan) -> Tensor:
        raise NotImplementedError

    def alloc_ring(self, num_slots: int, capacity: int, dtype, device):
        raise NotImplementedError

    def alloc_pages(self, num_blocks: int, block_size: int, dtype, device):
        raise NotImplementedError

    def kv_to_state(self, store: dict, pplan, slots: Tensor) -> None:
        raise NotImplementedError

    def allocate(self, P: int, capacity: int, dtype, device, paged=None, mode: str = "replay") -> dict:
        """Per-layer cache for ``P`` slots (null slot included): the conv window plus what the
        forms of cache ``mode`` allocate (``{"conv", "buf", "kv"?}``; see ModelCache)."""
        store = {"conv": ConvWindow.allocate(P - 1, self.conv_dim, self.conv_kernel, dtype=dtype, device=device)}
        for name in CACHE_FORMS[mode]:
            store.update(get_form(name).allocate(self, P, capacity, dtype, device, paged))
        return store

    def _conv_weight(self) -> tuple[Tensor, Tensor | None]:
        return self.conv1d.weight.reshape(self.conv_dim, self.conv_kernel), self.conv1d_bias()

    def conv1d_bias(self):
        return getattr(self.conv1d, "bias", None)

    # ---- conv -------------------------------------------------------------------------
    def _conv(self, xc: Tensor, ctx: StepContext) -> Tensor:
        """Causal depthwise conv + activation over ``xc [B, T, C]`` for this step kind."""
        conv = ops_for("conv")
        w, b = self._conv_weight()
        if ctx.cache is None:
            return conv.conv_prefill(xc, w, b, None, self.activation)[0]
        win = ctx.cache.layers[self.layer_id]["conv"]
        slots = ctx.slots
        if ctx.kind == "prefill":   # packed rows, each after its window (zeros when fresh)
            return conv.conv_prefill_varlen(xc[0], w, b, ctx.cu_seqlens, win, slots, ctx.fresh, self.activation)[None]
        if ctx.kind == "decode":  # one fused launch on the GPU
            return conv.conv_decode(win, slots, xc[:, 0], w, b, self.activation)[:, None]
        if ctx.kind == "tree":
            out = conv.conv_tree(win, slots, xc, ctx.parent, w, b, self.activation)
        else:  # one fused launch on the GPU
            out = conv.conv_verify(win, slots, xc, w, b, self.activation)
        ctx.pending[(self.layer_id, "conv")] = xc  # the commit keeps the accepted inputs
        return out

    # ---- recurrence ---------------------------------------------------------------------
    def _ssm(self, a: dict, ctx: StepContext) -> Tensor:
        """Run the recurrence on time-major args ``a`` (each ``[B, T, ...]``) -> ``y [B, T, ...]``."""
        if ctx.cache is None:
            return self.op("chunked_prefill", a=a, chunk_size=self.chunk_size)[0]
        return get_form(ctx.ssm_form).run(self, a, ctx, ctx.cache.layers[self.layer_id])

    # ---- commit -------------------------------------------------------------------------
    def commit(self, ctx: StepContext, accepted: Tensor, path: Tensor | None) -> None:
        """Keep ``accepted`` tentative entries of the pending verify (per row)."""
        conv = ops_for("conv")
        store = ctx.cache.layers[self.layer_id]
        xc = ctx.pending.pop((self.layer_id, "conv"))
        if ctx.kind == "tree":
            conv.conv_commit_tree(store["conv"], ctx.slots, xc, path, accepted)
        else:
            conv.conv_commit(store["conv"], ctx.slots, xc, accepted)
        get_form(ctx.ssm_form).commit(self, ctx, store, accepted, path)
