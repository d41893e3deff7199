"""Validated model configurations parsed from a Hugging Face ``config.json``.

One dataclass per supported ``model_type``.  Structural fields (sizes, head counts, layer
counts) are required: a missing one raises ``ConfigError`` naming ``config.json`` and the
key.  Optional fields default to the values transformers 5.17 uses.  Old key spellings
found on the Hub (``hybrid_override_pattern``, ``mamba_n_groups``, top-level ``rope_theta``,
``full_attention_interval`` ...) are accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ConfigError",
    "Mamba2Config",
    "NemotronHConfig",
    "Qwen3NextConfig",
]


class ConfigError(ValueError):
    """A ``config.json`` that cannot describe a supported model."""


class WeightError(ValueError):
    """Checkpoint tensors that do not match the model described by config.json."""


_ACTS = ("silu", "swish", "relu2", "gelu", "relu")
_NEMOTRON_KIND = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


class _Reader:
    """Reads keys of one config dict, remembering the file for error messages."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def req(self, key: str, *aliases: str):
        for k in (key, *aliases):
            if k in self.d and self.d[k] is not None:
                return self.d[k]
        raise ConfigError(f"{self.where}: missing required key '{key}'")

    def opt(self, key: str, default, *aliases: str):
        for k in (key, *aliases):
            if k in self.d and self.d[k] is not None:
                return self.d[k]
        return default

    def flag(self, key: str, default: bool, *aliases: str) -> bool:
        """A boolean field: JSON true / false (or 0 / 1); a string is refused (``bool("false")``
        would be True)."""
        v = self.opt(key, default, *aliases)
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        self.fail(f"'{key}' must be true or false, got {v!r}")

    def fail(self, msg: str):
        raise ConfigError(f"{self.where}: {msg}")


def _pos_int(r: _Reader, name: str, v, allow_zero: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
        r.fail(f"'{name}' must be a {'non-negative' if allow_zero else 'positive'} integer, got {v!r}")
    return v


def _pos_float(r: _Reader, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        r.fail(f"'{name}' must be a positive number, got {v!r}")
    return float(v)


#: more layers than any checkpoint holds: a config asking for more is refused while parsing
#: (some configs expand the count into per-layer lists; :mod:`replayssm.models.header`
#: checks the exact count against the weights)
MAX_LAYERS = 1 << 16


def _count(r: _Reader, name: str, v) -> int:
    v = _pos_int(r, name, v)
    if v > MAX_LAYERS:
        r.fail(f"'{name}' = {v} is more than any checkpoint holds (at most {MAX_LAYERS})")
    return v


def _eos(r: _Reader, v, vocab_size: int):
    """``eos_token_id``: None, an id or a list of ids, each in ``[0, vocab_size)``."""
    if v is None:
        return None
    ids = list(v) if isinstance(v, (list, tuple)) else [v]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            r.fail(f"'eos_token_id' must be an int or a list of ints, got {v!r}")
        if not 0 <= t < vocab_size:
            r.fail(f"'eos_token_id' {t} is outside the vocabulary [0, {vocab_size}) (vocab_size = {vocab_size})")
    return ids if isinstance(v, (list, tuple)) else ids[0]


def _opt_pos_int(r: _Reader, name: str):
    v = r.opt(name, None)
    return None if v is None else _pos_int(r, name, v)


def _num(r: _Reader, name: str, v) -> float:
    """A JSON number; transformers writes infinities as ``{"__float__": "Infinity"}``."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    try:
        if isinstance(v, bool):
            raise TypeError
        return float(v)
    except (TypeError, ValueError):
        r.fail(f"'{name}' must be a number, got {v!r}")


def _dt_floor(r: _Reader, name: str, v) -> float:
    """A finite number >= 0 (the clamp ``dt >= floor`` of every step: NaN or inf would turn
    every ``dt`` into NaN / inf)."""
    v = _num(r, name, v)
    if not 0.0 <= v < math.inf:
        r.fail(f"'{name}' must be a finite number >= 0, got {v!r}")
    return v


def _limit(r: _Reader, name: str, v) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        r.fail(f"'{name}' must be a pair [min, max], got {v!r}")
    lo, hi = _num(r, name, v[0]), _num(r, name, v[1])
    if not (0.0 <= lo <= hi):
        r.fail(f"'{name}' must satisfy 0 <= min <= max, got {v!r}")
    return lo, hi


@dataclass(frozen=True)
class Mamba2Config:
    """``Mamba2ForCausalLM``: embeddings -> [RMSNorm -> Mamba2Mixer (+residual)] x L -> RMSNorm -> lm_head.

    ``intermediate = expand * hidden_size = num_heads * head_dim``; conv channels
    ``intermediate + 2 * n_groups * state_size``; ``in_proj`` rows ``[z | xBC | dt]``.
    ``norm_group_size``: the gated RMSNorm normalises groups of this many channels.  We use
    ``intermediate // n_groups`` (mamba_ssm's ``RMSNormGated(group_size=d_ssm // ngroups)``);
    transformers' torch path normalises the whole ``intermediate`` (identical when n_groups == 1).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 8
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    chunk_size: int = 256
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = 2
    bos_token_id: int | None = 0
    pad_token_id: int | None = 1
    max_position_embeddings: int | None = None   # context the model was trained for, if stated
    num_nextn_predict_layers: int = 0   # MTP blocks (our layout: docs/ARCHITECTURE.md, "MTP heads")
    model_type: str = "mamba2"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def norm_group_size(self) -> int:
        return self.intermediate_size // self.n_groups

    @property
    def layer_kinds(self) -> list[str]:
        return ["mamba"] * self.num_hidden_layers

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Mamba2Config":
        r = _Reader(d, where)
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        c = cls(
            vocab_size=V,
            hidden_size=_pos_int(r, "hidden_size", r.req("hidden_size", "d_model")),
            num_hidden_layers=_count(r, "num_hidden_layers", r.req("num_hidden_layers", "n_layer")),
            num_heads=_pos_int(r, "num_heads", r.req("num_heads")),
            head_dim=_pos_int(r, "head_dim", r.req("head_dim")),
            state_size=_pos_int(r, "state_size", r.req("state_size")),
            n_groups=_pos_int(r, "n_groups", r.opt("n_groups", 8)),
            expand=_pos_int(r, "expand", r.opt("expand", 2)),
            conv_kernel=_pos_int(r, "conv_kernel", r.opt("conv_kernel", 4)),
            use_bias=r.flag("use_bias", False),
            use_conv_bias=r.flag("use_conv_bias", True),
            hidden_act=r.opt("hidden_act", "silu"),
            layer_norm_epsilon=_pos_float(r, "layer_norm_epsilon", r.opt("layer_norm_epsilon", 1e-5)),
            residual_in_fp32=r.flag("residual_in_fp32", True),
            time_step_limit=_limit(r, "time_step_limit", r.opt("time_step_limit", (0.0, math.inf))),
            chunk_size=_pos_int(r, "chunk_size", r.opt("chunk_size", 256)),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id", 2), V),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
            bos_token_id=d.get("bos_token_id", 0),
            pad_token_id=d.get("pad_token_id", 1),
            num_nextn_predict_layers=_pos_int(r, "num_nextn_predict_layers",
                                              r.opt("num_nextn_predict_layers", 0), allow_zero=True),
        )
        if c.hidden_act not in ("silu", "swish"):
            r.fail(f"'hidden_act' {c.hidden_act!r} is not supported for the Mamba-2 conv (need 'silu')")
        if c.expand * c.hidden_size != c.num_heads * c.head_dim:
            r.fail(f"hidden_size * expand ({c.hidden_size * c.expand}) must equal num_heads * head_dim "
                   f"({c.num_heads * c.head_dim})")
        if c.num_heads % c.n_groups:
            r.fail(f"num_heads {c.num_heads} is not a multiple of n_groups {c.n_groups}")
        return c


@dataclass(frozen=True)
class NemotronHConfig:
    """``NemotronHForCausalLM``: per layer ``x + mixer(RMSNorm(x))`` where the mixer is a Mamba-2
    mixer (``M``), attention without RoPE (``*``), a relu2 MLP (``-``) or a MoE (``E``) with a
    sigmoid router (grouped top-k, score-correction bias) and a shared relu2 expert.

    The Mamba-2 gated norm uses groups of ``intermediate // n_groups`` (as transformers and
    mamba_ssm).  ``dt`` is clamped to ``[time_step_min, inf)`` as transformers 5.17 does.
    """

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"
    mamba_hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 1e-3
    chunk_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = 2
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()  # the layers of one MTP step (``mtp_layers_block_type``)
    model_type: str = "nemotron_h"

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def layer_kinds(self) -> list[str]:
        return [_NEMOTRON_KIND[t] for t in self.layer_types]

    @property
    def mtp_layer_kinds(self) -> list[str]:
        return [_NEMOTRON_KIND[t] for t in self.mtp_layer_types]

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "NemotronHConfig":
        r = _Reader(d, where)
        pat = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
        legacy = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
        lt = d.get("layers_block_type") or d.get("layer_types")
        if lt is None:
            p = d.get("hybrid_override_pattern")
            if p is None:
                r.fail("missing required key 'layers_block_type' (or 'hybrid_override_pattern')")
            if not isinstance(p, str) or any(ch not in pat for ch in p) or not p:
                r.fail(f"'hybrid_override_pattern' must be a non-empty string over 'M*-E', got {p!r}")
            lt = [pat[ch] for ch in p]
        if not isinstance(lt, list) or not lt:
            r.fail(f"'layers_block_type' must be a non-empty list, got {lt!r}")
        lt = [legacy.get(t, t) for t in lt]
        bad = sorted({t for t in lt if t not in pat.values()})
        if bad:
            r.fail(f"'layers_block_type' has unknown layer types {bad} (expected {sorted(pat.values())})")
        # MTP layers (vLLM: ``mtp_hybrid_override_pattern``; transformers: ``mtp_layers_block_type``)
        n_mtp = _pos_int(r, "num_nextn_predict_layers", r.opt("num_nextn_predict_layers", 0), allow_zero=True)
        mtp_lt: list = []
        if n_mtp:
            mtp_lt = d.get("mtp_layers_block_type") or []
            p = d.get("mtp_hybrid_override_pattern")
            if not mtp_lt and p is not None:
                if not isinstance(p, str) or not p or any(ch not in pat for ch in p):
                    r.fail(f"'mtp_hybrid_override_pattern' must be a non-empty string over 'M*-E', got {p!r}")
                mtp_lt = [pat[ch] for ch in p]
            if not mtp_lt:
                mtp_lt = ["full_attention", "moe"]   # transformers' default
            if not isinstance(mtp_lt, list):
                r.fail(f"'mtp_layers_block_type' must be a list, got {mtp_lt!r}")
            mtp_lt = [legacy.get(t, t) for t in mtp_lt]
            bad = sorted({t for t in mtp_lt if t not in pat.values()})
            if bad:
                r.fail(f"'mtp_layers_block_type' has unknown layer types {bad} (expected {sorted(pat.values())})")
        kinds = set(lt) | set(mtp_lt)
        need_attn, need_mamba = "full_attention" in kinds, "linear_attention" in kinds
        need_moe, need_mlp = "moe" in kinds, "mlp" in kinds

        def maybe(key, need, default, *aliases):
            return r.req(key, *aliases) if need else r.opt(key, default, *aliases)

        nh = maybe("num_attention_heads", need_attn, 32)
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        c = cls(
            vocab_size=V,
            hidden_size=_pos_int(r, "hidden_size", r.req("hidden_size")),
            layer_types=tuple(lt),
            num_attention_heads=_pos_int(r, "num_attention_heads", nh),
            num_key_value_heads=_pos_int(r, "num_key_value_heads", r.opt("num_key_value_heads", nh)),
            head_dim=_pos_int(r, "head_dim", maybe("head_dim", need_attn, 128, "attention_head_dim")),
            intermediate_size=_pos_int(r, "intermediate_size", maybe("intermediate_size", need_mlp, 21504)),
            mamba_num_heads=_pos_int(r, "mamba_num_heads", maybe("mamba_num_heads", need_mamba, 128)),
            mamba_head_dim=_pos_int(r, "mamba_head_dim", maybe("mamba_head_dim", need_mamba, 64)),
            ssm_state_size=_pos_int(r, "ssm_state_size", maybe("ssm_state_size", need_mamba, 128)),
            n_groups=_pos_int(r, "n_groups", r.opt("n_groups", 8, "mamba_n_groups")),
            conv_kernel=_pos_int(r, "conv_kernel", r.opt("conv_kernel", 4, "mamba_d_conv")),
            use_conv_bias=r.flag("use_conv_bias", True, "mamba_conv_bias"),
            use_bias=r.flag("use_bias", False, "mamba_proj_bias"),
            mlp_bias=r.flag("mlp_bias", False),
            mlp_hidden_act=r.opt("mlp_hidden_act", "relu2"),
            mamba_hidden_act=r.opt("mamba_hidden_act", "silu"),
            layer_norm_epsilon=_pos_float(r, "layer_norm_epsilon", r.opt("layer_norm_epsilon", 1e-5)),
            time_step_min=_dt_floor(r, "time_step_min", r.opt("time_step_min", 1e-3, "mamba_dt_min")),
            chunk_size=_pos_int(r, "chunk_size", r.opt("chunk_size", 128, "mamba_chunk_size")),
            n_routed_experts=_pos_int(r, "n_routed_experts", maybe("n_routed_experts", need_moe, 8)),
            num_experts_per_tok=_pos_int(r, "num_experts_per_tok", maybe("num_experts_per_tok", need_moe, 2)),
            moe_intermediate_size=_pos_int(r, "moe_intermediate_size", maybe("moe_intermediate_size", need_moe, 7688)),
            moe_shared_expert_intermediate_size=_pos_int(
                r, "moe_shared_expert_intermediate_size",
                maybe("moe_shared_expert_intermediate_size", need_moe, 7688)),
            moe_latent_size=_opt_pos_int(r, "moe_latent_size"),
            n_group=_pos_int(r, "n_group", r.opt("n_group", 1)),
            topk_group=_pos_int(r, "topk_group", r.opt("topk_group", 1)),
            norm_topk_prob=r.flag("norm_topk_prob", True),
            routed_scaling_factor=_num(r, "routed_scaling_factor", r.opt("routed_scaling_factor", 1.0)),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id", 2), V),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
            bos_token_id=d.get("bos_token_id", 1),
            pad_token_id=d.get("pad_token_id", 0),
            num_nextn_predict_layers=n_mtp,
            mtp_layer_types=tuple(mtp_lt),
        )
        if c.mlp_hidden_act not in _ACTS:
            r.fail(f"'mlp_hidden_act' {c.mlp_hidden_act!r} is not supported (one of {_ACTS})")
        if need_mamba:
            if c.mamba_hidden_act not in ("silu", "swish"):
                r.fail(f"'mamba_hidden_act' {c.mamba_hidden_act!r} is not supported (need 'silu')")
            if c.mamba_num_heads % c.n_groups:
                r.fail(f"mamba_num_heads {c.mamba_num_heads} is not a multiple of n_groups {c.n_groups}")
        if need_attn and c.num_attention_heads % c.num_key_value_heads:
            r.fail(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                   f"num_key_value_heads {c.num_key_value_heads}")
        if need_moe:
            if c.num_experts_per_tok > c.n_routed_experts:
                r.fail(f"num_experts_per_tok {c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}")
            if c.n_routed_experts % c.n_group or c.topk_group > c.n_group:
                r.fail(f"n_routed_experts {c.n_routed_experts} must be a multiple of n_group {c.n_group} "
                       f"and topk_group {c.topk_group} <= n_group")
            if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
                r.fail("grouped routing needs at least 2 experts per group")
        return c


#: keys of ``rope_parameters`` that are not part of a scaling: the base, the partial factor and
#: Qwen3.5's multimodal rope sections (text positions are equal on the t/h/w axes, so mrope
#: reduces to plain rope for text)
_ROPE_BASE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section",
                   "mrope_interleaved")
#: per rope type: (required keys, optional keys) we implement (``replayssm.layers.rotary``)
_ROPE_KEYS = {"linear": (("factor",), ()),
              "yarn": (("factor", "original_max_position_embeddings"),
                       ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"))}


def rope_scaling(r: _Reader, rp: dict, max_pos) -> tuple:
    """The rope scaling of ``rope_parameters`` / ``rope_scaling`` dict ``rp`` as sorted
    ``(key, value)`` pairs (``()`` for the default rope): ``linear`` and ``yarn`` (YaRN's
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings``, as
    transformers standardises it); any other type (``dynamic``, ``longrope``, ``llama3`` ...)
    or an unknown / malformed key raises ``ConfigError`` naming it."""
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return ()
    if kind not in _ROPE_KEYS:
        why = (" (dynamic NTK rescales the frequencies with the running sequence length, which cached keys "
               "cannot follow)" if kind == "dynamic" else "")
        r.fail(f"rope_type {kind!r} in 'rope_parameters' is not supported{why}; supported: "
               f"'default', {', '.join(repr(k) for k in _ROPE_KEYS)}")
    need, optional = _ROPE_KEYS[kind]
    s = {k: v for k, v in rp.items() if k not in _ROPE_BASE_KEYS}
    if kind == "yarn" and s.get("original_max_position_embeddings") is None and max_pos is not None:
        s["original_max_position_embeddings"] = max_pos
    for k in need:
        if s.get(k) is None:
            r.fail(f"rope_type {kind!r} needs 'rope_parameters.{k}'")
    bad = sorted(k for k in s if k not in need + optional)
    if bad:
        r.fail(f"'rope_parameters' has key(s) {bad} that rope_type {kind!r} does not take")
    s["factor"] = _num(r, "rope_parameters.factor", s["factor"])
    if not s["factor"] >= 1.0:
        r.fail(f"'rope_parameters.factor' must be >= 1, got {s['factor']!r}")
    for k in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if s.get(k) is not None:
            s[k] = _num(r, f"rope_parameters.{k}", s[k])
    if "original_max_position_embeddings" in s:
        _pos_int(r, "rope_parameters.original_max_position_embeddings", s["original_max_position_embeddings"])
    if "truncate" in s and s["truncate"] not in (True, False):
        r.fail(f"'rope_parameters.truncate' must be true or false, got {s['truncate']!r}")
    return (("rope_type", kind),) + tuple(sorted(s.items()))


@dataclass(frozen=True)
class Qwen3NextConfig:
    """``Qwen3NextForCausalLM``: per layer ``x + mixer(N1(x))`` then ``x + ffn(N2(x))`` with
    mixer = Gated DeltaNet or gated full attention (every ``full_attention_interval``-th layer),
    ffn = sparse MoE (softmax top-k + sigmoid-gated shared expert) or dense SwiGLU MLP.
    All plain RMSNorms are zero-centred, ``y = x̂ (1 + w)``; the GDN output norm is not.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: tuple = ()   # sorted (key, value) pairs of a non-default rope type (:func:`rope_scaling`)
    num_experts: int = 0
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0   # MTP layers (0: unknown; the checkpoint's mtp.* tensors decide)
    model_type: str = "qwen3_next"

    @property
    def layer_kinds(self) -> list[str]:
        return ["gdn" if t == "linear_attention" else "attention" for t in self.layer_types]

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_scaling_dict(self) -> dict | None:
        """The rope scaling for :class:`~replayssm.layers.rotary.Rotary` (None: default rope)."""
        return dict(self.rope_scaling) or None

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Qwen3NextConfig":
        r = _Reader(d, where)
        L = _count(r, "num_hidden_layers", r.req("num_hidden_layers"))
        lt = d.get("layer_types")
        if lt is None:
            interval = _pos_int(r, "full_attention_interval", r.opt("full_attention_interval", 4))
            lt = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)]
        legacy = {"attention": "full_attention", "linear": "linear_attention"}
        if not isinstance(lt, list):
            r.fail(f"'layer_types' must be a list, got {lt!r}")
        lt = [legacy.get(t, t) for t in lt]
        if len(lt) != L:
            r.fail(f"'layer_types' has {len(lt)} entries but num_hidden_layers is {L}")
        bad = sorted({t for t in lt if t not in ("linear_attention", "full_attention")})
        if bad:
            r.fail(f"'layer_types' has unknown layer types {bad}")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rp, dict):
            r.fail(f"'rope_parameters' must be a dict, got {rp!r}")
        scaling = rope_scaling(r, rp, d.get("max_position_embeddings"))
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        need_attn = "full_attention" in lt
        ne = _pos_int(r, "num_experts", r.opt("num_experts", 0), allow_zero=True)
        nh = r.req("num_attention_heads")
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        c = cls(
            vocab_size=V,
            hidden_size=_pos_int(r, "hidden_size", r.req("hidden_size")),
            num_hidden_layers=L,
            num_attention_heads=_pos_int(r, "num_attention_heads", nh),
            num_key_value_heads=_pos_int(r, "num_key_value_heads", r.opt("num_key_value_heads", nh)),
            head_dim=_pos_int(r, "head_dim", r.req("head_dim") if need_attn else r.opt("head_dim", 256)),
            intermediate_size=_pos_int(r, "intermediate_size", r.req("intermediate_size")),
            linear_num_key_heads=_pos_int(r, "linear_num_key_heads", r.req("linear_num_key_heads")),
            linear_num_value_heads=_pos_int(r, "linear_num_value_heads", r.req("linear_num_value_heads")),
            linear_key_head_dim=_pos_int(r, "linear_key_head_dim", r.req("linear_key_head_dim")),
            linear_value_head_dim=_pos_int(r, "linear_value_head_dim", r.req("linear_value_head_dim")),
            layer_types=tuple(lt),
            linear_conv_kernel_dim=_pos_int(r, "linear_conv_kernel_dim", r.opt("linear_conv_kernel_dim", 4)),
            hidden_act=r.opt("hidden_act", "silu"),
            rms_norm_eps=_pos_float(r, "rms_norm_eps", r.opt("rms_norm_eps", 1e-6)),
            attention_bias=r.flag("attention_bias", False),
            rope_theta=_pos_float(r, "rope_theta", theta),
            partial_rotary_factor=float(prf),
            rope_scaling=scaling,
            num_experts=ne,
            num_experts_per_tok=_pos_int(r, "num_experts_per_tok", r.req("num_experts_per_tok") if ne else r.opt("num_experts_per_tok", 10)),
            moe_intermediate_size=_pos_int(r, "moe_intermediate_size", r.req("moe_intermediate_size") if ne else r.opt("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=_pos_int(r, "shared_expert_intermediate_size", r.opt("shared_expert_intermediate_size", 512), allow_zero=True),
            norm_topk_prob=r.flag("norm_topk_prob", True),
            decoder_sparse_step=_pos_int(r, "decoder_sparse_step", r.opt("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(r.opt("mlp_only_layers", [])),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id"), V),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
            bos_token_id=d.get("bos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            num_nextn_predict_layers=_pos_int(r, "num_nextn_predict_layers", r.opt(
                "num_nextn_predict_layers", 0, "mtp_num_hidden_layers"), allow_zero=True),
        )
        if c.hidden_act not in ("silu", "swish"):
            r.fail(f"'hidden_act' {c.hidden_act!r} is not supported (need 'silu')")
        if c.linear_num_value_heads % c.linear_num_key_heads:
            r.fail(f"linear_num_value_heads {c.linear_num_value_heads} is not a multiple of "
                   f"linear_num_key_heads {c.linear_num_key_heads}")
        if c.num_attention_heads % c.num_key_value_heads:
            r.fail(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                   f"num_key_value_heads {c.num_key_value_heads}")
        if not (0.0 < c.partial_rotary_factor <= 1.0) or c.rotary_dim % 2:
            r.fail(f"partial_rotary_factor {c.partial_rotary_factor} must give an even rotary dim "
                   f"in (0, head_dim], got {c.rotary_dim}")
        if ne and c.num_experts_per_tok > ne:
            r.fail(f"num_experts_per_tok {c.num_experts_per_tok} > num_experts {ne}")
        return c
