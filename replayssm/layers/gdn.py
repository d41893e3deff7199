"""Gated DeltaNet mixer (HF ``Qwen3NextGatedDeltaNet`` checkpoints).

HF packs ``in_proj_qkvz`` per key head ``[q (K) | k (K) | v (r·V) | z (r·V)]`` and
``in_proj_ba`` per key head ``[b (r) | a (r)]`` with ``r = HV / H``.  At load time we permute
the rows to ``[q (H·K) | k (H·K) | v (HV·V) | z (HV·V)]`` and ``[b (HV) | a (HV)]``
(:func:`reorder_qkvz`, :func:`reorder_ba`); value head ``hv = h·r + i`` keeps its index, so
value head ``hv`` reads key head ``hv // r``.

``qkv = silu(causal_conv([q | k | v]))``; ``β = sigmoid(b)``;
``g = -exp(A_log) · softplus(a + dt_bias)`` (fp32+); ``y = GDN(q, k, v, g, β)`` with
l2-normalised q, k and ``q · K^-1/2``; ``out = out_proj(rms(y) · w · silu(z))`` per value head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache.buffers import GDNBuffers
from ..cache.paged import GDNPagedBuffers
from ..kernels.dispatch import ops_for
from .context import StepContext
from .derived import derived, fused_gates
from .mlp import Linear, _param
from ..runtime import compute_dtype
from .norms import GatedRMSNorm
from .ssm_base import SSMLayer


#: ops whose q/k are l2-normalised inside (HF/fla ``use_qk_l2norm_in_kernel``)
_QK_NORM_OPS = ("recurrent_step", "replay_decode", "replay_verify", "tree_verify", "snapshot_verify",
                "kv_verify", "kv_tree_verify", "chunked_prefill", "chunked_prefill_varlen")


def reorder_qkvz(w: Tensor, H: int, HV: int, K: int, V: int) -> Tensor:
    """HF per-key-head interleaved rows -> ``[q | k | v | z]`` rows (any trailing dims)."""
    r = HV // H
    t = w.reshape(H, 2 * K + 2 * r * V, *w.shape[1:])
    q, k, v, z = torch.split(t, [K, K, r * V, r * V], dim=1)
    return torch.cat([x.reshape(-1, *w.shape[1:]) for x in (q, k, v, z)], 0).contiguous()


def reorder_ba(w: Tensor, H: int, HV: int) -> Tensor:
    """HF per-key-head ``[b (r) | a (r)]`` rows -> ``[b (HV) | a (HV)]``."""
    r = HV // H
    t = w.reshape(H, 2 * r, *w.shape[1:])
    b, a = torch.split(t, [r, r], dim=1)
    return torch.cat([b.reshape(-1, *w.shape[1:]), a.reshape(-1, *w.shape[1:])], 0).contiguous()


class GatedDeltaNet(SSMLayer):
    family = "gdn"

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, *, eps: float, chunk_size: int = 64,
                 layer_id: int = 0):
        super().__init__()
        self.H, self.HV, self.K, self.V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel, self.layer_id, self.chunk_size = conv_kernel, layer_id, chunk_size
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim)
        self.in_proj_ba = Linear(hidden, 2 * num_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, conv_kernel)
        self.dt_bias = _param(num_v_heads)
        self.A_log = _param(num_v_heads)
        self.norm = GatedRMSNorm(head_v_dim, eps, gate_first=False)
        self.out_proj = Linear(self.value_dim, hidden)

    def conv1d_bias(self):
        return None

    # ---- family hooks (forms call these) -------------------------------------------------
    def op(self, name: str, *prefix, a: dict, t0: bool = False, packed: bool = False, **kw):
        q, k, v, g, beta = self._args(a, ("q", "k", "v", "g", "beta"), t0, packed)
        if name in _QK_NORM_OPS:
            kw.setdefault("use_qk_l2norm", True)
        return getattr(self.ops(), name)(*prefix, q, k, v, g, beta, **kw)

    def mask_padding(self, a: dict, valid: Tensor) -> dict:
        a = dict(a)
        m = valid[..., None]
        a["g"] = torch.where(m, a["g"], torch.zeros_like(a["g"]))
        a["beta"] = torch.where(m, a["beta"], torch.zeros_like(a["beta"]))
        return a

    def rebuild_state(self, buf, plan):
        return self.ops().rebuild_state(buf, plan)

    def alloc_ring(self, num_slots: int, capacity: int, dtype, device, state_dtype=None) -> GDNBuffers:
        sdt = state_dtype or compute_dtype(dtype)
        return GDNBuffers.allocate(num_slots, capacity, self.H, self.HV, self.K, self.V, dtype=dtype,
                                   state_dtype=sdt, decay_dtype=compute_dtype(dtype, sdt), device=device)

    def alloc_pages(self, num_blocks: int, block_size: int, dtype, device) -> GDNPagedBuffers:
        return GDNPagedBuffers.allocate(num_blocks, block_size, self.H, self.HV, self.K, self.V, dtype=dtype,
                                        state_dtype=compute_dtype(dtype), device=device)

    def kv_to_state(self, store: dict, pplan, slots: Tensor) -> None:
        self.ops().kv_to_state(store["kv"], pplan, store["buf"], slots)

    def state_shape(self) -> tuple[int, ...]:
        return (self.HV, self.K, self.V)

    def fold(self, entries, pplan, initial_state):
        return self.ops().kv_fold(entries, pplan, initial_state)

    def entry_kwargs(self) -> dict:
        return {"return_u": True}    # the corrected values the ring stores

    def prefill_entries(self, a: dict, out: tuple) -> list[Tensor]:
        """``(u, k, g)``: ``u`` from the scan, ``k`` l2-normalised as the ops store it."""
        k = a["k"][0]
        return [out[2], self.ops().l2norm(k.to(compute_dtype(k.dtype))), a["g"][0]]

    # ---- forward ---------------------------------------------------------------------------
    def _neg_exp_A(self, cdt) -> Tensor:
        """``-exp(A_log)`` in ``cdt`` (cached, see :mod:`.derived`)."""
        return derived(self, ("A", cdt), (self.A_log,), lambda: -torch.exp(self.A_log.to(cdt)))

    def _bias(self, cdt) -> Tensor:
        """``dt_bias`` in ``cdt`` (cached; the parameter itself when it has it)."""
        p = self.dt_bias
        return p if p.dtype == cdt else derived(self, ("dt_bias", cdt), (p,), lambda: p.to(cdt))

    def gates(self, a_: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """``g = -exp(A_log) · softplus(a + dt_bias)`` (fp32+) and ``β = sigmoid(b)`` (``b``'s
        dtype) of ``a, b [.., HV]`` (slices of the projections): one launch on the GPU."""
        cdt = compute_dtype(a_.dtype)
        if fused_gates():
            return ops_for("gates").gates(a_, self._bias(cdt), self._neg_exp_A(cdt), beta_in=b)
        g = -torch.exp(self.A_log.to(cdt)) * F.softplus(a_.to(cdt) + self.dt_bias.to(cdt))
        return g, torch.sigmoid(b)

    def forward(self, h: Tensor, ctx: StepContext) -> Tensor:
        Bt, T, _ = h.shape
        qkvz = self.in_proj_qkvz(h)
        qkv, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        b, a_ = self.in_proj_ba(h).split([self.HV, self.HV], dim=-1)
        qkv = self._conv(qkv, ctx)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = self.gates(a_, b)
        args = {"q": q.reshape(Bt, T, self.H, self.K), "k": k.reshape(Bt, T, self.H, self.K),
                "v": v.reshape(Bt, T, self.HV, self.V), "g": g, "beta": beta}
        y = self._ssm(args, ctx)                                        # [Bt, T, HV, V]
        y = self.norm(y.to(h.dtype), z.reshape(Bt, T, self.HV, self.V))
        return self.out_proj(y.reshape(Bt, T, self.value_dim))
