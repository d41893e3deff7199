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
from ..cache.prefix import PrefixPools
from ..forms import CACHE_FORMS, get_form
from ..kernels.dispatch import ops_for
from ..runtime import compute_dtype
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

    def alloc_ring(self, num_slots: int, capacity: int, dtype, device, state_dtype=None):
        raise NotImplementedError

    def alloc_pages(self, num_blocks: int, block_size: int, dtype, device):
        raise NotImplementedError

    def kv_to_state(self, store: dict, pplan, slots: Tensor) -> None:
        raise NotImplementedError

    # ---- prefix caching hooks (the model cache's prefix store, replayssm.models.prefix) ---
    def state_shape(self) -> tuple[int, ...]:
        """Shape of one sequence's state (Mamba-2 ``(H, d, n)``, GDN ``(HV, K, V)``)."""
        raise NotImplementedError

    def fold(self, entries, pplan, initial_state: Tensor | None) -> Tensor:
        """The state ``initial_state`` becomes after the paged ``entries`` of ``pplan``'s rows
        (``ops.kv_fold``; layers whose store keeps whole entries): ``[Bt, *state]``."""
        raise NotImplementedError

    def fold_stored(self, pools: PrefixPools, pplan, start: Tensor, initial_state: Tensor | None) -> Tensor:
        """:meth:`fold` for a layer whose store keeps only part of each entry
        (``stores_entries`` False): positions ``start_b ..`` (``pplan.length`` of them) of
        each row's chain, ``pplan``'s block table from position 0; ``[Bt, *state]``."""
        raise NotImplementedError

    def prefill_entries(self, a: dict, out: tuple) -> list[Tensor]:
        """Every token's ring entry ``[Nt, ...]`` (the paged pools' order) of a packed prefill
        from its inputs ``a`` and the ``chunked_prefill_varlen`` result ``out``."""
        raise NotImplementedError

    def entry_kwargs(self) -> dict:
        """Extra ``chunked_prefill_varlen`` arguments :meth:`prefill_entries` needs."""
        return {}

    #: whether the prefix store keeps whole ring entries (else :meth:`prefix_entries` rebuilds
    #: them from the conv inputs, and folds read a rebuilt copy)
    stores_entries = True

    def alloc_prefix(self, num_blocks: int, block_size: int, num_checkpoints: int, dtype, device,
                     state_dtype=None) -> PrefixPools:
        """This layer's part of the prefix store: entries (or their stored part) and pre-conv
        inputs of ``num_blocks`` blocks, ``num_checkpoints`` checkpoint states (in
        ``state_dtype``, the slots' checkpoint dtype; default the compute dtype)."""
        state = torch.zeros((num_checkpoints,) + tuple(self.state_shape()), dtype=state_dtype or compute_dtype(dtype),
                            device=device)
        window = torch.zeros(num_checkpoints, self.conv_dim, self.conv_kernel - 1, dtype=dtype, device=device)
        return PrefixPools(self.alloc_prefix_entries(num_blocks, block_size, dtype, device),
                           torch.zeros(num_blocks * block_size, self.conv_dim, dtype=dtype, device=device), state,
                           window)

    def alloc_prefix_entries(self, num_blocks: int, block_size: int, dtype, device):
        """The stored part of the entries (default: whole entries, the KV-only layout)."""
        return self.alloc_pages(num_blocks, block_size, dtype, device)

    def stored_entries(self, entries: list[Tensor]) -> list[Tensor]:
        """The part of ring entries the prefix store keeps (default: all of them)."""
        return entries

    def prefix_entries(self, pools: PrefixPools, rows: Tensor, valid: Tensor) -> list[Tensor]:
        """Whole ring entries (the :meth:`alloc_pages` layout, ``[R, ...]`` each) of ``R``
        cached positions; ``rows [R, W]`` / ``valid [R, W]``: the store rows of the ``W``
        tokens ending at each position and which exist (``PrefixTable.window_rows``)."""
        return [t[rows[:, -1]] for t in pools.entries.tensors()]

    def capture(self, ctx: StepContext, entries: list[Tensor], form_slots: Tensor) -> None:
        """Store a packed prefill's ring entries (``[Nt, ...]`` each; their stored part) in
        the prefix store at the rows the capture table gives (``ctx.prefix_rows``); tokens of
        rows this form does not run (``form_slots`` 0) go to the null block."""
        if ctx.prefix_rows is None:
            return
        pools = ctx.cache.layers[self.layer_id]["prefix"]
        rows = ctx.prefix_rows
        rows = torch.where(form_slots[ctx.token_rows] != 0, rows, torch.zeros_like(rows))
        for t, v in zip(pools.entries.tensors(), self.stored_entries(entries)):
            t[rows] = v.to(t.dtype)

    def _conv_rows(self, pre: Tensor, valid: Tensor | None = None) -> Tensor:
        """``silu(conv)`` output at the last of ``W`` conv inputs ``pre [R, W, C]`` (``valid
        [R, W]``: False reads as zero) -> ``[R, C]`` (the prefill's arithmetic, bit for bit:
        :func:`ops.conv.conv_window_out`)."""
        w, b = self._conv_weight()
        return ops_for("conv").conv_window_out(pre, w, b, self.activation, valid)

    def allocate(self, P: int, capacity: int, dtype, device, paged=None, mode: str = "replay",
                 state_dtype=None) -> dict:
        """Per-layer cache for ``P`` slots (null slot included): the conv window plus what the
        forms of cache ``mode`` allocate (``{"conv", "buf", "kv"?}``; see ModelCache);
        checkpoint states in ``state_dtype`` (default: the compute dtype of ``dtype``)."""
        store = {"conv": ConvWindow.allocate(P - 1, self.conv_dim, self.conv_kernel, dtype=dtype, device=device)}
        for name in CACHE_FORMS[mode]:
            store.update(get_form(name).allocate(self, P, capacity, dtype, device, paged, state_dtype=state_dtype))
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
            if ctx.prefix_rows is not None:   # prefix caching: every token's conv input
                pre = ctx.cache.layers[self.layer_id]["prefix"].preconv
                pre[ctx.prefix_rows] = xc[0].to(pre.dtype)
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
