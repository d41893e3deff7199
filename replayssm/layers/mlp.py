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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def activation(name: str):
    if name in ("silu", "swish"):
        return F.silu
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    if name == "relu":
        return F.relu
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, inter, bias), Linear(hidden, inter, bias)
        self.down_proj = Linear(inter, hidden, bias)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "relu2", bias: bool = False):
        super().__init__()
        self.up_proj, self.down_proj = Linear(hidden, inter, bias), Linear(inter, hidden, bias)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def _dispatch(x: Tensor, idx: Tensor, w: Tensor, E: int, expert, gathered=None) -> Tensor:
    """``Σ_k w[t,k] · expert(e=idx[t,k], x[t])`` accumulated in ``w``'s dtype.

    No host synchronisation either way (the route is chosen from shapes only):
    few token-expert pairs (``N·k <= E``, e.g. decode): gather the chosen experts' weights
    per pair (``gathered(x, idx) -> [N, k, D]``); otherwise dense over experts (every expert
    sees every token, weighted by its routing weight, zero for unchosen).  ``x [N, D]``,
    ``idx/w [N, k]``.
    """
    if gathered is not None and idx.numel() <= E:
        y = gathered(x, idx)                                        # [N, k, D_out]
        return (y.to(w.dtype) * w[..., None]).sum(1)
    out = None
    for e in range(E):
        we = torch.where(idx == e, w, torch.zeros_like(w)).sum(-1)  # [N]
        term = expert(e, x).to(w.dtype) * we[:, None]
        out = term if out is None else out + term
    return out


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
        self.act = activation(act)

    def _expert(self, e: int, x: Tensor) -> Tensor:
        g, u = F.linear(x, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(g) * u, self.experts.down_proj[e])

    def _gathered(self, x: Tensor, idx: Tensor) -> Tensor:
        gu = self.experts.gate_up_proj[idx]                          # [N, k, 2I, D]
        g, u = torch.einsum("nkod,nd->nko", gu, x).chunk(2, dim=-1)
        return torch.einsum("nkdi,nki->nkd", self.experts.down_proj[idx], self.act(g) * u)

    def forward(self, x: Tensor) -> Tensor:
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        logits = self.gate(xf)
        probs = torch.softmax(logits.to(compute_dtype(x.dtype)), -1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)  # transformers casts routing weights to the activation dtype
        out = _dispatch(xf, idx, w, self.E, self._expert, self._gathered).to(x.dtype)
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
        self.act = activation(act)

    def _expert(self, e: int, x: Tensor) -> Tensor:
        return F.linear(self.act(F.linear(x, self.experts.up_proj[e])), self.experts.down_proj[e])

    def _gathered(self, x: Tensor, idx: Tensor) -> Tensor:
        h = self.act(torch.einsum("nkid,nd->nki", self.experts.up_proj[idx], x))
        return torch.einsum("nkdi,nki->nkd", self.experts.down_proj[idx], h)

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
        h = _dispatch(h, idx, w, self.E, self._expert, self._gathered).to(x.dtype)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return (h + self.shared_experts(xf)).reshape(shp)
