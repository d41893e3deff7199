"""Feed-forward blocks: dense MLPs and mixtures of experts.

* ``GatedMLP`` (Qwen3-Next): ``down(silu(gate(x)) · up(x))``.
* ``PlainMLP`` (Nemotron-H): ``down(act(up(x)))`` with ``act = relu²`` by default.
* ``SoftmaxMoE`` (Qwen3-Next): softmax router (fp32+), top-k, optional renormalisation,
  SwiGLU experts ``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``, plus a shared expert
  scaled by ``sigmoid(shared_expert_gate(x))``.
* ``SigmoidMoE`` (Nemotron-H): ``s = sigmoid(router(x))`` (fp32+), expert choice on
  ``s + e_score_correction_bias`` restricted to the ``topk_group`` best of ``n_group`` groups
  (group score = sum of its top-2), weights ``s`` of the chosen experts (renormalised with
  ``+1e-20`` when ``norm_topk_prob``) times ``routed_scaling_factor``; non-gated experts
  ``up_proj [E, I, D']``, ``down_proj [E, D', I]`` with optional latent projections; plus a
  shared MLP.
* ``GatedSigmoidMoE`` (Kimi-Linear): ``SigmoidMoE``'s routing with SwiGLU experts
  ``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]`` and a SwiGLU shared MLP
  (``shared_experts``; none when its width is 0).

Every projection is a :class:`~replayssm.layers.linear.Linear` (plain or FP8); the stacked
expert weights live in :class:`FP8Experts` (plain, or e4m3 with per-expert scales).

The MoE blocks route with plain tensor ops (``route``) and compute the routed experts
through ``kernels.dispatch.ops_for("moe").experts``: on CUDA (below fp64) the fused
kernels (tokens sorted by expert on the device, one grouped-GEMM launch per projection, no
host sync), elsewhere the gather-based reference :func:`replayssm.ops.moe.naive.experts`
(each chosen expert on exactly the tokens that chose it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.activation import relu2_
from ..kernels.dispatch import fused_ok, ops_for
from ..ops.moe.naive import activation
from ..ops.fp8.naive import FP8, expert_scale_shape
from ..runtime import compute_dtype
from .linear import Linear, param

__all__ = ["Linear", "GatedMLP", "PlainMLP", "SoftmaxMoE", "SigmoidMoE", "FP8Experts"]


_param = param   # the older name, kept for the layers that import it from here


class FP8Experts(nn.Module):
    """Stacked expert weights (``nn.Module`` holding ``w1`` / ``w2`` under their HF names);
    :meth:`to_fp8` makes them e4m3 with per-expert scales (``<name>_scale_inv``, block layout
    of :func:`replayssm.ops.fp8.naive.quantize_experts`, or per-tensor ``<name>_scale``
    ``[E, parts]``).  Experts quantize their activations dynamically, so a checkpoint's
    expert ``input_scale`` tensors are not read."""

    def __init__(self, w1: str, w2: str, E: int, n1: int, d_in: int, d_out: int, inter: int, gated: bool):
        super().__init__()
        self.names, self.gated, self.fp8, self.block = (w1, w2), gated, False, None
        setattr(self, w1, _param(E, n1, d_in))
        setattr(self, w2, _param(E, d_out, inter))

    def to_fp8(self, block=None) -> "FP8Experts":
        self.fp8, self.block = True, None if block is None else (int(block[0]), int(block[1]))
        for name, parts in zip(self.names, (2 if self.gated else 1, 1)):
            w = getattr(self, name)
            E, n, K = w.shape
            setattr(self, name, _param(E, n, K, dtype=FP8, device=w.device))
            shape = expert_scale_shape(E, n, K, self.block, parts)
            leaf = name + ("_scale_inv" if self.block is not None else "_scale")
            setattr(self, leaf, _param(*shape, dtype=torch.float32, device=w.device))
        return self

    def weights(self) -> tuple:
        """``(w1, w2, fp8 keywords of the experts op)``."""
        w1, w2 = (getattr(self, n) for n in self.names)
        if not self.fp8:
            return w1, w2, {}
        suffix = "_scale_inv" if self.block is not None else "_scale"
        return w1, w2, {"w1_scale": getattr(self, self.names[0] + suffix),
                        "w2_scale": getattr(self, self.names[1] + suffix), "block": self.block}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, inter, bias), Linear(hidden, inter, bias)
        self.down_proj = Linear(inter, hidden, bias)
        self.act, self.act_name = activation(act), act

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "relu2", bias: bool = False):
        super().__init__()
        self.up_proj, self.down_proj = Linear(hidden, inter, bias), Linear(inter, hidden, bias)
        self.act, self.act_name = activation(act), act

    def forward(self, x: Tensor) -> Tensor:
        u = self.up_proj(x)
        if self.act_name == "relu2" and fused_ok(u) and u.is_contiguous():
            return self.down_proj(relu2_(u))   # one pass, in place on the projection's output
        return self.down_proj(self.act(u))



class SoftmaxMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_inter: int, act: str = "silu"):
        super().__init__()
        self.E, self.k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = Linear(hidden, num_experts)
        self.experts = FP8Experts("gate_up_proj", "down_proj", num_experts, 2 * inter, hidden, hidden, inter, True)
        self.shared_expert = GatedMLP(hidden, shared_inter, act) if shared_inter else None
        self.shared_expert_gate = Linear(hidden, 1) if shared_inter else None
        activation(act)  # validates the name
        self.act_name = act

    def route(self, xf: Tensor) -> tuple[Tensor, Tensor]:
        """``(idx [N, k], w [N, k])``: top-k of the softmax router (fp32+), renormalised when
        ``norm_topk_prob``, weights cast to the activation dtype (as transformers does)."""
        logits = self.gate(xf)
        probs = torch.softmax(logits.to(compute_dtype(xf.dtype)), -1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return idx, w.to(xf.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        idx, w = self.route(xf)
        w1, w2, q = self.experts.weights()
        out = ops_for("moe").experts(xf, idx, w, w1, w2, act=self.act_name, gated=True, **q)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return out.reshape(shp)


class SigmoidMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, scaling: float, shared_inter: int,
                 latent: int | None, act: str = "relu2", bias: bool = False):
        super().__init__()
        self.E, self.k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        d_in = latent or hidden
        self.gate = nn.Module()
        self.gate.weight = _param(num_experts, hidden)
        self.gate.e_score_correction_bias = _param(num_experts)
        self.experts = FP8Experts("up_proj", "down_proj", num_experts, inter, d_in, d_in, inter, False)
        self.shared_experts = PlainMLP(hidden, shared_inter, act, bias)
        self.fc1_latent_proj = Linear(hidden, latent, bias) if latent else None
        self.fc2_latent_proj = Linear(latent, hidden, bias) if latent else None
        activation(act)  # validates the name
        self.act_name = act

    def route(self, xf: Tensor) -> tuple[Tensor, Tensor]:
        cdt = compute_dtype(xf.dtype)
        s = torch.sigmoid(F.linear(xf.to(cdt), self.gate.weight.to(cdt)))
        choice = s + self.gate.e_score_correction_bias.to(cdt)
        N, E, G = s.shape[0], self.E, self.n_group
        grp = choice.view(N, G, E // G).topk(min(2, E // G), dim=-1)[0].sum(-1)
        gidx = torch.topk(grp, k=self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(grp).scatter_(1, gidx, 1.0).bool()
        emask = gmask[:, :, None].expand(N, G, E // G).reshape(N, E)
        choice = choice.masked_fill(~emask, float("-inf"))
        idx = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
        w = s.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        idx, w = self.route(xf)
        h = self.fc1_latent_proj(xf) if self.fc1_latent_proj is not None else xf
        w1, w2, q = self.experts.weights()
        h = ops_for("moe").experts(h, idx, w, w1, w2, act=self.act_name, gated=False, **q)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return (h + self.shared_experts(xf)).reshape(shp)


class GatedSigmoidMoE(SigmoidMoE):
    """Grouped sigmoid routing (:meth:`SigmoidMoE.route`), SwiGLU experts, SwiGLU shared MLP."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, scaling: float, shared_inter: int, act: str = "silu"):
        nn.Module.__init__(self)
        self.E, self.k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        self.gate = nn.Module()
        self.gate.weight = _param(num_experts, hidden)
        self.gate.e_score_correction_bias = _param(num_experts)
        self.experts = nn.Module()
        self.experts.gate_up_proj = _param(num_experts, 2 * inter, hidden)
        self.experts.down_proj = _param(num_experts, hidden, inter)
        self.shared_experts = GatedMLP(hidden, shared_inter, act) if shared_inter else None
        activation(act)  # validates the name
        self.act_name = act

    def forward(self, x: Tensor) -> Tensor:
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        idx, w = self.route(xf)
        out = ops_for("moe").experts(xf, idx, w, self.experts.gate_up_proj, self.experts.down_proj,
                                     act=self.act_name, gated=True)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf)
        return out.reshape(shp)
