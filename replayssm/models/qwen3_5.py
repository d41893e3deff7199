"""Qwen3.5 (``model_type`` ``qwen3_5`` / ``qwen3_5_text`` dense, ``qwen3_5_moe`` /
``qwen3_5_moe_text`` MoE): the Qwen3-Next architecture (:mod:`replayssm.models.qwen3_next`)
with these differences, read from transformers 5.17's ``models/qwen3_5*``:

* GDN projections are separate and not interleaved per key head: ``in_proj_qkv`` rows
  ``[q (H·K) | k (H·K) | v (HV·V)]``, ``in_proj_z`` ``[HV·V]``, ``in_proj_b`` / ``in_proj_a``
  ``[HV]`` (Qwen3-Next: ``in_proj_qkvz`` / ``in_proj_ba`` packed per key head) — the layout
  our GDN computes in, so no load-time permutation.
* Dense: every layer has the SwiGLU MLP (no experts).  MoE: every layer is sparse (no
  ``decoder_sparse_step`` / ``mlp_only_layers``) and the top-k weights are always
  renormalised (no ``norm_topk_prob``); softmax router, sigmoid-gated shared expert as in
  Qwen3-Next.  ``intermediate_size`` is absent from MoE configs (unused).
* RoPE is multimodal (``mrope_section``, ``mrope_interleaved``): for text all three position
  axes carry the same position, which makes it the plain partial rotary of Qwen3-Next; the
  mrope keys are accepted and need nothing else.  Rope scalings: as Qwen3-Next
  (:func:`replayssm.models.config.rope_scaling`).
* The multimodal configs (``qwen3_5``, ``qwen3_5_moe``; ``Qwen3_5*ForConditionalGeneration``)
  nest the text model's config under ``text_config`` (``tie_word_embeddings`` and the
  token ids may sit at the top level) and its tensors under ``model.language_model.``
  (our ``model.`` parameters read those names through :meth:`Qwen3_5LM.key_aliases`); the
  vision tower (``model.visual.*``) is not ours to load.
* Unchanged: zero-centred ``x̂ (1 + w)`` RMSNorms (not the GDN output norm), gated attention
  (``q_proj`` rows ``[q | gate]`` per head, q/k norms), partial rotary (default 0.25).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layers.context import StepContext
from ..layers.gdn import GatedDeltaNet
from ..layers.mlp import Linear
from .config import ConfigError, Qwen3NextConfig
from .qwen3_next import Qwen3NextLM

__all__ = ["Qwen3_5Config", "Qwen3_5LM", "Qwen3_5GatedDeltaNet", "QWEN3_5_TYPES"]

#: model_type -> (multimodal, moe)
QWEN3_5_TYPES = {"qwen3_5": (True, False), "qwen3_5_text": (False, False),
                 "qwen3_5_moe": (True, True), "qwen3_5_moe_text": (False, True)}
#: top-level keys of a multimodal config that the text model uses when text_config lacks them
_TOP_LEVEL = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    """A Qwen3-Next config (same fields) plus ``multimodal``: the checkpoint is a
    ``*ForConditionalGeneration`` one (text tensors under ``model.language_model.``)."""

    multimodal: bool = False
    model_type: str = "qwen3_5_text"

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Qwen3_5Config":
        mt = d.get("model_type")
        if mt not in QWEN3_5_TYPES:
            raise ConfigError(f"{where}: model_type {mt!r} is not a Qwen3.5 type ({', '.join(QWEN3_5_TYPES)})")
        multimodal, moe = QWEN3_5_TYPES[mt]
        text_where = where
        if multimodal:
            td = d.get("text_config")
            if td is None:
                raise ConfigError(f"{where}: missing required key 'text_config' (model_type {mt!r} nests the "
                                  f"language model's config there)")
            if not isinstance(td, dict):
                raise ConfigError(f"{where}: 'text_config' must be a JSON object, got {type(td).__name__}")
            td = dict(td)
            for k in _TOP_LEVEL:
                if td.get(k) is None and d.get(k) is not None:
                    td[k] = d[k]
            if d.get("tie_word_embeddings") is not None:   # the top-level model ties (or not) its head
                td["tie_word_embeddings"] = d["tie_word_embeddings"]
            text_where = f"{where} (text_config)"
        else:
            td = dict(d)
        # fields Qwen3.5 does not have: routing is fixed by the variant
        for k in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            td.pop(k, None)
        if moe:
            if td.get("num_experts") is None:
                raise ConfigError(f"{text_where}: missing required key 'num_experts'")
            if td.get("num_experts") == 0:
                raise ConfigError(f"{text_where}: 'num_experts' must be a positive integer for {mt!r}, got 0")
            if td.get("intermediate_size") is None:   # every layer is MoE: the dense size is unused
                td["intermediate_size"] = td.get("moe_intermediate_size")
        else:
            td["num_experts"] = 0
        base = super().from_dict(td, text_where)
        return dataclasses.replace(base, model_type=mt, multimodal=multimodal, norm_topk_prob=True,
                                   decoder_sparse_step=1, mlp_only_layers=())


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """The Qwen3-Next GDN with Qwen3.5's four separate input projections
    (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); the rest is inherited."""

    def __init__(self, hidden: int, *args, **kw):
        super().__init__(hidden, *args, **kw)
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = Linear(hidden, self.conv_dim)
        self.in_proj_z = Linear(hidden, self.value_dim)
        self.in_proj_b = Linear(hidden, self.HV)
        self.in_proj_a = Linear(hidden, self.HV)

    def forward(self, h: Tensor, ctx: StepContext) -> Tensor:
        Bt, T, _ = h.shape
        qkv = self._conv(self.in_proj_qkv(h), ctx)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = self.gates(self.in_proj_a(h), self.in_proj_b(h))
        args = {"q": q.reshape(Bt, T, self.H, self.K), "k": k.reshape(Bt, T, self.H, self.K),
                "v": v.reshape(Bt, T, self.HV, self.V), "g": g, "beta": beta}
        y = self._ssm(args, ctx)                                        # [Bt, T, HV, V]
        y = self.norm(y.to(h.dtype), self.in_proj_z(h).reshape(Bt, T, self.HV, self.V))
        return self.out_proj(y.reshape(Bt, T, self.value_dim))


class _LanguageModelPrefix:
    """Key aliases: parameter ``model.X`` may be stored as ``model.language_model.X`` (the
    text part of a multimodal checkpoint); ``lm_head.weight`` keeps its name."""

    def get(self, name: str, default=()):
        if name.startswith("model."):
            return ["model.language_model." + name[len("model."):]]
        return list(default)


class Qwen3_5LM(Qwen3NextLM):
    def __init__(self, config: Qwen3_5Config, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        for i, (blk, kind) in enumerate(zip(self.blocks, c.layer_kinds)):
            if kind == "gdn":   # the block keeps its place in ``subs``; only the module changes
                blk.linear_attn = Qwen3_5GatedDeltaNet(
                    c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                    c.linear_value_head_dim, c.linear_conv_kernel_dim, eps=c.rms_norm_eps, layer_id=i)

    def load_transforms(self) -> dict:
        return {}   # the checkpoint's GDN rows are already in our [q | k | v] order

    @staticmethod
    def key_aliases():
        return _LanguageModelPrefix()

