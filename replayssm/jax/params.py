"""Checkpoint -> (static model spec, ``jnp`` parameter pytree).

The JAX backend reads the same Hugging Face directories as the PyTorch engine.  Loading goes
through :func:`replayssm.models.load_model` (config parsing, shard index, key aliases, per
expert stacking, the Qwen3-Next row reordering and every shape / NaN check), on the CPU, and
then converts each parameter once to a ``jnp`` array; the torch module is dropped afterwards.
So a checkpoint the engine rejects is rejected here with the same error, and the two backends
can never disagree about which tensor is which.

The model is described by a tuple of *stages*: runs of consecutive sub-blocks
(``h = h + mixer(norm(h))``) of the same kind and shape.  A stage's parameters are stacked
on a leading layer axis so that one ``lax.scan`` runs all of its layers (a 64-layer Mamba-2
compiles as one layer body).  Hybrids (Nemotron-H, Qwen3-Next) mostly give stages of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..layers.kda import KimiDeltaAttention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mla import MLAttention
from ..layers.mlp import GatedMLP, GatedSigmoidMoE, PlainMLP, SigmoidMoE, SoftmaxMoE
from ..models import load_model
from ..models.base import Block

__all__ = ["MixerSpec", "SubBlockSpec", "ModelSpec", "load_params", "from_torch_model", "jnp_dtype"]


@dataclass(frozen=True)
class MixerSpec:
    """Static hyper-parameters of one mixer kind (hashable: part of the jit cache key).

    kind: ``mamba`` | ``gdn`` | ``attn`` | ``mlp`` (plain) | ``gmlp`` (gated) |
    ``moe_sig`` (Nemotron-H) | ``moe_soft`` (Qwen3-Next).  ``opts`` holds the kind's fields
    as sorted ``(name, value)`` pairs; read them with :meth:`get` / attribute access.
    """

    kind: str
    opts: tuple = ()

    def __getattr__(self, name):
        for k, v in object.__getattribute__(self, "opts"):
            if k == name:
                return v
        raise AttributeError(name)

    @property
    def stateful(self) -> bool:
        return self.kind in ("mamba", "gdn", "attn")


def _spec(kind: str, **kw) -> MixerSpec:
    return MixerSpec(kind, tuple(sorted(kw.items())))


@dataclass(frozen=True)
class SubBlockSpec:
    """``h = res(h) + mixer(norm(h.astype(dtype)))``; ``res`` upcasts to fp32 when ``residual_fp32``."""

    mixer: MixerSpec
    norm_eps: float
    norm_zero_centered: bool
    residual_fp32: bool


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    stages: tuple            # ((SubBlockSpec, count), ...)
    final_eps: float
    final_zero_centered: bool
    tied: bool
    dtype: str               # "float32" | "float64" | "bfloat16" | "float16"
    eos_token_ids: tuple = field(default=())

    @property
    def num_layers(self) -> int:
        return sum(c for _, c in self.stages)

    def kinds(self) -> list[str]:
        return [s.mixer.kind for s, c in self.stages for _ in range(c)]


_TORCH_TO_NAME = {"torch.float32": "float32", "torch.float64": "float64",
                  "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16,
            "float16": jnp.float16}[name]


def _np(t):
    """A torch parameter as a numpy array (bf16 goes through fp32; cast back by the caller)."""
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.numpy()


def _linear(prefix: str, lin, out: dict) -> None:
    out[prefix + "_w"] = lin.weight
    if getattr(lin, "bias", None) is not None:
        out[prefix + "_b"] = lin.bias


def _split_rows(prefix: str, lin, parts, out: dict) -> None:
    """A packed projection as one linear per output block (``prefix_<name>_w [rows, in]``):
    each block can then be sharded on its own head axis (:mod:`replayssm.jax.shard`)."""
    off = 0
    for name, rows in parts:
        out[f"{prefix}_{name}_w"] = lin.weight[off:off + rows]
        if getattr(lin, "bias", None) is not None:
            out[f"{prefix}_{name}_b"] = lin.bias[off:off + rows]
        off += rows
    if off != lin.weight.shape[0]:
        raise ValueError(f"{prefix} projection has {lin.weight.shape[0]} rows, expected {off}")


def _split_conv(conv, W: int, parts, out: dict) -> None:
    """A depthwise conv over packed channels as one conv per channel block
    (``conv_<name>_w [C_name, W]``): channels are independent, so this is exact."""
    w = conv.weight.reshape(-1, W)
    off = 0
    for name, ch in parts:
        out[f"conv_{name}_w"] = w[off:off + ch]
        if getattr(conv, "bias", None) is not None:
            out[f"conv_{name}_b"] = conv.bias[off:off + ch]
        off += ch


def _mixer(m) -> tuple[MixerSpec, dict]:
    """Spec and (torch) parameters of one mixer module of ``replayssm.layers``."""
    if isinstance(m, (KimiDeltaAttention, MLAttention, GatedSigmoidMoE)):   # subclasses of ported layers
        raise ValueError(f"the JAX backend has no {type(m).__name__} layer (Kimi-Linear): use the PyTorch engine")
    p: dict = {}
    if isinstance(m, Mamba2Mixer):
        inter, bc = m.H * m.d, 2 * m.G * m.n
        _split_rows("in", m.in_proj, (("z", inter), ("x", inter), ("bc", bc), ("dt", m.H)), p)
        _linear("out_proj", m.out_proj, p)
        _split_conv(m.conv1d, m.conv_kernel, (("x", inter), ("bc", bc)), p)
        p.update(dt_bias=m.dt_bias, A_log=m.A_log, D=m.D, norm_w=m.norm.weight)
        lo, hi = m.time_step_limit
        return _spec("mamba", H=m.H, d=m.d, n=m.n, G=m.G, W=m.conv_kernel, conv_dim=m.conv_dim,
                     group_size=m.norm.group_size, eps=float(m.norm.eps), dt_min=float(lo),
                     dt_max=float(hi), chunk=int(m.chunk_size)), p
    if isinstance(m, GatedDeltaNet):
        kd, vd = m.H * m.K, m.HV * m.V
        _split_rows("in", m.in_proj_qkvz, (("q", kd), ("k", kd), ("v", vd), ("z", vd)), p)
        _split_rows("in", m.in_proj_ba, (("b", m.HV), ("a", m.HV)), p)
        _linear("out_proj", m.out_proj, p)
        _split_conv(m.conv1d, m.conv_kernel, (("q", kd), ("k", kd), ("v", vd)), p)
        p.update(dt_bias=m.dt_bias, A_log=m.A_log, norm_w=m.norm.weight)
        return _spec("gdn", H=m.H, HV=m.HV, K=m.K, V=m.V, W=m.conv_kernel, conv_dim=m.conv_dim,
                     eps=float(m.norm.eps), chunk=int(m.chunk_size)), p
    if isinstance(m, Attention):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _linear(name, getattr(m, name), p)
        qk_eps = None
        if m.q_norm is not None:
            p["q_norm"], p["k_norm"] = m.q_norm.weight, m.k_norm.weight
            qk_eps = float(m.q_norm.eps)
        rot = m.rotary
        inv = None if rot is None else tuple(float(v) for v in rot.inv_freq.tolist())
        return _spec("attn", H=m.H, Hkv=m.Hkv, Dh=m.Dh, qk_eps=qk_eps, output_gate=bool(m.output_gate),
                     rotary_dim=None if rot is None else rot.rotary_dim, inv_freq=inv), p
    if isinstance(m, PlainMLP):
        _linear("up", m.up_proj, p)
        _linear("down", m.down_proj, p)
        return _spec("mlp", act=m.act_name), p
    if isinstance(m, GatedMLP):
        for name in ("gate", "up", "down"):
            _linear(name, getattr(m, name + "_proj"), p)
        return _spec("gmlp", act=m.act_name), p
    if isinstance(m, SigmoidMoE):
        p.update(gate_w=m.gate.weight, e_bias=m.gate.e_score_correction_bias,
                 up=m.experts.up_proj, down=m.experts.down_proj)
        sh = m.shared_experts
        _linear("sh_up", sh.up_proj, p)
        _linear("sh_down", sh.down_proj, p)
        if m.fc1_latent_proj is not None:
            _linear("fc1", m.fc1_latent_proj, p)
            _linear("fc2", m.fc2_latent_proj, p)
        return _spec("moe_sig", E=m.E, k=m.k, n_group=m.n_group, topk_group=m.topk_group,
                     norm_topk_prob=bool(m.norm_topk_prob), scaling=float(m.scaling),
                     act=m.act_name, latent=m.fc1_latent_proj is not None), p
    if isinstance(m, SoftmaxMoE):
        gu = m.experts.gate_up_proj                  # [E, 2I, D]: gate rows, then up rows
        I = gu.shape[1] // 2
        p.update(gate_w=m.gate.weight, e_gate=gu[:, :I], e_up=gu[:, I:], down=m.experts.down_proj)
        shared = m.shared_expert is not None
        if shared:
            for name in ("gate", "up", "down"):
                _linear("sh_" + name, getattr(m.shared_expert, name + "_proj"), p)
            p["sh_sig_w"] = m.shared_expert_gate.weight
        return _spec("moe_soft", E=m.E, k=m.k, norm_topk_prob=bool(m.norm_topk_prob),
                     act=m.act_name, shared=shared), p
    raise ValueError(f"the JAX backend has no mixer for {type(m).__name__}")


def from_torch_model(model, dtype: str | None = None):
    """``(ModelSpec, params)`` from a loaded ``replayssm.models`` CausalLM.

    ``params = {"embed", "final_norm", "head"?, "stages": [stacked sub-block params]}``; a
    sub-block's params are ``{"norm": [D], "mixer": {...}}``.  ``dtype`` defaults to the
    model's; parameters kept in fp32 by the loader (``A_log``, ``dt_bias``, ``D``, router
    bias) stay fp32 (fp64 for a float64 model).
    """
    import jax.numpy as jnp

    fp8 = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    if fp8:
        raise ValueError(f"the JAX backend takes float models; this one has FP8 weights ({fp8[0]}, ...): "
                         f"use the torch backend, or load the float checkpoint")
    name = dtype or _TORCH_TO_NAME[str(model.dtype)]
    wdt = jnp_dtype(name)
    keep32 = jnp.float64 if name == "float64" else jnp.float32
    fp32_leaves = ("A_log", "dt_bias", "D", "e_bias")

    def conv(leaf, t):
        return jnp.asarray(_np(t), dtype=keep32 if leaf in fp32_leaves else wdt)

    subs: list[tuple[SubBlockSpec, dict]] = []
    for blk in model.blocks:
        assert isinstance(blk, Block)
        for norm_name, mixer_name in blk.subs:
            norm = getattr(blk, norm_name)
            mspec, p = _mixer(getattr(blk, mixer_name))
            sb = SubBlockSpec(mspec, float(norm.eps), bool(norm.zero_centered), bool(blk.residual_fp32))
            subs.append((sb, {"norm": conv("norm", norm.weight),
                              "mixer": {k: conv(k, v) for k, v in p.items()}}))
    # consecutive identical sub-blocks (same spec, same parameter shapes) form one stage
    stages, stage_params = [], []
    for sb, p in subs:
        shapes = _shapes(p)
        if stages and stages[-1][0] == sb and _shapes(stage_params[-1][0]) == shapes:
            stages[-1][1] += 1
            stage_params[-1].append(p)
        else:
            stages.append([sb, 1])
            stage_params.append([p])
    import jax

    stacked = [jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, 0), *ps) for ps in stage_params]
    cfg = model.config
    fn = model.final_norm()
    eos = getattr(cfg, "eos_token_id", None)
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    spec = ModelSpec(model_type=cfg.model_type, vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                     stages=tuple((s, c) for s, c in stages), final_eps=float(fn.eps),
                     final_zero_centered=bool(fn.zero_centered), tied=bool(cfg.tie_word_embeddings),
                     dtype=name, eos_token_ids=eos)
    params = {"embed": conv("embed", model.embed_weight()), "final_norm": conv("norm", fn.weight),
              "stages": stacked}
    if not spec.tied:
        params["head"] = conv("head", model.head_weight())
    return spec, params


def _shapes(p: dict) -> tuple:
    import jax

    return tuple((str(k), tuple(np.shape(v))) for k, v in
                 jax.tree_util.tree_flatten_with_path(p)[0])


def load_params(path: str, dtype: str = "float32"):
    """``(ModelSpec, params)`` for the HF model directory ``path`` (see module docstring).

    ``dtype``: ``float32`` | ``float64`` | ``bfloat16`` | ``float16``.  Raises the loader's
    ``ConfigError`` / ``WeightError`` / ``FileNotFoundError`` for bad directories.
    """
    if dtype not in ("float32", "float64", "bfloat16", "float16"):
        raise ValueError(f"dtype must be one of float32, float64, bfloat16, float16; got {dtype!r}")
    if dtype == "float64":
        _require_x64()
    # read in fp32 (fp64 for a float64 model): bf16 weights convert exactly either way
    model = load_model(path, device="cpu", dtype="float64" if dtype == "float64" else "float32")
    return from_torch_model(model, dtype)


def _require_x64() -> None:
    import jax

    if not jax.config.read("jax_enable_x64"):
        raise ValueError("dtype='float64' needs 64-bit JAX: call jax.config.update('jax_enable_x64', True) "
                         "before creating arrays")
