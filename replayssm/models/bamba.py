"""Bamba (``BambaForCausalLM``, ``model_type`` ``bamba``): ``model.{embed_tokens,
layers.i.{input_layernorm, mamba | self_attn, pre_ff_layernorm, feed_forward}, final_layernorm}``,
``lm_head``.

Per layer ``h = h + mixer(N1(h))`` then ``h = h + mlp(N2(h))``; the mixer is Mamba-2, or GQA
attention at the indices ``attn_layer_indices`` with RoPE on the first half of each head
(transformers fixes ``partial_rotary_factor`` at 0.5 for Bamba); the MLP is SwiGLU
``down(silu(gate(x)) · up(x))`` (``mlp_bias``).  No multipliers.  The Mamba-2 gated norm
normalises groups of ``intermediate // n_groups`` channels (mamba_ssm; transformers' torch path
normalises the whole vector — the same for ``mamba_n_groups == 1``, as Bamba-9B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..layers.mlp import GatedMLP
from ..layers.norms import RMSNorm
from ..layers.rotary import Rotary
from .base import Block, CausalLM
from .config import _Reader, _count, _eos, _opt_pos_int, _pos_float, _pos_int
from .granite_hybrid import hybrid_mixer, read_attention, read_mamba, read_rope


@dataclass(frozen=True)
class BambaConfig:
    """``BambaForCausalLM`` (see the module docstring)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    attn_layer_indices: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int = 1
    mamba_expand: int = 2
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = 2
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "bamba"

    @property
    def layer_kinds(self) -> list[str]:
        return ["attention" if i in self.attn_layer_indices else "mamba" for i in range(self.num_hidden_layers)]

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "BambaConfig":
        r = _Reader(d, where)
        L = _count(r, "num_hidden_layers", r.req("num_hidden_layers"))
        idx = r.opt("attn_layer_indices", [])
        if not isinstance(idx, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idx):
            r.fail(f"'attn_layer_indices' must be a list of layer indices, got {idx!r}")
        bad = [i for i in idx if not 0 <= i < L]
        if bad:
            r.fail(f"'attn_layer_indices' {bad} outside the layers [0, {L}) (num_hidden_layers = {L})")
        need_attn, need_mamba = bool(idx), len(set(idx)) < L
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        D = _pos_int(r, "hidden_size", r.req("hidden_size"))
        theta, prf = read_rope(r, d, default_partial=0.5)
        c = cls(
            vocab_size=V, hidden_size=D, num_hidden_layers=L, attn_layer_indices=tuple(sorted(set(idx))),
            **read_attention(r, D, need_attn),
            intermediate_size=_pos_int(r, "intermediate_size", r.req("intermediate_size")),
            **read_mamba(r, D, need_mamba),
            hidden_act=r.opt("hidden_act", "silu"),
            rms_norm_eps=_pos_float(r, "rms_norm_eps", r.opt("rms_norm_eps", 1e-5)),
            mlp_bias=r.flag("mlp_bias", False),
            rope_theta=theta, partial_rotary_factor=prf,
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id", 2), V),
            bos_token_id=d.get("bos_token_id", 1), pad_token_id=d.get("pad_token_id", 0),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
        )
        if c.hidden_act not in ("silu", "swish"):
            r.fail(f"'hidden_act' {c.hidden_act!r} is not supported (need 'silu')")
        if need_attn and (c.rotary_dim < 2 or c.rotary_dim % 2):
            r.fail(f"partial_rotary_factor {prf} of head_dim {c.head_dim} must give an even rotary dim >= 2")
        return c


def bamba_block(c: BambaConfig, kind: str, layer_id: int, rot: Rotary | None) -> Block:
    blk = Block()
    name, m = hybrid_mixer(c, kind, layer_id, rot)
    blk.add("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), name, m)
    blk.add("pre_ff_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), "feed_forward",
            GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias))
    return blk


class BambaLM(CausalLM):
    def __init__(self, config: BambaConfig, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        rot = Rotary(c.head_dim, c.rotary_dim, c.rope_theta) if c.attn_layer_indices else None
        self.rotary = rot
        layers = [bamba_block(c, kind, i, rot) for i, kind in enumerate(c.layer_kinds)]
        self._assemble("model", "embed_tokens", layers, "final_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))

    @staticmethod
    def key_aliases() -> dict:
        return {}
