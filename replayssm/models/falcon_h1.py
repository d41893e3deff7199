"""Falcon-H1 (``FalconH1ForCausalLM``): ``model.{embed_tokens, layers.i.{input_layernorm, mamba,
self_attn, pre_ff_layernorm, feed_forward}, final_layernorm}``, ``lm_head``.

Each decoder layer runs a Mamba-2 mixer and GQA attention (RoPE) *in parallel* on the same
normed input and adds their outputs, then a SwiGLU MLP::

    x = input_layernorm(h)
    h = h + ssm_out · mamba(ssm_in · x) + attn_out · self_attn(attn_in · x)
    h = h + feed_forward(pre_ff_layernorm(h))

with muP multipliers.  All but two are linear maps next to a projection, so they are folded
into the weights at load time (:meth:`FalconH1LM.load_transforms`, computed in fp64 before the
cast): ``ssm_in_multiplier`` and the per-group ``ssm_multipliers`` ``[z, x, B, C, dt]`` (the
in-projection's output groups, bias included) into ``mamba.in_proj``; ``ssm_out_multiplier``
into ``mamba.out_proj``; ``attention_in_multiplier`` into ``q/k/v_proj`` (weights only; the
multiplier scales the input), ``key_multiplier`` into ``k_proj`` (weight and bias, it scales
the keys before RoPE, which is linear); ``attention_out_multiplier`` into ``o_proj``;
``mlp_multipliers = [gate, down]`` into ``gate_proj`` / ``down_proj``.  ``embedding_multiplier``
and ``lm_head_multiplier`` scale the embeddings and the logits at run time (the two may
share one tied matrix).

The Mamba-2 output is ``y · silu(z)`` (``mamba_rms_norm: false``) or a gated RMSNorm over
``mamba_n_groups`` groups, ``w · rms_g(y) · silu(z)`` (``mamba_norm_before_gate: true``) or
``w · rms_g(y · silu(z))``.  The in-projection's bias is ``mamba_proj_bias``, the out-projection's
``projectors_bias``.  The Mamba-2 mixer and the attention of layer ``i`` are two stateful layers
with cache ids ``2i`` and ``2i + 1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.attention import Attention
from ..layers.context import StepContext
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mlp import GatedMLP, Linear
from ..layers.norms import GatedRMSNorm, RMSNorm, _rms
from ..layers.rotary import Rotary
from ..layers.ssm_base import SSMLayer
from ..runtime import compute_dtype
from .base import Block, CausalLM
from .config import _count, _eos, _limit, _num, _opt_pos_int, _pos_float, _pos_int, _Reader

__all__ = ["FalconH1Config", "FalconH1LM"]


# ---------------------------------------------------------------------------- config
def _mult(r: _Reader, name: str, v) -> float:
    """A finite multiplier (any sign; 0 is allowed)."""
    x = _num(r, name, v)
    if not math.isfinite(x):
        r.fail(f"'{name}' must be a finite number, got {v!r}")
    return x


def _mults(r: _Reader, name: str, v, n: int) -> tuple[float, ...]:
    if not isinstance(v, (list, tuple)) or len(v) != n:
        r.fail(f"'{name}' must be a list of {n} numbers, got {v!r}")
    return tuple(_mult(r, name, x) for x in v)


@dataclass(frozen=True)
class FalconH1Config:
    """``FalconH1ForCausalLM`` (transformers 5.17 defaults).  ``mamba_d_ssm`` (the Mamba
    intermediate width) is 1024 when absent and ``mamba_expand * hidden_size`` when null;
    ``mamba_d_head: "auto"`` is ``mamba_d_ssm // mamba_n_heads``; attention ``head_dim``
    defaults to ``hidden_size // num_attention_heads``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_ssm: int
    mamba_d_state: int
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    projectors_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = 2
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "falcon_h1"

    @property
    def layer_kinds(self) -> list[str]:
        return ["hybrid"] * self.num_hidden_layers

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "FalconH1Config":
        r = _Reader(d, where)
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        D = _pos_int(r, "hidden_size", r.req("hidden_size"))
        nh = _pos_int(r, "num_attention_heads", r.req("num_attention_heads"))
        expand = _pos_int(r, "mamba_expand", r.opt("mamba_expand", 2))
        # transformers: an absent mamba_d_ssm is 1024, an explicit null is expand * hidden_size
        d_ssm = d.get("mamba_d_ssm", 1024)
        d_ssm = _pos_int(r, "mamba_d_ssm", expand * D if d_ssm is None else d_ssm)
        mh = _pos_int(r, "mamba_n_heads", r.req("mamba_n_heads"))
        dh = r.opt("mamba_d_head", "auto")
        if dh == "auto":
            if d_ssm % mh:
                r.fail(f"mamba_n_heads {mh} must divide the Mamba width mamba_d_ssm {d_ssm} "
                       f"(with mamba_d_head 'auto')")
            dh = d_ssm // mh
        dh = _pos_int(r, "mamba_d_head", dh)
        if dh * mh != d_ssm:
            r.fail(f"mamba_d_head * mamba_n_heads ({dh} * {mh}) must equal mamba_d_ssm ({d_ssm})")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rp, dict):
            r.fail(f"'rope_parameters' must be a dict, got {rp!r}")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            r.fail(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        head_dim = r.opt("head_dim", None)
        if head_dim is None:
            if D % nh:
                r.fail(f"hidden_size {D} is not a multiple of num_attention_heads {nh} (and no 'head_dim')")
            head_dim = D // nh
        c = cls(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=_count(r, "num_hidden_layers", r.req("num_hidden_layers")),
            num_attention_heads=nh,
            num_key_value_heads=_pos_int(r, "num_key_value_heads", r.opt("num_key_value_heads", nh)),
            head_dim=_pos_int(r, "head_dim", head_dim),
            intermediate_size=_pos_int(r, "intermediate_size", r.req("intermediate_size")),
            mamba_n_heads=mh,
            mamba_d_head=dh,
            mamba_d_ssm=d_ssm,
            mamba_d_state=_pos_int(r, "mamba_d_state", r.req("mamba_d_state")),
            mamba_n_groups=_pos_int(r, "mamba_n_groups", r.opt("mamba_n_groups", 1)),
            mamba_d_conv=_pos_int(r, "mamba_d_conv", r.opt("mamba_d_conv", 4)),
            mamba_chunk_size=_pos_int(r, "mamba_chunk_size", r.opt("mamba_chunk_size", 256)),
            mamba_conv_bias=r.flag("mamba_conv_bias", True),
            mamba_proj_bias=r.flag("mamba_proj_bias", False),
            mamba_rms_norm=r.flag("mamba_rms_norm", False),
            mamba_norm_before_gate=r.flag("mamba_norm_before_gate", True),
            time_step_limit=_limit(r, "time_step_limit", r.opt("time_step_limit", (0.0, math.inf))),
            projectors_bias=r.flag("projectors_bias", False),
            attention_bias=r.flag("attention_bias", False),
            mlp_bias=r.flag("mlp_bias", False),
            hidden_act=r.opt("hidden_act", "silu"),
            rms_norm_eps=_pos_float(r, "rms_norm_eps", r.opt("rms_norm_eps", 1e-5)),
            rope_theta=_pos_float(r, "rope_theta", theta),
            embedding_multiplier=_mult(r, "embedding_multiplier", r.opt("embedding_multiplier", 1.0)),
            lm_head_multiplier=_mult(r, "lm_head_multiplier", r.opt("lm_head_multiplier", 1.0)),
            attention_in_multiplier=_mult(r, "attention_in_multiplier", r.opt("attention_in_multiplier", 1.0)),
            attention_out_multiplier=_mult(r, "attention_out_multiplier", r.opt("attention_out_multiplier", 1.0)),
            key_multiplier=_mult(r, "key_multiplier", r.opt("key_multiplier", 1.0)),
            ssm_in_multiplier=_mult(r, "ssm_in_multiplier", r.opt("ssm_in_multiplier", 1.0)),
            ssm_out_multiplier=_mult(r, "ssm_out_multiplier", r.opt("ssm_out_multiplier", 1.0)),
            ssm_multipliers=_mults(r, "ssm_multipliers", r.opt("ssm_multipliers", [1.0] * 5), 5),
            mlp_multipliers=_mults(r, "mlp_multipliers", r.opt("mlp_multipliers", [1.0, 1.0]), 2),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            eos_token_id=_eos(r, d.get("eos_token_id", 2), V),
            bos_token_id=d.get("bos_token_id", 1),
            pad_token_id=d.get("pad_token_id", 0),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
        )
        if c.hidden_act not in ("silu", "swish"):
            r.fail(f"'hidden_act' {c.hidden_act!r} is not supported (need 'silu': it is also the Mamba conv's)")
        if c.mamba_n_heads % c.mamba_n_groups:
            r.fail(f"mamba_n_heads {c.mamba_n_heads} is not a multiple of mamba_n_groups {c.mamba_n_groups}")
        if c.mamba_d_ssm % c.mamba_n_groups:
            r.fail(f"mamba_d_ssm {c.mamba_d_ssm} is not a multiple of mamba_n_groups {c.mamba_n_groups}")
        if c.num_attention_heads % c.num_key_value_heads:
            r.fail(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                   f"num_key_value_heads {c.num_key_value_heads}")
        if c.head_dim % 2:
            r.fail(f"head_dim {c.head_dim} must be even (RoPE rotates pairs)")
        return c


# ---------------------------------------------------------------------------- layers
class SiluGate(nn.Module):
    """``y · silu(z)`` (the Mamba-2 output gate without a norm, ``mamba_rms_norm: false``)."""

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        cdt = compute_dtype(x.dtype)
        return (x.to(cdt) * F.silu(z.to(cdt))).to(x.dtype)


class GroupedNormThenGate(nn.Module):
    """``w · rms_g(y) · silu(z)`` over groups of ``group_size`` channels, all in at least fp32
    (``mamba_norm_before_gate: true`` with several groups)."""

    def __init__(self, dim: int, eps: float, group_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.group_size = eps, group_size

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        cdt = compute_dtype(x.dtype)
        shp = x.shape
        y = _rms(x.to(cdt).reshape(*shp[:-1], -1, self.group_size), self.eps).reshape(shp)
        return (self.weight.to(cdt) * y * F.silu(z.to(cdt))).to(x.dtype)


def _mamba_out_norm(c: FalconH1Config) -> nn.Module:
    I, G = c.mamba_d_ssm, c.mamba_n_groups
    if not c.mamba_rms_norm:
        return SiluGate()
    if not c.mamba_norm_before_gate:
        return GatedRMSNorm(I, c.rms_norm_eps, group_size=I // G, gate_first=True)
    if G == 1:
        return GatedRMSNorm(I, c.rms_norm_eps, gate_first=False)
    return GroupedNormThenGate(I, c.rms_norm_eps, I // G)


class ParallelBlock(Block):
    """A :class:`Block` whose sub-blocks may hold several mixers reading the same normed input:
    ``h = h + Σ_m mixer_m(norm(h))`` (the residual add deferred into the next norm, as in
    ``Block``).  ``subs`` lists every ``(norm, mixer)`` pair (a norm shared by parallel mixers
    appears once per mixer), so :meth:`CausalLM.stateful_layers` finds each stateful mixer.
    Parallel mixers' outputs are summed here, so they come as tensors (``defers`` off)."""

    defers = False

    def __init__(self):
        super().__init__()
        self.groups: list[tuple[str, tuple[str, ...]]] = []   # (norm attr, mixer attrs)

    def add(self, norm_name: str, norm: nn.Module, mixer_name: str, mixer: nn.Module) -> None:
        self.add_parallel(norm_name, norm, {mixer_name: mixer})

    def add_parallel(self, norm_name: str, norm: nn.Module, mixers: dict[str, nn.Module]) -> None:
        setattr(self, norm_name, norm)
        for name, m in mixers.items():
            setattr(self, name, m)
            self.subs.append((norm_name, name))
        self.groups.append((norm_name, tuple(mixers)))

    def forward(self, h: Tensor, ctx: StepContext, dtype: torch.dtype,
                pending: Tensor | None = None) -> tuple[Tensor, Tensor]:
        for norm_name, names in self.groups:
            norm = getattr(self, norm_name)
            if pending is None:
                x = norm(h.to(dtype))
            else:
                x, h = self.add_norm(norm, h, pending, dtype)
            out = None
            for name in names:
                m = getattr(self, name)
                y = m(x, ctx) if isinstance(m, (SSMLayer, Attention)) else m(x)
                out = y if out is None else out + y
            pending = out
        return h, pending


def falcon_h1_block(c: FalconH1Config, i: int, rot: Rotary) -> ParallelBlock:
    """``model.layers.i``: Mamba-2 (cache id ``2i``) and attention (``2i + 1``) in parallel,
    then the SwiGLU ``feed_forward``."""
    m = Mamba2Mixer(c.hidden_size, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_n_groups,
                    c.mamba_d_conv, norm_group_size=c.mamba_d_ssm // c.mamba_n_groups, eps=c.rms_norm_eps,
                    use_bias=c.mamba_proj_bias, use_conv_bias=c.mamba_conv_bias,
                    time_step_limit=c.time_step_limit, chunk_size=min(c.mamba_chunk_size, 64), layer_id=2 * i)
    m.out_proj = Linear(c.mamba_d_ssm, c.hidden_size, c.projectors_bias)
    m.norm = _mamba_out_norm(c)
    a = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                  bias=c.attention_bias, rotary=rot, layer_id=2 * i + 1)
    blk = ParallelBlock()
    blk.add_parallel("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), {"mamba": m, "self_attn": a})
    blk.add("pre_ff_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps),
            "feed_forward", GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias))
    return blk


def _scale(t: Tensor, s) -> Tensor:
    """``t · s`` in fp64 (``s`` a number or a per-row vector); the loader casts the result."""
    t = t.to(torch.float64)
    if isinstance(s, Tensor):
        s = s.to(torch.float64).reshape(-1, *([1] * (t.dim() - 1)))
    return t * s


class FalconH1LM(CausalLM):
    def __init__(self, config: FalconH1Config, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        self.rotary = rot = Rotary(c.head_dim, c.head_dim, c.rope_theta)
        self.embedding_multiplier = float(c.embedding_multiplier)   # applied by CausalLM after the lookup
        layers = [falcon_h1_block(c, i, rot) for i in range(c.num_hidden_layers)]
        self._assemble("model", "embed_tokens", layers, "final_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))

    def _logits(self, hn: Tensor) -> Tensor:
        out = super()._logits(hn)
        m = self.config.lm_head_multiplier
        return out if m == 1.0 else out * m

    def mup_vector(self) -> Tensor:
        """The in-projection's per-row multipliers ``[z | x | B | C | dt]`` (``ssm_multipliers``)."""
        c = self.config
        I, GN, H = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state, c.mamba_n_heads
        sizes = (I, I, GN, GN, H)
        return torch.cat([torch.full((n,), float(s), dtype=torch.float64)
                          for n, s in zip(sizes, c.ssm_multipliers)])

    def load_transforms(self) -> dict:
        """The muP multipliers folded into the projections they follow or precede."""
        c = self.config
        mup = self.mup_vector()
        fold = {  # (weight scale, bias scale) per projection
            "mamba.in_proj": (mup * c.ssm_in_multiplier, mup),
            "mamba.out_proj": (c.ssm_out_multiplier,) * 2,
            "self_attn.q_proj": (c.attention_in_multiplier, 1.0),
            "self_attn.k_proj": (c.attention_in_multiplier * c.key_multiplier, c.key_multiplier),
            "self_attn.v_proj": (c.attention_in_multiplier, 1.0),
            "self_attn.o_proj": (c.attention_out_multiplier,) * 2,
            "feed_forward.gate_proj": (c.mlp_multipliers[0],) * 2,
            "feed_forward.down_proj": (c.mlp_multipliers[1],) * 2,
        }
        params = dict(self.named_parameters())
        out = {}
        for i in range(c.num_hidden_layers):
            for mod, scales in fold.items():
                for leaf, s in zip(("weight", "bias"), scales):
                    name = f"model.layers.{i}.{mod}.{leaf}"
                    if name in params and not (isinstance(s, float) and s == 1.0):
                        out[name] = functools.partial(_scale, s=s)
        return out

    @staticmethod
    def key_aliases() -> dict:
        return {}
