"""One rank's model: the usual layers at local sizes, plus the collectives that join them.

A rank's model is the model class itself built from :func:`~.sharding.local_config` (its
share of heads and channels), with four additions:

* every sub-block mixer (Mamba-2, GDN, attention, MLP, MoE) ends in a row-parallel
  projection whose output is a partial sum: a forward hook all-reduces it, one all-reduce
  per sub-block, before the residual add (``h = h + mixer(norm(h))`` stays the same code);
* the embedding holds a vocabulary shard: ids outside it give exact zeros, and the
  all-reduce of the rows assembles each token's embedding (one rank contributes it);
* the LM head holds the same shard: the local logits ``[..., Vs]`` are all-gathered to
  ``[..., N Vs]`` and cut to ``V``, so every rank holds the complete, identical logits (and
  computes identical greedy acceptances from them); a greedy step that needs only the
  argmax (``decode(..., greedy=True)``) exchanges each shard's ``(max, index)`` instead
  (:mod:`.greedy`);
* an MTP head (``mtp_keys``: the checkpoint's tensor names) is built on the local model the
  same way: its decoder layers at local sizes with the same hooks, its ``fc`` / ``eh_proj``
  and norms replicated (their input ``[n_e(E x) ; n_h(h)]`` is complete on every rank: the
  embedding is all-reduced, ``h`` is the replicated final-normed stream), and the shared
  vocabulary-parallel embedding and head (:meth:`MTPHead.logits` gathers like the target);
* a Mamba-2 gated RMSNorm whose groups span ranks (``n_groups`` < ranks) all-reduces its
  per-group sums of squares (:class:`ShardedGatedRMSNorm`; on GPUs two Triton kernels
  around that one small all-reduce: the local sums, then the norm with the group's total).

The sums go through :class:`~.allreduce.AllReduce` (one-shot symmetric memory on GPUs for
decode-sized messages, NCCL past that, gloo on CPU).  With the fused finish
(:mod:`.fused`, ``REPLAYSSM_TP_FUSED``, default on) a plain block's mixer instead returns
its partial as a :class:`~.fused.DeferredSum`, summed by the kernel that also adds the
residual and applies the next norm; Mamba-2's gated norm over ranks is then deferred past
``out_proj`` (:class:`DeferredGatedNorm`).

After an all-reduce every rank holds the same residual stream, so replicated decisions
(MoE routing, ring flushes, accepted counts) are computed identically everywhere.
Collectives run inside CUDA graphs: each rank captures the same graphs for the same keys.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.dispatch import fused_ok
from ..kernels.norm import gated_rmsnorm, gated_sumsq
from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..layers.kda import KimiDeltaAttention
from ..layers.linear import Linear
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mlp import GatedMLP, PlainMLP
from ..models.mtp import attach_mtp
from ..runtime import compute_dtype
from .allreduce import AllReduce
from .greedy import argmax_over_shards, greedy_local_enabled
from .fused import FusedFinish, GroupScale, SymmOutProj, deferring_hook, fused_enabled
from ..layers.norms import GatedRMSNorm
from ..models.base import Block
from ..models.falcon_h1 import GroupedNormThenGate
from ..models.zamba2 import HybridBlock, SharedTransformer
from .sharding import mamba_dims, mamba_groups, vocab_shard

__all__ = ["ShardInfo", "ShardedGatedRMSNorm", "TensorParallelLM", "build_local_model", "all_gather_last"]

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ShardInfo:
    """Where a model shard sits: ``rank`` of ``size``, over process group ``group``
    (``None``: the default group); the global ``config`` and the vocabulary shard rows
    ``[vocab_start, vocab_start + vocab_rows)`` (``vocab_rows`` includes padding);
    ``allreduce``: the sum over the ranks every row-parallel layer ends in."""

    rank: int
    size: int
    group: object
    config: object
    vocab_start: int
    vocab_rows: int
    allreduce: AllReduce


def all_gather_last(x: Tensor, size: int, group=None) -> Tensor:
    """``[..., C]`` on each of ``size`` ranks -> ``[..., size * C]``, rank ``r``'s block at
    ``r C`` (the same tensor on every rank)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = flat.new_empty(size * flat.shape[0], flat.shape[1])
    _all_gather_into(out, flat, group=group)
    return out.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def _all_reduce_hook(allreduce: AllReduce):
    def hook(module, args, output: Tensor) -> Tensor:
        return allreduce(output)

    return hook


class ShardedGatedRMSNorm(nn.Module):
    """Mamba-2's gated RMSNorm ``y = w · rms_g(x · silu(z))`` when a norm group (``group_size``
    channels) spans several ranks: the local channels all lie in group ``group_index`` of
    ``num_groups``; their sum of squares is all-reduced (a ``[...]`` vector for one group,
    else ``[..., num_groups]`` with each rank's partial in its group's column), then
    ``rms = sqrt(sum / group_size + eps)``.  On GPUs the two halves are Triton kernels
    (:func:`~replayssm.kernels.norm.gated_sumsq`, ``gated_rmsnorm(..., sumsq=)``)."""

    def __init__(self, dim: int, eps: float, group_size: int, group_index: int, num_groups: int,
                 allreduce: AllReduce):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.group_size = eps, group_size
        self.group_index, self.num_groups, self.allreduce = group_index, num_groups, allreduce

    def _total(self, part: Tensor) -> Tensor:
        """The group's sum of squares over all ranks, ``[...]`` (``part``: this rank's)."""
        if self.num_groups == 1:
            return self.allreduce(part)
        sums = part.new_zeros(*part.shape, self.num_groups)
        sums[..., self.group_index] = part
        return self.allreduce(sums)[..., self.group_index].contiguous()

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        if fused_ok(x, z, self.weight):
            total = self._total(gated_sumsq(x, z))
            return gated_rmsnorm(x, z, self.weight, self.eps, x.shape[-1], True, sumsq=total, total=self.group_size)
        return self.reference(x, z)

    def reference(self, x: Tensor, z: Tensor) -> Tensor:
        dt = x.dtype
        xf = x.to(compute_dtype(dt)) * F.silu(z.to(compute_dtype(dt)))
        var = self._total(xf.pow(2).sum(-1))[..., None] / self.group_size
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(dt)


class DeferredGatedNorm(ShardedGatedRMSNorm):
    """:class:`ShardedGatedRMSNorm` with its row scale deferred past ``out_proj`` (the fused
    finish, :mod:`.fused`): returns ``u = w · x · silu(z)`` and keeps this rank's sums of
    squares for the mixer's hook, which sends them with the projection's partial (on GPUs
    they go straight into the finish's buffer).  Where the fused finish does not apply
    (:meth:`~.fused.FusedFinish.mode` None) it is the sharded norm it extends."""

    def __init__(self, *args, fin: FusedFinish):
        super().__init__(*args)
        self.fin = fin
        self.pending: GroupScale | None = None

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        mode = self.fin.mode(rows, x)
        if mode is None:
            return super().forward(x, z)
        if mode == "fused" and fused_ok(x, z, self.weight):
            u, ss = gated_sumsq(x, z, self.weight, out=self.fin.sums_out(rows))
        else:
            cdt = compute_dtype(x.dtype)
            xf = x.to(cdt) * F.silu(z.to(cdt))
            ss = xf.pow(2).sum(-1)
            u = (self.weight.to(cdt) * xf).to(x.dtype)
        self.pending = GroupScale(ss, self.group_index, self.num_groups, self.group_size, self.eps)
        return u

    def take(self) -> GroupScale | None:
        """The sums of the last forward (once)."""
        s, self.pending = self.pending, None
        return s


class ShardedNormThenGate(ShardedGatedRMSNorm):
    """Falcon-H1's norm-then-gate ``y = w · rms_g(x) · silu(z)`` (``mamba_norm_before_gate``)
    when a norm group spans ranks: the local sums of squares of ``x`` are all-reduced as in
    :class:`ShardedGatedRMSNorm` (plain PyTorch, at least fp32)."""

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return self.reference(x, z)

    def reference(self, x: Tensor, z: Tensor) -> Tensor:
        cdt = compute_dtype(x.dtype)
        xf = x.to(cdt)
        var = self._total(xf.pow(2).sum(-1))[..., None] / self.group_size
        return (self.weight.to(cdt) * xf * torch.rsqrt(var + self.eps) * F.silu(z.to(cdt))).to(x.dtype)


class TensorParallelLM:
    """Mixed into a model class (``shard_class``): a vocabulary-parallel embedding and LM head."""

    tp: ShardInfo

    def _embed(self, input_ids: Tensor) -> Tensor:
        tp = self.tp
        local = input_ids - tp.vocab_start
        inside = (local >= 0) & (local < tp.vocab_rows)
        h = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.embed_weight())
        h = torch.where(inside[..., None], h, torch.zeros((), dtype=h.dtype, device=h.device))
        return tp.allreduce(h)

    def _logits(self, hn: Tensor) -> Tensor:
        local = super()._logits(hn)                                           # [..., Vs]
        full = all_gather_last(local, self.tp.size, self.tp.group)            # [..., N Vs]
        return full[..., : self.tp.config.vocab_size]

    def _argmax(self, hn: Tensor) -> Tensor:
        """Greedy tokens ``[...]`` without gathering the logits: each rank's shard's per-row
        max and first argmax, then one all-gather of the ``(max, global index)`` pairs
        (:func:`~.greedy.argmax_over_shards`: ``[..., 2]`` per rank instead of ``[..., Vs]``)."""
        tp = self.tp
        local = super(TensorParallelLM, self)._logits(hn)                     # [..., Vs]
        return argmax_over_shards(local, tp.vocab_start, tp.config.vocab_size, tp.size, tp.group)

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size

    @property
    def argmax_head(self) -> bool:
        """Whether greedy tokens (:meth:`_argmax`) cost less than the logits (no vocabulary
        gather): runners then keep a greedy decode step beside the logits one.
        ``REPLAYSSM_TP_GREEDY_LOCAL=0`` turns it off (greedy steps gather the logits again);
        rank 0's reading decides for every rank (``TensorParallelModel.make_runner``)."""
        return self.tp.size > 1 and greedy_local_enabled()


@functools.lru_cache(maxsize=None)
def shard_class(cls: type) -> type:
    """``cls`` with :class:`TensorParallelLM` in front (one class per model class)."""
    return type(f"TensorParallel{cls.__name__}", (TensorParallelLM, cls), {})


def _holder_rows(holder: nn.Module, rows: int) -> None:
    w = holder.weight
    holder.weight = nn.Parameter(torch.empty(rows, w.shape[1], device="meta"), requires_grad=False)


def build_local_model(cls: type, cfg, lcfg, dtype: torch.dtype, device, rank: int, size: int, group=None,
                      mtp_keys=None, times=None):
    """Rank ``rank``'s model skeleton on the meta device (weights still to load): ``cls``
    built from the local config ``lcfg``, with vocabulary-shard embedding/head, sharded
    gated norms where a norm group spans ranks, and the all-reduce hooks; with an MTP head
    (``model.mtp``) when ``mtp_keys`` (the checkpoint's tensor names) is given.  ``times``
    (a :class:`~.startup.StartupTimes`) records the all-reduce's setup."""
    with torch.device("meta"):
        model = shard_class(cls)(lcfg, dtype, device)
        if mtp_keys is not None:
            attach_mtp(model, mtp_keys)
    lo, _, Vs = vocab_shard(cfg.vocab_size, size, rank)
    # collective setup (every rank builds its model together); messages come in the model's
    # dtype, and the norm's sums of squares in its compute dtype
    t0 = time.perf_counter()
    allreduce = AllReduce(group, device, dtypes=(dtype, compute_dtype(dtype)))
    if times is not None:
        times.add("load.allreduce_setup", time.perf_counter() - t0)
    model.tp = ShardInfo(rank, size, group, cfg, lo, Vs, allreduce)
    root, embed, _ = model._names
    _holder_rows(getattr(getattr(model, root), embed), Vs)
    if not lcfg.tie_word_embeddings:
        _holder_rows(model.lm_head, Vs)
    fin = None
    if fused_enabled() and allreduce.requested != "nccl":    # REPLAYSSM_TP_ALLREDUCE=nccl: NCCL sums only
        t0 = time.perf_counter()
        fin = FusedFinish(group, device, dtype, cfg.hidden_size, allreduce.symm_max_bytes, rank, size, allreduce)
        if times is not None:
            times.add("load.allreduce_setup", time.perf_counter() - t0)   # the fused finish's buffers too
    model.tp_fused = fin
    blocks = list(model.blocks) + (list(model.mtp.blocks) if mtp_keys is not None else [])
    for blk in blocks:
        for _, mixer_name in blk.subs:
            mixer = getattr(blk, mixer_name)
            defer = fin is not None and isinstance(blk, Block) and blk.defers
            if isinstance(mixer, Mamba2Mixer):
                _shard_norm(mixer, cfg, size, rank, allreduce, fin if defer else None)
            if defer:
                _write_into_buffer(mixer, fin)
                norm = getattr(mixer, "norm", None)
                mixer.register_forward_hook(deferring_hook(fin, allreduce, norm if isinstance(norm, DeferredGatedNorm)
                                                           else None))
            else:
                mixer.register_forward_hook(_all_reduce_hook(allreduce))
    for mixer in _held_mixers(model):
        if isinstance(mixer, Mamba2Mixer):
            _shard_norm(mixer, cfg, size, rank, allreduce)
        mixer.register_forward_hook(_all_reduce_hook(allreduce))
    return model


#: mixers whose forward returns their last projection's output as it is: (class, projection)
_OUT_PROJ = ((Mamba2Mixer, "out_proj"), (KimiDeltaAttention, "o_proj"), (GatedDeltaNet, "out_proj"),
             (Attention, "o_proj"), (GatedMLP, "down_proj"), (PlainMLP, "down_proj"))


def _write_into_buffer(mixer: nn.Module, fin: FusedFinish) -> None:
    """Make the mixer's last projection write its partial into the fused finish's buffer
    (:class:`~.fused.SymmOutProj`: no copy before the sum), for the mixers of ``_OUT_PROJ``
    (one call of that projection per forward, its output the mixer's)."""
    for cls, name in _OUT_PROJ:
        if isinstance(mixer, cls):
            old = getattr(mixer, name)
            if type(old) is not Linear:
                return
            with torch.device("meta"):
                new = SymmOutProj(old.d_in, old.d_out, old.bias is not None)
            new.fin = fin
            setattr(mixer, name, new)
            return


def _held_mixers(model) -> list[nn.Module]:
    """Row-parallel modules that no block's ``subs`` lists, each once: a Zamba2 hybrid layer's
    attention invocation and Mamba-2 mixer, and each shared block's MLP ``down_proj`` (one
    module, however many layers invoke it)."""
    out = []
    for mod in model.modules():
        if isinstance(mod, HybridBlock):
            out += [mod.attention, mod.mamba_decoder.mamba]
        elif isinstance(mod, SharedTransformer):
            out.append(mod.feed_forward.down_proj)
    return out


def _shard_norm(mixer: Mamba2Mixer, cfg, size: int, rank: int, allreduce: AllReduce,
                fin: FusedFinish | None = None) -> None:
    """Replace the mixer's gated norm when its groups span ranks (``n_groups`` < ranks); with
    the fused finish ``fin`` (the mixer's output only becomes a block's ``pending``), a
    gate-first norm over a bias-free ``out_proj`` is deferred past it (:class:`DeferredGatedNorm`)."""
    H, G = mamba_dims(cfg)
    if G % size == 0:
        return  # whole norm groups on every rank: the local norm is exact
    old = mixer.norm
    if not isinstance(old, (GatedRMSNorm, GroupedNormThenGate)):
        return  # no norm (Falcon-H1's plain ``y · silu(z)``): elementwise, exact per rank
    gate_first = getattr(old, "gate_first", False)
    gsize = mixer.inter * size // G          # global channels / G
    g0, _ = mamba_groups(H, G, size, rank)
    args = (mixer.inter, old.eps, gsize, g0, G, allreduce)
    with torch.device("meta"):
        if gate_first and fin is not None and mixer.out_proj.bias is None:
            mixer.norm = DeferredGatedNorm(*args, fin=fin)
        else:
            mixer.norm = (ShardedGatedRMSNorm if gate_first else ShardedNormThenGate)(*args)
