"""Load one rank's shard of a Hugging Face checkpoint, reading only that shard from disk.

Each rank builds the global model and its own (local-size) model on the meta device, checks
the checkpoint against the global model exactly as :func:`replayssm.models.load_model` does
(missing, unexpected and mis-shaped tensors, from the headers only), then reads every
parameter through ``safe_open(...).get_slice``: only the ranges in the rank's
:class:`~.sharding.Shard` rule come off the disk (per segment for packed layouts such as
Mamba-2's ``in_proj = [z | xBC | dt]``), so a model larger than one GPU loads with one
shard per device and never whole anywhere.  The model's own load transforms (GDN's
per-key-head row order) then run on the local block with the local head counts.

:func:`random_shard` builds the same skeleton with random weights generated on the device
(benchmarks of models that fit no disk): replicated parameters from a seed that depends
only on their name, so every rank holds the same ones.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from ..models.registry import model_class, parse_config, read_config
from ..models.header import check_sizes
from ..models.mtp import attach_mtp
from ..models.loader import (_FP32_PARAMS, WeightError, _cast_checked, _install, _transformed_checked,
                             _weight_files, check_source_shapes, check_tied_copies, parse_dtype,
                             source_plan)
from ..runtime import canonical_device, compute_dtype
from .layers import build_local_model
from .sharding import ROOT_ONLY, Shard, check_tensor_parallel, local_config, shard_rules

__all__ = ["load_shard", "random_shard"]


def _read(handle, key: str, dim: int, ranges) -> torch.Tensor:
    """The ranges ``[a, b)`` along ``dim`` of checkpoint tensor ``key``, concatenated."""
    sl = handle.get_slice(key)
    parts = [sl[(slice(None),) * dim + (slice(a, b),)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _read_source(handles, key_file, src, rule, gshape) -> torch.Tensor:
    """One parameter's local tensor: a single key, or per-expert keys stacked on dim 0 (the
    rule's dim then refers to the stacked tensor; ``gate_up_proj`` is two keys per expert)."""
    def h(k):
        return handles[key_file[k]]

    if src.stack is None:
        if rule is None:
            return h(src.keys[0]).get_tensor(src.keys[0])
        return _read(h(src.keys[0]), src.keys[0], rule.dim, rule.ranges)
    E, per_part = gshape[0], gshape[1] // src.parts
    experts = []
    for e in range(E):
        keys = src.keys[e * src.parts:(e + 1) * src.parts]
        if rule is None:
            experts.append(torch.cat([h(k).get_tensor(k) for k in keys], 0))
            continue
        if rule.dim == 1:   # rows of the stacked [E, parts * rows, cols]: each range lies in one part
            pieces = []
            for a, b in rule.ranges:
                p = a // per_part
                pieces.append(_read(h(keys[p]), keys[p], 0, [(a - p * per_part, b - p * per_part)]))
            experts.append(torch.cat(pieces, 0))
        else:
            experts.append(torch.cat([_read(h(k), k, rule.dim - 1, rule.ranges) for k in keys], 0))
    return torch.stack(experts, 0)


def _pad(t: torch.Tensor, rule: Shard) -> torch.Tensor:
    if rule.pad_to is None or t.shape[rule.dim] == rule.pad_to:
        return t
    shape = list(t.shape)
    shape[rule.dim] = rule.pad_to - t.shape[rule.dim]
    return torch.cat([t, t.new_zeros(shape)], rule.dim)


def _skeletons(cfg, dtype, device, rank: int, size: int, group, mtp_keys=None):
    """``(global model, local model)`` on the meta device (no memory); both with an MTP head
    when ``mtp_keys`` (the checkpoint's tensor names) is given."""
    check_tensor_parallel(cfg, size, mtp=mtp_keys is not None)
    cls = model_class(cfg)
    with torch.device("meta"):
        gmodel = cls(cfg, dtype, device)
        if mtp_keys is not None:
            attach_mtp(gmodel, mtp_keys)
    lmodel = build_local_model(cls, cfg, local_config(cfg, size), dtype, device, rank, size, group, mtp_keys)
    return gmodel, lmodel


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    leaf = name.rpartition(".")[2]
    return compute_dtype(dtype) if leaf in _FP32_PARAMS and dtype != torch.float64 else dtype


def load_shard(path: str, rank: int, size: int, device="cpu", dtype="float32", group=None, mtp: bool = False):
    """Rank ``rank``'s shard (of ``size``) of the model in ``path``, on ``device`` (``mtp``:
    with its MTP head, ``model.mtp``, sharded by the same rules).

    Raises what :func:`replayssm.models.load_model` raises for a bad directory, plus
    ``ValueError`` when the model cannot be split over ``size`` ranks.
    """
    import os

    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a model directory")
    tdtype = parse_dtype(dtype)
    device = canonical_device(device)
    cfg = read_config(path)
    key_file = _weight_files(path)
    check_sizes(cfg, key_file, os.path.join(path, "config.json"))  # before any skeleton is built
    if cfg.tie_word_embeddings and "lm_head.weight" in key_file:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    gmodel, model = _skeletons(cfg, tdtype, device, rank, size, group, key_file if mtp else None)
    gparams = dict(gmodel.named_parameters())
    lparams = dict(model.named_parameters())
    if set(gparams) != set(lparams):  # pragma: no cover - the local model mirrors the global one
        raise WeightError(f"local model parameters differ from the global model's: {sorted(set(gparams) ^ set(lparams))[:4]}")
    plan = source_plan(path, cfg, gparams, key_file, type(gmodel).key_aliases(), type(gmodel).tied_copy)
    check_tied_copies(cfg, key_file, type(gmodel).tied_copy)
    rules = shard_rules(gmodel, size, rank)
    transforms = model.load_transforms()
    handles = {}
    try:
        for fn in sorted(set(key_file.values())):
            handles[fn] = safe_open(fn, framework="pt", device="cpu")
        for name, src in plan.items():  # headers first: every shape against the global model
            check_source_shapes(name, src, tuple(gparams[name].shape), handles, key_file)
        for name, src in plan.items():
            rule = rules.get(name)
            pdt = _param_dtype(name, tdtype)
            try:
                if rule == ROOT_ONLY and rank != 0:
                    t = torch.zeros(gparams[name].shape, dtype=pdt)
                else:
                    shard = rule if isinstance(rule, Shard) else None
                    t = _read_source(handles, key_file, src, shard, tuple(gparams[name].shape))
                    if shard is not None:
                        t = _pad(t, shard)
            except Exception as e:
                raise WeightError(f"{key_file[src.keys[0]]}: cannot read tensor {src.keys[0]!r} "
                                  f"(corrupt or truncated file: {e})") from None
            t = _transformed_checked(t, name, src, key_file, transforms)
            if tuple(t.shape) != tuple(lparams[name].shape):  # pragma: no cover - a rule bug
                raise WeightError(f"rank {rank}: shard of {name} has shape {list(t.shape)}, "
                                  f"expected {list(lparams[name].shape)}")
            _install(model, name, _cast_checked(t, src.keys[0], key_file, device, pdt))
    finally:
        handles.clear()
    return model.eval()


def random_shard(cfg_dict: dict, rank: int, size: int, device="cpu", dtype="bfloat16", group=None,
                 seed: int = 0, scale: float = 0.02, mtp: bool = False):
    """Rank ``rank``'s shard of a random-weight model described by a ``config.json`` dict,
    generated directly on ``device`` (no checkpoint; ``mtp``: with an MTP head of
    ``num_nextn_predict_layers`` layers, default 1).  Norm weights are 1, ``A_log`` and
    ``dt_bias`` in the usual ranges, other weights ``N(0, scale²)``; replicated parameters
    are identical on every rank (their seed depends only on their name)."""
    tdtype = parse_dtype(dtype)
    device = canonical_device(device)
    cfg = parse_config(dict(cfg_dict), "config dict")
    gmodel, model = _skeletons(cfg, tdtype, device, rank, size, group, () if mtp else None)
    rules = shard_rules(gmodel, size, rank)
    for name, p in model.named_parameters():
        leaf = name.rpartition(".")[2]
        pdt = _param_dtype(name, tdtype)
        sharded = isinstance(rules.get(name), Shard)
        g = torch.Generator(device=device)
        g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) + (rank + 1) * 7919 * int(sharded))
        owner = name.rpartition(".")[0].rpartition(".")[2]      # e.g. the MTP head's pre_fc_norm_hidden
        if name.endswith("norm.weight") or (leaf == "weight" and "norm" in owner) or leaf == "D":
            t = torch.ones(p.shape, dtype=pdt, device=device)
        elif leaf == "A_log":
            t = torch.empty(p.shape, dtype=torch.float32, device=device).uniform_(0.0, 2.7, generator=g).to(pdt)
        elif leaf == "dt_bias":
            t = torch.empty(p.shape, dtype=torch.float32, device=device).uniform_(-6.0, -2.0, generator=g).to(pdt)
        elif rules.get(name) == ROOT_ONLY or leaf == "bias":
            t = torch.zeros(p.shape, dtype=pdt, device=device)
        else:
            t = (torch.randn(p.shape, dtype=torch.float32, device=device, generator=g) * scale).to(pdt)
        _install(model, name, t)
    return model.eval()
