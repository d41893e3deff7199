"""Config sizes checked against the safetensors headers, before any module is built.

A ``config.json`` whose sizes disagree with the checkpoint (``num_hidden_layers:
1000000000``, a wrong head count ...) would otherwise build a model skeleton of that size
first (time and memory proportional to the bad value) and only then fail on a tensor shape.
:func:`check_sizes` reads only tensor names and shapes (the files' JSON headers, which
``safetensors`` parses without touching tensor data) and compares them with the config:
the layer count, ``vocab_size`` / ``hidden_size`` from the embedding, and per layer kind
the head counts and dims each mixer's tensors fix.  A mismatch raises
:class:`~replayssm.models.config.ConfigError` naming the config field, its value and the
tensor that contradicts it.
"""

from __future__ import annotations

import re
from typing import Callable

from .config import ConfigError

# (multimodal checkpoints, e.g. Qwen3.5's, nest the language model under model.language_model.)
_LAYER = re.compile(r"^(?:backbone|model)\.(?:language_model\.)?layers\.(\d+)\.")
_EMBED = ("backbone.embeddings.weight", "backbone.embedding.weight", "model.embeddings.weight",
          "model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def header_shapes(key_file: dict[str, str]) -> Callable[[str], tuple[int, ...] | None]:
    """``shape(key)``: the shape a checkpoint's header gives tensor ``key`` (None if absent);
    files are opened lazily, header only, and kept open for the lookups."""
    from safetensors import safe_open

    handles: dict[str, object] = {}

    def shape(key: str):
        fn = key_file.get(key)
        if fn is None:
            return None
        if fn not in handles:
            handles[fn] = safe_open(fn, framework="pt", device="cpu")
        return tuple(handles[fn].get_slice(key).get_shape())

    return shape


def _layer_count_field(cfg) -> str:
    if cfg.model_type == "nemotron_h":
        return "layers_block_type (one entry per layer)"
    return "num_hidden_layers"


def _check_layers(cfg, keys, where: str) -> None:
    idx = {int(m.group(1)) for k in keys if (m := _LAYER.match(k))}
    have = max(idx) + 1 if idx else 0
    want = cfg.num_hidden_layers
    if want != have:
        held = f"layers 0 .. {have - 1}" if have else "no layers"
        raise ConfigError(f"{where}: {_layer_count_field(cfg)} = {want}, but the checkpoint's tensors hold "
                          f"{held} ({have} layer{'s' if have != 1 else ''})")
    missing = sorted(set(range(have)) - idx)
    if missing:
        raise ConfigError(f"{where}: the checkpoint has no tensors for layer(s) {missing[:8]} of "
                          f"{_layer_count_field(cfg)} = {want}")


class _Checker:
    """Compares config values with dims read from tensor shapes; the first mismatch raises."""

    def __init__(self, cfg, shape, where: str):
        self.cfg, self.shape, self.where = cfg, shape, where

    def dim(self, expr: str, want: int, key: str, axis: int) -> None:
        """``shape(key)[axis]`` must be ``want``, the value of the config expression ``expr``
        (skipped when the checkpoint has no ``key``)."""
        s = self.shape(key)
        if s is None or len(s) <= axis or s[axis] == want:
            return
        raise ConfigError(f"{self.where}: {expr} = {want}, but tensor {key!r} in the checkpoint has shape "
                          f"{list(s)} (dim {axis} is {s[axis]})")


def _first(kinds: list[str], kind: str) -> int | None:
    return next((i for i, k in enumerate(kinds) if k == kind), None)


def check_sizes(cfg, key_file: dict[str, str], where: str = "config.json") -> None:
    """Check ``cfg`` against the checkpoint's tensor names and header shapes (no data read).

    ``key_file`` maps tensor names to their files (the loader's index).  Raises
    ``ConfigError`` naming the field; checks only what the tensors present can tell.
    """
    _check_layers(cfg, key_file, where)
    c = _Checker(cfg, header_shapes(key_file), where)
    embed = next((k for k in _EMBED if k in key_file), None)
    if embed is not None:
        c.dim("vocab_size", cfg.vocab_size, embed, 0)
        c.dim("hidden_size", cfg.hidden_size, embed, 1)
    c.dim("vocab_size", cfg.vocab_size, "lm_head.weight", 0)
    kinds = list(cfg.layer_kinds)
    mt = cfg.model_type
    if mt in ("mamba2", "nemotron_h"):
        i = _first(kinds, "mamba")
        if i is not None:
            p = f"backbone.layers.{i}.mixer."
            H, hd, st = (("num_heads", "head_dim", "state_size") if mt == "mamba2"
                         else ("mamba_num_heads", "mamba_head_dim", "ssm_state_size"))
            nh, d, n, G = getattr(cfg, H), getattr(cfg, hd), getattr(cfg, st), cfg.n_groups
            c.dim(H, nh, p + "A_log", 0)
            c.dim(f"{H} * {hd} ({nh} * {d})", nh * d, p + "out_proj.weight", 1)
            c.dim("conv_kernel", cfg.conv_kernel, p + "conv1d.weight", 2)
            c.dim(f"{H} * {hd} + 2 * n_groups * {st} ({nh} * {d} + 2 * {G} * {n})", nh * d + 2 * G * n,
                  p + "conv1d.weight", 0)
        if mt == "nemotron_h":
            i = _first(kinds, "attention")
            if i is not None:
                p = f"backbone.layers.{i}.mixer."
                _attention(c, cfg, p)
            i = _first(kinds, "mlp")
            if i is not None:
                c.dim("intermediate_size", cfg.intermediate_size, f"backbone.layers.{i}.mixer.up_proj.weight", 0)
            i = _first(kinds, "moe")
            if i is not None:
                _check_experts(c, "n_routed_experts", cfg.n_routed_experts, f"backbone.layers.{i}.mixer.", key_file)
    elif mt == "kimi_linear":
        _kimi_linear(c, cfg, kinds, key_file)
    elif mt == "qwen3_next":
        i = _first(kinds, "gdn")
        if i is not None:
            p = f"model.layers.{i}.linear_attn."
            H, K = cfg.linear_num_key_heads, cfg.linear_key_head_dim
            HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            c.dim("linear_num_value_heads", HV, p + "A_log", 0)
            c.dim("linear_value_head_dim", V, p + "norm.weight", 0)
            c.dim(f"linear_num_value_heads * linear_value_head_dim ({HV} * {V})", HV * V, p + "out_proj.weight", 1)
            c.dim("linear_conv_kernel_dim", cfg.linear_conv_kernel_dim, p + "conv1d.weight", 2)
            c.dim(f"2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * "
                  f"linear_value_head_dim (2 * {H} * {K} + {HV} * {V})", 2 * H * K + HV * V,
                  p + "conv1d.weight", 0)
        i = _first(kinds, "attention")
        if i is not None:
            p = f"model.layers.{i}.self_attn."
            c.dim("head_dim", cfg.head_dim, p + "k_norm.weight", 0)
            _attention(c, cfg, p)
        moe = next((j for j in range(cfg.num_hidden_layers) if cfg.is_moe_layer(j)), None)
        if moe is not None:
            _check_experts(c, "num_experts", cfg.num_experts, f"model.layers.{moe}.mlp.", key_file)
        dense = next((j for j in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(j)), None)
        if dense is not None:
            c.dim("intermediate_size", cfg.intermediate_size, f"model.layers.{dense}.mlp.gate_proj.weight", 0)


def _kimi_linear(c: _Checker, cfg, kinds: list[str], key_file) -> None:
    """KDA head count / dim and conv size, MLA latent and head dims, expert count."""
    i = _first(kinds, "kda")
    if i is not None:
        p = f"model.layers.{i}.self_attn."
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        c.dim("linear_attn_config.head_dim (linear_head_dim)", K, p + "f_a_proj.weight", 0)
        c.dim(f"linear_num_heads * linear_head_dim ({H} * {K})", H * K, p + "q_proj.weight", 0)
        c.dim("linear_attn_config.num_heads (linear_num_heads)", H, p + "b_proj.weight", 0)
        c.dim("linear_attn_config.short_conv_kernel_size (linear_conv_kernel_dim)", cfg.linear_conv_kernel_dim,
              p + "q_conv1d.weight", 2)
    i = _first(kinds, "attention")
    if i is not None:
        p = f"model.layers.{i}.self_attn."
        R, dr, dn, dv, H = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
                            cfg.num_attention_heads)
        c.dim("kv_lora_rank", R, p + "kv_a_layernorm.weight", 0)
        c.dim(f"kv_lora_rank + qk_rope_head_dim ({R} + {dr})", R + dr, p + "kv_a_proj_with_mqa.weight", 0)
        c.dim(f"num_attention_heads * (qk_nope_head_dim + v_head_dim) ({H} * ({dn} + {dv}))", H * (dn + dv),
              p + "kv_b_proj.weight", 0)
        c.dim(f"num_attention_heads * v_head_dim ({H} * {dv})", H * dv, p + "o_proj.weight", 1)
    moe = next((j for j in range(cfg.num_hidden_layers) if cfg.is_moe_layer(j)), None)
    if moe is not None:
        for name in ("block_sparse_moe", "mlp"):
            _check_experts(c, "num_experts", cfg.num_experts, f"model.layers.{moe}.{name}.", key_file)


def _attention(c: _Checker, cfg, p: str) -> None:
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c.dim(f"num_key_value_heads * head_dim ({Hkv} * {Dh})", Hkv * Dh, p + "k_proj.weight", 0)
    c.dim(f"num_attention_heads * head_dim ({H} * {Dh})", H * Dh, p + "o_proj.weight", 1)


def _check_experts(c: _Checker, field: str, want: int, prefix: str, keys) -> None:
    """Routed-expert count: the router's rows (``gate.weight``), or per-expert key indices."""
    c.dim(field, want, prefix + "gate.weight", 0)
    pat = re.compile(re.escape(prefix) + r"experts\.(\d+)\.")
    idx = {int(m.group(1)) for k in keys if (m := pat.match(k))}
    if idx and max(idx) + 1 != want:
        raise ConfigError(f"{c.where}: {field} = {want}, but the checkpoint holds experts 0 .. {max(idx)} "
                          f"under {prefix}experts.")
