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
from ..runtime import compute_dtype


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x Wᵀ (+ b)`` with HF parameter names ``weight`` / ``bias``."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = _param(d_out, d_in)
        self.bias = _param(d_out) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


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
        self.experts = nn.Module()
        self.experts.gate_up_proj = _param(num_experts, 2 * inter, hidden)
        self.experts.down_proj = _param(num_experts, hidden, inter)
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
        out = ops_for("moe").experts(xf, idx, w, self.experts.gate_up_proj, self.experts.down_proj,
                                   act=self.act_name, gated=True)
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
        self.experts = nn.Module()
        self.experts.up_proj = _param(num_experts, inter, d_in)
        self.experts.down_proj = _param(num_experts, d_in, inter)
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
        h = ops_for("moe").experts(h, idx, w, self.experts.up_proj, self.experts.down_proj,
                                 act=self.act_name, gated=False)
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
