"""Test helpers: tiny random transformers models saved to disk, and an fp64 reference mode.

transformers computes several pieces in float32 on purpose (norms, the SSM scans, the RoPE
angles, softmax), even when the model is float64.  To compare at 1e-8 we run transformers
under :class:`Float32AsFloat64`, a torch function mode that turns every float64 -> float32
cast (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32`` arguments) into a
no-op / float64, i.e. transformers' own code with "fp32" meaning "at least fp32".
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

F32, F64 = torch.float32, torch.float64


def _swap(v):
    if v is F32:
        return F64
    if isinstance(v, (list, tuple)):
        return type(v)(_swap(x) for x in v)
    return v


class Float32AsFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:  # "to float32" (also int positions) -> float64
            return args[0].to(F64)
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_swap(a) for a in args)
            kwargs = {k: _swap(v) for k, v in kwargs.items()}
        elif "dtype" in kwargs:
            kwargs["dtype"] = _swap(kwargs["dtype"])
        return func(*args, **kwargs)


def save_tiny(model, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def save_quiet(model, path: str) -> str:
    """:func:`save_tiny` with transformers' save-time warnings (tied or shared weights) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_tiny(model, path)


def build_tiny(cls, config, seed: int, prepare=None):
    """``cls(config)`` in eval mode: eager attention and experts (:func:`_eager`), its random
    weights drawn after ``torch.manual_seed(seed)``, ``prepare(model)`` (when given) applied,
    then the constant-initialised parameters randomised (:func:`_jitter`)."""
    torch.manual_seed(seed)
    m = _eager(cls, config).eval()
    if prepare is not None:
        prepare(m)
    _jitter(m, seed)
    return m


def built_models(root, build, load: bool = False):
    """``get(name)``: ``build(name)`` (a transformers model) saved under ``root/name``, with
    ``load`` also read back by replayssm in float64; built once per ``name``.  Returns
    ``(hf_model, path)`` or ``(hf_model, path, replayssm_model)``."""
    from replayssm.models import load_model

    cache = {}

    def get(name):
        if name not in cache:
            m = build(name)
            path = save_quiet(m, os.path.join(str(root), name))
            cache[name] = (m, path, load_model(path, dtype="float64")) if load else (m, path)
        return cache[name]

    return get


def greedy_reference(model, prompts, n: int) -> list[list[int]]:
    """:func:`hf_greedy` of every prompt, checked not degenerate (more than 5 distinct tokens)."""
    ref = [hf_greedy(model, p, n) for p in prompts]
    assert len({t for r in ref for t in r}) > 5, ref
    return ref


def engine_runs(draft_model, ngram_modes=("replay", "kv")) -> list[dict]:
    """``LLM`` keyword sets of the families' generation tests: every decode mode plain, n-gram
    speculation (3 drafts) in ``ngram_modes``, and the model drafting for itself as a chain
    (replay, 3 drafts) and as a tree (kv, width 2, depth 2), through its own cache."""
    from replayssm import SpeculativeConfig

    runs = [dict(decode_mode=m) for m in ("recurrent", "replay", "kv", "auto")]
    runs += [dict(decode_mode=m, speculative=SpeculativeConfig("ngram", num_tokens=3)) for m in ngram_modes]
    runs += [dict(decode_mode="replay", speculative=SpeculativeConfig("draft", num_tokens=3, draft_model=draft_model)),
             dict(decode_mode="kv", speculative=SpeculativeConfig("tree", draft_model=draft_model, tree_width=2,
                                                                  tree_depth=2))]
    return runs


def generate_quiet(llm, prompts, n: int) -> list[list[int]]:
    """Greedy ``n`` tokens of every prompt from ``llm`` (warnings silenced): the token ids."""
    from replayssm import SamplingParams

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n))]


def tiny_mamba2(seed=0, **over):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    kw = dict(vocab_size=61, hidden_size=20, num_heads=5, head_dim=8, state_size=6, n_groups=1,
              expand=2, num_hidden_layers=2, conv_kernel=4, chunk_size=8, residual_in_fp32=False,
              tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    kw.update(over)
    return build_tiny(Mamba2ForCausalLM, Mamba2Config(**kw), seed)


def tiny_nemotron_h(seed=0, **over):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    kw = dict(vocab_size=61, hidden_size=24, hybrid_override_pattern="M*-E", num_attention_heads=4,
              num_key_value_heads=2, head_dim=5, intermediate_size=18, mamba_num_heads=6, mamba_head_dim=4,
              ssm_state_size=5, n_groups=3, conv_kernel=3, chunk_size=8, n_routed_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=7, moe_shared_expert_intermediate_size=9,
              n_group=2, topk_group=1, routed_scaling_factor=1.5, time_step_min=1e-4,
              tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    kw.update(over)
    return build_tiny(NemotronHForCausalLM, NemotronHConfig(**kw), seed)


def tiny_qwen3_next(seed=0, **over):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kw = dict(vocab_size=61, hidden_size=24, num_hidden_layers=3, full_attention_interval=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=20,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
              linear_value_head_dim=5, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=7, shared_expert_intermediate_size=9, decoder_sparse_step=1,
              tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    kw.update(over)
    return build_tiny(Qwen3NextForCausalLM, Qwen3NextConfig(**kw), seed)


#: the Qwen3-Next-80B-A3B structure (``scripts/gpu_tp_big.py --model qwen3-next-80b``) at tiny,
#: odd sizes that split over 2 and 4 ranks: 4 layers (GDN, GDN, GDN, attention), 8 query / 2 KV
#: heads of 8 (rotary on 2 channels), GDN 4 key / 12 value heads, 7 experts top-3 of 12
#: channels, a shared expert of 20, hidden 21, vocabulary 67
QWEN3_NEXT_80B_TINY = dict(vocab_size=67, hidden_size=21, num_hidden_layers=4, full_attention_interval=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.25,
                           linear_num_key_heads=4, linear_num_value_heads=12, linear_key_head_dim=6,
                           linear_value_head_dim=5, linear_conv_kernel_dim=4, num_experts=7, num_experts_per_tok=3,
                           moe_intermediate_size=12, shared_expert_intermediate_size=20, decoder_sparse_step=1,
                           mlp_only_layers=[], rms_norm_eps=1e-6)


def _eager(cls, cfg):
    """Eager attention and eager (per-expert loop) MoE: the plain torch paths."""
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cls(cfg)


@torch.no_grad()
def _jitter(model, seed):
    """Randomise the parameters HF initialises to constants (norm weights, biases, D, router
    bias) so the test exercises every weight; keep magnitudes modest."""
    g = torch.Generator().manual_seed(1000 + seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(p + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        elif leaf in ("D", "bias") or name.endswith("dt_bias"):
            p.copy_(p + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=g, dtype=b.dtype))


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor, float64: bool = True) -> torch.Tensor:
    if float64:
        model = model.to(F64)
        with Float32AsFloat64():
            return model(ids).logits.to(F64)
    return model(ids).logits


# name -> (builder, overrides).  Odd sizes everywhere; see hf_utils for the base configs.
SPECS = {
    # Mamba-2, one group (transformers' torch norm == mamba_ssm's grouped norm), 3 layers
    "mamba2": (tiny_mamba2, dict(num_hidden_layers=3)),
    # Mamba-2, 5 heads in... 3 groups impossible (5 % 3); use 6 heads / 3 groups, tied embeddings
    "mamba2_g3": (tiny_mamba2, dict(num_heads=6, head_dim=5, hidden_size=15, n_groups=3,
                                     tie_word_embeddings=True)),
    # Nemotron-H: Mamba (3 groups) + attention (GQA) + relu2 MLP + grouped sigmoid MoE
    "nemotron_h": (tiny_nemotron_h, dict(hybrid_override_pattern="M*-EM")),
    # Nemotron-H without MoE, attention first, one group, latent-free
    "nemotron_h_dense": (tiny_nemotron_h, dict(hybrid_override_pattern="*M-M", n_groups=1,
                                                 tie_word_embeddings=True)),
    # Qwen3-Next: GDN with GVA (2 key heads, 4 value heads), gated attention, MoE + shared expert
    "qwen3_next": (tiny_qwen3_next, dict()),
    # Qwen3-Next: dense MLP layers (mlp_only_layers), attention in the middle, 1:3 GVA, tied
    "qwen3_next_dense": (tiny_qwen3_next, dict(num_hidden_layers=4, full_attention_interval=3,
                                                 linear_num_key_heads=1, linear_num_value_heads=3,
                                                 mlp_only_layers=[0, 2], decoder_sparse_step=1,
                                                 partial_rotary_factor=0.5, tie_word_embeddings=True)),
    # variants exercising optional weights / clamps (parity only)
    "mamba2_opts": (tiny_mamba2, dict(use_bias=True, use_conv_bias=False, residual_in_fp32=True,
                                        time_step_limit=(0.02, 0.06), num_hidden_layers=1)),
    "nemotron_h_opts": (tiny_nemotron_h, dict(hybrid_override_pattern="ME*", use_bias=True, mlp_bias=True,
                                                moe_latent_size=5, time_step_min=0.05, norm_topk_prob=False,
                                                n_group=1, use_conv_bias=False)),
    "qwen3_next_opts": (tiny_qwen3_next, dict(num_hidden_layers=2, attention_bias=True,
                                                norm_topk_prob=False, num_experts_per_tok=3)),
}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from transformers' ``generate`` in float64 (a copy of ``model``)."""
    hf64 = copy.deepcopy(model).to(torch.float64)
    ids = torch.tensor([prompt])
    with torch.no_grad(), Float32AsFloat64():
        out = hf64.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            pad_token_id=0, eos_token_id=None, use_cache=True)
    return out[0, len(prompt):].tolist()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|``."""
    return ((got - ref).abs().max() / ref.abs().max()).item()

