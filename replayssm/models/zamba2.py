"""Zamba2 (``Zamba2ForCausalLM``, ``model_type`` ``zamba2``): Mamba-2 layers and a few shared
transformer blocks invoked at the ``hybrid`` layers.

Checkpoint layout ``model.{embed_tokens, layers.i, final_layernorm}``, ``lm_head`` (tied by
default).  A ``mamba`` layer is ``h = h + mamba(input_layernorm(h))`` (``layers.i.{input_layernorm,
mamba}``).  The ``j``-th hybrid layer ``i`` (``hybrid_layer_ids[j] = i``) invokes shared block
``b = j % num_mem_blocks``::

    x = input_layernorm(cat(h, e))           # e: the token embeddings, width 2·hidden
    a = attention(x)                          # q/k/v += LoRA adapters j (use_shared_attention_adapter)
    t = linear_i(mlp(pre_ff_layernorm(a)))    # gate_up += adapter j; down(act(g) · u)
    h = h + mamba_i(N_i(h + t))               # t feeds the Mamba input only, not the residual

Block ``b`` is stored once, under its first invocation's layer
(``layers.<first>.shared_transformer.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.linear_{q,k,v}_adapter_list.j.{0,1}, pre_ff_layernorm, feed_forward.{gate_up_proj,
down_proj, gate_up_proj_adapter_list.j.{0,1}}}``; adapter ``j`` of every invocation of ``b``
sits in ``b``'s lists); ``layers.i.{linear, mamba_decoder.{input_layernorm, mamba}}`` are per
layer.  Each invocation is its own stateful attention layer (own ``layer_id``, own KV cache)
whose projections are the shared block's modules (registered once under the checkpoint name).
Attention scores scale by ``(head_dim / 2) ** -0.5`` (folded into ``q`` at load time: ``√2``);
``head_dim = 2·hidden / heads``; RoPE (``use_mem_rope``) on the whole head.  The Mamba-2 mixer:
conv bias always present, ``in_proj`` / ``out_proj`` biases with ``add_bias_linear``, gate-then-
norm over ``n_groups`` groups with eps 1e-5, ``Δ >= time_step_min``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layers.attention import Attention
from ..layers.context import StepContext
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mlp import Linear
from ..layers.norms import RMSNorm
from ..layers.rotary import Rotary
from ..ops.moe.naive import activation
from .base import Block, CausalLM
from .config import _Reader, _count, _dt_floor, _eos, _opt_pos_int, _pos_float, _pos_int

#: layer kinds as written in ``layers_block_type`` (transformers' legacy and current names)
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
_ACTS = ("gelu", "silu", "swish", "relu", "relu2")


@dataclass(frozen=True)
class Zamba2Config:
    """``Zamba2ForCausalLM`` (transformers 5.17 defaults: ``intermediate_size`` 4·hidden,
    ``num_key_value_heads`` = heads, ``hidden_act`` gelu, tied embeddings)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layers_block_type: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    n_mamba_heads: int
    mamba_headdim: int
    mamba_d_state: int
    mamba_ngroups: int = 1
    mamba_expand: int = 2
    mamba_d_conv: int = 4
    chunk_size: int = 256
    add_bias_linear: bool = False
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    use_mem_rope: bool = False
    rope_theta: float = 10000.0
    time_step_min: float = 0.001
    hidden_act: str = "gelu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    eos_token_id: int | list | None = 2
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "zamba2"
    #: the attention head size when it is not ``2 · hidden / heads`` (a tensor-parallel rank's
    #: config holds a share of the heads at the global head size); never read from config.json
    attention_head_dim: int | None = None

    @property
    def layer_kinds(self) -> list[str]:
        return list(self.layers_block_type)

    @property
    def hybrid_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layers_block_type) if k == "hybrid"]

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or 2 * self.hidden_size // self.num_attention_heads

    @property
    def mamba_intermediate(self) -> int:
        return self.n_mamba_heads * self.mamba_headdim

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Zamba2Config":
        r = _Reader(d, where)
        V = _pos_int(r, "vocab_size", r.req("vocab_size"))
        D = _pos_int(r, "hidden_size", r.req("hidden_size"))
        L = _count(r, "num_hidden_layers", r.req("num_hidden_layers"))
        kinds = r.req("layers_block_type", "layer_types")
        if not isinstance(kinds, list) or len(kinds) != L or any(k not in _KINDS for k in kinds):
            r.fail(f"'layers_block_type' must list one of {sorted(_KINDS)} per layer "
                   f"(num_hidden_layers = {L}), got {kinds!r}")
        kinds = tuple(_KINDS[k] for k in kinds)
        nh = _pos_int(r, "num_attention_heads", r.req("num_attention_heads"))
        nkv = _pos_int(r, "num_key_value_heads", r.opt("num_key_value_heads", nh))
        expand = _pos_int(r, "mamba_expand", r.opt("mamba_expand", 2))
        mh = _pos_int(r, "n_mamba_heads", r.opt("n_mamba_heads", 8))
        if (expand * D) % mh:
            r.fail(f"n_mamba_heads {mh} must divide the Mamba width mamba_expand * hidden_size ({expand * D})")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rp, dict):
            r.fail(f"'rope_parameters' must be a dict, got {rp!r}")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            r.fail(f"rope_type {rope_type!r} is not supported (only 'default')")
        c = cls(
            vocab_size=V, hidden_size=D, num_hidden_layers=L, layers_block_type=kinds,
            num_attention_heads=nh, num_key_value_heads=nkv,
            intermediate_size=_pos_int(r, "intermediate_size", r.opt("intermediate_size", 4 * D)),
            n_mamba_heads=mh, mamba_headdim=expand * D // mh,
            mamba_d_state=_pos_int(r, "mamba_d_state", r.opt("mamba_d_state", 64)),
            mamba_ngroups=_pos_int(r, "mamba_ngroups", r.opt("mamba_ngroups", 1)),
            mamba_expand=expand,
            mamba_d_conv=_pos_int(r, "mamba_d_conv", r.opt("mamba_d_conv", 4)),
            chunk_size=_pos_int(r, "chunk_size", r.opt("chunk_size", 256)),
            add_bias_linear=r.flag("add_bias_linear", False),
            num_mem_blocks=_pos_int(r, "num_mem_blocks", r.opt("num_mem_blocks", 1)),
            use_shared_attention_adapter=r.flag("use_shared_attention_adapter", False),
            adapter_rank=_pos_int(r, "adapter_rank", r.opt("adapter_rank", 128)),
            use_mem_rope=r.flag("use_mem_rope", False),
            rope_theta=_pos_float(r, "rope_theta", rp.get("rope_theta", d.get("rope_theta", 10000.0))),
            time_step_min=_dt_floor(r, "time_step_min", r.opt("time_step_min", 0.001)),
            hidden_act=r.opt("hidden_act", "gelu"),
            rms_norm_eps=_pos_float(r, "rms_norm_eps", r.opt("rms_norm_eps", 1e-5)),
            tie_word_embeddings=r.flag("tie_word_embeddings", True),
            eos_token_id=_eos(r, d.get("eos_token_id", 2), V),
            bos_token_id=d.get("bos_token_id", 1), pad_token_id=d.get("pad_token_id", 0),
            max_position_embeddings=_opt_pos_int(r, "max_position_embeddings"),
        )
        if c.hidden_act not in _ACTS:
            r.fail(f"'hidden_act' {c.hidden_act!r} is not supported (one of {', '.join(_ACTS)})")
        if mh % c.mamba_ngroups:
            r.fail(f"n_mamba_heads {mh} is not a multiple of mamba_ngroups {c.mamba_ngroups}")
        if c.hybrid_layer_ids:
            if (2 * D) % nh:
                r.fail(f"num_attention_heads {nh} must divide the attention width 2 * hidden_size ({2 * D})")
            if nh % nkv:
                r.fail(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
            if c.use_shared_attention_adapter and nkv != nh:
                r.fail(f"num_key_value_heads {nkv} must equal num_attention_heads {nh} with "
                       f"use_shared_attention_adapter (the k/v adapters are 2 * hidden_size wide)")
            if c.use_mem_rope and c.head_dim % 2:
                r.fail(f"num_attention_heads {nh} gives an odd head_dim {c.head_dim} (2 * hidden_size / heads); "
                       f"RoPE (use_mem_rope) rotates pairs")
        return c


# ---------------------------------------------------------------------------- layers
def _adapter(d_in: int, rank: int, d_out: int) -> nn.ModuleList:
    """A LoRA pair ``.0`` (``[rank, d_in]``) then ``.1`` (``[d_out, rank]``)."""
    return nn.ModuleList([Linear(d_in, rank), Linear(rank, d_out)])


def _run_adapter(a: nn.ModuleList, x: Tensor) -> Tensor:
    return a[1](a[0](x))


def _adapter_list(n: int, owned: list[int], d_in: int, rank: int, d_out: int) -> nn.ModuleList:
    """``n`` entries (one per invocation); those of ``owned`` hold adapters, the rest nothing."""
    return nn.ModuleList([_adapter(d_in, rank, d_out) if j in owned else nn.Module() for j in range(n)])


class SharedTransformer(nn.Module):
    """Shared block ``b``'s weights (``shared_transformer.*``); invoked by :class:`HybridBlock`."""

    def __init__(self, c: Zamba2Config, owned: list[int]):
        super().__init__()
        D2, n, r = 2 * c.hidden_size, len(c.hybrid_layer_ids), c.adapter_rank
        H, Hkv, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_layernorm = RMSNorm(D2, c.rms_norm_eps)
        a = self.self_attn = nn.Module()
        a.q_proj, a.k_proj = Linear(D2, H * Dh), Linear(D2, Hkv * Dh)
        a.v_proj, a.o_proj = Linear(D2, Hkv * Dh), Linear(H * Dh, c.hidden_size)
        if c.use_shared_attention_adapter:
            for w, heads in zip("qkv", (H, Hkv, Hkv)):   # out: the projection's width (2 · hidden globally)
                setattr(a, f"linear_{w}_adapter_list", _adapter_list(n, owned, D2, r, heads * Dh))
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        f = self.feed_forward = nn.Module()
        f.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, c.add_bias_linear)
        f.down_proj = Linear(c.intermediate_size, c.hidden_size, c.add_bias_linear)
        f.gate_up_proj_adapter_list = _adapter_list(n, owned, c.hidden_size, r, 2 * c.intermediate_size)


class AdaptedAttention(Attention):
    """Invocation ``j`` of a shared attention: the shared block's projections (the same
    modules, not copies) plus adapters ``j`` on q / k / v; its own ``layer_id`` (KV cache)."""

    def __init__(self, c: Zamba2Config, shared: SharedTransformer, j: int, rot: Rotary | None, layer_id: int):
        super().__init__(2 * c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         rotary=rot, layer_id=layer_id)
        a = shared.self_attn
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):   # replaces the fresh projections
            setattr(self, n, getattr(a, n))
        self.adapters = None
        if c.use_shared_attention_adapter:
            self.adapters = tuple(getattr(a, f"linear_{w}_adapter_list")[j] for w in "qkv")

    def _qkv(self, x: Tensor, positions: Tensor):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.adapters is not None:
            aq, ak, av = self.adapters
            q, k, v = q + _run_adapter(aq, x), k + _run_adapter(ak, x), v + _run_adapter(av, x)
        q = q.reshape(B, T, self.H, self.Dh)
        k, v = k.view(B, T, self.Hkv, self.Dh), v.view(B, T, self.Hkv, self.Dh)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, v, None


_SHARED_KEY = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+)$")


def _mamba(c: Zamba2Config, layer_id: int) -> Mamba2Mixer:
    return Mamba2Mixer(c.hidden_size, c.n_mamba_heads, c.mamba_headdim, c.mamba_d_state, c.mamba_ngroups,
                       c.mamba_d_conv, norm_group_size=c.mamba_intermediate // c.mamba_ngroups, eps=1e-5,
                       use_bias=c.add_bias_linear, use_conv_bias=True, time_step_limit=(c.time_step_min, math.inf),
                       chunk_size=min(c.chunk_size, 64), layer_id=layer_id)


class HybridBlock(Block):
    """Hybrid layer ``i`` (invocation ``j`` of shared block ``b``): see the module docstring.
    ``shared_transformer`` is registered only at the block's first invocation (its checkpoint
    name); later invocations hold it unregistered, so each weight has one name.  Its mixers'
    outputs feed its own arithmetic, so they come as tensors (``defers`` off)."""

    defers = False

    def __init__(self, c: Zamba2Config, shared: SharedTransformer, first: bool, j: int, rot: Rotary | None,
                 attn_id: int, mamba_id: int):
        super().__init__()
        if first:
            self.shared_transformer = shared
        self._shared = (shared,)
        self.j = j
        self.act = activation(c.hidden_act)
        self.linear = Linear(c.hidden_size, c.hidden_size)
        md = self.mamba_decoder = nn.Module()
        md.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        md.mamba = _mamba(c, mamba_id)
        self._attn = (AdaptedAttention(c, shared, j, rot, attn_id),)

    @property
    def attention(self) -> AdaptedAttention:
        return self._attn[0]

    def stateful(self) -> list[nn.Module]:
        return [self._attn[0], self.mamba_decoder.mamba]

    def _mlp(self, x: Tensor) -> Tensor:
        f = self._shared[0].feed_forward
        gu = f.gate_up_proj(x) + _run_adapter(f.gate_up_proj_adapter_list[self.j], x)
        g, u = gu.chunk(2, dim=-1)
        return f.down_proj(self.act(g) * u)

    def forward(self, h: Tensor, ctx: StepContext, dtype: torch.dtype, pending: Tensor | None = None,
                emb: Tensor | None = None) -> tuple[Tensor, Tensor]:
        s = self.finish(h, pending, dtype)                         # the residual stream
        st = self._shared[0]
        x = st.input_layernorm(torch.cat([s.to(dtype), emb.to(dtype)], -1))
        a = self._attn[0](x, ctx)
        t = self.linear(self._mlp(st.pre_ff_layernorm(a)))
        md = self.mamba_decoder
        m = md.mamba(md.input_layernorm((s + t).to(dtype)), ctx)
        return s, m


def mamba_block(c: Zamba2Config, layer_id: int) -> Block:
    blk = Block()
    blk.add("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps), "mamba", _mamba(c, layer_id))
    return blk


def _scale(t: Tensor, s: float) -> Tensor:
    return t.to(torch.float64) * s


class Zamba2LM(CausalLM):
    def __init__(self, config: Zamba2Config, dtype: torch.dtype, device):
        super().__init__(config, dtype, device)
        c = config
        self.rotary = rot = Rotary(c.head_dim, c.head_dim, c.rope_theta) if c.use_mem_rope else None
        hyb = c.hybrid_layer_ids
        M = c.num_mem_blocks
        shared = [SharedTransformer(c, [j for j in range(len(hyb)) if j % M == b]) for b in range(min(M, len(hyb)))]
        layers, lid = [], 0
        for i, kind in enumerate(c.layer_kinds):
            if kind == "hybrid":
                j = hyb.index(i)
                layers.append(HybridBlock(c, shared[j % M], j < M, j, rot, lid, lid + 1))
                lid += 2
            else:
                layers.append(mamba_block(c, lid))
                lid += 1
        self._assemble("model", "embed_tokens", layers, "final_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))

    def stateful_layers(self) -> list[nn.Module]:
        out = []
        for blk in self.blocks:
            out.extend(blk.stateful() if isinstance(blk, HybridBlock) else [blk.mamba])
        return out

    def _trunk(self, input_ids: Tensor, ctx: StepContext) -> Tensor:
        e = self._embed(input_ids)
        h, pending = e, None
        for blk in self.blocks:
            if isinstance(blk, HybridBlock):
                h, pending = blk(h, ctx, self._dtype, pending, emb=e)
            else:
                h, pending = blk(h, ctx, self._dtype, pending)
        return self.blocks[-1].finish(h, pending, self._dtype) if self.blocks else h

    def load_transforms(self) -> dict:
        """Attention scores scale by ``(head_dim / 2) ** -0.5``, ours by ``head_dim ** -0.5``:
        ``q`` (projection and q adapters) times ``√2``."""
        fold = functools.partial(_scale, s=math.sqrt(2.0))
        out = {}
        for name, _ in self.named_parameters():
            if name.endswith(".self_attn.q_proj.weight") or \
                    (".self_attn.linear_q_adapter_list." in name and name.endswith(".1.weight")):
                out[name] = fold
        return out

    @staticmethod
    def key_aliases() -> dict:
        return {}

    @staticmethod
    def tied_copy(config, key: str) -> str | None:
        """transformers 5.17 saves a shared block under every hybrid layer that invokes it
        (``layers.<i>.shared_transformer.*``); we read it at its first invocation's layer."""
        m = _SHARED_KEY.match(key)
        if m is None:
            return None
        hyb, M = config.hybrid_layer_ids, config.num_mem_blocks
        i = int(m.group(1))
        if i not in hyb or hyb.index(i) < M:
            return None
        return f"model.layers.{hyb[hyb.index(i) % M]}.shared_transformer.{m.group(2)}"
