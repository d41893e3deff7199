"""Kimi Delta Attention mixer (KDA, HF ``KimiLinearDeltaAttention`` checkpoints).

Per token ``x`` (``H`` heads of ``K = V = head_dim`` channels, ``HV == H``)::

    q, k, v = silu(causal_conv([W_q x | W_k x | W_v x]))      (one depthwise conv; the
                                                               checkpoint stores its three
                                                               parts q_conv1d / k_conv1d / v_conv1d)
    f = f_b_proj(f_a_proj(x)) + dt_bias                       (fp32+, [H, K])
    g = -exp(A_log_h) · softplus(f)                           (log-decay per head and key channel)
    β = sigmoid(b_proj(x))                                    ([H])
    y = KDA(q, k, v, g, β)                                    (l2-normalised q, k; q · K^-1/2)
    out = o_proj(rms(y) · w · sigmoid(g_b_proj(g_a_proj(x)))) (per head, fp32+)

``softplus(f) = f`` for ``f > 20``, else ``log(1 + e^f)`` (transformers' form).  The
recurrence and its cache forms are :mod:`replayssm.ops.kda` (``ops_for("kda")``); the cache
plumbing is GDN's (same ring entries ``(u, k, g)``, ``g`` with a key-channel axis).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cache.buffers import KDABuffers
from ..cache.paged import KDAPagedBuffers
from ..kernels.dispatch import KERNEL_ONLY, REFERENCE_ONLY, ops_for
from ..runtime import compute_dtype
from .context import StepContext
from .derived import derived, fused_gates
from .gdn import GatedDeltaNet
from .mlp import Linear, _param
from .ssm_base import SSMLayer


def softplus20(x: Tensor) -> Tensor:
    """``x`` where ``x > 20``, else ``log(1 + e^x)`` (transformers' kimi_linear softplus)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class SigmoidGatedRMSNorm(nn.Module):
    """``y = (w · x / sqrt(mean(x²) + eps)) · sigmoid(z)`` over the last axis, in fp32+
    (the weight too), returned in ``x``'s dtype (HF ``KimiLinearRMSNormGated``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        cdt = compute_dtype(x.dtype)
        xf = x.to(cdt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight.to(cdt) * y
        return (y * torch.sigmoid(z.to(cdt))).to(x.dtype)


class KimiDeltaAttention(GatedDeltaNet):
    """The KDA mixer (module docstring); GDN's cache hooks with the KDA op family."""

    family = "kda"

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv_kernel: int, *, eps: float,
                 chunk_size: int = 64, layer_id: int = 0):
        SSMLayer.__init__(self)
        self.H = self.HV = num_heads
        self.K = self.V = head_dim
        self.key_dim = self.value_dim = num_heads * head_dim
        self.conv_dim = 3 * self.key_dim
        self.conv_kernel, self.layer_id, self.chunk_size = conv_kernel, layer_id, chunk_size
        D = self.key_dim
        self.q_proj, self.k_proj, self.v_proj = Linear(hidden, D), Linear(hidden, D), Linear(hidden, D)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            m = nn.Module()
            m.weight = _param(D, 1, conv_kernel)
            setattr(self, name, m)
        self.f_a_proj = Linear(hidden, head_dim)
        self.f_b_proj = Linear(head_dim, D)
        self.dt_bias = _param(D)
        self.A_log = _param(1, 1, num_heads, 1)
        self.b_proj = Linear(hidden, num_heads)
        self.g_a_proj = Linear(hidden, head_dim)
        self.g_b_proj = Linear(head_dim, D)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = Linear(D, hidden)

    def _conv_weight(self) -> tuple[Tensor, None]:
        """The three convs' weights as one ``[3·H·K, W]`` (cached, see :mod:`.derived`)."""
        ws = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        cat = lambda: torch.cat(ws, 0).reshape(self.conv_dim, self.conv_kernel)  # noqa: E731
        return (derived(self, "conv_weight", ws, cat) if fused_gates() else cat()), None

    # ---- family hooks (forms call these) -------------------------------------------------
    def op(self, name: str, *prefix, a: dict, t0: bool = False, packed: bool = False, **kw):
        """GDN's call convention; kernel-only keywords (a form's tree ``bits``) are dropped
        for ops that run the reference on every device."""
        if name in REFERENCE_ONLY[self.family]:
            kw = {k: v for k, v in kw.items() if k not in KERNEL_ONLY}
        return super().op(name, *prefix, a=a, t0=t0, packed=packed, **kw)

    def mask_padding(self, a: dict, valid: Tensor) -> dict:
        a = dict(a)
        a["g"] = torch.where(valid[..., None, None], a["g"], torch.zeros_like(a["g"]))
        a["beta"] = torch.where(valid[..., None], a["beta"], torch.zeros_like(a["beta"]))
        return a

    def alloc_ring(self, num_slots: int, capacity: int, dtype, device, state_dtype=None) -> KDABuffers:
        sdt = state_dtype or compute_dtype(dtype)
        return KDABuffers.allocate(num_slots, capacity, self.H, self.HV, self.K, self.V, dtype=dtype,
                                   state_dtype=sdt, decay_dtype=compute_dtype(dtype, sdt), device=device)

    def alloc_pages(self, num_blocks: int, block_size: int, dtype, device) -> KDAPagedBuffers:
        return KDAPagedBuffers.allocate(num_blocks, block_size, self.H, self.HV, self.K, self.V, dtype=dtype,
                                        state_dtype=compute_dtype(dtype), device=device)

    # ---- forward ---------------------------------------------------------------------------
    def decay(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``g [.., H, K]`` (fp32+) and ``β = sigmoid(b_proj(x)) [.., H]`` of the layer inputs
        ``x [.., hidden]`` (the gate math in one launch on the GPU)."""
        cdt = compute_dtype(x.dtype)
        f = self.f_b_proj(self.f_a_proj(x))
        if fused_gates():
            g, beta = ops_for("gates").gates(f, self._bias(cdt), self._neg_exp_A(cdt), group=self.K,
                                             beta_in=self.b_proj(x))
            return g.reshape(*x.shape[:-1], self.H, self.K), beta
        f = (f.to(cdt) + self.dt_bias.to(cdt)).reshape(*x.shape[:-1], self.H, self.K)
        g = -torch.exp(self.A_log.to(cdt).reshape(self.H, 1)) * softplus20(f)
        return g, torch.sigmoid(self.b_proj(x))

    def forward(self, h: Tensor, ctx: StepContext) -> Tensor:
        Bt, T, _ = h.shape
        qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], -1)
        q, k, v = self._conv(qkv, ctx).split(self.key_dim, dim=-1)
        g, beta = self.decay(h)
        args = {"q": q.reshape(Bt, T, self.H, self.K), "k": k.reshape(Bt, T, self.H, self.K),
                "v": v.reshape(Bt, T, self.HV, self.V), "g": g, "beta": beta}
        y = self._ssm(args, ctx)                                        # [Bt, T, HV, V]
        gate = self.g_b_proj(self.g_a_proj(h)).reshape(Bt, T, self.HV, self.V)
        y = self.o_norm(y.to(h.dtype), gate)
        return self.o_proj(y.reshape(Bt, T, self.value_dim))
