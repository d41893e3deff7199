"""Kimi-Linear (``KimiLinearForCausalLM``, ``model_type`` ``kimi_linear``), as transformers
5.17's ``models/kimi_linear`` computes it: ``model.{embed_tokens, layers.i.{input_layernorm,
self_attn, post_attention_layernorm, mlp}, norm}``, ``lm_head``.

* ``self_attn`` is KDA (``linear_attention``, :class:`~replayssm.layers.kda.KimiDeltaAttention`)
  or MLA without rope (``full_attention``, :class:`~replayssm.layers.mla.MLAttention`).
* ``mlp`` is a SwiGLU MLP (``dense``) or the MoE (``sparse``): sigmoid router with a score
  correction bias, ``topk_group`` of ``n_group`` groups, renormalised top-k times
  ``routed_scaling_factor``, SwiGLU experts and shared experts
  (:class:`~replayssm.layers.mlp.GatedSigmoidMoE`).
* Plain RMSNorms ``w · rms(x)``.

Checkpoints: the names transformers writes (and Moonshot's checkpoints use):
``self_attn.{q,k,v}_conv1d.weight`` (the three parts of the depthwise conv),
``self_attn.{f_a_proj, f_b_proj, dt_bias, A_log}``, MoE layers under ``block_sparse_moe.``
with per-expert ``experts.<e>.{w1 (gate), w3 (up), w2 (down)}.weight``.  The names of
transformers' in-memory modules (``self_attn.forget_gate.*``, ``mlp.experts.gate_up_proj``)
are read too.

Config: the fields transformers' ``KimiLinearConfig`` reads, with its defaults, in both
spellings (``num_experts`` / ``num_local_experts``, ``num_experts_per_token`` /
``num_experts_per_tok``, ``num_shared_experts`` / ``n_shared_experts``, ``num_expert_group``
/ ``n_group``, ``moe_renormalize`` / ``norm_topk_prob``, ``model_max_length`` /
``max_position_embeddings``), ``linear_attn_config`` (``head_dim``, ``num_heads``,
``short_conv_kernel_size``, 1-indexed ``full_attn_layers`` / ``kda_layers``) and
``first_k_dense_replace``.  Refused by name: a non-silu activation, a router other than
sigmoid, ``mla_use_nope: false`` (rope in MLA: transformers never applies it), and
``num_key_value_heads != num_attention_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.kda import KimiDeltaAttention
from ..layers.mla import MLAttention
from ..layers.mlp import GatedMLP, GatedSigmoidMoE
from ..layers.norms import RMSNorm
from .base import Block, CausalLM
from .config import _Reader, _count, _eos, _opt_pos_int, _pos_float, _pos_int

_KIND = {"linear_attention": "kda", "full_attention": "attention"}
_MLP = ("dense", "sparse")


@dataclass(frozen=True)
class KimiLinearConfig:
    """``KimiLinearForCausalLM`` (see the module docstring)."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "kimi_linear"

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def layer_kinds(self) -> list[str]:
        return [_KIND[t] for t in self.layer_types]

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "KimiLinearConfig":
        r = _Reader(d, where)
        la = d.get("linear_attn_config") or {}
        if not isinstance(la, dict):
            r.fail(f"'linear_attn_config' must be a JSON object, got {la!r}")
        n = _count(r, "num_hidden_layers", r.opt("num_hidden_layers", 27))
        lt = _layer_types(r, d, la, n)
        mlt = _mlp_layer_types(r, d, n)
        V = _pos_int(r, "vocab_size", r.opt("vocab_size", 163840))
        H = _pos_int(r, "num_attention_heads", r.opt("num_attention_heads", 32))
        _refuse(r, d, H, "full_attention" in lt)
        qlr = r.opt("q_lora_rank", None)
        c = cls(
            vocab_size=V, hidden_size=_pos_int(r, "hidden_size", r.opt("hidden_size", 2304)),
            layer_types=tuple(lt), mlp_layer_types=tuple(mlt),
            intermediate_size=_pos_int(r, "intermediate_size", r.opt("intermediate_size", 9216)),
            moe_intermediate_size=_pos_int(r, "moe_intermediate_size", r.opt("moe_intermediate_size", 1024)),
            num_experts=_pos_int(r, "num_experts", r.opt("num_experts", 256, "num_local_experts")),
            num_experts_per_tok=_pos_int(r, "num_experts_per_token",
                                         r.opt("num_experts_per_token", 8, "num_experts_per_tok")),
            num_shared_experts=_pos_int(r, "num_shared_experts", r.opt("num_shared_experts", 1, "n_shared_experts"),
                                        allow_zero=True),
            n_group=_pos_int(r, "num_expert_group", r.opt("num_expert_group", 1, "n_group")),
            topk_group=_pos_int(r, "topk_group", r.opt("topk_group", 1)),
            norm_topk_prob=r.flag("moe_renormalize", True, "norm_topk_prob"),
            routed_scaling_factor=_pos_float(r, "routed_scaling_factor", r.opt("routed_scaling_factor", 2.446)),
            num_attention_heads=H,
            q_lora_rank=None if qlr is None else _pos_int(r, "q_lora_rank", qlr),
            kv_lora_rank=_pos_int(r, "kv_lora_rank", r.opt("kv_lora_rank", 512)),
            qk_nope_head_dim=_pos_int(r, "qk_nope_head_dim", r.opt("qk_nope_head_dim", 128)),
            qk_rope_head_dim=_pos_int(r, "qk_rope_head_dim", r.opt("qk_rope_head_dim", 64), allow_zero=True),
            v_head_dim=_pos_int(r, "v_head_dim", r.opt("v_head_dim", 128)),
            linear_num_heads=_pos_int(r, "linear_attn_config.num_heads",
                                      la.get("num_heads", r.opt("linear_num_heads", 32))),
            linear_head_dim=_pos_int(r, "linear_attn_config.head_dim", la.get("head_dim", r.opt("linear_head_dim", 128))),
            linear_conv_kernel_dim=_pos_int(r, "linear_attn_config.short_conv_kernel_size",
                                            la.get("short_conv_kernel_size", r.opt("linear_conv_kernel_dim", 4))),
            hidden_act="silu",   # (silu / swish: _refuse)
            rms_norm_eps=_pos_float(r, "rms_norm_eps", r.opt("rms_norm_eps", 1e-5)),
            attention_bias=r.flag("attention_bias", False),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id"), V),
            bos_token_id=d.get("bos_token_id"), pad_token_id=d.get("pad_token_id"),
            max_position_embeddings=_opt_pos_int(r, "model_max_length") or _opt_pos_int(r, "max_position_embeddings"),
        )
        if "sparse" in mlt:
            _check_routing(r, c)
        return c


def _refuse(r: _Reader, d: dict, H: int, has_mla: bool) -> None:
    """What transformers' kimi_linear does not compute, refused by name."""
    Hkv = _pos_int(r, "num_key_value_heads", r.opt("num_key_value_heads", H))
    if Hkv != H and has_mla:
        r.fail(f"num_key_value_heads {Hkv} != num_attention_heads {H}: Kimi-Linear's MLA expands every "
               f"head's key and value from the latent (transformers needs them equal)")
    for key, want in (("moe_router_activation_func", ("sigmoid",)), ("hidden_act", ("silu", "swish"))):
        v = d.get(key)
        if v is not None and v not in want:
            r.fail(f"'{key}' {v!r} is not supported (need {want[0]!r})")
    if d.get("mla_use_nope") is False:
        r.fail("'mla_use_nope' false (rope in the MLA layers) is not supported: transformers' "
               "kimi_linear applies no rope")


def _check_routing(r: _Reader, c: KimiLinearConfig) -> None:
    E, k, G, tg = c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group
    if E % G:
        r.fail(f"num_experts {E} is not a multiple of num_expert_group (n_group) {G}")
    if tg > G:
        r.fail(f"topk_group {tg} > num_expert_group (n_group) {G}")
    if k > tg * (E // G):
        r.fail(f"num_experts_per_token {k} > the experts of topk_group {tg} groups ({tg * (E // G)})")


def _layer_types(r: _Reader, d: dict, la: dict, n: int) -> list[str]:
    """``layer_types``, else ``linear_attn_config``'s 1-indexed layer lists, else transformers'
    default (attention at every 4th layer from layer 4: ``i > 0 and i % 4 == 0``)."""
    lt = d.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n:
            r.fail(f"'layer_types' must be a list of num_hidden_layers = {n} entries, got {lt!r}")
        bad = sorted({repr(t) for t in lt if t not in _KIND})
        if bad:
            r.fail(f"'layer_types' has unknown layer types {bad} (expected 'linear_attention' or 'full_attention')")
        return list(lt)
    if "full_attn_layers" in la and "kda_layers" in la:
        out: list[str | None] = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            ids = la[key]
            if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n
                                                for i in ids):
                r.fail(f"'linear_attn_config.{key}' must list layer numbers in [1, {n}] (1-indexed), got {ids!r}")
            for i in ids:
                out[i - 1] = kind
        if None in out:
            r.fail(f"'linear_attn_config' names no layer type for layer(s) "
                   f"{[i + 1 for i, t in enumerate(out) if t is None][:8]} (1-indexed)")
        return out
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _mlp_layer_types(r: _Reader, d: dict, n: int) -> list[str]:
    mlt = d.get("mlp_layer_types")
    if mlt is not None:
        if not isinstance(mlt, list) or len(mlt) != n or any(t not in _MLP for t in mlt):
            r.fail(f"'mlp_layer_types' must be a list of num_hidden_layers = {n} entries 'dense' / 'sparse', "
                   f"got {mlt!r}")
        return list(mlt)
    k = r.opt("first_k_dense_replace", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        r.fail(f"'first_k_dense_replace' must be a non-negative integer, got {k!r}")
    return ["dense" if i < k else "sparse" for i in range(n)]


def kimi_block(c: KimiLinearConfig, kind: str, layer_id: int) -> Block:
    blk = Block()
    if kind == "kda":
        m = KimiDeltaAttention(c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim,
                               eps=c.rms_norm_eps, layer_id=layer_id)
    else:
        m = MLAttention(c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                        c.qk_rope_head_dim, c.v_head_dim, bias=c.attention_bias, layer_id=layer_id)
    blk.add("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), "self_attn", m)
    if c.is_moe_layer(layer_id):
        f = GatedSigmoidMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                            c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                            c.moe_intermediate_size * c.num_shared_experts, c.hidden_act)
    else:
        f = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
    blk.add("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), "mlp", f)
    return blk


#: transformers' in-memory names -> the names its checkpoints hold (read as aliases)
_FORGET = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")


class _KimiAliases:
    """Key aliases: ``.mlp.`` may be stored as ``.block_sparse_moe.`` (Moonshot's and
    transformers' saved name for the MoE, and for the dense MLP in transformers' save), the
    forget gate's tensors under ``self_attn.forget_gate.``."""

    def get(self, name: str, default=()):
        out = list(default)
        if ".mlp." in name:
            out.append(name.replace(".mlp.", ".block_sparse_moe.", 1))
        for leaf in _FORGET:
            if name.endswith(".self_attn." + leaf):
                out.append(name[: -len(leaf)] + "forget_gate." + leaf)
        return out


class KimiLinearLM(CausalLM):
    def __init__(self, config: KimiLinearConfig, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        layers = [kimi_block(c, kind, i) for i, kind in enumerate(c.layer_kinds)]
        self._assemble("model", "embed_tokens", layers, "norm", RMSNorm(c.hidden_size, c.rms_norm_eps))

    @staticmethod
    def key_aliases():
        return _KimiAliases()
