"""Tensor parallelism for the JAX backend with ``jax.sharding``: a 1-D device mesh (axis
``"tp"``), a :class:`~jax.sharding.PartitionSpec` per parameter and per cache array, and the
compiler (GSPMD) inserting every collective.  No hand-written communication.

What is split over ``tp`` devices (each only where its axis divides by ``tp``; anything
else is replicated, which is always correct, only slower):

==============  ==================================================================
Mamba-2         ``in_z/in_x/in_dt`` rows, ``conv_x``, ``dt_bias/A_log/D``, ``norm_w``
                by heads; ``out_proj`` columns (all-reduce); state, ``win_x``, ring
                ``rx/rdt`` by heads.  ``in_bc``, ``conv_bc``, ``rB`` replicated (``G``
                groups, usually 1).
Gated DeltaNet  ``in_q/in_k`` by key heads, ``in_v/in_z/in_b/in_a`` by value heads,
                their convs, ``dt_bias/A_log``; ``out_proj`` columns; state, windows,
                ring ``ru/rk/rg`` by heads.
attention       ``q/k/v`` rows and ``o_proj`` columns by heads (needs ``H`` and ``Hkv``
                divisible); K/V cache by KV heads.
MLP / experts   up/gate rows and down columns by the intermediate axis (every expert's
                ``I`` split, so decode's gathered experts stay local); router replicated.
embedding/head  by vocabulary rows.
==============  ==================================================================

Every layer layout of :class:`~replayssm.jax.generate.JaxLLM`'s loops takes the same splits: a
stage stacked ``[cnt, ...]`` (scan), a tuple of ``g`` stacks ``[cnt/g, ...]`` (grouped loop)
or a list of per-layer leaves (unrolled loop; its caches are per-layer lists too).

Mamba-2's single-group gated norm is folded past ``out_proj`` (:func:`fold_norms`): one
all-reduce per layer carries both the norm's sum of squares and the partial products.

The math is unchanged: greedy tokens equal those of one device (tests run two host CPU
devices, ``XLA_FLAGS=--xla_force_host_platform_device_count=2``); reductions split over
devices may round differently in low precision.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .params import ModelSpec

__all__ = ["AXIS", "make_mesh", "param_specs", "cache_spec", "shard_params", "constrain_cache", "fold_norms"]

AXIS = "tp"


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh over the first ``tp`` devices of jax's default backend."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < tp:
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; jax sees {len(devs)} "
                         f"({jax.default_backend()})")
    return Mesh(np.array(devs[:tp]), (AXIS,))


def _split(ndim: int, axis: int, size: int, tp: int) -> P:
    """``axis`` (of ``ndim``) over the mesh when it divides by ``tp``, else replicated."""
    if tp == 1 or size % tp:
        return P()
    return P(*([None] * axis + [AXIS] + [None] * (ndim - axis - 1)))


#: per mixer kind: leaf name -> the axis (of the unstacked leaf) split over devices
_PARAM_AXES = {
    "mamba": {"in_z_w": 0, "in_z_b": 0, "in_x_w": 0, "in_x_b": 0, "in_dt_w": 0, "in_dt_b": 0,
              "conv_x_w": 0, "conv_x_b": 0, "dt_bias": 0, "A_log": 0, "D": 0, "norm_w": 0, "out_proj_w": 1},
    "gdn": {"in_q_w": 0, "in_q_b": 0, "in_k_w": 0, "in_k_b": 0, "in_v_w": 0, "in_v_b": 0, "in_z_w": 0,
            "in_z_b": 0, "in_b_w": 0, "in_b_b": 0, "in_a_w": 0, "in_a_b": 0, "conv_q_w": 0, "conv_q_b": 0,
            "conv_k_w": 0, "conv_k_b": 0, "conv_v_w": 0, "conv_v_b": 0, "dt_bias": 0, "A_log": 0,
            "out_proj_w": 1},
    "attn": {"q_proj_w": 0, "q_proj_b": 0, "k_proj_w": 0, "k_proj_b": 0, "v_proj_w": 0, "v_proj_b": 0,
             "o_proj_w": 1},
    "mlp": {"up_w": 0, "up_b": 0, "down_w": 1},
    "gmlp": {"gate_w": 0, "gate_b": 0, "up_w": 0, "up_b": 0, "down_w": 1},
    "moe_sig": {"up": 1, "down": 2, "sh_up_w": 0, "sh_up_b": 0, "sh_down_w": 1},
    "moe_soft": {"e_gate": 1, "e_up": 1, "down": 2, "sh_gate_w": 0, "sh_up_w": 0, "sh_down_w": 1},
}

#: per mixer kind: cache array -> the axis (of the unstacked ``[B, ...]`` array) split
_CACHE_AXES = {
    "mamba": {"state": 1, "win_x": 2, "rx": 2, "rdt": 2},
    "gdn": {"state": 1, "win_q": 2, "win_k": 2, "win_v": 2, "ru": 2, "rk": 2, "rg": 2},
    "attn": {"k": 2, "v": 2},
}


def _heads(sp, tp: int) -> bool:
    """Whether a mixer's head (or intermediate) axis splits evenly over ``tp`` devices."""
    k = sp.kind
    if k == "mamba":
        return sp.H % tp == 0
    if k == "gdn":
        return sp.H % tp == 0 and sp.HV % tp == 0
    if k == "attn":
        return sp.H % tp == 0 and sp.Hkv % tp == 0
    return True   # MLPs / experts: per leaf (the intermediate size) below


def _layout(p):
    """``(stacks, wrap)`` of one stage in any layout: a stacked dict (leaves ``[cnt, ...]``), a
    tuple of stacks (grouped, :func:`~replayssm.jax.model.group_params`: leaves ``[cnt/g, ...]``)
    or a list of per-layer dicts (:func:`~replayssm.jax.model.unstack_params`, no layer axis);
    ``stacks`` is a list of ``(pytree, leading layer axes)``, ``wrap`` rebuilds the layout."""
    if isinstance(p, tuple):
        return [(q, 1) for q in p], tuple
    if isinstance(p, list):
        return [(q, 0) for q in p], list
    return [(p, 1)], lambda xs: xs[0]


def param_specs(spec: ModelSpec, params, tp: int):
    """A pytree of :class:`PartitionSpec` matching ``params`` in any layer layout (stacked,
    grouped or per-layer; a stack's leading layer axis is never split: a grouped stack's
    leaves split on the axes of the stacked ones)."""
    def leaf(sp, name, a, stacked: int):
        ax = _PARAM_AXES.get(sp.kind, {}).get(name)
        if ax is None or not _heads(sp, tp):
            return P()
        return _split(a.ndim, ax + stacked, a.shape[ax + stacked], tp)

    stages = []
    for (sb, _), p in zip(spec.stages, params["stages"]):
        stacks, wrap = _layout(p)
        stages.append(wrap([{"norm": P(), "mixer": {k: leaf(sb.mixer, k, v, n) for k, v in q["mixer"].items()}}
                            for q, n in stacks]))
    out = {"embed": _split(2, 0, params["embed"].shape[0], tp), "final_norm": P(), "stages": stages}
    if "head" in params:
        out["head"] = _split(2, 0, params["head"].shape[0], tp)
    return out


def cache_spec(kind_sp, name: str, shape, tp: int, stacked: int = 1) -> P:
    """The :class:`PartitionSpec` of one cache array: stacked ``[Ly, B, ...]``
    (``stacked=1``) or one layer's ``[B, ...]`` (``stacked=0``: per-layer caches,
    :func:`~replayssm.jax.model.split_cache`)."""
    ax = _CACHE_AXES.get(kind_sp.kind, {}).get(name)
    if ax is None or not _heads(kind_sp, tp):
        return P()
    return _split(len(shape), ax + stacked, shape[ax + stacked], tp)


def fold_norms(spec: ModelSpec) -> ModelSpec:
    """``spec`` with Mamba-2's single-group gated norm folded past ``out_proj``
    (``fold_norm``: the norm's sum of squares rides on out_proj's all-reduce; see
    :func:`replayssm.jax.layers.mamba`).  Same math, other rounding order."""
    import dataclasses

    from .params import MixerSpec

    stages = []
    for sb, cnt in spec.stages:
        m = sb.mixer
        if m.kind == "mamba":
            m = MixerSpec(m.kind, tuple(sorted(dict(m.opts, fold_norm=True).items())))
            sb = dataclasses.replace(sb, mixer=m)
        stages.append((sb, cnt))
    return dataclasses.replace(spec, stages=tuple(stages))


def shard_params(spec: ModelSpec, params, mesh: Mesh):
    """``params`` placed on ``mesh`` (one ``device_put``)."""
    tp = mesh.devices.size
    specs = param_specs(spec, params, tp)
    return jax.device_put(params, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                                         is_leaf=lambda x: isinstance(x, P)))


def constrain_cache(spec: ModelSpec, cache, mesh: Mesh | None):
    """``cache`` with every stage array pinned to its sharding (inside ``jit``), so that the
    compiled loop's carry keeps one layout from step to step.  Stacked caches ``[Ly, B, ...]``
    (the scan and grouped loops) or per-layer lists of ``[B, ...]`` (unrolled layers)."""
    if mesh is None:
        return cache
    tp = mesh.devices.size

    def pin(sp, k, v, stacked):
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, cache_spec(sp, k, v.shape, tp, stacked)))

    stages = []
    for (sb, _), c in zip(spec.stages, cache.stages):
        stages.append({k: [pin(sb.mixer, k, a, 0) for a in v] if isinstance(v, list) else pin(sb.mixer, k, v, 1)
                       for k, v in c.items()})
    return cache.replace(stages=stages)
