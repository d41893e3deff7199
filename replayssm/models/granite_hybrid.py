"""IBM Granite-4.0-H (``GraniteMoeHybridForCausalLM``, ``model_type`` ``granitemoehybrid``):
``model.{embed_tokens, layers.i.{input_layernorm, mamba | self_attn, post_attention_layernorm,
block_sparse_moe, shared_mlp}, norm}``, ``lm_head`` (or tied to the embedding).

Per layer ``h = h + m_r · mixer(N1(h))`` then ``h = h + m_r · (moe(N2(h)) + shared(N2(h)))``
with ``m_r = residual_multiplier``; the mixer is Mamba-2 (``linear_attention``) or GQA
attention (``full_attention``, RoPE when ``position_embedding_type == "rope"``, else none)
whose softmax scale is ``attention_multiplier`` (not ``head_dim^-1/2``).  The MoE routes
top-k of the router logits with a softmax over the k chosen (= the renormalised top-k of
the full softmax), SwiGLU experts ``input_linear [E, 2I, D]`` (``[gate | up]``),
``output_linear [E, D, I]``; the shared expert is a SwiGLU MLP ``shared_mlp.input_linear
[2S, D]`` / ``output_linear [D, S]`` (alone when ``num_local_experts == 0``).  The embeddings
are multiplied by ``embedding_multiplier``, the logits divided by ``logits_scaling``
(:class:`~replayssm.models.base.CausalLM` hooks).

``m_r`` and the attention scale are folded into the weights at load time (exact: each is a
linear factor on one projection): ``m_r`` into every residual branch's output projection
(``out_proj``, ``o_proj``, both ``output_linear``), ``attention_multiplier · head_dim^1/2``
into ``q_proj`` (RoPE is a rotation, so it commutes with the factor).  Products are taken in
the compute dtype (fp32, fp64 for fp64 models) before the cast to the model's dtype.

The Mamba-2 gated norm normalises groups of ``intermediate // n_groups`` channels (mamba_ssm,
as :class:`~replayssm.models.config.Mamba2Config`; transformers' torch path normalises the
whole vector — the same for ``mamba_n_groups == 1``, which every published Granite-4.0-H
checkpoint uses).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..kernels.dispatch import ops_for
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mlp import Linear, _param
from ..layers.norms import RMSNorm
from ..layers.rotary import Rotary
from ..ops.moe.naive import activation
from ..runtime import compute_dtype
from .base import Block, CausalLM
from .config import _Reader, _count, _eos, _limit, _num, _opt_pos_int, _pos_float, _pos_int

_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_KIND = {"linear_attention": "mamba", "full_attention": "attention"}


def read_layer_types(r: _Reader, d: dict, key: str = "layer_types") -> list[str] | None:
    """``layer_types`` (alias ``layers_block_type``) with the legacy names mapped, or None."""
    lt = d.get(key)
    if lt is None:
        lt = d.get("layers_block_type")
    if lt is None:
        return None
    if not isinstance(lt, list) or not lt:
        r.fail(f"'{key}' must be a non-empty list, got {lt!r}")
    lt = [_LEGACY.get(t, t) if isinstance(t, str) else t for t in lt]
    bad = sorted({repr(t) for t in lt if t not in _KIND})
    if bad:
        r.fail(f"'{key}' has unknown layer types {bad} (expected 'linear_attention' / 'mamba' or "
               f"'full_attention' / 'attention')")
    return lt


def read_mamba(r: _Reader, hidden: int, need: bool) -> dict:
    """The ``mamba_*`` fields shared by Granite-4.0-H and Bamba (``mamba_d_head: "auto"`` =
    ``mamba_expand * hidden_size // mamba_n_heads``), checked when a Mamba layer exists."""
    nh = _pos_int(r, "mamba_n_heads", r.opt("mamba_n_heads", 128))
    expand = _pos_int(r, "mamba_expand", r.opt("mamba_expand", 2))
    dh = r.opt("mamba_d_head", "auto")
    if dh == "auto":
        if need and (expand * hidden) % nh:
            r.fail(f"'mamba_n_heads' {nh} must divide mamba_expand * hidden_size ({expand * hidden})")
        dh = max(expand * hidden // nh, 1)
    out = dict(
        mamba_n_heads=nh, mamba_expand=expand, mamba_d_head=_pos_int(r, "mamba_d_head", dh),
        mamba_d_state=_pos_int(r, "mamba_d_state", r.opt("mamba_d_state", 256)),
        mamba_n_groups=_pos_int(r, "mamba_n_groups", r.opt("mamba_n_groups", 1)),
        mamba_d_conv=_pos_int(r, "mamba_d_conv", r.opt("mamba_d_conv", 4)),
        mamba_chunk_size=_pos_int(r, "mamba_chunk_size", r.opt("mamba_chunk_size", 256)),
        mamba_conv_bias=r.flag("mamba_conv_bias", True),
        mamba_proj_bias=r.flag("mamba_proj_bias", False),
        time_step_limit=_limit(r, "time_step_limit", r.opt("time_step_limit", (0.0, math.inf))),
    )
    if need:
        if out["mamba_d_head"] * nh != expand * hidden:
            r.fail(f"mamba_n_heads * mamba_d_head ({nh} * {out['mamba_d_head']}) must equal "
                   f"mamba_expand * hidden_size ({expand} * {hidden})")
        if nh % out["mamba_n_groups"]:
            r.fail(f"mamba_n_heads {nh} is not a multiple of mamba_n_groups {out['mamba_n_groups']}")
    return out


def read_attention(r: _Reader, hidden: int, need: bool) -> dict:
    nh = _pos_int(r, "num_attention_heads", r.req("num_attention_heads") if need else r.opt("num_attention_heads", 32))
    nkv = _pos_int(r, "num_key_value_heads", r.opt("num_key_value_heads", nh))
    hd = r.opt("head_dim", None)
    if hd is None:
        if need and hidden % nh:
            r.fail(f"hidden_size {hidden} is not a multiple of num_attention_heads {nh} (and no 'head_dim')")
        hd = max(hidden // nh, 1)
    if need and nh % nkv:
        r.fail(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
    return dict(num_attention_heads=nh, num_key_value_heads=nkv, head_dim=_pos_int(r, "head_dim", hd),
                attention_bias=r.flag("attention_bias", False))


def read_rope(r: _Reader, d: dict, default_partial: float = 1.0) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from ``rope_parameters`` / ``rope_scaling`` or the
    top-level keys; only the ``default`` rope type."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        r.fail(f"'rope_parameters' must be a dict, got {rp!r}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        r.fail(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
    theta = _pos_float(r, "rope_theta", rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    prf = _num(r, "partial_rotary_factor", rp.get("partial_rotary_factor", default_partial))
    if not 0.0 < prf <= 1.0:
        r.fail(f"'partial_rotary_factor' must be in (0, 1], got {prf!r}")
    return theta, prf


@dataclass(frozen=True)
class GraniteMoeHybridConfig:
    """``GraniteMoeHybridForCausalLM`` (see the module docstring)."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
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
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    position_embedding_type: str | None = None
    rope_theta: float = 10000.0
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = 2
    bos_token_id: int | None = 1
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "granitemoehybrid"

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def layer_kinds(self) -> list[str]:
        return [_KIND[t] for t in self.layer_types]

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "GraniteMoeHybridConfig":
        r = _Reader(d, where)
        lt = read_layer_types(r, d)
        n = d.get("num_hidden_layers")
        if lt is None:
            lt = ["linear_attention"] * _count(r, "num_hidden_layers", r.req("num_hidden_layers"))
        elif n is not None and _count(r, "num_hidden_layers", n) != len(lt):
            r.fail(f"'layer_types' has {len(lt)} entries but num_hidden_layers is {n}")
        need_attn, need_mamba = "full_attention" in lt, "linear_attention" in lt
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        D = _pos_int(r, "hidden_size", r.req("hidden_size"))
        E = _pos_int(r, "num_local_experts", r.opt("num_local_experts", 8), allow_zero=True)
        pet = d.get("position_embedding_type")
        if pet not in (None, "nope", "rope"):
            r.fail(f"'position_embedding_type' must be null, 'nope' or 'rope', got {pet!r}")
        theta, prf = read_rope(r, d)
        if prf != 1.0:
            r.fail(f"'partial_rotary_factor' {prf} is not supported for granitemoehybrid (full rotary)")

        def mult(key):
            v = _num(r, key, r.opt(key, 1.0))
            if not 0.0 < v < math.inf:
                r.fail(f"'{key}' must be a positive finite number, got {v!r}")
            return v

        c = cls(
            vocab_size=V, hidden_size=D, layer_types=tuple(lt),
            **read_attention(r, D, need_attn),
            intermediate_size=_pos_int(r, "intermediate_size",
                                       r.req("intermediate_size") if E else r.opt("intermediate_size", 1)),
            shared_intermediate_size=_pos_int(r, "shared_intermediate_size", r.opt("shared_intermediate_size", 1024)),
            num_local_experts=E,
            num_experts_per_tok=_pos_int(r, "num_experts_per_tok", r.opt("num_experts_per_tok", 2)),
            **read_mamba(r, D, need_mamba),
            hidden_act=r.opt("hidden_act", "silu"),
            rms_norm_eps=_pos_float(r, "rms_norm_eps", r.opt("rms_norm_eps", 1e-6)),
            position_embedding_type=pet, rope_theta=theta,
            embedding_multiplier=mult("embedding_multiplier"), logits_scaling=mult("logits_scaling"),
            residual_multiplier=mult("residual_multiplier"), attention_multiplier=mult("attention_multiplier"),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id", 2), V),
            bos_token_id=d.get("bos_token_id", 1), pad_token_id=d.get("pad_token_id"),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
        )
        if c.hidden_act not in ("silu", "swish"):
            r.fail(f"'hidden_act' {c.hidden_act!r} is not supported (need 'silu')")
        if need_attn and pet == "rope" and c.head_dim % 2:
            r.fail(f"head_dim {c.head_dim} must be even for position_embedding_type 'rope'")
        if E and c.num_experts_per_tok > E:
            r.fail(f"num_experts_per_tok {c.num_experts_per_tok} > num_local_experts {E}")
        return c


class GraniteSharedMLP(nn.Module):
    """``output_linear(act(a) · b)`` with ``[a | b] = input_linear(x)`` (``shared_mlp``), plus
    the layer's routed experts when it has them (``moe``: held, not registered — the block
    registers it as ``block_sparse_moe``, the checkpoint's name)."""

    def __init__(self, hidden: int, inter: int, act: str, moe: "GraniteMoE | None"):
        super().__init__()
        self.input_linear = Linear(hidden, 2 * inter)
        self.output_linear = Linear(inter, hidden)
        self.act = activation(act)
        self._moe = [moe] if moe is not None else []

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.input_linear(x).chunk(2, dim=-1)
        out = self.output_linear(self.act(a) * b)
        return self._moe[0](x) + out if self._moe else out


class GraniteMoE(nn.Module):
    """``block_sparse_moe``: ``router.layer [E, D]``; the top-k router logits (fp32+), softmax
    over the k chosen; SwiGLU experts ``input_linear [E, 2I, D]``, ``output_linear [E, D, I]``."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        self.E, self.k, self.act_name = num_experts, top_k, act
        self.router = nn.Module()
        self.router.layer = Linear(hidden, num_experts)
        self.input_linear = nn.Module()
        self.input_linear.weight = _param(num_experts, 2 * inter, hidden)
        self.output_linear = nn.Module()
        self.output_linear.weight = _param(num_experts, hidden, inter)
        activation(act)

    def route(self, xf: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.router.layer(xf).to(compute_dtype(xf.dtype))
        top, idx = logits.topk(self.k, dim=-1)
        return idx, torch.softmax(top, dim=-1).to(xf.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        idx, w = self.route(xf)
        out = ops_for("moe").experts(xf, idx, w, self.input_linear.weight, self.output_linear.weight,
                                     act=self.act_name, gated=True)
        return out.reshape(shp)


def hybrid_mixer(c, kind: str, layer_id: int, rot: Rotary | None) -> tuple[str, torch.nn.Module]:
    """``(checkpoint name, module)`` of a Granite-4.0-H / Bamba layer's mixer: Mamba-2
    (``mamba``) or attention (``self_attn``), from the ``mamba_*`` / attention fields both
    configs share."""
    if kind == "mamba":
        return "mamba", Mamba2Mixer(
            c.hidden_size, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_n_groups, c.mamba_d_conv,
            norm_group_size=c.mamba_intermediate // c.mamba_n_groups, eps=c.rms_norm_eps,
            use_bias=c.mamba_proj_bias, use_conv_bias=c.mamba_conv_bias, time_step_limit=c.time_step_limit,
            chunk_size=min(c.mamba_chunk_size, 64), layer_id=layer_id)
    return "self_attn", Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                  bias=c.attention_bias, rotary=rot, layer_id=layer_id)


def granite_block(c: GraniteMoeHybridConfig, kind: str, layer_id: int, rot: Rotary | None) -> Block:
    blk = Block()
    name, m = hybrid_mixer(c, kind, layer_id, rot)
    blk.add("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), name, m)
    moe = None
    if c.num_local_experts:
        moe = blk.block_sparse_moe = GraniteMoE(c.hidden_size, c.intermediate_size, c.num_local_experts,
                                                c.num_experts_per_tok, c.hidden_act)
    blk.add("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), "shared_mlp",
            GraniteSharedMLP(c.hidden_size, c.shared_intermediate_size, c.hidden_act, moe))
    return blk


def _scaled(t: Tensor, s: float, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) * s


class GraniteMoeHybridLM(CausalLM):
    def __init__(self, config: GraniteMoeHybridConfig, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        self.embedding_multiplier = float(c.embedding_multiplier)
        self.logits_scaling = float(c.logits_scaling)
        rot = Rotary(c.head_dim, c.head_dim, c.rope_theta) if c.position_embedding_type == "rope" else None
        self.rotary = rot
        layers = [granite_block(c, kind, i, rot) for i, kind in enumerate(c.layer_kinds)]
        self._assemble("model", "embed_tokens", layers, "norm", RMSNorm(c.hidden_size, c.rms_norm_eps))

    def load_transforms(self) -> dict:
        """Fold ``residual_multiplier`` into each branch's output projection and
        ``attention_multiplier · head_dim^1/2`` into ``q_proj`` (see the module docstring)."""
        c = self.config
        cdt = compute_dtype(self._dtype)
        res = functools.partial(_scaled, s=c.residual_multiplier, dtype=cdt)
        q = functools.partial(_scaled, s=c.attention_multiplier * math.sqrt(c.head_dim), dtype=cdt)
        names = {n for n, _ in self.named_parameters()}
        out = {}
        for i, kind in enumerate(c.layer_kinds):
            p = f"model.layers.{i}."
            if c.residual_multiplier != 1.0:
                outs = ([p + "mamba.out_proj."] if kind == "mamba" else [p + "self_attn.o_proj."]) + \
                       [p + "shared_mlp.output_linear.", p + "block_sparse_moe.output_linear."]
                for o in outs:
                    for leaf in ("weight", "bias"):
                        if o + leaf in names:
                            out[o + leaf] = res
            if kind == "attention" and c.attention_multiplier * math.sqrt(c.head_dim) != 1.0:
                for leaf in ("weight", "bias"):
                    if p + "self_attn.q_proj." + leaf in names:
                        out[p + "self_attn.q_proj." + leaf] = q
        return out

    @staticmethod
    def key_aliases() -> dict:
        return {}
