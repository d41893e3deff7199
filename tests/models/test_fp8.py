"""FP8 checkpoints (``replayssm.models.quant``): ``quantize`` writes the block-scaled or
per-tensor layout, the loader reads it (and the ModelOpt per-tensor layout), the FP8 model
equals the model loaded from an independently dequantized float64 checkpoint, greedy output is
the same in every decode mode and with n-gram speculation, and bad checkpoints are refused by
name before anything is installed."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_utils as H
from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.layers.linear import Linear
from replayssm.layers.mlp import FP8Experts
from replayssm.models import load_model
from replayssm.models import loader as L
from replayssm.models.config import ConfigError, WeightError
from replayssm.models.quant import read_quant_config
from replayssm.models.quantize import quantize_checkpoint
from replayssm.ops.fp8 import naive as Q

IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
# block (2, 8): Qwen3-Next's head reorder moves whole 2-row blocks; (4, 8) partial edge blocks
CASES = {"nemotron_block": (H.tiny_nemotron_h, (4, 8)), "qwen_block": (H.tiny_qwen3_next, (2, 8)),
         "nemotron_tensor": (H.tiny_nemotron_h, None)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    cache = {}

    def get(name):
        if name not in cache:
            fn, block = CASES[name]
            src, dst = str(root / name), str(root / (name + "-fp8"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                H.save_tiny(fn(seed=3, moe_intermediate_size=8), src)
            quantize_checkpoint(src, dst, block)
            cache[name] = (src, dst)
        return cache[name]

    return get


def _tensors(path):
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _rewrite(src, dst, tensors, conf_edit=None):
    """A copy of model dir ``src`` at ``dst`` holding ``tensors`` (config edited in place)."""
    shutil.copytree(src, dst)
    for fn in os.listdir(dst):
        if fn.endswith(".safetensors"):
            os.remove(os.path.join(dst, fn))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    if conf_edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            conf = json.load(f)
        conf_edit(conf)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(conf, f)
    return dst


def _dequantized_dir(fp8_dir, dst):
    """The float64 checkpoint of the dequantized weights (plain torch, not the loader's path)."""
    block = read_quant_config(fp8_dir).block
    t = _tensors(fp8_dir)
    out = {}
    for k, v in t.items():
        if k.endswith(("_scale_inv", "_scale")):
            continue
        base = k[:-len("weight")]
        if v.dtype == Q.FP8:
            out[k] = (Q.dequantize_block(v, t[base + "weight_scale_inv"], block, torch.float64) if block
                      else Q.dequantize_tensor(v, t[base + "weight_scale"], torch.float64))
        else:
            out[k] = v
    return _rewrite(fp8_dir, dst, out, lambda c: c.pop("quantization_config"))


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_model_equals_dequantized_weights(ckpt, tmp_path, name):
    src, dst = ckpt(name)
    m8 = load_model(dst, dtype="float64")
    ref = load_model(_dequantized_dir(dst, str(tmp_path / "deq")), dtype="float64")
    lin = [m for m in m8.modules() if isinstance(m, Linear)]
    exp = [m for m in m8.modules() if isinstance(m, FP8Experts)]
    assert sum(m.fp8 for m in lin) >= 6 and exp and all(m.fp8 for m in exp)
    assert all(m.weight.dtype == Q.FP8 for m in lin if m.fp8)
    assert all(not m.fp8 and m.weight.dtype == torch.float64 for m in lin if m.d_out <= 4)  # gates stay
    got, want = m8(IDS), ref(IDS)
    assert (got - want).abs().max().item() <= 1e-9 * want.abs().max().item()
    plain = load_model(src, dtype="float64")(IDS)          # and close to the unquantized model
    assert H.rel_err(got, plain) < 0.15


def test_fp8_float32_model_close_to_float64(ckpt):
    _, dst = ckpt("qwen_block")
    a, b = load_model(dst, dtype="float32")(IDS), load_model(dst, dtype="float64")(IDS)
    assert H.rel_err(a.double(), b) < 1e-5


def reference_greedy(model, prompt, n):
    """Plain greedy decoding by full forwards."""
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        out.append(int(model(ids)[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out


@pytest.mark.parametrize("name", ["qwen_block", "nemotron_block"])
def test_fp8_greedy_same_in_every_mode_and_with_ngram(ckpt, name):
    _, dst = ckpt(name)
    model = load_model(dst, dtype="float64")
    prompts = [[1, 2, 3], [7, 7, 7, 1, 7, 7, 7, 1]]
    want = [reference_greedy(model, p, 10) for p in prompts]
    for mode in ("recurrent", "replay", "kv", "auto"):
        outs = LLM(model, decode_mode=mode, auto_threshold=6).generate(prompts, SamplingParams(max_tokens=10))
        assert [o.token_ids for o in outs] == want, mode
    for mode in ("replay", "recurrent"):
        llm = LLM(model, decode_mode=mode, speculative=SpeculativeConfig("ngram", num_tokens=3), buffer_size=16)
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10))] == want, mode


def test_modelopt_per_tensor_layout(ckpt, tmp_path):
    """NVIDIA ModelOpt layout: hf_quant_config.json, per-tensor weight_scale [] and input_scale,
    KV-cache scales read past."""
    _, dst = ckpt("nemotron_tensor")
    t = _tensors(dst)
    for k in list(t):
        if k.endswith(".weight_scale"):
            t[k[:-len("weight_scale")] + "input_scale"] = torch.tensor(0.02)
    t["backbone.layers.1.mixer.k_scale"] = torch.tensor(1.0)
    d = _rewrite(dst, str(tmp_path / "mo"), t, lambda c: c.pop("quantization_config"))
    with open(os.path.join(d, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}, f)
    m = load_model(d, dtype="float64")
    assert read_quant_config(d).method == "modelopt"
    assert any(getattr(x, "input_scale", None) is not None for x in m.modules() if isinstance(x, Linear))
    assert torch.equal(m(IDS), load_model(dst, dtype="float64")(IDS))   # the reference ignores input scales


def _no_install(monkeypatch):
    calls = []
    monkeypatch.setattr(L, "_install", lambda *a: calls.append(a))
    return calls


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("backbone.layers.0.mixer.in_proj.weight_scale_inv"), "in_proj.weight'.*no scale"),
    (lambda t: t.update({"backbone.layers.0.mixer.in_proj.weight_scale_inv": torch.ones(3, 3)}),
     "in_proj.weight_scale_inv.*shape"),
    (lambda t: t["backbone.layers.2.mixer.up_proj.weight_scale_inv"].view(-1).__setitem__(1, float("nan")),
     "up_proj.weight_scale_inv.*non-finite"),
    (lambda t: t["backbone.layers.3.mixer.experts.1.down_proj.weight_scale_inv"].zero_(),
     "experts.1.down_proj.weight_scale_inv.*non-positive"),
    (lambda t: t.update({"backbone.layers.0.mixer.out_proj.weight":
                         t["backbone.layers.0.mixer.out_proj.weight"].to(torch.bfloat16)}),
     "out_proj.weight.*expected F8_E4M3"),
])
def test_bad_fp8_checkpoint_refused_before_install(ckpt, tmp_path, monkeypatch, edit, match):
    _, dst = ckpt("nemotron_block")
    t = _tensors(dst)
    edit(t)
    d = _rewrite(dst, str(tmp_path / "bad"), t)
    calls = _no_install(monkeypatch)
    with pytest.raises(WeightError, match=match):
        load_model(d, dtype="float64")
    assert calls == []


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "'awq' \\(AWQ"), ({"quant_method": "gptq"}, "GPTQ"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"), ({"quant_method": "whatever"}, "unknown"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
])
def test_other_quantization_refused_by_name(ckpt, tmp_path, qc, match):
    src, _ = ckpt("nemotron_block")
    d = _rewrite(src, str(tmp_path / "q"), _tensors(src), lambda c: c.update(quantization_config=qc))
    with pytest.raises(ConfigError, match=match):
        load_model(d)


def test_ignored_layer_with_scale_and_misaligned_reorder_refused(ckpt, tmp_path):
    _, dst = ckpt("nemotron_block")
    d = _rewrite(dst, str(tmp_path / "ign"), _tensors(dst),
                 lambda c: c["quantization_config"].update(ignored_layers=["backbone.layers.0.mixer.in_proj"]))
    with pytest.raises(WeightError, match="in_proj.*listed as unquantized"):
        load_model(d)
    src, _ = ckpt("qwen_block")
    bad = str(tmp_path / "q4")
    quantize_checkpoint(src, bad, (4, 8))        # 6- and 10-row head chunks straddle 4-row blocks
    with pytest.raises(WeightError, match="in_proj_qkvz.weight.*across FP8 blocks"):
        load_model(bad)


def test_quantize_layout_and_refusals(ckpt, tmp_path):
    src, dst = ckpt("qwen_block")
    t = _tensors(dst)
    w = t["model.layers.0.linear_attn.out_proj.weight"]
    assert w.dtype == Q.FP8 and t["model.layers.0.linear_attn.out_proj.weight_scale_inv"].shape == (12, 3)
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.float32           # router stays
    assert t["model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv"].shape == (4, 3)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(dst, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="must differ"):
        quantize_checkpoint(src, src)
    with pytest.raises(ValueError, match="block"):
        quantize_checkpoint(src, str(tmp_path / "y"), (0, 8))


def test_quantize_cli(ckpt, tmp_path, capsys):
    from replayssm.cli import main
    src, _ = ckpt("nemotron_block")
    out = str(tmp_path / "cli")
    assert main(["quantize", src, out, "--fp8-block", "4,8"]) == 0
    assert read_quant_config(out).block == (4, 8) and "FP8 e4m3, block [4, 8]" in capsys.readouterr().out
    assert main(["quantize", src, str(tmp_path / "pt"), "--per-tensor"]) == 0
    assert read_quant_config(str(tmp_path / "pt")).block is None
    assert load_model(str(tmp_path / "pt"), dtype="float64")(IDS).isfinite().all()
    assert main(["quantize", out, str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", src, str(tmp_path / "z"), "--fp8-block", "0"])


def test_quantize_model_in_place_equals_quantized_checkpoint(ckpt):
    from replayssm.models.quantize import quantize_model_
    src, dst = ckpt("nemotron_block")
    m = load_model(src, dtype="float64")
    names = quantize_model_(m, (4, 8))
    assert names and all(isinstance(dict(m.named_modules())[n], (Linear, FP8Experts)) for n in names)
    assert torch.equal(m(IDS), load_model(dst, dtype="float64")(IDS))


def test_nan_fp8_weight_refused(ckpt, tmp_path):
    _, dst = ckpt("nemotron_block")
    t = _tensors(dst)
    w = t["backbone.layers.0.mixer.out_proj.weight"].view(torch.uint8).clone()
    w[3, 5] = 0x7F                                   # e4m3fn NaN
    t["backbone.layers.0.mixer.out_proj.weight"] = w.view(Q.FP8)
    with pytest.raises(WeightError, match="out_proj.weight.*NaN"):
        load_model(_rewrite(dst, str(tmp_path / "nan"), t))


def test_bfloat16_scales_and_scalar_shapes(ckpt, tmp_path):
    """Qwen's release stores ``weight_scale_inv`` in bf16; per-tensor scales may be ``[1]``."""
    _, dst = ckpt("qwen_block")
    t = {k: (v.to(torch.bfloat16) if k.endswith("_scale_inv") else v) for k, v in _tensors(dst).items()}
    d = _rewrite(dst, str(tmp_path / "bf"), t)
    m = load_model(d, dtype="float64")
    assert all(p.dtype == torch.float32 for n, p in m.named_parameters() if n.endswith("_scale_inv"))
    ref = load_model(_dequantized_dir(d, str(tmp_path / "bfdeq")), dtype="float64")
    assert (m(IDS) - ref(IDS)).abs().max().item() <= 1e-9 * ref(IDS).abs().max().item()
    _, dst = ckpt("nemotron_tensor")
    t = {k: (v.reshape(1) if k.endswith("weight_scale") else v) for k, v in _tensors(dst).items()}
    m1 = load_model(_rewrite(dst, str(tmp_path / "one"), t), dtype="float64")
    assert torch.equal(m1(IDS), load_model(dst, dtype="float64")(IDS))


@pytest.mark.parametrize("block", [(2, 8), None])
def test_fused_expert_tensors_quantize_and_load(ckpt, tmp_path, block):
    """Experts stored as one ``[E, n, D]`` tensor (``experts.gate_up_proj`` ...) quantize to
    ``<name>_scale_inv`` / ``<name>_scale`` per expert and load like the per-expert layout."""
    src, _ = ckpt("qwen_block")
    t = _tensors(src)
    fused = {}
    for k in list(t):
        if ".experts.0.gate_proj.weight" in k:
            pre = k.split(".experts.")[0] + ".experts"
            E = 1 + max(int(x.split(".experts.")[1].split(".")[0]) for x in t if x.startswith(pre + "."))
            fused[pre + ".gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{pre}.{e}.gate_proj.weight"),
                                                                   t.pop(f"{pre}.{e}.up_proj.weight")]) for e in range(E)])
            fused[pre + ".down_proj"] = torch.stack([t.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
    d = _rewrite(src, str(tmp_path / "fused"), {**t, **fused})
    quantize_checkpoint(d, str(tmp_path / "fq"), block)
    q = _tensors(str(tmp_path / "fq"))
    leaf = "_scale_inv" if block else "_scale"
    assert q["model.layers.0.mlp.experts.gate_up_proj"].dtype == Q.FP8
    assert q["model.layers.0.mlp.experts.gate_up_proj" + leaf].shape == ((4, 8, 3) if block else (4, 2))
    per = str(tmp_path / "per")
    quantize_checkpoint(src, per, block)
    assert torch.equal(load_model(str(tmp_path / "fq"), dtype="float64")(IDS), load_model(per, dtype="float64")(IDS))


def test_prefixed_multimodal_layout_loads(ckpt, tmp_path):
    """A Qwen3.5 checkpoint's text weights under ``model.language_model.`` (scales and
    per-expert tensors included) load through the key aliases."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tq35", os.path.join(os.path.dirname(__file__), "test_qwen3_5.py"))
    tq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tq)
    src = str(tmp_path / "q35")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        H.save_tiny(tq.tiny_qwen3_5_moe(), src)
    quantize_checkpoint(src, str(tmp_path / "q35-fp8"), (4, 8))
    t = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
         for k, v in _tensors(str(tmp_path / "q35-fp8")).items()}
    d = _rewrite(str(tmp_path / "q35-fp8"), str(tmp_path / "pref"), t)
    m = load_model(d, dtype="float64")
    assert any(isinstance(x, FP8Experts) and x.fp8 for x in m.modules())
    assert torch.equal(m(IDS), load_model(str(tmp_path / "q35-fp8"), dtype="float64")(IDS))
