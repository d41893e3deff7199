"""Nemotron-H (``NemotronHForCausalLM``): ``backbone.{embeddings, layers.i.{norm, mixer}, norm_f}``,
``lm_head``; each layer's mixer is Mamba-2 (``M``), attention (``*``, no RoPE), a relu² MLP
(``-``) or a sigmoid-routed MoE (``E``)."""

from __future__ import annotations

import math

import torch

from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mlp import PlainMLP, SigmoidMoE
from ..layers.norms import RMSNorm
from .base import Block, CausalLM
from .config import NemotronHConfig


def nemotron_h_block(c: NemotronHConfig, kind: str, layer_id: int) -> Block:
    """One ``backbone.layers.i`` of ``kind`` (mamba | attention | mlp | moe): ``h + mixer(norm(h))``
    (also the MTP head's layers)."""
    if kind == "mamba":
        m = Mamba2Mixer(c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups,
                        c.conv_kernel, norm_group_size=c.mamba_intermediate // c.n_groups,
                        eps=c.layer_norm_epsilon, use_bias=c.use_bias, use_conv_bias=c.use_conv_bias,
                        time_step_limit=(c.time_step_min, math.inf), chunk_size=min(c.chunk_size, 64),
                        layer_id=layer_id)
    elif kind == "attention":
        m = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                      bias=False, layer_id=layer_id)
    elif kind == "mlp":
        m = PlainMLP(c.hidden_size, c.intermediate_size, c.mlp_hidden_act, c.mlp_bias)
    else:
        m = SigmoidMoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                       c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                       c.moe_shared_expert_intermediate_size, c.moe_latent_size, c.mlp_hidden_act,
                       c.mlp_bias)
    blk = Block()
    blk.add("norm", RMSNorm(c.hidden_size, c.layer_norm_epsilon), "mixer", m)
    return blk


class NemotronHLM(CausalLM):
    def __init__(self, config: NemotronHConfig, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        layers = [nemotron_h_block(c, kind, i) for i, kind in enumerate(c.layer_kinds)]
        self._assemble("backbone", "embeddings", layers, "norm_f", RMSNorm(c.hidden_size, c.layer_norm_epsilon))

    @staticmethod
    def key_aliases() -> dict:
        return {"backbone.embeddings.weight": ["backbone.embedding.weight", "model.embeddings.weight"]}
