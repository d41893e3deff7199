"""Shared cache plumbing of the two recurrent mixers (Mamba-2, Gated DeltaNet).

A subclass projects its input, calls :meth:`SSMLayer._conv` (causal depthwise conv through
``replayssm.cache.conv``) and :meth:`SSMLayer._ssm` (the recurrence through
``self._ops()``: :func:`replayssm.kernels.dispatch.ops_for`, i.e. the Triton kernels for CUDA
tensors and the reference ops ``replayssm.ops.<kind>.naive`` otherwise), then
gates/normalises/projects.  This class only routes
each call to the right op for the step kind and the cache form:

============  =====================  ==============================  =====================
kind          recurrent              replay                          kv (KV-only, paged)
============  =====================  ==============================  =====================
prefill       chunked from state     chunked from rebuilt state      kv_verify (T tokens)
decode        recurrent_update       replay_decode                   kv_verify (1 token)
verify        snapshot_verify        replay_verify                   kv_verify (T tokens)
tree          recurrent_step / node  tree_verify                     tree_verify, temp ring
commit        snapshot_commit        ring pointer move (+ path)      paged move (+ path)
============  =====================  ==============================  =====================

Rows in KV form and rows in replay form may share a call (``ctx.ssm_form == "mixed"``,
after :meth:`ModelCache.switch_to_state` on some slots): both forms run, each on its own
rows (the other rows point at the null slot), and ``torch.where`` picks per row.
Prefill padding is data: masked tokens get ``dt = 0`` / ``g = 0, β = 0`` (state unchanged).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .context import StepContext


def _conv_mod():
    from ..cache import conv  # written beside the ring/paged modules

    return conv


class SSMLayer(nn.Module):
    """Base of :class:`Mamba2Mixer` and :class:`GatedDeltaNet` (see module docstring)."""

    layer_id: int
    conv_dim: int
    conv_kernel: int
    activation = "silu"

    # ---- subclass hooks ---------------------------------------------------------------
    def _ops(self):
        raise NotImplementedError

    def _mask(self, a: dict, valid: Tensor) -> dict:
        """Make padded tokens leave the state unchanged."""
        raise NotImplementedError

    def _call(self, op: str, *prefix, a: dict, t0: bool = False, **kw):
        """Call ``ops.<op>(*prefix, <args of a>, ...)``; ``t0`` drops the time axis."""
        raise NotImplementedError

    def _rebuild(self, buf, plan):
        raise NotImplementedError

    def allocate(self, P: int, capacity: int, dtype, device, paged=None) -> dict:
        """Per-layer cache ``{"buf", "conv", "kv"}`` for ``P`` slots (see ModelCache)."""
        raise NotImplementedError

    def _conv_weight(self) -> tuple[Tensor, Tensor | None]:
        return self.conv1d.weight.reshape(self.conv_dim, self.conv_kernel), self.conv1d_bias()

    def conv1d_bias(self):
        return getattr(self.conv1d, "bias", None)

    # ---- conv -------------------------------------------------------------------------
    def _conv(self, xc: Tensor, ctx: StepContext) -> Tensor:
        """Causal depthwise conv + activation over ``xc [B, T, C]`` for this step kind."""
        conv = _conv_mod()
        w, b = self._conv_weight()
        if ctx.cache is None:
            return conv.conv_prefill(xc, w, b, None, self.activation)[0]
        store = ctx.cache.layers[self.layer_id]
        win = store["conv"]
        slots = ctx.slots
        if ctx.kind == "prefill":
            init = win.window[slots]                                    # [B, C, W-1]
            init = torch.where(ctx.fresh[:, None, None], torch.zeros_like(init), init)
            out, final = conv.conv_prefill(xc, w, b, init, self.activation, lengths=ctx.lengths)
            win.window[slots] = final.to(win.window.dtype)
            return out
        if ctx.kind == "decode":  # one fused launch on the GPU (kernels.conv)
            from ..kernels.dispatch import conv_decode

            return conv_decode(win, slots, xc[:, 0], w, b, self.activation)[:, None]
        if ctx.kind == "tree":
            out = conv.conv_tree(win, slots, xc, ctx.parent, w, b, self.activation)
        else:  # one fused launch on the GPU (kernels.conv)
            from ..kernels.dispatch import conv_verify

            out = conv_verify(win, slots, xc, w, b, self.activation)
        ctx.pending[(self.layer_id, "conv")] = xc  # the commit keeps the accepted inputs
        return out

    # ---- recurrence ---------------------------------------------------------------------
    def _ssm(self, a: dict, ctx: StepContext) -> Tensor:
        """Run the recurrence on time-major args ``a`` (each ``[B, T, ...]``) -> ``y [B, T, ...]``."""
        if ctx.cache is None:
            return self._call("chunked_prefill", a=a, chunk_size=self.chunk_size)[0]
        if ctx.kind == "prefill":
            a = self._mask(a, ctx.valid)
        store = ctx.cache.layers[self.layer_id]
        form = ctx.ssm_form
        y_state = y_kv = None
        if form != "kv":
            y_state = self._state_form(a, ctx, store, "recurrent" if form == "recurrent" else "replay")
        if form in ("kv", "mixed"):
            y_kv = self._kv_form(a, ctx, store)
        if form == "mixed":
            sel = ctx.kv_rows.view(-1, *([1] * (y_kv.dim() - 1)))
            return torch.where(sel, y_kv, y_state)
        return y_kv if form == "kv" else y_state

    def _state_form(self, a: dict, ctx: StepContext, store: dict, form: str) -> Tensor:
        buf, slots, kind = store["buf"], ctx.state_slots, ctx.kind
        if kind == "prefill":
            if form == "recurrent":
                init = buf.state[slots]
            else:
                init = self._rebuild(buf, ctx.plan)
            init = torch.where(ctx.fresh.view(-1, 1, 1, 1), torch.zeros_like(init), init).to(buf.state.dtype)
            y, S = self._call("chunked_prefill", a=a, initial_state=init, chunk_size=self.chunk_size)
            buf.state[slots] = S.to(buf.state.dtype)
            return y
        if kind == "decode":
            if form == "recurrent":
                y = self._call("recurrent_update", buf.state, a=a, t0=True, slot=slots)
            else:
                y = self._call("replay_decode", buf, ctx.plan, a=a, t0=True)
            return y[:, None]
        if kind == "verify":
            if form == "recurrent":
                y, snaps = self._call("snapshot_verify", buf.state, slots, a=a)
                ctx.pending[(self.layer_id, "snap")] = snaps
                return y
            return self._call("replay_verify", buf, ctx.plan, a=a)
        if kind == "tree":
            if form == "recurrent":
                return self._tree_recurrent(a, ctx, buf)
            return self._call("tree_verify", buf, ctx.plan, ctx.parent, a=a, **self._bits(ctx))
        raise ValueError(f"unknown step kind {kind!r}")

    def _tree_recurrent(self, a: dict, ctx: StepContext, buf) -> Tensor:
        """Per-node states from each node's parent (root parent: the slot's state)."""
        S0 = buf.state[ctx.state_slots]
        B, N = ctx.parent.shape
        rows = torch.arange(B, device=S0.device)
        nodes = S0.new_zeros((B, N) + tuple(S0.shape[1:]))
        ys = []
        for i in range(N):
            p = ctx.parent[:, i]
            base = S0 if i == 0 else torch.where(
                (p < 0).view(-1, 1, 1, 1), S0, nodes[rows, p.clamp(min=0)])
            ai = {k: v[:, i:i + 1] for k, v in a.items()}
            y, S = self._call("recurrent_step", base, a=ai, t0=True)
            nodes[:, i] = S.to(nodes.dtype)
            ys.append(y)
        ctx.pending[(self.layer_id, "nodes")] = nodes
        return torch.stack(ys, 1)

    @staticmethod
    def _bits(ctx: StepContext) -> dict:
        """The step's ancestor bitmasks, computed once per model call rather than per layer
        (the naive ops drop ``bits``)."""
        return {} if ctx.tree_bits is None else {"bits": ctx.tree_bits}

    def _kv_form(self, a: dict, ctx: StepContext, store: dict) -> Tensor:
        if ctx.kind == "tree":
            return self._kv_tree(a, ctx, store)
        return self._call("kv_verify", store["kv"], ctx.pplan, a=a)

    def _kv_tree(self, a: dict, ctx: StepContext, store: dict) -> Tensor:
        """Tree verify in KV-only form through the replay ``tree_verify`` op.

        KV-only is replay with ``S0 = 0`` and every entry in the buffer: copy each row's
        paged entries into a temporary ring (capacity ``max_len + N``, zero checkpoint, no
        flush), run ``tree_verify`` there, and write the N node entries to the paged pool at
        ``length .. length+N-1``; ``commit`` moves the accepted path to the front
        (``cache.paged.gather_path``) before the paged pointer moves.
        """
        from ..cache import paged
        from ..cache.ring import StepPlan

        kv, pplan, buf0 = store["kv"], ctx.pplan, store["buf"]
        B, N = ctx.parent.shape
        Lt = pplan.max_len + N
        dev = pplan.slot.device
        tmp = self._alloc_buf(B, Lt, buf0.ring_tensors()[0].dtype, buf0.state.dtype, dev)
        tmp.state.zero_()
        for rt, pool in zip(tmp.ring_tensors(), kv.tensors()):
            rt[1:, : pplan.max_len] = paged.gather_kv(pool, pplan)
        rows = torch.arange(1, B + 1, device=dev)
        zero = torch.zeros(B, dtype=torch.long, device=dev)
        plan = StepPlan(rows, zero, pplan.length, torch.zeros(B, dtype=torch.bool, device=dev), N, "tree", Lt)
        y = self._call("tree_verify", tmp, plan, ctx.parent, a=a, **self._bits(ctx))
        pos = pplan.length[:, None] + torch.arange(N, device=dev)[None, :]
        for rt, pool in zip(tmp.ring_tensors(), kv.tensors()):
            paged.write_kv_new(pool, pplan, rt[rows[:, None], pos])
        return y

    # ---- commit -------------------------------------------------------------------------
    def commit(self, ctx: StepContext, accepted: Tensor, path: Tensor | None) -> None:
        """Keep ``accepted`` tentative entries of the pending verify (per row)."""
        conv = _conv_mod()
        store = ctx.cache.layers[self.layer_id]
        xc = ctx.pending.pop((self.layer_id, "conv"))
        if ctx.kind == "tree":
            conv.conv_commit_tree(store["conv"], ctx.slots, xc, path, accepted)
        else:
            from ..kernels.dispatch import conv_commit

            conv_commit(store["conv"], ctx.slots, xc, accepted)
        buf = store["buf"]
        if (self.layer_id, "snap") in ctx.pending:
            self._ops().snapshot_commit(buf.state, ctx.state_slots, ctx.pending.pop((self.layer_id, "snap")),
                                        accepted)
        elif (self.layer_id, "nodes") in ctx.pending:
            nodes = ctx.pending.pop((self.layer_id, "nodes"))
            rows = torch.arange(nodes.shape[0], device=nodes.device)
            snaps = nodes[rows[:, None], path.long()]                   # [B, N, ...] along path
            self._ops().snapshot_commit(buf.state, ctx.state_slots, snaps, accepted)
        elif ctx.kind == "tree" and ctx.ssm_form in ("replay", "mixed"):
            from ..cache.tree import gather_path

            gather_path(buf.ring_tensors(), ctx.plan, path, accepted)
        if ctx.kind == "tree" and ctx.ssm_form in ("kv", "mixed"):
            from ..cache import paged

            paged.gather_path(store["kv"].tensors(), ctx.pplan, path, accepted)
