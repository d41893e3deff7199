"""Writing FP8: :func:`quantize_checkpoint` (a float HF checkpoint to the block-scaled or
per-tensor layout ``replayssm.models.quant`` loads) and :func:`quantize_model_` (a loaded
model in place).  The reading side — config parsing, module conversion, scale checks — is
:mod:`replayssm.models.quant`; this module sits above it and the loader."""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn

from ..layers.linear import Linear
from ..layers.mlp import FP8Experts
from ..ops.fp8 import naive as Q
from .loader import _resolve, _weight_files
from .config import WeightError
from .quant import DEFAULT_SKIP, _weight_key, read_quant_config

__all__ = ["quantize_checkpoint", "quantize_model_"]


def _skip(name: str, skip) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def quantize_checkpoint(src: str, dst: str, block=(128, 128), skip=DEFAULT_SKIP) -> dict:
    """Write an FP8 copy of the float HF checkpoint ``src`` to ``dst``: every linear layer
    (experts and shared experts included) except those named in ``skip`` (router gates and
    the head by default) becomes e4m3 with block scales ``weight_scale_inv`` (``block``) or
    a per-tensor ``weight_scale`` (``block=None``); other tensors are copied unchanged.
    ``config.json`` gets ``quantization_config`` (``quant_method: "fp8"``, dynamic
    activations, the skipped layers as ``ignored_layers``); other files are copied.  Returns
    the quantization config written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .registry import model_class, read_config

    if block is not None:
        block = Q.check_block(tuple(block))
    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: not a model directory")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("quantize writes a new directory: OUT_DIR must differ from MODEL_DIR")
    if read_quant_config(src) is not None:
        raise ValueError(f"{src}: already quantized")
    cfg = read_config(src)
    key_file = _weight_files(src)
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, torch.float32, "meta")
    aliases = cls.key_aliases()
    targets: dict[str, int] = {}          # checkpoint key -> parts of a fused 3-D expert tensor (0: 2-D)
    ignored = []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            k = _weight_key(name + ".weight", key_file, aliases)
            if k is None:
                continue
            if _skip(name, skip):
                ignored.append(name)
            else:
                targets[k] = 0
        elif isinstance(mod, FP8Experts):
            for w, parts in zip(mod.names, (2 if mod.gated else 1, 1)):
                pname = f"{name}.{w}"
                shape = tuple(getattr(mod, w).shape)
                srcs = _resolve(pname, shape, key_file, aliases)
                if srcs is None:
                    continue
                for k in srcs.keys:
                    targets[k] = parts if srcs.stack is None else 0
    os.makedirs(dst, exist_ok=True)
    wmap = {}
    for fn in sorted(set(key_file.values())):
        out = {}
        with safe_open(fn, framework="pt", device="cpu") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if k not in targets:
                    out[k] = t.contiguous()
                    continue
                if not torch.isfinite(t).all():
                    raise WeightError(f"{fn}: tensor {k!r} holds NaN/Inf values")
                base = k[: -len("weight")] if k.endswith("weight") else k + "_"
                leaf = "weight_scale_inv" if block is not None else "weight_scale"
                if targets[k]:
                    q, s = Q.quantize_experts(t, block, targets[k])
                    out[k], out[k + ("_scale_inv" if block is not None else "_scale")] = q, s
                else:
                    q, s = Q.quantize_block(t, block) if block is not None else Q.quantize_tensor(t)
                    out[k], out[base + leaf] = q, s
        name = os.path.basename(fn)
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        wmap.update({k: name for k in out})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "ignored_layers": sorted(ignored)}
    if block is not None:
        qc["weight_block_size"] = list(block)
    conf["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(conf, f, indent=2)
    if os.path.isfile(os.path.join(src, "model.safetensors.index.json")):
        with open(os.path.join(dst, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f, indent=2)
    for entry in os.listdir(src):
        p = os.path.join(src, entry)
        if os.path.isfile(p) and not entry.endswith(".safetensors") and entry not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(p, os.path.join(dst, entry))
    return qc


@torch.no_grad()
def quantize_model_(model: nn.Module, block=(128, 128), skip=DEFAULT_SKIP) -> list[str]:
    """Quantize a loaded float ``model`` in place (on its device): every linear layer and
    expert stack not named in ``skip`` becomes FP8 (block ``block`` or per-tensor for None),
    as if loaded from :func:`quantize_checkpoint`'s output.  Returns the converted names."""
    if block is not None:
        block = Q.check_block(tuple(block))
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear) and not mod.fp8 and not _skip(name, skip):
            w = mod.weight.data
            q, s = Q.quantize_block(w, block) if block is not None else Q.quantize_tensor(w)
            mod.to_fp8(block)
            mod.weight.data = q
            (mod.weight_scale_inv if block is not None else mod.weight_scale).data = s.to(w.device)
            done.append(name)
        elif isinstance(mod, FP8Experts) and not mod.fp8 and not _skip(name, skip):
            ws = [getattr(mod, n).data for n in mod.names]
            mod.to_fp8(block)
            for n, w, parts in zip(mod.names, ws, (2 if mod.gated else 1, 1)):
                q, s = Q.quantize_experts(w, block, parts)
                getattr(mod, n).data = q
                getattr(mod, n + ("_scale_inv" if block is not None else "_scale")).data = s.to(w.device)
            done.append(name)
    return done
