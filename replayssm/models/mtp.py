"""Multi-token-prediction (MTP) heads: the drafter a checkpoint ships with its target.

One MTP step turns the target's hidden state after token ``t`` and the token ``t+1`` into a
prediction of token ``t+2``::

    u_t = fc([n_e(E x_{t+1}) ; n_h(h_t)])     fc: [D, 2D], no bias; n_e, n_h: RMSNorms
    g_t = n_out(blocks(u_t))                   blocks: full decoder layers, causal over t
    logits_t = lm_head(g_t)                    E and lm_head shared with the target

``h_t`` is the target's final-normed hidden state (the LM head's input: what vLLM and SGLang
feed their MTP drafters; ``ModelCache.keep_hidden`` keeps it).  The blocks run as a causal
sequence model over the pairs ``(h_t, x_{t+1})``, pair ``t`` at position ``t``, with a cache
of their own (attention KV; a Mamba-2 block's checkpoint state and ring).  Drafting more
than one token feeds ``g`` back as the next step's hidden state (``u = fc([n_e(E d) ;
n_h(g)])``), as vLLM and SGLang do.

Parameter names are the checkpoint's (the head is the target's submodule ``mtp``):

* ``qwen3_next`` (the layout vLLM's ``Qwen3NextMTP`` and SGLang load): ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` (zero-centred
  RMSNorms) and ``mtp.layers.0.*``, a full-attention decoder layer whose MoE / MLP follows the
  target's rule for layer 0.  One layer (``num_nextn_predict_layers`` or
  ``mtp_num_hidden_layers``; absent: counted from the checkpoint's ``mtp.layers.N``).
* ``nemotron_h`` (vLLM's ``NemotronHMTP``): one step of ``mtp_layers_block_type`` (or
  ``mtp_hybrid_override_pattern``, e.g. ``"*E"``) layers ``mtp.layers.i.{norm, mixer}``;
  layer 0 also holds ``enorm``, ``hnorm`` and ``eh_proj`` (the fc), the last layer
  ``final_layernorm``.  Plain RMSNorms.  transformers 5.17 defines the config keys but no
  modules.
* ``mamba2`` (ours; no public Mamba-2 checkpoint has an MTP head): ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` (plain RMSNorms,
  ``layer_norm_epsilon``) and ``num_nextn_predict_layers`` Mamba-2 blocks ``mtp.layers.i.{norm,
  mixer}`` shaped like the target's, applied in sequence.

Every call returns ``g`` (``[B, T, D]``), not logits: a drafter feeds ``g`` back and projects
only the rows it samples from (:meth:`MTPHead.logits`).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from ..layers.mlp import Linear
from ..layers.norms import RMSNorm
from .base import CausalLM
from .cache import ModelCache
from .config import WeightError
from .mamba2 import mamba2_block
from .nemotron_h import nemotron_h_block
from .qwen3_next import qwen3_next_block

_LAYER_KEY = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_num_layers(config, keys) -> int:
    """MTP layers of a checkpoint: the config's count, else the checkpoint's ``mtp.layers.N``
    (``keys``: its tensor names), else 1 (so that loading names the missing tensors)."""
    n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if n:
        return n
    found = {int(m.group(1)) for k in keys for m in [_LAYER_KEY.match(k)] if m}
    return max(found) + 1 if found else 1


class MTPHead(CausalLM):
    """The MTP head of ``target`` (see the module docstring); a :class:`CausalLM` whose every
    cached call also takes the hidden-state stream ``hidden [B, T, D]`` (``[B, D]`` for
    :meth:`decode`) and returns ``g`` instead of logits."""

    def __init__(self, target: CausalLM, num_layers: int = 1):
        super().__init__(target.config, target.dtype, target.device)
        self.__dict__["target"] = target  # shared embedding and head; not a submodule (no duplicate names)
        c = target.config
        D, n, L0 = c.hidden_size, int(num_layers), c.num_hidden_layers
        if n < 1:
            raise ValueError(f"an MTP head needs at least one layer, got {n}")
        mt = c.model_type
        if mt == "qwen3_next" or mt.startswith("qwen3_5"):   # Qwen3.5 (dense, MoE): Qwen3-Next's layout
            if n != 1:
                raise ValueError(f"{mt}: MTP heads of {n} layers are not supported (one layer per step, as "
                                 f"vLLM runs them, is; the public checkpoints have one)")
            eps = c.rms_norm_eps
            self.fc = Linear(2 * D, D)
            self.pre_fc_norm_embedding = RMSNorm(D, eps, zero_centered=True)
            self.pre_fc_norm_hidden = RMSNorm(D, eps, zero_centered=True)
            layers = [qwen3_next_block(c, "attention", L0, target.rotary, c.is_moe_layer(0))]
            self.layers = nn.ModuleList(layers)
            self.norm = RMSNorm(D, eps, zero_centered=True)
            parts = (self.fc, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm)
        elif mt == "nemotron_h":
            kinds = c.mtp_layer_kinds
            if not kinds or c.num_nextn_predict_layers != 1:
                raise WeightError(
                    "nemotron_h: config.json declares no MTP step (num_nextn_predict_layers must be 1 with "
                    "mtp_layers_block_type or mtp_hybrid_override_pattern, e.g. '*E'), so the checkpoint has "
                    "no mtp.layers.0.{enorm,hnorm,eh_proj} tensors; speculative method 'mtp' needs an MTP head"
                    if not kinds else
                    f"nemotron_h: {c.num_nextn_predict_layers} MTP steps; one is supported (as in vLLM)")
            eps = c.layer_norm_epsilon
            layers = [nemotron_h_block(c, kind, L0 + i) for i, kind in enumerate(kinds)]
            first, last = layers[0], layers[-1]
            first.enorm, first.hnorm = RMSNorm(D, eps), RMSNorm(D, eps)
            first.eh_proj = Linear(2 * D, D)
            last.final_layernorm = RMSNorm(D, eps)
            self.layers = nn.ModuleList(layers)
            parts = (first.eh_proj, first.enorm, first.hnorm, last.final_layernorm)
        elif mt == "mamba2":
            eps = c.layer_norm_epsilon
            self.fc = Linear(2 * D, D)
            self.pre_fc_norm_embedding = RMSNorm(D, eps)
            self.pre_fc_norm_hidden = RMSNorm(D, eps)
            self.layers = nn.ModuleList([mamba2_block(c, L0 + i) for i in range(n)])
            self.norm = RMSNorm(D, eps)
            parts = (self.fc, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm)
        else:
            raise ValueError(f"no MTP layout for model_type {mt!r}")
        self._parts = parts            # (fc, n_e, n_h, n_out): a tuple, so not registered twice
        self.blocks = list(self.layers)
        self._hidden_in: Tensor | None = None

    # ---- shared with the target ---------------------------------------------------------------
    def embed_weight(self) -> Tensor:
        return self.target.embed_weight()

    def head_weight(self) -> Tensor:
        return self.target.head_weight()

    def final_norm(self) -> nn.Module:
        return self._parts[3]

    def logits(self, g: Tensor) -> Tensor:
        """The shared LM head on MTP outputs ``g [..., D]`` -> ``[..., V]`` (the target's own
        ``_logits``: under tensor parallelism a vocabulary shard, gathered to all of ``V``)."""
        return self.target._logits(g)

    # ---- the MTP step -------------------------------------------------------------------------
    def _embed(self, input_ids: Tensor) -> Tensor:
        fc, n_e, n_h, _ = self._parts
        e = n_e(self.target._embed(input_ids))      # the target's embedding (a vocabulary shard under TP)
        h = n_h(self._hidden_in.to(e.dtype))
        return fc(torch.cat([e, h], -1))

    def _trunk(self, input_ids: Tensor, ctx) -> Tensor:
        if ctx.packed and self._hidden_in is not None:   # a packed prefill: pack the hidden stream alike
            self._hidden_in = ctx.pack(self._hidden_in)
        return super()._trunk(input_ids, ctx)

    def _logits(self, hn: Tensor) -> Tensor:
        return hn          # calls return g; logits() projects the rows a drafter needs

    def _with(self, hidden: Tensor, ids: Tensor, fn, *args):
        """Run ``fn(*args)`` with ``hidden`` as the hidden-state stream of ``ids``."""
        want = tuple(ids.shape) + (self.config.hidden_size,)
        if not isinstance(hidden, Tensor) or tuple(hidden.shape) != want or hidden.device != self.device:
            got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise ValueError(f"MTP hidden states must have shape {list(want)} on {self.device}, got {got}")
        self._hidden_in = hidden if ids.dim() == 2 else hidden[:, None]
        try:
            return fn(*args)
        finally:
            self._hidden_in = None

    @torch.no_grad()
    def forward(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        """No cache: tokens ``x_{t+1}`` ``[B, T]`` and hidden states ``h_t`` ``[B, T, D]`` ->
        ``g [B, T, D]``."""
        return self._with(hidden, input_ids, super().forward, input_ids)

    def prefill(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, lengths: Tensor,
                hidden: Tensor) -> Tensor:
        return self._with(hidden, input_ids, super().prefill, cache, slots, input_ids, lengths)

    def decode(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, hidden: Tensor) -> Tensor:
        return self._with(hidden, input_ids, super().decode, cache, slots, input_ids)

    def verify(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, hidden: Tensor) -> Tensor:
        return self._with(hidden, input_ids, super().verify, cache, slots, input_ids)

    def verify_tree(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, parent: Tensor,
                    hidden: Tensor) -> Tensor:
        return self._with(hidden, input_ids, super().verify_tree, cache, slots, input_ids, parent)


def attach_mtp(model: CausalLM, keys) -> MTPHead:
    """Build ``model.mtp`` (parameters unset, on the current default device) for a checkpoint
    whose tensor names are ``keys``; the loader then fills it like any other submodule."""
    head = MTPHead(model, mtp_num_layers(model.config, keys))
    model.mtp = head
    return head
