"""Loader: configs, safetensors layouts (single, sharded, fused experts), dtypes, tokenizer,
and a clear error for every kind of bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayssm.models import ConfigError, WeightError, load_model, load_tokenizer, parse_config


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, fn) -> None:
    fn_ = os.path.join(path, "config.json")
    d = json.load(open(fn_))
    fn(d)
    json.dump(d, open(fn_, "w"))


def _edit_tensors(path: str, fn) -> None:
    f = os.path.join(path, "model.safetensors")
    t = dict(load_file(f))
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def _ids(model, T=9, seed=0):
    return torch.randint(0, model.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- good inputs
def test_sharded_checkpoint_loads_identically(tiny, ours, tmp_path):
    hf, path = tiny("nemotron_h")
    out = str(tmp_path / "sharded")
    hf.save_pretrained(out, max_shard_size="3KB")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    m = load_model(out, dtype="float64")
    ids = _ids(m)
    assert torch.equal(m(ids), ours("nemotron_h")(ids))


def test_fused_expert_tensors_load_identically(tiny, ours, tmp_path):
    """transformers 5 stores experts as 3-D tensors in memory; checkpoints may hold either form."""
    _, path = tiny("qwen3_next")
    p = _copy(path, tmp_path / "fused")

    def fuse(t):
        for i in range(3):
            pre = f"model.layers.{i}.mlp.experts"
            if f"{pre}.0.gate_proj.weight" not in t:
                continue
            E = 4
            gu = [torch.cat([t.pop(f"{pre}.{e}.gate_proj.weight"), t.pop(f"{pre}.{e}.up_proj.weight")], 0)
                  for e in range(E)]
            t[f"{pre}.gate_up_proj"] = torch.stack(gu)
            t[f"{pre}.down_proj"] = torch.stack([t.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])

    _edit_tensors(p, fuse)
    m = load_model(p, dtype="float64")
    ids = _ids(m)
    assert torch.equal(m(ids), ours("qwen3_next")(ids))


def test_legacy_config_keys(tiny, ours, tmp_path):
    _, path = tiny("nemotron_h")
    p = _copy(path, tmp_path / "legacy_nh")

    def legacy(d):
        pat = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
        d["hybrid_override_pattern"] = "".join(pat[t] for t in d.pop("layers_block_type"))
        d["mamba_n_groups"] = d.pop("n_groups")
        d["mamba_d_conv"] = d.pop("conv_kernel")

    _edit_config(p, legacy)
    ids = _ids(ours("nemotron_h"))
    assert torch.equal(load_model(p, dtype="float64")(ids), ours("nemotron_h")(ids))

    _, path = tiny("qwen3_next")
    p = _copy(path, tmp_path / "legacy_q")

    def legacy_q(d):
        d.pop("layer_types")
        d["full_attention_interval"] = 2
        rp = d.pop("rope_parameters")
        d["rope_theta"] = rp["rope_theta"]
        d["partial_rotary_factor"] = rp["partial_rotary_factor"]

    _edit_config(p, legacy_q)
    assert torch.equal(load_model(p, dtype="float64")(ids), ours("qwen3_next")(ids))


def test_dtypes_and_tied_embeddings(tiny):
    _, path = tiny("qwen3_next_dense")   # tie_word_embeddings=True: no lm_head tensor on disk
    for dt, want in (("float64", torch.float64), (torch.float32, torch.float32),
                     ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        m = load_model(path, dtype=dt)
        assert m.dtype == want and m.embed_weight().dtype == want
        assert m.head_weight() is m.embed_weight()
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype="int8")


def test_tokenizer(tiny, tmp_path):
    _, path = tiny("mamba2")
    assert load_tokenizer(path) is None
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    p = _copy(path, tmp_path / "with_tok")
    tok.save(os.path.join(p, "tokenizer.json"))
    t = load_tokenizer(p)
    assert t.encode("hello world foo").ids == [0, 1, 2]
    open(os.path.join(p, "tokenizer.json"), "w").write("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(p)


def test_transformers_not_imported_at_run_time(tiny):
    _, path = tiny("qwen3_next")
    code = ("import sys, torch; from replayssm.models import load_model, load_tokenizer; "
            f"m = load_model({path!r}); m(torch.zeros(1, 3, dtype=torch.long)); load_tokenizer({path!r}); "
            "c = m.make_cache(2); m.prefill(c, torch.tensor([1]), torch.zeros(1, 2, dtype=torch.long), torch.tensor([2])); "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------------------- bad inputs
def test_config_errors(tiny, tmp_path):
    _, path = tiny("mamba2")
    p = _copy(path, tmp_path / "cfg")
    _edit_config(p, lambda d: d.update(model_type="llama"))
    with pytest.raises(ConfigError, match=r"config\.json.*unknown model_type 'llama'"):
        load_model(p)
    _edit_config(p, lambda d: (d.update(model_type="mamba2"), d.pop("hidden_size")))
    with pytest.raises(ConfigError, match=r"config\.json.*'hidden_size'"):
        load_model(p)
    _edit_config(p, lambda d: d.update(hidden_size=21))
    with pytest.raises(ConfigError, match="num_heads \\* head_dim"):
        load_model(p)
    open(os.path.join(p, "config.json"), "w").write("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(p)
    os.remove(os.path.join(p, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(p)
    with pytest.raises(ConfigError, match="model_type"):
        parse_config({"hidden_size": 3})
    with pytest.raises(ConfigError, match="hybrid_override_pattern"):
        parse_config({"model_type": "nemotron_h", "vocab_size": 5, "hidden_size": 4,
                      "hybrid_override_pattern": "MX"})
    _, npath = tiny("nemotron_h")
    for key, bad, msg in (("time_step_min", float("nan"), "finite number >= 0"),
                          ("time_step_min", {"__float__": "Infinity"}, "finite number >= 0"),
                          ("time_step_min", -0.5, "finite number >= 0"),
                          ("moe_latent_size", "8", "positive integer"), ("moe_latent_size", 0, "positive integer")):
        p = _copy(npath, tmp_path / f"n-{key}-{bad!s:.8}")
        _edit_config(p, lambda d: d.update({key: bad}))
        with pytest.raises(ConfigError, match=f"'{key}' must be a {msg}"):
            load_model(p)
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        parse_config({"model_type": "qwen3_next", "vocab_size": 5, "hidden_size": 4, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "head_dim": 2, "intermediate_size": 4,
                      "linear_num_key_heads": 2, "linear_num_value_heads": 3, "linear_key_head_dim": 2,
                      "linear_value_head_dim": 2, "layer_types": ["linear_attention"]})


def test_missing_extra_and_misshaped_tensors(tiny, tmp_path):
    _, path = tiny("qwen3_next")
    p = _copy(path, tmp_path / "w1")
    _edit_tensors(p, lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"))
    with pytest.raises(WeightError, match=r"missing.*model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_model(p)
    p = _copy(path, tmp_path / "w2")
    _edit_tensors(p, lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(WeightError, match=r"unexpected.*model\.layers\.0\.bogus\.weight \(in model\.safetensors\)"):
        load_model(p)
    p = _copy(path, tmp_path / "w3")
    _edit_tensors(p, lambda t: t.update({"model.norm.weight": torch.zeros(23)}))
    with pytest.raises(WeightError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[23\], expected \[24\]"):
        load_model(p)
    p = _copy(path, tmp_path / "w4")
    _edit_tensors(p, lambda t: t.pop("model.layers.0.mlp.experts.3.down_proj.weight"))
    with pytest.raises(WeightError, match=r"missing.*experts\.down_proj"):
        load_model(p)


def test_corrupt_truncated_and_missing_files(tiny, tmp_path):
    _, path = tiny("mamba2")
    p = _copy(path, tmp_path / "c1")
    f = os.path.join(p, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(WeightError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_model(p)
    open(f, "wb").write(b"\x00" * 64)
    with pytest.raises(WeightError, match=r"model\.safetensors.*corrupt"):
        load_model(p)
    os.remove(f)
    with pytest.raises(WeightError, match="no \\*.safetensors"):
        load_model(p)
    json.dump({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}},
              open(os.path.join(p, "model.safetensors.index.json"), "w"))
    with pytest.raises(WeightError, match="model-00001-of-00002.safetensors"):
        load_model(p)
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "does_not_exist"))


def test_values_a_cast_would_hide_and_loose_config_types(tiny, tmp_path):
    """What used to load as a wrong model: int8 expert weights (cast to float), a float32
    value past float16's range (inf after the cast), string booleans (``bool("false")``);
    and raw Python errors: a weight_map that is not a name -> file map, a config that is not
    UTF-8, a path that is not a path."""
    _, path = tiny("qwen3_next")
    p = _copy(path, tmp_path / "q1")
    key = "model.layers.0.mlp.experts.2.up_proj.weight"
    _edit_tensors(p, lambda t: t.update({key: (t[key] * 100).to(torch.int8)}))
    with pytest.raises(WeightError, match=r"experts\.2\.up_proj\.weight' has dtype torch\.int8"):
        load_model(p)
    p = _copy(path, tmp_path / "q2")
    _edit_tensors(p, lambda t: t.update({key: t[key][:-1].clone()}))
    with pytest.raises(WeightError, match=r"experts\.2\.up_proj\.weight' has shape .*one expert's part"):
        load_model(p)
    p = _copy(path, tmp_path / "q3")
    _edit_tensors(p, lambda t: t[key].view(-1).__setitem__(0, float("nan")))
    with pytest.raises(WeightError, match=r"experts\.2\.up_proj\.weight' holds NaN"):
        load_model(p)
    _, mpath = tiny("mamba2")
    p = _copy(mpath, tmp_path / "m1")
    _edit_tensors(p, lambda t: t.update({"backbone.norm_f.weight": torch.full_like(t["backbone.norm_f.weight"], 1e6)}))
    with pytest.raises(WeightError, match="beyond float16's range"):
        load_model(p, dtype="float16")
    assert load_model(p, dtype="float32") is not None
    p = _copy(mpath, tmp_path / "m2")
    _edit_config(p, lambda d: d.update(residual_in_fp32="false"))
    with pytest.raises(ConfigError, match="'residual_in_fp32' must be true or false"):
        load_model(p)
    p = _copy(mpath, tmp_path / "m3")
    open(os.path.join(p, "config.json"), "wb").write(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_model(p)
    p = _copy(mpath, tmp_path / "m4")
    json.dump({"weight_map": ["a"]}, open(os.path.join(p, "model.safetensors.index.json"), "w"))
    with pytest.raises(WeightError, match="weight_map must map tensor names"):
        load_model(p)
    for bad in (None, 5):
        with pytest.raises(ValueError, match="model path must be"):
            load_model(bad)


def test_all_finite_sees_every_nan_and_infinity():
    """The loader's value check (min/max reduction) against ``isfinite(t).all()``: every
    float dtype, odd lengths, the bad value first, in the middle and last, strided views,
    empty and 0-d tensors."""
    from replayssm.models.loader import all_finite

    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for n in (1, 7, 33, 4099):
            t = torch.randn(n).to(dt)
            assert all_finite(t) and all_finite(t.view(1, -1).expand(3, -1))
            for bad in (float("nan"), float("inf"), float("-inf")):
                for pos in {0, n // 2, n - 1}:
                    u = t.clone()
                    u[pos] = bad
                    assert all_finite(u) == bool(torch.isfinite(u).all()) is False
                    assert not all_finite(u.view(1, -1).expand(2, -1)[:, ::1])
        assert all_finite(torch.empty(0, 5, dtype=dt)) and all_finite(torch.tensor(1.5, dtype=dt))
        assert not all_finite(torch.tensor(float("nan"), dtype=dt))
