"""Random-weight hybrid models in HF layout for ``bench e2e --preset`` and the profilers.

* ``nemotron-h-4b``: the public NVIDIA-Nemotron-3-Nano-4B shape (``nemotron_h``): d_model
  3136, 42 layers ``M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-`` (21 Mamba-2, 4 attention, 17
  relu² MLP), Mamba-2 96 heads × 80, d_state 128, 8 groups; attention 40 heads, 8 KV heads ×
  128, no RoPE; MLP 12544; vocab 131072 (3.97 B parameters).
* ``qwen3-next-4b``: a Qwen3-Next-class model (``qwen3_next``) at ~4 B total: d_model 2048, 24
  layers with gated attention every 4th (16 heads, 2 KV heads × 256, partial RoPE) and Gated
  DeltaNet elsewhere (16 key heads, 32 value heads, 128 × 128 state); every layer a MoE of 64
  SwiGLU experts (I=256, top-8) plus a 512-wide shared expert; vocab 151936.
* ``qwen3.5-4b``: the Qwen3.5-4B text model (``qwen3_5_text``; no vision tower, no MTP head):
  d_model 2560, 32 layers, gated attention every 4th (16 heads, 4 KV heads x 256, RoPE on a
  quarter), Gated DeltaNet elsewhere (16 key heads, 32 value heads, 128 x 128 state, conv 4),
  SwiGLU MLP 9216; vocab 248320 (4.84 B parameters, untied head).
* ``granite-4.0-h-tiny``: Granite-4.0-H-Tiny (``granitemoehybrid``): d_model 1536, 40 layers,
  attention (12 heads, 4 KV heads x 128, no position embedding) at layers 5/15/25/35, Mamba-2
  elsewhere (48 heads x 64, d_state 128, 1 group); every layer a 64-expert top-6 SwiGLU MoE
  (I=512) plus a 1024-wide shared MLP; Granite's multipliers; tied embeddings, vocab 100352
  (6.94 B parameters, 1.47 B active per token).
* ``*-tiny`` (``granite-4.0-h-tiny-smoke`` for Granite): the same structure at toy size (CPU
  tests, ``--smoke``).

Where the two newer shapes come from (random weights: only the shapes matter for speed).
transformers 5.17 ships no config of either model; what it does document:

* Qwen3.5, ``Qwen3_5TextConfig`` defaults (its docstring: a "Qwen3.5-9B style" config): the
  family-wide numbers vocab 248320, 16 attention / 4 KV heads of 256, GDN 16 key / 32 value
  heads of 128, conv 4, full attention every 4th layer, partial RoPE 0.25, rope_theta 1e4,
  RMS eps 1e-6.  The 4B-specific d_model 2560, MLP 9216 and 32 layers come from public
  ``config.json`` copies of Qwen3.5-4B fine-tunes (``Qwen3_5ForCausalLM``, e.g.
  huggingface.co/halen214/st01, which also repeat the GDN and attention numbers above) and a
  derived model's card (Qwen3.5-4B backbone: 2560 wide, 32 layers, 16 Q / 4 KV heads x 256);
  assumed: an untied head (a tied one is 4.21 B; the decode step's work is the same).
* Granite-4.0-H: ``GraniteMoeHybridConfig`` names no Granite-4.0-H shape (generic defaults;
  ``ibm-granite/granite-4.0-h-tiny`` appears only in a usage example).  From public pages:
  7 B total / ~1 B active, 40 layers, 4 KV heads x 128, 6 experts per token, attention at
  5/15/25/35 (9:1 Mamba-2 : attention), no position embedding.  From a public ``config.json``
  of a 1536-wide Granite-4.0-H (huggingface.co/bnbnoman01/test): d_model 1536, the attention
  layers above, Mamba-2 48 heads x 64, d_state 128, 1 group, conv 4, embedding multiplier
  12, logits scaling 6, attention multiplier 1/128.  Assumed (not documented in anything we
  could read offline): 64 experts of I=512 and the 1024-wide shared MLP (they give the
  published 7 B total), 12 attention heads (1536 / 128), residual multiplier 0.22 (Granite
  3.x), vocab 100352, RMS eps 1e-5, tied embeddings.

Weights follow the greedy-margin recipe (:mod:`replayssm.models.margin`, as the Mamba-2
presets of :func:`replayssm.bench.e2e._random_model_dir`): unit-variance embeddings,
``lm_head`` a permutation of the embedding rows over ``sqrt(d_model)``, and every residual
branch's output projection at ``0.02 / sqrt(layers)``, so the residual stream keeps the
current token's embedding and the greedy next token wins by a logit margin far above bf16
rounding (the oracle drafter's continuations stay valid).  Tensor names and shapes come from the model class itself (built on the
``meta`` device), so the files always match what the loader expects.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.margin import branch_scale, embedding_name, permuted_head, residual_outputs
from ..models.registry import model_class, parse_config
from .common import random_model_dir

NEMOTRON_4B = dict(
    model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=3136,
    hybrid_override_pattern="M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-", mamba_num_heads=96, mamba_head_dim=80,
    ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=256, num_attention_heads=40, num_key_value_heads=8,
    head_dim=128, intermediate_size=12544, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5, time_step_min=1e-3,
    use_conv_bias=True, use_bias=False, mlp_bias=False, tie_word_embeddings=False, eos_token_id=None)

QWEN3_NEXT_4B = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    num_hidden_layers=24, full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    partial_rotary_factor=0.25, rope_theta=10000000.0, intermediate_size=5120, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, shared_expert_intermediate_size=512,
    decoder_sparse_step=1, norm_topk_prob=True, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
    eos_token_id=None)

#: Qwen3.5-4B (``qwen3_5_text``, text model only; see the module docstring for each number's source)
QWEN3_5_4B = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=2560,
    num_hidden_layers=32, layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(32)],
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, intermediate_size=9216, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, eos_token_id=None)

#: Granite-4.0-H-Tiny (``granitemoehybrid``; see the module docstring for each number's source)
GRANITE_4_H_TINY = dict(
    model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], vocab_size=100352,
    hidden_size=1536, num_hidden_layers=40,
    layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)],
    num_attention_heads=12, num_key_value_heads=4, intermediate_size=512, shared_intermediate_size=1024,
    num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
    mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
    embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
    rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, eos_token_id=None)

HYBRID_PRESETS = {
    # name: (config.json, checkpoint dtype)
    "nemotron-h-4b": (NEMOTRON_4B, "bfloat16"),
    "qwen3-next-4b": (QWEN3_NEXT_4B, "bfloat16"),
    "qwen3.5-4b": (QWEN3_5_4B, "bfloat16"),
    "granite-4.0-h-tiny": (GRANITE_4_H_TINY, "bfloat16"),
    "nemotron-h-tiny": (dict(NEMOTRON_4B, vocab_size=256, hidden_size=64, hybrid_override_pattern="M-M*-EM*-",
                             mamba_num_heads=8, mamba_head_dim=10, ssm_state_size=16, n_groups=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=96, n_routed_experts=6,
                             num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=32,
                             n_group=2, topk_group=1, routed_scaling_factor=1.5), "float32"),
    "qwen3-next-tiny": (dict(QWEN3_NEXT_4B, vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=96, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=12,
                             num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=32),
                        "float32"),
    "qwen3.5-tiny": (dict(QWEN3_5_4B, vocab_size=256, hidden_size=64, num_hidden_layers=4,
                          layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16), "float32"),
    "granite-4.0-h-tiny-smoke": (dict(GRANITE_4_H_TINY, vocab_size=256, hidden_size=64, num_hidden_layers=4,
                                      layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=32,
                                      num_local_experts=6, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                                      mamba_d_state=16), "float32"),
}

#: the tiny stand-in of each preset for ``--smoke`` runs
TINY_OF = {"nemotron-h-4b": "nemotron-h-tiny", "qwen3-next-4b": "qwen3-next-tiny", "qwen3.5-4b": "qwen3.5-tiny",
           "granite-4.0-h-tiny": "granite-4.0-h-tiny-smoke"}
TINY_OF.update({t: t for t in list(TINY_OF.values())})


def preset_config(preset: str, num_layers: int | None = None) -> dict:
    """The preset's ``config.json`` dict; ``num_layers`` keeps the first layers only (profiling)."""
    cfg = dict(HYBRID_PRESETS[preset][0])
    if num_layers is not None:
        if cfg["model_type"] == "nemotron_h":
            cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:num_layers]
        else:
            cfg["num_hidden_layers"] = num_layers
            if "layer_types" in cfg:
                cfg["layer_types"] = cfg["layer_types"][:num_layers]
    return cfg


def _init(name: str, shape, module, L: int, gen, device, residual: bool = False):
    """Random value of one parameter (see the module docstring for the recipe); ``residual``:
    a residual branch's output projection (:func:`replayssm.models.margin.residual_outputs`)."""
    leaf = name.rpartition(".")[2]
    rnd = lambda scale: torch.randn(*shape, generator=gen, device=device) * scale
    uni = lambda lo, hi: torch.empty(*shape, device=device).uniform_(lo, hi, generator=gen)
    if leaf == "weight" and "norm" in name.rpartition(".")[0].rpartition(".")[2]:
        return torch.zeros(shape, device=device) if getattr(module, "zero_centered", False) else torch.ones(shape, device=device)
    if leaf == "A_log":
        return torch.log(uni(1.0, 16.0))
    if leaf == "dt_bias":
        return torch.log(torch.expm1(uni(1e-3, 1e-1)))
    if leaf == "D":
        return torch.ones(shape, device=device)
    if leaf == "e_score_correction_bias":
        return rnd(0.01)
    if "conv1d" in name:
        return rnd(0.3 if leaf == "weight" else 0.1)
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if residual:
        return rnd(branch_scale(0.02, L))
    return rnd(0.02)


def random_hybrid_dir(preset: str, root: str, seed: int = 0, num_layers: int | None = None,
                      gen_device: str | None = None) -> str:
    """Save a random-weight model of ``preset`` in HF layout under ``root``; returns its path.
    Values are drawn on ``gen_device`` (default: CUDA when available, it is much faster for
    4 B parameters) and saved in the preset's dtype."""
    cfg = preset_config(preset, num_layers)
    dev = gen_device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = f"random-{preset}" if num_layers is None else f"random-{preset}-{num_layers}l"
    return random_model_dir(root, name, {"config": cfg, "seed": seed, "gen_device": dev},
                            lambda d: _write_random_hybrid(d, preset, cfg, seed, dev))


def _write_random_hybrid(d: Path, preset: str, cfg: dict, seed: int, dev: str) -> None:
    dtype = getattr(torch, HYBRID_PRESETS[preset][1])
    parsed = parse_config(cfg, f"preset {preset}")
    with torch.device("meta"):
        model = model_class(parsed)(parsed, dtype, "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    L = parsed.num_hidden_layers
    sd = {}
    emb_name = embedding_name(model)
    residual = residual_outputs(model)
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        if name == emb_name:
            t = torch.randn(*p.shape, generator=gen, device=dev)
        else:
            t = _init(name, tuple(p.shape), module, L, gen, dev, name in residual)
        keep32 = name.rpartition(".")[2] in ("A_log", "dt_bias", "D", "e_score_correction_bias")
        sd[name] = t.to(torch.float32 if keep32 else dtype).cpu().contiguous()
    emb = sd[emb_name].float()
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed))
    sd["lm_head.weight"] = permuted_head(emb, perm).to(dtype).contiguous()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(d / "model.safetensors"))


def parameter_count(preset: str) -> int:
    """Parameters of the preset's model (from the meta-device skeleton, no memory)."""
    return config_parameter_count(preset_config(preset), f"preset {preset}")


def config_parameter_count(cfg: dict, what: str = "config dict") -> int:
    """Parameters of the model a ``config.json`` dict describes (meta-device skeleton)."""
    parsed = parse_config(dict(cfg), what)
    with torch.device("meta"):
        model = model_class(parsed)(parsed, torch.bfloat16, "cpu")
    return sum(p.numel() for p in model.parameters())
