"""Per-layer state pools and input ring buffers (one object per SSM/GDN layer).

Every tensor's first axis is the slot (``num_slots + 1`` rows; row 0 is the null slot
that padding rows write into).  The ring axis has length ``L`` (capacity).  The
bookkeeping (which ring entries are committed) lives in one shared
:class:`~replayssm.cache.ring.RingIndex`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


def _empty(shape, dtype, device, poison: bool) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if poison:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    else:
        t.zero_()
    return t


def _decay_dtype(state_dtype, decay_dtype):
    """The ring's per-head decay entries (``dt`` / ``g``): ``decay_dtype``, else the state's
    compute dtype (fp32, fp64 for fp64 states): a bf16/fp16 *checkpoint* keeps fp32 decays."""
    if decay_dtype is not None:
        return decay_dtype
    return torch.float64 if state_dtype == torch.float64 else torch.float32


@dataclass
class Mamba2Buffers:
    """Checkpoint states and ring of ``(x, B, dt)`` inputs of one Mamba-2 layer.

    state: ``[P, H, d, n]`` (HF layout ``nheads, head_dim, d_state``; ``state_dtype``: fp32,
           bf16, fp16 or fp64; math always in fp32 (fp64), rounded once per write)
    x:     ``[P, L, H, d]`` post-conv values ``v`` (model dtype)
    B:     ``[P, L, G, n]`` keys ``k`` (one per group; model dtype)
    dt:    ``[P, L, H]``   step sizes ``Δ`` (after softplus, bias and clamp; fp32, fp64 with
           fp64 states: ``decay_dtype``)
    """

    state: Tensor
    x: Tensor
    B: Tensor
    dt: Tensor

    @classmethod
    def allocate(cls, num_slots: int, capacity: int, nheads: int, head_dim: int, d_state: int,
                 ngroups: int, dtype=torch.float32, state_dtype=torch.float32, decay_dtype=None,
                 device="cpu", poison: bool = False) -> "Mamba2Buffers":
        if nheads % ngroups:
            raise ValueError(f"nheads {nheads} is not a multiple of ngroups {ngroups}")
        P, L = num_slots + 1, capacity
        return cls(
            state=_empty((P, nheads, head_dim, d_state), state_dtype, device, poison),
            x=_empty((P, L, nheads, head_dim), dtype, device, poison),
            B=_empty((P, L, ngroups, d_state), dtype, device, poison),
            dt=_empty((P, L, nheads), _decay_dtype(state_dtype, decay_dtype), device, poison),
        )

    def ring_tensors(self) -> list[Tensor]:
        return [self.x, self.B, self.dt]


@dataclass
class _DeltaRuleBuffers:
    """Checkpoint states ``[P, HV, K, V]`` and a ring of ``(u, k, g)`` entries of one delta-rule
    layer; ``g`` holds one log-decay per value head (GDN) or per value head and key channel
    (KDA: ``per_channel_decay``)."""

    per_channel_decay: ClassVar[bool] = False

    state: Tensor
    u: Tensor
    k: Tensor
    g: Tensor

    @classmethod
    def allocate(cls, num_slots: int, capacity: int, num_k_heads: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, dtype=torch.float32,
                 state_dtype=torch.float32, decay_dtype=None, device="cpu", poison: bool = False):
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
        P, L = num_slots + 1, capacity
        g_shape = (P, L, num_v_heads) + ((head_k_dim,) if cls.per_channel_decay else ())
        return cls(
            state=_empty((P, num_v_heads, head_k_dim, head_v_dim), state_dtype, device, poison),
            u=_empty((P, L, num_v_heads, head_v_dim), dtype, device, poison),
            k=_empty((P, L, num_k_heads, head_k_dim), dtype, device, poison),
            g=_empty(g_shape, _decay_dtype(state_dtype, decay_dtype), device, poison),
        )

    def ring_tensors(self) -> list[Tensor]:
        return [self.u, self.k, self.g]


@dataclass
class GDNBuffers(_DeltaRuleBuffers):
    """Checkpoint states and ring of ``(u, k, g)`` entries of one Gated DeltaNet layer.

    state: ``[P, HV, K, V]`` (HF/fla layout, i.e. ``Sᵀ``; fp32, bf16, fp16 or fp64)
    u:     ``[P, L, HV, V]`` corrected values ``u = β(v − α S k)`` (model dtype)
    k:     ``[P, L, H, K]``  keys after l2-norm (model dtype)
    g:     ``[P, L, HV]``    log-decays ``g <= 0`` (fp32; fp64 with fp64 states)
    """


@dataclass
class KDABuffers(_DeltaRuleBuffers):
    """Checkpoint states and ring of ``(u, k, g)`` entries of one KDA (Kimi Delta Attention)
    layer: :class:`GDNBuffers` with a log-decay per key channel (``docs/MATH.md``, "KDA").

    state: ``[P, HV, K, V]`` (HF/fla layout, i.e. ``Sᵀ``; fp32, bf16, fp16 or fp64)
    u:     ``[P, L, HV, V]`` corrected values ``u = β(v − S (α ⊙ k))`` (model dtype)
    k:     ``[P, L, H, K]``  keys after l2-norm (model dtype)
    g:     ``[P, L, HV, K]`` per-channel log-decays ``g <= 0`` (fp32; fp64 with fp64 states)
    """

    per_channel_decay: ClassVar[bool] = True
