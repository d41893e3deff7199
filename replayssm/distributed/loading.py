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

import contextlib
import dataclasses
import threading
import time
import zlib

import torch

from ..models.registry import model_class, parse_config, read_config
from ..models.header import check_sizes
from ..models.mtp import attach_mtp
from ..models.margin import branch_scale, embedding_name, permuted_head, residual_outputs
from ..models.loader import (_FP32_PARAMS, WeightError, _cast_checked, _install, _transformed_checked,
                             _weight_files, check_quant_tensors, check_source_shapes, check_tied_copies,
                             param_dtype, parse_dtype, prepare_quant, source_plan)
from ..models.quant import fp8_transforms
from ..ops.fp8.naive import FP8
from ..runtime import canonical_device, compute_dtype
from .layers import build_local_model
from .sharding import ROOT_ONLY, Shard, check_tensor_parallel, local_config, shard_rules, vocab_shard
from .startup import StartupTimes

__all__ = ["load_shard", "random_shard"]


def _read(handle, key: str, dim: int, ranges, device=None, pad_to: int | None = None) -> torch.Tensor:
    """The ranges ``[a, b)`` along ``dim`` of checkpoint tensor ``key``, concatenated (and
    zero-padded to ``pad_to`` rows along ``dim``).  One range: the slice as read.  Several
    (or padding): assembled in one tensor on ``device`` (default: the host), each range
    copied straight from the file into its place — on a GPU no host copy of the whole
    shard is made first."""
    sl = handle.get_slice(key)
    parts = [sl[(slice(None),) * dim + (slice(a, b),)] for a, b in ranges]
    n = sum(p.shape[dim] for p in parts)
    size = max(n, pad_to or 0)
    if len(parts) == 1 and size == n:
        return parts[0]
    shape = list(parts[0].shape)
    shape[dim] = size
    out = torch.empty(shape, dtype=parts[0].dtype, device=device)
    off = 0
    for p in parts:
        out.narrow(dim, off, p.shape[dim]).copy_(p)
        off += p.shape[dim]
    if size > n:
        out.narrow(dim, n, size - n).zero_()
    return out


def _read_source(handles, key_file, src, rule, gshape, device=None) -> torch.Tensor:
    """One parameter's local tensor: a single key (ranges of several or padded ones
    assembled on ``device``, see :func:`_read`), or per-expert keys stacked on dim 0 on the
    host (the rule's dim then refers to the stacked tensor; ``gate_up_proj`` is two keys per
    expert)."""
    def h(k):
        return handles[key_file[k]]

    if src.stack is None:
        if rule is None:
            return h(src.keys[0]).get_tensor(src.keys[0])
        return _read(h(src.keys[0]), src.keys[0], rule.dim, rule.ranges, device, rule.pad_to)
    E, per_part = gshape[0], gshape[1] // src.parts if len(gshape) > 1 else 1
    experts = []
    for e in range(E):
        keys = src.keys[e * src.parts:(e + 1) * src.parts]
        if rule is None:   # (per-tensor expert scales are stored as [] per part)
            experts.append(torch.cat([h(k).get_tensor(k).reshape(-1) if len(gshape) == 2 else h(k).get_tensor(k)
                                      for k in keys], 0))
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


def _scale_range(name: str, a: int, b: int, blk: int, full: int) -> tuple[int, int]:
    """Scale rows/columns ``[a // blk, ceil(b / blk))`` of weight range ``[a, b)``; ValueError
    naming the weight when the range cuts an FP8 block (the scales could not follow)."""
    if a % blk or (b % blk and b != full):
        raise ValueError(f"{name}: this tensor-parallel split takes [{a}, {b}) of {full}, which cuts its FP8 "
                         f"blocks of {blk}: use fewer ranks, or a checkpoint quantized with a block that divides "
                         f"each rank's share (or per-tensor scales)")
    return a // blk, -(-b // blk)


def scale_rules(gmodel, rules: dict, lparams: dict) -> dict:
    """Shard rules of the block scales of FP8 layers, from their weights' rules (a weight's
    row range ``[a, b)`` takes scale rows ``[a/bo, b/bo)``; columns with ``bi``; expert stacks
    per part).  Per-tensor scales stay replicated.  ValueError names a weight whose split cuts
    a block (before any tensor is read)."""
    from ..layers.linear import Linear
    from ..layers.mlp import FP8Experts

    out = {}
    for mname, mod in gmodel.named_modules():
        if not isinstance(mod, (Linear, FP8Experts)) or not mod.fp8 or mod.block is None:
            continue
        bo, bi = mod.block
        if isinstance(mod, Linear):
            pairs = [(f"{mname}.weight", f"{mname}.weight_scale_inv", 0, 1)]
        else:
            pairs = [(f"{mname}.{n}", f"{mname}.{n}_scale_inv", 1, parts)
                     for n, parts in zip(mod.names, (2 if mod.gated else 1, 1))]
        for wname, sname, lead, parts in pairs:
            rule = rules.get(wname)
            if not isinstance(rule, Shard):
                continue
            wshape = tuple(getattr(mod, wname.rpartition(".")[2]).shape)
            d = rule.dim - lead                       # 0: rows, 1: columns of one (expert's) matrix
            blk, full = (bo, wshape[rule.dim]) if d == 0 else (bi, wshape[rule.dim])
            if d == 0 and parts > 1:                  # [gate | up]: each part's own block grid
                per, nb = full // parts, -(-(full // parts) // bo)
                ranges = []
                for a, b in rule.ranges:
                    p = a // per
                    s0, s1 = _scale_range(wname, a - p * per, b - p * per, bo, per)
                    ranges.append((p * nb + s0, p * nb + s1))
            else:
                ranges = [_scale_range(wname, a, b, blk, full) for a, b in rule.ranges]
            srule = Shard(rule.dim, tuple(ranges))
            want = lparams[sname].shape[rule.dim]
            if srule.size != want:
                raise ValueError(f"{wname}: its tensor-parallel shard's FP8 blocks ({srule.size}) do not match "
                                 f"the rank's block grid ({want}): a partial block inside the shard")
            out[sname] = srule
    return out


def _pad(t: torch.Tensor, rule: Shard) -> torch.Tensor:
    if rule.pad_to is None or t.shape[rule.dim] == rule.pad_to:
        return t
    shape = list(t.shape)
    shape[rule.dim] = rule.pad_to - t.shape[rule.dim]
    return torch.cat([t, t.new_zeros(shape)], rule.dim)


def _skeletons(cfg, dtype, device, rank: int, size: int, group, mtp_keys=None, times=None, gmodel=None):
    """``(global model, local model)`` on the meta device (no memory); both with an MTP head
    when ``mtp_keys`` (the checkpoint's tensor names) is given (``gmodel``: the global one,
    already built)."""
    check_tensor_parallel(cfg, size, mtp=mtp_keys is not None)
    cls = model_class(cfg)
    if gmodel is None:
        with torch.device("meta"):
            gmodel = cls(cfg, dtype, device)
            if mtp_keys is not None:
                attach_mtp(gmodel, mtp_keys)
    lmodel = build_local_model(cls, cfg, local_config(cfg, size), dtype, device, rank, size, group, mtp_keys,
                               times=times)
    return gmodel, lmodel


def _real_skeleton(path, cfg, dtype, device, rank: int, size: int, group, mtp_keys, key_file, gmodel, times):
    """The local model the weights are installed into: its all-reduce's (and fused
    finish's) collective setup runs here, and the same FP8 layers as the plan's."""
    _, model = _skeletons(cfg, dtype, device, rank, size, group, mtp_keys, times, gmodel=gmodel)
    prepare_quant(path, model, key_file, type(gmodel).key_aliases())
    return model


class _Setup:
    """``fn()`` on a thread started now (bound to ``device`` when it is a GPU: the current
    device is per thread); :meth:`join` waits and returns its result or raises its error.
    ``times`` gets ``load.setup`` (the thread's time) and ``load.setup_wait`` (the caller's
    wait in :meth:`join`: the part of the setup the reading did not hide)."""

    def __init__(self, fn, device: torch.device, times: StartupTimes):
        self.box: list = [None, None]
        self.times = times

        def run():
            t0 = time.perf_counter()
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                self.box[0] = fn()
            except BaseException as e:  # noqa: BLE001 - raised by join
                self.box[1] = e
            finally:
                times.add("load.setup", time.perf_counter() - t0)

        self.thread = threading.Thread(target=run, name="replayssm-tp-setup", daemon=True)
        self.thread.start()

    def join(self):
        t0 = time.perf_counter()
        self.thread.join()
        self.times.add("load.setup_wait", time.perf_counter() - t0)
        if self.box[1] is not None:
            raise self.box[1]
        return self.box[0]


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    leaf = name.rpartition(".")[2]
    return compute_dtype(dtype) if leaf in _FP32_PARAMS and dtype != torch.float64 else dtype


def load_shard(path: str, rank: int, size: int, device="cpu", dtype="float32", group=None, mtp: bool = False,
               times: StartupTimes | None = None):
    """Rank ``rank``'s shard (of ``size``) of the model in ``path``, on ``device`` (``mtp``:
    with its MTP head, ``model.mtp``, sharded by the same rules).  ``times`` records the
    phases (``load.check``: config and headers; ``load.skeleton``; ``load.allreduce_setup``;
    ``load.read``: the shard off the disk; ``load.transform``: transforms and value checks;
    ``load.to_device``).

    Raises what :func:`replayssm.models.load_model` raises for a bad directory, plus
    ``ValueError`` when the model cannot be split over ``size`` ranks.
    """
    import os

    from safetensors import safe_open

    times = times or StartupTimes()
    t0 = time.perf_counter()
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
    times.add("load.check", time.perf_counter() - t0)
    t0 = time.perf_counter()
    mtp_keys = key_file if mtp else None
    with torch.device("meta"):
        gmodel = model_class(cfg)(cfg, tdtype, device)
        if mtp_keys is not None:
            attach_mtp(gmodel, mtp_keys)
    # the plan: a skeleton without the collective setup (meta device: no symmetric memory, no
    # fused finish), so this rank reads its shard while the real skeleton's setup — the
    # symmetric-memory rendezvous and probes, a collective every rank runs — goes on beside it
    _, plan_model = _skeletons(cfg, tdtype, torch.device("meta"), rank, size, None, mtp_keys, gmodel=gmodel)
    aliases, read_past, scales = prepare_quant(path, gmodel, key_file, type(gmodel).key_aliases())
    prepare_quant(path, plan_model, key_file, type(gmodel).key_aliases())    # the same layers FP8, local sizes
    gparams = dict(gmodel.named_parameters())
    lparams = dict(plan_model.named_parameters())
    if set(gparams) != set(lparams):  # pragma: no cover - the local model mirrors the global one
        raise WeightError(f"local model parameters differ from the global model's: {sorted(set(gparams) ^ set(lparams))[:4]}")
    plan = source_plan(path, cfg, gparams, key_file, aliases, type(gmodel).tied_copy, read_past)
    check_tied_copies(cfg, key_file, type(gmodel).tied_copy)
    rules = shard_rules(gmodel, size, rank)
    rules.update(scale_rules(gmodel, rules, lparams))
    transforms = plan_model.load_transforms()
    transforms.update(fp8_transforms(plan_model, transforms))
    times.add("load.skeleton", time.perf_counter() - t0)
    handles = {}
    phase = _Phases(times)
    setup = _Setup(lambda: _real_skeleton(path, cfg, tdtype, device, rank, size, group, mtp_keys, key_file, gmodel,
                                          times), device, times)
    tensors: dict = {}
    try:
        with phase("load.check"):
            for fn in sorted(set(key_file.values())):
                handles[fn] = safe_open(fn, framework="pt", device="cpu")
            for name, src in plan.items():  # headers first: every shape against the global model
                check_source_shapes(name, src, tuple(gparams[name].shape), handles, key_file)
            check_quant_tensors(plan, gparams, scales, handles, key_file)
        for name, src in plan.items():
            rule = rules.get(name)
            pdt = param_dtype(name, gparams[name], tdtype, scales)
            try:
                with phase("load.read"):
                    if rule == ROOT_ONLY and rank != 0:
                        t = torch.zeros(gparams[name].shape, dtype=pdt)
                    else:
                        shard = rule if isinstance(rule, Shard) else None
                        # transforms run on the host, as the one-rank loader's do
                        on = torch.device("cpu") if name in transforms else device
                        t = _read_source(handles, key_file, src, shard, tuple(gparams[name].shape), on)
                        if shard is not None:
                            t = _pad(t, shard)
            except Exception as e:
                raise WeightError(f"{key_file[src.keys[0]]}: cannot read tensor {src.keys[0]!r} "
                                  f"(corrupt or truncated file: {e})") from None
            with phase("load.transform"):
                t = _transformed_checked(t, name, src, key_file, transforms, pdt == FP8)
                if name in scales:
                    t = t.reshape(lparams[name].shape)
                if tuple(t.shape) != tuple(lparams[name].shape):  # pragma: no cover - a rule bug
                    raise WeightError(f"rank {rank}: shard of {name} has shape {list(t.shape)}, "
                                      f"expected {list(lparams[name].shape)}")
            with phase("load.to_device"):
                tensors[name] = _cast_checked(t, src.keys[0], key_file, device, pdt)
    except BaseException:
        setup.thread.join()      # the peers run the same setup collectives: never leave it mid-way
        raise
    finally:
        handles.clear()
        phase.flush()
    model = setup.join()
    rparams = dict(model.named_parameters())
    for name, t in tensors.items():
        if tuple(rparams[name].shape) != tuple(t.shape):  # pragma: no cover - the plan mirrors the model
            raise WeightError(f"rank {rank}: {name} is {list(rparams[name].shape)} in the model, "
                              f"{list(t.shape)} in its plan")
        _install(model, name, t)
    return model.eval()


def _margin_vocab(model, cfg, rank: int, size: int, device, seed: int) -> dict:
    """This rank's rows of the margin recipe's embedding and ``lm_head`` (see
    :func:`random_shard`), padded rows zero; empty when the head is tied."""
    params = dict(model.named_parameters())
    emb = embedding_name(model)
    if emb is None or "lm_head.weight" not in params:
        return {}
    V, D = int(cfg.vocab_size), int(cfg.hidden_size)
    lo, real, Vs = vocab_shard(V, size, rank)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 17)
    full = torch.randn(V, D, device=device, generator=g)
    perm = torch.randperm(V, device=device, generator=g)
    out = {}
    for name, rows in ((emb, full[lo:lo + real]), ("lm_head.weight", permuted_head(full, perm[lo:lo + real]))):
        t = torch.zeros(Vs, D, device=device)
        t[:real] = rows
        if tuple(params[name].shape) != (Vs, D):   # a layout this recipe does not know
            return {}
        out[name] = t
    del full
    return out


class _Phases:
    """Per-tensor phase timing summed locally, added to ``times`` once (one entry each,
    not one lock per tensor)."""

    def __init__(self, times: StartupTimes):
        self.times, self.sums = times, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sums[name] = self.sums.get(name, 0.0) + time.perf_counter() - t0

    def flush(self) -> None:
        for name, sec in self.sums.items():
            self.times.add(name, sec)
        self.sums.clear()


def random_shard(cfg_dict: dict, rank: int, size: int, device="cpu", dtype="bfloat16", group=None,
                 seed: int = 0, scale: float = 0.02, mtp: bool = False, margin: bool = False):
    """Rank ``rank``'s shard of a random-weight model described by a ``config.json`` dict,
    generated directly on ``device`` (no checkpoint; ``mtp``: with an MTP head of
    ``num_nextn_predict_layers`` layers, default 1).  Norm weights are 1, ``A_log`` and
    ``dt_bias`` in the usual ranges, other weights ``N(0, scale²)``; replicated parameters
    are identical on every rank (their seed depends only on their name).

    ``margin``: the benchmarks' greedy-margin recipe (:mod:`replayssm.models.margin`, as
    ``bench e2e``'s random checkpoints) — unit-variance embeddings, an untied ``lm_head``
    that is a fixed permutation of the embedding rows over ``sqrt(d_model)``, residual
    output projections (:func:`~replayssm.models.margin.residual_outputs`) at
    ``scale / sqrt(layers)`` — so the greedy next token wins by a margin far above bf16
    rounding and an oracle drafter's continuation stays the model's own in every decode form.
    Each rank draws the whole embedding with one seed (``V x d_model`` floats, briefly) and
    keeps its vocabulary rows."""
    tdtype = parse_dtype(dtype)
    device = canonical_device(device)
    cfg = parse_config(dict(cfg_dict), "config dict")
    gmodel, model = _skeletons(cfg, tdtype, device, rank, size, group, () if mtp else None)
    rules = shard_rules(gmodel, size, rank)
    vocab = _margin_vocab(model, cfg, rank, size, device, seed) if margin else {}
    residual = residual_outputs(model) if margin else frozenset()
    layers = max(1, int(getattr(cfg, "num_hidden_layers", 1) or 1))
    for name, p in model.named_parameters():
        if name in vocab:
            _install(model, name, vocab[name].to(_param_dtype(name, tdtype)))
            continue
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
            sc = branch_scale(scale, layers) if name in residual else scale
            t = (torch.randn(p.shape, dtype=torch.float32, device=device, generator=g) * sc).to(pdt)
        _install(model, name, t)
    return model.eval()
