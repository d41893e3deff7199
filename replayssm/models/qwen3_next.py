"""Qwen3-Next (``Qwen3NextForCausalLM``): ``model.{embed_tokens, layers.i.{input_layernorm,
linear_attn | self_attn, post_attention_layernorm, mlp}, norm}``, ``lm_head``."""

from __future__ import annotations

import functools

import torch

from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet, reorder_ba, reorder_qkvz
from ..layers.mlp import GatedMLP, SoftmaxMoE
from ..layers.norms import RMSNorm
from ..layers.rotary import Rotary
from .base import Block, CausalLM
from .config import Qwen3NextConfig


def qwen3_next_block(c: Qwen3NextConfig, kind: str, layer_id: int, rot: Rotary, moe: bool) -> Block:
    """One ``model.layers.i``: ``h + mixer(N1(h))`` (GDN ``linear_attn`` or gated ``self_attn``),
    then ``h + ffn(N2(h))`` (sparse MoE or dense MLP); also the MTP head's layer."""
    blk = Block()
    if kind == "gdn":
        m = GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
                          eps=c.rms_norm_eps, layer_id=layer_id)
        name = "linear_attn"
    else:
        m = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                      bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps, output_gate=True,
                      rotary=rot, layer_id=layer_id)
        name = "self_attn"
    blk.add("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centered=True), name, m)
    if moe:
        f = SoftmaxMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                       c.norm_topk_prob, c.shared_expert_intermediate_size, c.hidden_act)
    else:
        f = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
    blk.add("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centered=True),
            "mlp", f)
    return blk


class Qwen3NextLM(CausalLM):
    def __init__(self, config: Qwen3NextConfig, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        self.rotary = rot = Rotary(c.head_dim, c.rotary_dim, c.rope_theta, c.rope_scaling_dict)
        layers = [qwen3_next_block(c, kind, i, rot, c.is_moe_layer(i)) for i, kind in enumerate(c.layer_kinds)]
        self._assemble("model", "embed_tokens", layers, "norm",
                       RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centered=True))

    def load_transforms(self) -> dict:
        c = self.config
        H, HV, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        out = {}
        for i, kind in enumerate(c.layer_kinds):
            if kind == "gdn":
                p = f"model.layers.{i}.linear_attn."
                out[p + "in_proj_qkvz.weight"] = functools.partial(reorder_qkvz, H=H, HV=HV, K=K, V=V)
                out[p + "in_proj_ba.weight"] = functools.partial(reorder_ba, H=H, HV=HV)
        return out

    @staticmethod
    def key_aliases() -> dict:
        return {}
