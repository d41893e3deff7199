"""Config sizes are checked against the safetensors headers before any module is built: a
wrong size fails in milliseconds with a ConfigError naming the field and its value."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from replayssm.models import ConfigError, load_model
from replayssm.models import loader


def _variant(src: str, dst, **changes) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    fn = os.path.join(dst, "config.json")
    d = json.load(open(fn))
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    json.dump(d, open(fn, "w"))
    return dst


@pytest.fixture
def no_build(monkeypatch):
    """Fail if the loader gets as far as building a model skeleton."""
    def refuse(cfg):
        raise AssertionError(f"a {type(cfg).__name__} model was about to be built")

    monkeypatch.setattr(loader, "model_class", refuse)


@pytest.mark.parametrize("name, changes, field", [
    ("mamba2", dict(num_hidden_layers=1_000_000_000), "num_hidden_layers"),
    ("mamba2", dict(num_hidden_layers=20_000), "num_hidden_layers = 20000"),
    ("mamba2", dict(num_hidden_layers=2), "num_hidden_layers = 2"),
    ("mamba2", dict(vocab_size=4097), "vocab_size = 4097"),
    ("mamba2", dict(num_heads=10, head_dim=4), "num_heads = 10"),
    ("mamba2", dict(state_size=32), "state_size"),
    ("mamba2", dict(conv_kernel=3), "conv_kernel = 3"),
    ("mamba2", dict(eos_token_id=10 ** 6), "eos_token_id"),
    ("mamba2", dict(eos_token_id=[1, -1]), "eos_token_id"),
    ("nemotron_h", dict(mamba_num_heads=12), "mamba_num_heads = 12"),
    ("nemotron_h", dict(num_key_value_heads=4), "num_key_value_heads * head_dim"),
    ("qwen3_next", dict(num_hidden_layers=7, layer_types=None), "num_hidden_layers = 7"),
    ("qwen3_next", dict(linear_value_head_dim=7), "linear_value_head_dim = 7"),
    ("qwen3_next", dict(num_experts=9), "num_experts = 9"),
    ("qwen3_next", dict(hidden_size=26), "hidden_size = 26"),
])
def test_config_sizes_against_the_checkpoint_header(tiny, tmp_path, no_build, name, changes, field):
    _, path = tiny(name)
    bad = _variant(path, tmp_path / "bad", **changes)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_model(bad)
    assert time.perf_counter() - t0 < 0.5
    assert field in str(e.value), str(e.value)
    assert "config.json" in str(e.value)


def test_good_checkpoints_pass_the_header_check(tiny):
    from replayssm.models.registry import read_config
    from replayssm.models.header import check_sizes

    for name in ("mamba2", "nemotron_h", "qwen3_next"):
        _, path = tiny(name)
        check_sizes(read_config(path), loader._weight_files(path))


def test_unsupported_devices_are_named_before_loading(tiny, no_build):
    _, path = tiny("mamba2")
    for device, match in (("tpu", "'tpu'"), ("meta", "'meta'"), ("cuda:0", "CUDA is not available"),
                          (None, "device must be")):
        if device and device.startswith("cuda"):
            import torch

            if torch.cuda.is_available():
                continue
        with pytest.raises(ValueError, match=match):
            load_model(path, device=device)
