"""FP8 checkpoints: the quantization config, which layers are FP8, and ``quantize``.

Two layouts load (both e4m3 weights, ``torch.float8_e4m3fn`` in safetensors):

* ``quant_method: "fp8"`` with ``weight_block_size: [bo, bi]`` (Qwen3-Next-FP8, DeepSeek
  style): ``<layer>.weight_scale_inv [ceil(out/bo), ceil(in/bi)]``, dynamic activations;
  ``quant_method: "fp8"`` without a block size: per-tensor ``<layer>.weight_scale``;
* ModelOpt ``quant_method: "modelopt"`` / ``quant_algo: "FP8"`` (NVIDIA Nemotron-H FP8; in
  ``config.json`` or ``hf_quant_config.json``): per-tensor ``weight_scale`` and static
  ``input_scale``.

A layer is FP8 exactly when the checkpoint stores its scale; every other tensor (norms,
embeddings, router gates, layers in ``ignored_layers`` / ``modules_to_not_convert`` /
``exclude_modules``) loads in the model dtype, and an ignored layer that has a scale is an
error.  Any other ``quant_method`` / ``quant_algo`` (int4, AWQ, GPTQ, NVFP4, bitsandbytes,
...) is refused by name.  KV-cache scales (``k_scale`` / ``v_scale``, or ModelOpt's
``k_proj`` / ``v_proj`` ``output_scale``) and expert ``input_scale`` tensors are read past (the KV cache stays in the model dtype; experts run
with unquantized activations).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re

import torch
from torch import nn

from ..layers.linear import Linear
from ..layers.mlp import FP8Experts
from ..ops.fp8 import naive as Q
from .config import ConfigError, WeightError

__all__ = ["FP8Config", "read_quant_config", "convert_model", "SCALE_SUFFIXES",
           "ignored_key", "DEFAULT_SKIP"]

#: parameter leaves holding scales (loaded in float32 whatever the model dtype)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "_scale_inv", "_scale")
#: checkpoint tensors of a quantized model that are read past (see the module docstring)
_READ_PAST = (re.compile(r"\.(k_scale|v_scale|q_scale|kv_scale|output_scale)$"),
              re.compile(r"\.experts\.\d+\.[A-Za-z_]+\.input_scale$"), re.compile(r"\.experts\.\w+_input_scale$"))
#: layers ``quantize`` leaves in the model dtype by default: routers, the shared-expert gate, the
#: head, and GDN's small ``in_proj_ba`` (as Qwen's own FP8 release does)
DEFAULT_SKIP = ("gate", "shared_expert_gate", "lm_head", "in_proj_ba")


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """``block``: ``(bo, bi)`` for block scales, None for per-tensor; ``ignored``: layer names
    or patterns left unquantized; ``method``: the checkpoint's quant_method."""

    block: tuple[int, int] | None
    ignored: tuple[str, ...] = ()
    method: str = "fp8"

    def __post_init__(self):
        if self.block is not None:
            object.__setattr__(self, "block", Q.check_block(tuple(self.block)))

    def is_ignored(self, name: str) -> bool:
        """Whether module ``name`` is listed (exact, as a prefix, as a dotted suffix or a glob)."""
        for p in self.ignored:
            if name == p or name.startswith(p + ".") or name.endswith("." + p) or fnmatch.fnmatchcase(name, p):
                return True
        return False


def _refuse(fn: str, what: str) -> ConfigError:
    return ConfigError(f"{fn}: {what} checkpoints are not supported (FP8 e4m3 only: quant_method 'fp8' "
                       f"with per-tensor or block scales, or ModelOpt quant_algo 'FP8')")


def _names(v, fn: str, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{fn}: {key} must be a list of layer names")
    return tuple(v)


def read_quant_config(path: str) -> FP8Config | None:
    """The FP8 config of model directory ``path`` (None: not quantized); ConfigError naming
    any other quantization method or a malformed field."""
    fn = os.path.join(path, "config.json")
    with open(fn, encoding="utf-8") as f:
        q = json.load(f).get("quantization_config")
    if q is None:
        hq = os.path.join(path, "hf_quant_config.json")
        if not os.path.isfile(hq):
            return None
        fn = hq
        with open(hq, encoding="utf-8") as f:
            d = json.load(f)
        q = dict(d.get("quantization", d), quant_method="modelopt")
    if not isinstance(q, dict):
        raise ConfigError(f"{fn}: quantization_config must be an object")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse(fn, f"fp8 fmt {fmt!r}")
        ignored = _names(q.get("ignored_layers"), fn, "ignored_layers") + \
            _names(q.get("modules_to_not_convert"), fn, "modules_to_not_convert")
        bs = q.get("weight_block_size")
        if bs is not None:
            try:
                return FP8Config(tuple(bs), ignored, "fp8")
            except (ValueError, TypeError):
                raise ConfigError(f"{fn}: weight_block_size must be two positive ints, got {bs!r}") from None
        return FP8Config(None, ignored, "fp8")
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        if algo != "FP8":
            raise _refuse(fn, f"ModelOpt quant_algo {q.get('quant_algo')!r}")
        ignored = _names(q.get("exclude_modules"), fn, "exclude_modules") + _names(q.get("ignore"), fn, "ignore")
        return FP8Config(None, ignored, "modelopt")
    known = {"awq": "AWQ (int4)", "gptq": "GPTQ (int4/int8)", "bitsandbytes": "bitsandbytes (int8/nf4)",
             "compressed-tensors": "compressed-tensors", "mxfp4": "MXFP4", "nvfp4": "NVFP4", "hqq": "HQQ",
             "gguf": "GGUF", "aqlm": "AQLM", "eetq": "EETQ (int8)", "quanto": "quanto", "torchao": "torchao",
             "fbgemm_fp8": "fbgemm_fp8 (per-row FP8)", "bitnet": "BitNet", "marlin": "Marlin (int4)"}
    raise _refuse(fn, f"quant_method {method!r}" + (f" ({known[method]})" if method in known else
                                                      " (unknown quantization method)"))


def ignored_key(key: str) -> bool:
    """Whether checkpoint tensor ``key`` of an FP8 checkpoint is read past (KV-cache and
    expert activation scales)."""
    return any(r.search(key) for r in _READ_PAST)


def _weight_key(name: str, key_file: dict, aliases: dict) -> str | None:
    for k in (name, *aliases.get(name, [])):
        if k in key_file:
            return k
    return None


def _expert_keys(pre: str, which: str) -> list[str]:
    """Expert 0's per-expert keys of stacked param ``which`` under ``pre`` (the experts module)."""
    if which == "gate_up_proj":
        return [f"{pre}.0.gate_proj.weight", f"{pre}.0.up_proj.weight"]
    return [f"{pre}.0.{which}.weight"]


def convert_model(model: nn.Module, qcfg: FP8Config, key_file: dict, aliases: dict) -> list[str]:
    """Turn the (meta) ``model``'s layers that the checkpoint stores in FP8 (those with a
    scale tensor) into FP8 layers; returns their names.  WeightError when a layer the config
    lists as unquantized has a scale."""
    inv = qcfg.block is not None
    suffix = "weight_scale_inv" if inv else "weight_scale"
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear):
            k = _weight_key(name + ".weight", key_file, aliases)
            if k is None:
                continue
            base = k[: -len("weight")]
            if base + suffix not in key_file:
                continue
            if qcfg.is_ignored(name):
                raise WeightError(f"{key_file[k]}: layer {name!r} is listed as unquantized in the quantization "
                                  f"config but the checkpoint has {base + suffix!r}")
            mod.to_fp8(qcfg.block, input_scale=(not inv) and base + "input_scale" in key_file)
            done.append(name)
        elif isinstance(mod, FP8Experts):
            w1 = mod.names[0]
            fused = f"{name}.{w1}_{suffix.replace('weight_', '')}"
            keys = [_weight_key(kk, key_file, aliases) or kk for kk in _expert_keys(name, w1)]
            fused = _weight_key(fused, key_file, aliases) or fused
            if fused in key_file or all(kk[: -len("weight")] + suffix in key_file for kk in keys):
                if qcfg.is_ignored(name):
                    raise WeightError(f"experts {name!r} are listed as unquantized in the quantization config "
                                      f"but the checkpoint has their scales")
                mod.to_fp8(qcfg.block)
                done.append(name)
    return done


def scale_params(model: nn.Module) -> set[str]:
    """Names of the scale parameters of ``model``'s FP8 layers."""
    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, (Linear, FP8Experts)) and mod.fp8:
            for leaf, _ in mod.named_parameters(recurse=False):
                if leaf.endswith(SCALE_SUFFIXES):
                    out.add(f"{name}.{leaf}")
    return out


def _row_perm(fn, rows: int) -> torch.Tensor | None:
    """The row permutation ``fn`` (a load transform) applies, or None if it is not one."""
    try:
        r = fn(torch.arange(rows, dtype=torch.float64)[:, None])
    except Exception:
        return None
    if not isinstance(r, torch.Tensor) or tuple(r.shape) != (rows, 1):
        return None
    p = r[:, 0]
    if not torch.equal(torch.sort(p)[0], torch.arange(rows, dtype=torch.float64)):
        return None
    return p.long()


def fp8_transforms(model: nn.Module, transforms: dict) -> dict:
    """Load transforms for FP8 layers: a transform that permutes a weight's rows moves whole
    ``bo``-row blocks (it does for Qwen3-Next's head reorders at block 128), so it applies to
    the e4m3 rows and the scale rows alike.  Any other transform of an FP8 weight raises
    WeightError naming it (its values cannot be changed without requantizing)."""
    out = {}
    for name, mod in model.named_modules():
        if not (isinstance(mod, Linear) and mod.fp8 and name + ".weight" in transforms):
            continue
        out_rows = mod.d_out
        perm = _row_perm(transforms[name + ".weight"], out_rows)
        if perm is None:
            raise WeightError(f"{name}.weight: its load transform is not a row permutation, so it cannot be "
                              f"applied to FP8 weights; list {name!r} as unquantized")
        out[name + ".weight"] = lambda t, p=perm: t.view(torch.uint8)[p].view(Q.FP8)
        if mod.block is not None:
            bo = mod.block[0]
            nb = -(-out_rows // bo)
            r = torch.arange(out_rows)
            bp = perm[::bo] // bo
            if not (torch.equal(torch.sort(bp)[0], torch.arange(nb)) and torch.equal(perm, bp[r // bo] * bo + r % bo)):
                raise WeightError(f"{name}.weight: its rows are reordered at load time across FP8 blocks of "
                                  f"{bo} rows; quantize with a block size dividing the head sizes, or list "
                                  f"{name!r} as unquantized")
            out[name + ".weight_scale_inv"] = lambda s, p=bp: s[p]
    return out


# --------------------------------------------------------------------------- quantize
