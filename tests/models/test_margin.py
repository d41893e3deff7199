"""The greedy-margin recipe for random weights (``replayssm.models.margin``) on every model
type: which parameters are residual output projections, the greedy token of a checkpoint
written with the recipe is the permutation's (the layers never overturn it), and a random
TP shard scales exactly those projections."""

from __future__ import annotations

import re

import pytest
import torch

from replayssm.bench.e2e import mamba2_preset_config
from replayssm.bench.hybrid_presets import HYBRID_PRESETS, random_hybrid_dir
from replayssm.models import load_model
from replayssm.models.margin import branch_scale, embedding_name, permuted_head, residual_outputs
from replayssm.models.registry import SUPPORTED_MODEL_TYPES, model_class, parse_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models; ``tests/conftest.py``)."""


_QWEN3_5 = dict(vocab_size=67, hidden_size=24, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=22, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5, linear_conv_kernel_dim=3,
                tie_word_embeddings=False)

#: one small config per model type (the hybrid presets' tiny ones where there is one)
CONFIGS = {
    "mamba2": mamba2_preset_config("tiny"),
    "nemotron_h": HYBRID_PRESETS["nemotron-h-tiny"][0],
    "nemotron_h_latent": dict(HYBRID_PRESETS["nemotron-h-tiny"][0], hybrid_override_pattern="M*E-", moe_latent_size=8),
    "qwen3_next": HYBRID_PRESETS["qwen3-next-tiny"][0],
    "qwen3_5_text": HYBRID_PRESETS["qwen3.5-tiny"][0],
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(_QWEN3_5, model_type="qwen3_5_text")),
    "qwen3_5_moe_text": dict(_QWEN3_5, model_type="qwen3_5_moe_text", num_experts=5, num_experts_per_tok=2,
                             moe_intermediate_size=7, shared_expert_intermediate_size=9),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(
        _QWEN3_5, model_type="qwen3_5_moe_text", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=7,
        shared_expert_intermediate_size=9)),
    # untied: the recipe's head is a permutation only when it is not the embedding itself
    "granitemoehybrid": dict(HYBRID_PRESETS["granite-4.0-h-tiny-smoke"][0], tie_word_embeddings=False),
    "falcon_h1": dict(model_type="falcon_h1", vocab_size=61, hidden_size=30, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=6, intermediate_size=22, mamba_d_ssm=24,
                      mamba_n_heads=6, mamba_d_state=5, mamba_n_groups=2, tie_word_embeddings=False),
    "bamba": dict(model_type="bamba", vocab_size=61, hidden_size=20, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=11, attn_layer_indices=[1], mamba_n_heads=5,
                  mamba_d_head=8, mamba_n_groups=1, mamba_d_state=6, mamba_d_conv=4, tie_word_embeddings=False),
    "zamba2": dict(model_type="zamba2", vocab_size=61, hidden_size=32, num_hidden_layers=3,
                   layers_block_type=["mamba", "hybrid", "hybrid"], num_attention_heads=4, n_mamba_heads=8,
                   mamba_d_state=5, mamba_ngroups=2, tie_word_embeddings=False),
    "kimi_linear": dict(model_type="kimi_linear", vocab_size=67, hidden_size=24, num_hidden_layers=3,
                        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=7, qk_rope_head_dim=4,
                        qk_nope_head_dim=6, v_head_dim=5, intermediate_size=22, moe_intermediate_size=7, num_experts=6,
                        num_experts_per_token=2, num_shared_experts=1, n_group=2, topk_group=1, linear_head_dim=6,
                        linear_num_heads=3, linear_conv_kernel_dim=3,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"], tie_word_embeddings=False),
}

_MOE = ["mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight"]
_QWEN = ["linear_attn.out_proj.weight", "self_attn.o_proj.weight"]
#: every residual output projection, layer index as N (what each layer adds to the residual stream)
EXPECTED = {
    "mamba2": ["backbone.layers.N.mixer.out_proj.weight"],
    "nemotron_h": ["backbone.layers.N.mixer." + n for n in (
        "out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")],
    # the routed experts write the latent width; fc2_latent_proj adds to the residual stream
    "nemotron_h_latent": ["backbone.layers.N.mixer." + n for n in (
        "out_proj.weight", "o_proj.weight", "down_proj.weight", "fc2_latent_proj.weight",
        "shared_experts.down_proj.weight")],
    "qwen3_next": ["model.layers.N." + n for n in _QWEN + _MOE],
    "qwen3_5_text": ["model.layers.N." + n for n in _QWEN + ["mlp.down_proj.weight"]],
    "qwen3_5": ["model.layers.N." + n for n in _QWEN + ["mlp.down_proj.weight"]],
    "qwen3_5_moe_text": ["model.layers.N." + n for n in _QWEN + _MOE],
    "qwen3_5_moe": ["model.layers.N." + n for n in _QWEN + _MOE],
    "granitemoehybrid": ["model.layers.N." + n for n in (
        "mamba.out_proj.weight", "self_attn.o_proj.weight", "block_sparse_moe.output_linear.weight",
        "shared_mlp.output_linear.weight")],
    "falcon_h1": ["model.layers.N." + n for n in (
        "mamba.out_proj.weight", "self_attn.o_proj.weight", "feed_forward.down_proj.weight")],
    "bamba": ["model.layers.N." + n for n in (
        "mamba.out_proj.weight", "self_attn.o_proj.weight", "feed_forward.down_proj.weight")],
    # the shared transformer's o_proj / down_proj feed a norm and the Mamba-2 input, not the stream
    "zamba2": ["model.layers.N.mamba.out_proj.weight", "model.layers.N.mamba_decoder.mamba.out_proj.weight"],
    "kimi_linear": ["model.layers.N." + n for n in (
        "self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.experts.down_proj",
        "mlp.shared_experts.down_proj.weight")],
}


def _meta_model(cfg: dict):
    parsed = parse_config(dict(cfg), "test config")
    with torch.device("meta"):
        return model_class(parsed)(parsed, torch.float32, "cpu")


def _collapse(names) -> set[str]:
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names}


def test_every_model_type_is_covered():
    types = {parse_config(dict(c), k).model_type for k, c in CONFIGS.items()}
    assert types == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_residual_outputs_of_every_model_type(name):
    m = _meta_model(CONFIGS[name])
    got = residual_outputs(m)
    assert _collapse(got) == set(EXPECTED[name])
    assert embedding_name(m).endswith(("embeddings.weight", "embed_tokens.weight"))
    layers = {int(re.search(r"\.(\d+)\.", n).group(1)) for n in got}
    assert layers == set(range(len(layers))) and len(layers) >= 2  # every layer has one


@pytest.mark.parametrize("name", list(CONFIGS))
def test_margin_checkpoint_greedy_token_is_the_permutation(name, tmp_path, monkeypatch):
    """A checkpoint written with the recipe (``bench.hybrid_presets``' writer, any config):
    every position's greedy token is the zero-layer model's (``argmax_j lm_head[j] . E[t]``,
    the permutation's preimage of the current token ``t``), by a margin well above rounding."""
    monkeypatch.setitem(HYBRID_PRESETS, "test-" + name, (CONFIGS[name], "float32"))
    m = load_model(random_hybrid_dir("test-" + name, str(tmp_path), seed=3, gen_device="cpu"), device="cpu",
                   dtype=torch.float32)
    params = dict(m.named_parameters())
    emb, head = params[embedding_name(m)], params["lm_head.weight"]
    V = emb.shape[0]
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = m(ids).double()
        direct = emb.double()[ids] @ head.double().T
    assert torch.equal(logits.argmax(-1), direct.argmax(-1))
    top = logits.topk(2, -1).values
    assert float(((top[..., 0] - top[..., 1]) / logits.std(-1)).min()) > 0.5


#: the families random TP shards support (Zamba2 and Kimi-Linear have no sharding rules)
TP_TYPES = ["mamba2", "nemotron_h", "nemotron_h_latent", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
            "granitemoehybrid", "falcon_h1", "bamba"]


@pytest.mark.parametrize("name", TP_TYPES)
def test_random_shard_scales_exactly_the_residual_outputs(name):
    """``random_shard(margin=True)`` against the plain draw (same seeds): the residual
    outputs over ``sqrt(layers)``, embedding and head replaced, everything else equal."""
    from replayssm.distributed.loading import random_shard

    cfg = CONFIGS[name]
    margin = random_shard(cfg, 0, 1, dtype="float32", seed=5, margin=True)
    plain = dict(random_shard(cfg, 0, 1, dtype="float32", seed=5).named_parameters())
    L = margin.config.num_hidden_layers
    scaled, emb = residual_outputs(margin), embedding_name(margin)
    assert _collapse(scaled) == set(EXPECTED[name])
    for n, p in margin.named_parameters():
        if n in scaled:
            torch.testing.assert_close(p, plain[n] / L ** 0.5, rtol=1e-6, atol=0)
        elif n not in (emb, "lm_head.weight"):
            assert torch.equal(p, plain[n]), n
    p = dict(margin.named_parameters())
    E, W = p[emb], p["lm_head.weight"]
    src = torch.cdist(W * E.shape[1] ** 0.5, E).argmin(-1)           # the embedding row of each head row
    assert sorted(src.tolist()) == list(range(E.shape[0]))             # a permutation
    torch.testing.assert_close(W, E[src] / E.shape[1] ** 0.5, rtol=1e-6, atol=0)


def test_permuted_head_and_branch_scale():
    emb = torch.randn(7, 9, dtype=torch.float64)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    head = permuted_head(emb, perm)
    assert head.dtype == torch.float32
    torch.testing.assert_close(head, emb.float()[perm] / 3.0, rtol=0, atol=0)
    torch.testing.assert_close(permuted_head(emb, perm[:3]), head[:3], rtol=0, atol=0)   # a shard's rows
    assert branch_scale(0.02, 4) == 0.01 and branch_scale(0.02, 0) == 0.02
    with pytest.raises(ValueError, match=r"emb \[V, D\]"):
        permuted_head(emb[0], perm)
    with pytest.raises(ValueError, match=r"perm \[V'\]"):
        permuted_head(emb, perm[None])
