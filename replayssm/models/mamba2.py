"""Mamba-2 (``Mamba2ForCausalLM``): ``backbone.{embeddings, layers.i.{norm, mixer}, norm_f}``, ``lm_head``."""

from __future__ import annotations

import torch

from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm
from .base import Block, CausalLM
from .config import Mamba2Config


def mamba2_block(c: Mamba2Config, layer_id: int) -> Block:
    """One ``backbone.layers.i``: ``h + mixer(norm(h))`` (also the MTP head's block)."""
    blk = Block()
    blk.residual_fp32 = c.residual_in_fp32
    mixer = Mamba2Mixer(c.hidden_size, c.num_heads, c.head_dim, c.state_size, c.n_groups, c.conv_kernel,
                        norm_group_size=c.norm_group_size, eps=c.layer_norm_epsilon,
                        use_bias=c.use_bias, use_conv_bias=c.use_conv_bias,
                        time_step_limit=c.time_step_limit, chunk_size=min(c.chunk_size, 64), layer_id=layer_id)
    blk.add("norm", RMSNorm(c.hidden_size, c.layer_norm_epsilon), "mixer", mixer)
    return blk


class Mamba2LM(CausalLM):
    def __init__(self, config: Mamba2Config, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        layers = [mamba2_block(c, i) for i in range(c.num_hidden_layers)]
        self._assemble("backbone", "embeddings", layers, "norm_f", RMSNorm(c.hidden_size, c.layer_norm_epsilon))

    @staticmethod
    def key_aliases() -> dict:
        return {"backbone.embeddings.weight": ["backbone.embedding.weight"]}
