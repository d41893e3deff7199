"""Random MTP heads in a checkpoint's own layout, for benchmarks on random-weight models
(acceptance then means nothing; the benchmarks verify an oracle's tokens)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..layers.norms import GatedRMSNorm, RMSNorm
from ..models.margin import branch_scale, residual_outputs
from ..models.mtp import MTPHead
from ..models.registry import model_class, read_config


def add_random_mtp(model_dir: str, seed: int = 0) -> str:
    """Give the HF model in ``model_dir`` a random MTP head in its checkpoint layout
    (``mtp.safetensors`` + the config keys that declare it), in the checkpoint's dtype.
    Names and shapes come from :class:`replayssm.models.mtp.MTPHead` on the ``meta`` device.
    Nemotron-H gets one ``*E`` step when the target has MoE layers, else ``*-``."""
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    if cfg["model_type"] == "nemotron_h":
        moe = "E" in cfg.get("hybrid_override_pattern", "") or "moe" in cfg.get("layers_block_type", [])
        cfg["mtp_hybrid_override_pattern"] = "*E" if moe else "*-"
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors") and f != "mtp.safetensors")
    with safe_open(str(d / files[0]), "pt") as f:
        dtype = f.get_tensor(next(iter(f.keys()))).dtype
    c = read_config(str(d))
    with torch.device("meta"):
        head = MTPHead(model_class(c)(c, torch.float32, "cpu"), 1)
    g = torch.Generator().manual_seed(seed)
    L = max(1, len(head.blocks))
    residual = residual_outputs(head)       # the greedy-margin recipe's scaled projections
    out = {}
    for name, p in head.named_parameters():
        mod_name, _, leaf = name.rpartition(".")
        mod = head.get_submodule(mod_name)
        shape = tuple(p.shape)
        if isinstance(mod, RMSNorm):
            t = torch.zeros(shape) if mod.zero_centered else torch.ones(shape)
        elif isinstance(mod, GatedRMSNorm) or leaf == "D":
            t = torch.ones(shape)
        elif leaf == "A_log":
            t = torch.log(torch.empty(shape).uniform_(1, 16, generator=g))
        elif leaf == "dt_bias":
            t = torch.log(torch.expm1(torch.empty(shape).uniform_(1e-3, 1e-1, generator=g)))
        elif "conv1d" in name:
            t = torch.randn(shape, generator=g) * (0.3 if leaf == "weight" else 0.1)
        elif len(shape) == 1:
            t = torch.zeros(shape)
        else:
            scale = branch_scale(0.02, L) if name in residual else 0.02
            t = torch.randn(shape, generator=g) * scale
        out["mtp." + name] = t.to(dtype).contiguous()
    save_file(out, str(d / "mtp.safetensors"))
    return str(d)
