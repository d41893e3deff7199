"""Random MTP heads in each family's checkpoint layout, added to a saved HF model directory,
and an independent reference of the MTP step built from transformers' own modules.

transformers 5.17 skips ``mtp.*`` tensors (it has no MTP modules), so the weights are made
here: the MTP decoder layers come from a one-layer transformers model of the same config
(saved with ``save_pretrained``, so tensor names and expert layout are exactly what
transformers writes for the target's own layers), renamed under ``mtp.``; the fc and the two
input norms are random.  The reference step is ``body(inputs_embeds=fc([n_e(E x); n_h(h)]))``
of that one-layer model, whose final norm is the MTP's output norm.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_utils as H

#: config.json additions that declare the MTP head
NEMOTRON_MTP_TYPES = ["full_attention", "moe"]


def _one_layer_model(path: str, seed: int):
    import transformers

    conf = transformers.AutoConfig.from_pretrained(path)
    mt = conf.model_type
    if mt.startswith("qwen3_5"):   # the text decoder's layer (a multimodal config holds it in text_config)
        conf = getattr(conf, "text_config", None) or conf
        conf.num_hidden_layers = 1
        conf.layer_types = ["full_attention"]
        cls = transformers.Qwen3_5MoeForCausalLM if "moe" in mt else transformers.Qwen3_5ForCausalLM
    elif mt == "qwen3_next":
        conf.num_hidden_layers = 1
        conf.layer_types = ["full_attention"]
        cls = transformers.Qwen3NextForCausalLM
    elif mt == "nemotron_h":
        conf.layers_block_type = list(NEMOTRON_MTP_TYPES)
        cls = transformers.NemotronHForCausalLM
    else:
        conf.num_hidden_layers = 1
        cls = transformers.Mamba2ForCausalLM
    torch.manual_seed(seed)
    m = H._eager(cls, conf).eval()
    H._jitter(m, seed)
    return m, mt


def add_mtp(path: str, seed: int = 0) -> dict:
    """Write ``mtp.safetensors`` (random MTP head, checkpoint layout) into the HF model
    directory ``path`` and declare it in ``config.json``; returns what :func:`reference_g`
    needs."""
    one, mt = _one_layer_model(path, seed)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one.save_pretrained(tmp)
        sd = {}
        for fn in os.listdir(tmp):
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(tmp, fn), "pt") as f:
                    sd.update({k: f.get_tensor(k) for k in f.keys()})
    cfg = json.load(open(os.path.join(path, "config.json")))
    tc = cfg.get("text_config", cfg)       # a multimodal Qwen3.5 config holds the text model's sizes
    D = tc["hidden_size"]
    g = torch.Generator().manual_seed(100 + seed)
    fc = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
    # zero-centred norms (Qwen3-Next) store w with y = (1 + w) x_hat
    qwen = mt == "qwen3_next" or mt.startswith("qwen3_5")
    base = 0.0 if qwen else 1.0
    n_e = base + 0.2 * torch.randn(D, generator=g)
    n_h = base + 0.2 * torch.randn(D, generator=g)
    out = {}
    if qwen:
        for k, v in sd.items():
            if k.startswith("model.layers.0."):
                out["mtp.layers.0." + k[len("model.layers.0."):]] = v
        out["mtp.norm.weight"] = sd["model.norm.weight"]
        out.update({"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": n_e,
                    "mtp.pre_fc_norm_hidden.weight": n_h})
        tc["mtp_num_hidden_layers" if mt.startswith("qwen3_5") else "num_nextn_predict_layers"] = 1
    elif mt == "nemotron_h":
        last = len(NEMOTRON_MTP_TYPES) - 1
        for k, v in sd.items():
            if k.startswith("backbone.layers."):
                out["mtp." + k[len("backbone."):]] = v
        out[f"mtp.layers.{last}.final_layernorm.weight"] = sd["backbone.norm_f.weight"]
        out.update({"mtp.layers.0.eh_proj.weight": fc, "mtp.layers.0.enorm.weight": n_e,
                    "mtp.layers.0.hnorm.weight": n_h})
        cfg["num_nextn_predict_layers"] = 1
        cfg["mtp_hybrid_override_pattern"] = "".join({"full_attention": "*", "moe": "E", "mlp": "-",
                                                      "linear_attention": "M"}[t] for t in NEMOTRON_MTP_TYPES)
    else:
        for k, v in sd.items():
            if k.startswith("backbone.layers.0."):
                out["mtp." + k[len("backbone."):]] = v
        out["mtp.norm.weight"] = sd["backbone.norm_f.weight"]
        out.update({"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": n_e,
                    "mtp.pre_fc_norm_hidden.weight": n_h})
        cfg["num_nextn_predict_layers"] = 1
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "mtp.safetensors"))
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"), indent=1)
    return {"model_type": mt, "one": one, "fc": fc, "n_e": n_e, "n_h": n_h, "eps": _eps(tc)}


def _eps(cfg):
    return cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-5))


def _rms(x, w, eps, zero_centered):
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return xn * (1.0 + w) if zero_centered else w * xn


@torch.no_grad()
def reference_g(ref: dict, embed: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP step's output ``g [B, T, D]`` in float64 from transformers modules:
    tokens ``x_{t+1}`` ``[B, T]``, target hidden states ``h_t`` ``[B, T, D]``."""
    zc = ref["model_type"] == "qwen3_next" or ref["model_type"].startswith("qwen3_5")
    f64 = torch.float64
    e = _rms(embed.to(f64)[tokens], ref["n_e"].to(f64), ref["eps"], zc)
    h = _rms(hidden.to(f64), ref["n_h"].to(f64), ref["eps"], zc)
    u = torch.cat([e, h], -1) @ ref["fc"].to(f64).T
    one = ref["one"].to(f64)
    body = one.backbone if hasattr(one, "backbone") else one.model
    with H.Float32AsFloat64():
        return body(inputs_embeds=u).last_hidden_state.to(f64)


@torch.no_grad()
def hf_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's final-normed hidden states (the LM head's input), float64."""
    model = model.to(torch.float64)
    body = model.model if hasattr(model, "model") else model.backbone
    with H.Float32AsFloat64():
        return body(ids).last_hidden_state.to(torch.float64)


_BRANCH_OUT = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj")


def make_predictable(path: str, seed: int = 0, mtp_noise: float = 0.0, branch_scale: float = 0.01,
                     hidden_scale: float = 0.5) -> None:
    """Rewrite the weights in ``path`` so that greedy decoding mostly walks a fixed permutation
    of the vocabulary and the MTP head mostly predicts it: unit-variance embeddings, ``lm_head``
    the permuted embedding rows over ``sqrt(D)``, every residual branch's output projection
    scaled by ``branch_scale`` (the residual stream keeps the current token's embedding), and the
    MTP's fc reading the embedding half (plus ``mtp_noise``: wrong guesses for some tokens) and
    a random ``hidden_scale`` part of the hidden half (so a wrong hidden state shows).
    Speculation then accepts long runs, which exercises the multi-token accept paths."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(500 + seed)
    cfg = json.load(open(os.path.join(path, "config.json")))
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    for fn in sorted(os.listdir(path)):
        if not fn.endswith(".safetensors"):
            continue
        full = os.path.join(path, fn)
        sd = load_file(full)
        for k in list(sd):
            if k.endswith(_BRANCH_OUT):
                sd[k] = sd[k] * branch_scale
            elif k.endswith(("embeddings.weight", "embed_tokens.weight")):
                emb = torch.randn(V, D, generator=g)
                sd[k] = emb
                sd["lm_head.weight"] = emb[torch.randperm(V, generator=g)] / D ** 0.5
            elif k.endswith(("mtp.fc.weight", "eh_proj.weight")):
                w = torch.zeros(D, 2 * D)
                w[:, :D] = torch.eye(D) + mtp_noise * torch.randn(D, D, generator=g) / D ** 0.5
                w[:, D:] = hidden_scale * torch.randn(D, D, generator=g) / D ** 0.5
                sd[k] = w
        save_file({k: v.contiguous() for k, v in sd.items()}, full)
