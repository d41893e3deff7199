"""Which part of every weight a tensor-parallel rank holds (Megatron-style, by heads).

Pure bookkeeping, no communication: :func:`check_tensor_parallel` validates a model config
for ``N`` ranks (a ``ValueError`` naming the dimension, raised before any process starts),
:func:`local_config` gives the config one rank's layers are built from (head counts and
intermediate sizes divided by ``N``), and :func:`shard_rules` says, for every parameter of
the *global* model, which slices of the checkpoint tensor rank ``r`` reads.

Rules per layer (rank ``r`` of ``N``; "column" = output rows split, "row" = input columns
split, its partial output summed by one all-reduce per sub-block):

* Mamba-2 (``H`` heads of ``d``, ``G`` groups of ``n``): heads ``[r H/N, (r+1) H/N)``.
  ``in_proj`` rows ``[z | x | B | C | dt]`` are sliced per segment (z, x, dt by head; B, C by
  group), the conv channels ``[x | B | C]`` likewise, ``dt_bias / A_log / D`` and the gated
  norm weight by head; ``out_proj`` columns by head (row-parallel).  Groups are split when
  ``N`` divides ``G`` and replicated (each rank keeps the one group its heads read) when
  ``G`` divides ``N``.  The gated RMSNorm normalises groups of ``H d / G`` channels: with
  split groups they stay whole on one rank; with replicated groups a group spans ``N / G``
  ranks and its sum of squares is all-reduced (``layers.ShardedGatedRMSNorm``).
* Gated DeltaNet (``H`` key heads, ``HV`` value heads): key heads ``[r H/N, ...)`` and their
  value heads.  HF packs ``in_proj_qkvz`` / ``in_proj_ba`` per key head, so a rank's rows
  are one contiguous block, reordered by the model's own load transform with the local
  head counts; conv channels ``[q | k | v]`` per segment; ``out_proj`` row-parallel.
* Attention (``H`` query heads, ``Hkv`` KV heads): query heads split (``q_proj`` rows per
  head, including Qwen3-Next's per-head output gate), KV heads split when ``N`` divides
  ``Hkv``, else replicated (each rank keeps the KV head its query heads read); ``o_proj``
  row-parallel; q/k norms replicated.
* Dense MLPs: the intermediate dimension split (gate/up rows, down columns).
* MoE: every expert's intermediate dimension split (all experts on every rank, a slice of
  each), and the shared expert likewise; routers, routing biases and latent projections
  replicated, so routing is computed identically on every rank and one all-reduce sums
  experts and shared expert.  (Splitting experts across ranks instead would leave a rank
  idle whenever a batch routes to the other's experts; the intermediate split is balanced
  for any routing.)
* Embedding and LM head: vocabulary rows ``[r Vs, (r+1) Vs)`` with ``Vs = ceil(V / N)``
  (the last shard zero-padded); logits are all-gathered and cut back to ``V``.
* Family specifics (same rules, other layouts): Qwen3.5's GDN has separate
  ``in_proj_qkv`` (rows ``[q | k | v]`` as the conv) / ``in_proj_z`` / ``in_proj_b`` /
  ``in_proj_a`` (by value head); Granite-4.0-H's shared MLP ``input_linear = [gate | up]``
  and experts ``input_linear [E, 2I, D]`` / ``output_linear [E, D, I]`` split like the
  MoE above (its ``residual_multiplier`` and attention scale are folded into the weights:
  linear, so each rank's partial sum carries them exactly); Falcon-H1's Mamba-2 and
  attention run in parallel on one input, each row-parallel with its own all-reduce, and
  its muP multipliers are folded per rank into the local rows (``ssm_multipliers`` by
  segment ``[z | x | B | C | dt]``, computed from the local sizes) or applied to replicated
  values (embeddings, complete logits).  Zamba2's shared blocks are split once, where
  they are registered (attention by heads, ``gate_up_proj = [gate | up]`` rows, ``down_proj``
  columns); each invocation's LoRA adapters ``x -> B (A x)`` keep ``A`` whole (replicated)
  and split ``B``'s rows like the projection they add to, so ``q + B A x`` stays each rank's
  own heads exactly.  Kimi-Linear: KDA by heads (``q/k/v_proj``, their convs, the decay's
  ``f_b_proj`` and ``dt_bias``, ``A_log``, ``b_proj`` and the output gate's ``g_b_proj`` by
  head; the low-rank inputs ``f_a_proj`` / ``g_a_proj`` and the per-head gated norm's
  weight replicated: each head's norm stays whole on one rank), ``o_proj`` row-parallel.
  MLA by heads: ``q_proj`` (or ``q_b_proj``) rows and ``kv_b_proj``'s per-head
  ``[W_uk_h | W_uv_h]`` rows split, ``o_proj`` row-parallel; ``q_a_proj`` / ``kv_a_proj_with_mqa``
  and their norms replicated, so every rank computes and caches the whole latent
  ``[c | k_rot]`` of each token (MLA's one KV head, replicated as a KV head is when
  ranks outnumber KV heads).  Its MoE as above (``gate_up_proj = [gate | up]``).
* An MTP head (``mtp.*``, loaded with ``mtp=True``): its decoder layers follow the rules of
  their kind above (same hooks); it shares the target's vocabulary-parallel embedding and
  head.  Its ``fc`` / ``eh_proj`` ``[D, 2D]`` mixes ``[n_e(E x) ; n_h(h)]``, both complete
  on every rank, so it is replicated (an exact, small ``D x 2D`` copy per rank).
* Everything else (RMSNorms, routers, q/k norms, GDN's per-head-dim norm): replicated.
  Biases of row-parallel projections live on rank 0 only (zeros elsewhere), so the
  all-reduced sum adds them once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..layers.kda import KimiDeltaAttention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mla import MLAttention
from ..layers.mlp import GatedMLP, GatedSigmoidMoE, PlainMLP, SigmoidMoE, SoftmaxMoE
from ..models.granite_hybrid import GraniteMoE, GraniteSharedMLP
from ..models.zamba2 import HybridBlock, SharedTransformer
from ..models.qwen3_5 import QWEN3_5_TYPES, Qwen3_5GatedDeltaNet

__all__ = ["Shard", "ROOT_ONLY", "check_tensor_parallel", "local_config", "shard_rules", "vocab_shard",
           "kv_heads", "mamba_groups", "mamba_dims"]


@dataclass(frozen=True)
class Shard:
    """Rank ``r``'s part of a checkpoint tensor: the global ranges ``[start, stop)`` along
    ``dim``, concatenated in order, then zero-padded along ``dim`` to ``pad_to`` rows."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int | None = None

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


#: a row-parallel projection's bias: rank 0 holds it, the others zeros (added once by the sum)
ROOT_ONLY = "root_only"


def _pieces(*ranges) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in ranges if b > a)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _divides(N: int, field: str, value: int, what: str) -> None:
    _need(value % N == 0, f"tensor_parallel_size={N} must divide {field} ({value}): each rank holds "
                          f"{field}/tensor_parallel_size {what}")


def mamba_groups(H: int, G: int, N: int, rank: int) -> tuple[int, int]:
    """``(first group, local groups)`` of rank ``rank``'s Mamba-2 heads: ``G / N`` groups
    when ``N`` divides ``G``, else the one group its heads read (replicated)."""
    if G % N == 0:
        return rank * (G // N), G // N
    return (rank * (H // N)) // (H // G), 1


def kv_heads(H: int, Hkv: int, N: int, rank: int) -> tuple[int, int]:
    """``(first KV head, local KV heads)`` of rank ``rank``: ``Hkv / N`` heads when ``N``
    divides ``Hkv``, else the one KV head its query heads read (replicated)."""
    if Hkv % N == 0:
        return rank * (Hkv // N), Hkv // N
    return (rank * (H // N)) // (H // Hkv), 1


def vocab_shard(V: int, N: int, rank: int) -> tuple[int, int, int]:
    """``(first row, real rows, padded rows)`` of rank ``rank``'s vocabulary shard."""
    Vs = -(-V // N)
    lo = min(rank * Vs, V)
    return lo, min(V, lo + Vs) - lo, Vs


# ---------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------
def _check_mamba(N: int, H: int, G: int, heads_field: str, groups_field: str = "n_groups") -> None:
    _divides(N, heads_field, H, "Mamba-2 heads")
    _need(G % N == 0 or N % G == 0,
          f"tensor_parallel_size={N} and {groups_field} ({G}) must divide one another: Mamba-2 groups (B, C and "
          f"the gated-norm groups) are split across ranks or replicated, never cut")


def _check_attention(N: int, H: int, Hkv: int) -> None:
    _divides(N, "num_attention_heads", H, "attention heads")
    _need(Hkv % N == 0 or N % Hkv == 0,
          f"tensor_parallel_size={N} and num_key_value_heads ({Hkv}) must divide one another: KV heads are "
          f"split across ranks or replicated")


def _check_size(N) -> int:
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {N!r}")
    return N


def check_tensor_parallel(cfg, N: int, mtp: bool = False) -> None:
    """Raise ``ValueError`` naming the dimension when ``cfg`` cannot be split over ``N`` ranks
    (``mtp``: with its MTP head, whose layer kinds count too)."""
    N = _check_size(N)
    if N == 1:
        return
    mt = cfg.model_type
    if mt == "mamba2":
        _check_mamba(N, cfg.num_heads, cfg.n_groups, "num_heads")
    elif mt == "nemotron_h":
        kinds = set(cfg.layer_kinds) | (set(cfg.mtp_layer_kinds) if mtp else set())
        if "mamba" in kinds:
            _check_mamba(N, cfg.mamba_num_heads, cfg.n_groups, "mamba_num_heads")
        if "attention" in kinds:
            _check_attention(N, cfg.num_attention_heads, cfg.num_key_value_heads)
        if "mlp" in kinds:
            _divides(N, "intermediate_size", cfg.intermediate_size, "MLP channels")
        if "moe" in kinds:
            _divides(N, "moe_intermediate_size", cfg.moe_intermediate_size, "channels of every expert")
            _divides(N, "moe_shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size,
                     "shared-expert channels")
    elif mt == "qwen3_next" or mt in QWEN3_5_TYPES:
        kinds = set(cfg.layer_kinds) | ({"attention"} if mtp else set())   # the MTP layer: attention
        if "gdn" in kinds:
            _divides(N, "linear_num_key_heads", cfg.linear_num_key_heads, "GDN key heads (and their value heads)")
        if "attention" in kinds:
            _check_attention(N, cfg.num_attention_heads, cfg.num_key_value_heads)
        moe = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] + ([cfg.is_moe_layer(0)] if mtp else [])
        if not all(moe):
            _divides(N, "intermediate_size", cfg.intermediate_size, "MLP channels")
        if any(moe):
            _divides(N, "moe_intermediate_size", cfg.moe_intermediate_size, "channels of every expert")
            if cfg.shared_expert_intermediate_size:
                _divides(N, "shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                         "shared-expert channels")
    elif mt in _FAMILY_CHECKS:
        _FAMILY_CHECKS[mt](cfg, N)
    else:
        why = _REFUSED.get(mt, "no sharding rules")
        raise ValueError(f"tensor parallelism does not support model_type {mt!r} ({why}); "
                         f"use tensor_parallel_size=1")


def local_config(cfg, N: int):
    """The config one rank's layers are built from (``vocab_size`` stays global: token ids
    are checked against it; the embedding and head hold a vocabulary shard)."""
    check_tensor_parallel(cfg, N)
    if N == 1:
        return cfg
    mt = cfg.model_type

    def div(v: int) -> int:
        return v // N if v % N == 0 else v  # sizes of layer kinds the model lacks stay as read

    def kv(H: int, Hkv: int) -> int:
        return Hkv // N if Hkv % N == 0 else 1

    def groups(G: int) -> int:
        return G // N if G % N == 0 else 1

    if mt == "mamba2":
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // N, n_groups=groups(cfg.n_groups))
    if mt in _FAMILY_LOCAL:
        return _FAMILY_LOCAL[mt](cfg, div, kv, groups)
    if mt == "nemotron_h":
        return dataclasses.replace(
            cfg, mamba_num_heads=div(cfg.mamba_num_heads), n_groups=groups(cfg.n_groups),
            num_attention_heads=div(cfg.num_attention_heads),
            num_key_value_heads=kv(cfg.num_attention_heads, cfg.num_key_value_heads),
            intermediate_size=div(cfg.intermediate_size), moe_intermediate_size=div(cfg.moe_intermediate_size),
            moe_shared_expert_intermediate_size=div(cfg.moe_shared_expert_intermediate_size))
    return dataclasses.replace(
        cfg, linear_num_key_heads=div(cfg.linear_num_key_heads), linear_num_value_heads=div(cfg.linear_num_value_heads),
        num_attention_heads=div(cfg.num_attention_heads),
        num_key_value_heads=kv(cfg.num_attention_heads, cfg.num_key_value_heads),
        intermediate_size=div(cfg.intermediate_size), moe_intermediate_size=div(cfg.moe_intermediate_size),
        shared_expert_intermediate_size=div(cfg.shared_expert_intermediate_size))


# ---------------------------------------------------------------------------------------
# the hybrid families with ``mamba_n_*`` fields (Bamba, Granite-4.0-H, Falcon-H1)
# ---------------------------------------------------------------------------------------
def mamba_dims(cfg) -> tuple[int, int]:
    """``(Mamba-2 heads, groups)`` of a config, whatever the family calls them."""
    if cfg.model_type == "mamba2":
        return cfg.num_heads, cfg.n_groups
    if cfg.model_type == "nemotron_h":
        return cfg.mamba_num_heads, cfg.n_groups
    if cfg.model_type == "zamba2":
        return cfg.n_mamba_heads, cfg.mamba_ngroups
    return cfg.mamba_n_heads, cfg.mamba_n_groups


def _check_hybrid(cfg, N: int, mamba: bool, attention: bool) -> None:
    if mamba:
        _check_mamba(N, cfg.mamba_n_heads, cfg.mamba_n_groups, "mamba_n_heads", "mamba_n_groups")
    if attention:
        _check_attention(N, cfg.num_attention_heads, cfg.num_key_value_heads)


def _check_bamba(cfg, N: int) -> None:
    kinds = set(cfg.layer_kinds)
    _check_hybrid(cfg, N, "mamba" in kinds, "attention" in kinds)
    _divides(N, "intermediate_size", cfg.intermediate_size, "MLP channels")


def _check_granite(cfg, N: int) -> None:
    kinds = set(cfg.layer_kinds)
    _check_hybrid(cfg, N, "mamba" in kinds, "attention" in kinds)
    if cfg.num_local_experts:
        _divides(N, "intermediate_size", cfg.intermediate_size, "channels of every expert")
    _divides(N, "shared_intermediate_size", cfg.shared_intermediate_size, "shared-MLP channels")


def _check_falcon_h1(cfg, N: int) -> None:
    _check_hybrid(cfg, N, True, True)
    _divides(N, "intermediate_size", cfg.intermediate_size, "MLP channels")


def _local_hybrid(cfg, div, kv, groups, **extra):
    return dataclasses.replace(
        cfg, mamba_n_heads=div(cfg.mamba_n_heads), mamba_n_groups=groups(cfg.mamba_n_groups),
        num_attention_heads=div(cfg.num_attention_heads),
        num_key_value_heads=kv(cfg.num_attention_heads, cfg.num_key_value_heads),
        intermediate_size=div(cfg.intermediate_size), **extra)


def _check_zamba2(cfg, N: int) -> None:
    _check_mamba(N, cfg.n_mamba_heads, cfg.mamba_ngroups, "n_mamba_heads", "mamba_ngroups")
    if cfg.hybrid_layer_ids:
        _check_attention(N, cfg.num_attention_heads, cfg.num_key_value_heads)
        _divides(N, "intermediate_size", cfg.intermediate_size, "shared-MLP channels")


def _check_kimi(cfg, N: int) -> None:
    kinds = set(cfg.layer_kinds)
    if "kda" in kinds:
        _divides(N, "linear_attn_config.num_heads", cfg.linear_num_heads, "KDA heads")
    if "attention" in kinds:
        _divides(N, "num_attention_heads", cfg.num_attention_heads,
                 "MLA heads (the latent [c | k_rot] is replicated)")
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    if not all(moe):
        _divides(N, "intermediate_size", cfg.intermediate_size, "MLP channels")
    if any(moe):
        _divides(N, "moe_intermediate_size", cfg.moe_intermediate_size,
                 "channels of every expert (and of every shared expert)")


def _local_kimi(cfg, div, kv, groups):
    return dataclasses.replace(
        cfg, linear_num_heads=div(cfg.linear_num_heads), num_attention_heads=div(cfg.num_attention_heads),
        intermediate_size=div(cfg.intermediate_size), moe_intermediate_size=div(cfg.moe_intermediate_size))


def _local_zamba2(cfg, div, kv, groups):
    return dataclasses.replace(
        cfg, n_mamba_heads=div(cfg.n_mamba_heads), mamba_ngroups=groups(cfg.mamba_ngroups),
        num_attention_heads=div(cfg.num_attention_heads), attention_head_dim=cfg.head_dim,
        num_key_value_heads=kv(cfg.num_attention_heads, cfg.num_key_value_heads),
        intermediate_size=div(cfg.intermediate_size))


_FAMILY_CHECKS = {"bamba": _check_bamba, "granitemoehybrid": _check_granite, "falcon_h1": _check_falcon_h1,
                  "zamba2": _check_zamba2, "kimi_linear": _check_kimi}
_FAMILY_LOCAL = {
    "bamba": _local_hybrid,
    "granitemoehybrid": lambda c, div, kv, g: _local_hybrid(c, div, kv, g,
                                                            shared_intermediate_size=div(c.shared_intermediate_size)),
    "falcon_h1": lambda c, div, kv, g: _local_hybrid(c, div, kv, g, mamba_d_ssm=div(c.mamba_d_ssm)),
    "zamba2": _local_zamba2,
    "kimi_linear": _local_kimi,
}
#: families refused by name, and why
_REFUSED: dict[str, str] = {}


# ---------------------------------------------------------------------------------------
# per-layer rules (computed from the global model's layers)
# ---------------------------------------------------------------------------------------
def _split(total: int, N: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s block ``[start, stop)`` of ``total`` equal parts' worth (``N`` divides ``total``)."""
    per = total // N
    return rank * per, (rank + 1) * per


def _mamba_rules(m, N: int, r: int) -> dict:
    H, d, n, G, inter = m.H, m.d, m.n, m.G, m.inter
    h0, h1 = _split(H, N, r)
    g0, Gl = mamba_groups(H, G, N, r)
    g1 = g0 + Gl
    z = (h0 * d, h1 * d)
    x = (inter + h0 * d, inter + h1 * d)
    B = (2 * inter + g0 * n, 2 * inter + g1 * n)
    C = (2 * inter + G * n + g0 * n, 2 * inter + G * n + g1 * n)
    dt = (2 * inter + 2 * G * n + h0, 2 * inter + 2 * G * n + h1)
    in_rows = Shard(0, _pieces(z, x, B, C, dt))
    conv = Shard(0, _pieces((h0 * d, h1 * d), (inter + g0 * n, inter + g1 * n),
                            (inter + G * n + g0 * n, inter + G * n + g1 * n)))
    heads = Shard(0, _pieces((h0, h1)))
    return {"in_proj.weight": in_rows, "in_proj.bias": in_rows, "conv1d.weight": conv, "conv1d.bias": conv,
            "dt_bias": heads, "A_log": heads, "D": heads, "norm.weight": Shard(0, _pieces(z)),
            "out_proj.weight": Shard(1, _pieces(z)), "out_proj.bias": ROOT_ONLY}


def _gdn_rules(m, N: int, r: int) -> dict:
    H, HV, K, V = m.H, m.HV, m.K, m.V
    rr = HV // H
    k0, k1 = _split(H, N, r)
    v0, v1 = _split(HV, N, r)
    per_key = 2 * K + 2 * rr * V          # HF rows per key head of in_proj_qkvz: [q | k | v | z]
    conv = Shard(0, _pieces((k0 * K, k1 * K), (H * K + k0 * K, H * K + k1 * K),
                            (2 * H * K + v0 * V, 2 * H * K + v1 * V)))
    vheads = Shard(0, _pieces((v0, v1)))
    return {"in_proj_qkvz.weight": Shard(0, _pieces((k0 * per_key, k1 * per_key))),
            "in_proj_ba.weight": Shard(0, _pieces((k0 * 2 * rr, k1 * 2 * rr))),
            "conv1d.weight": conv, "dt_bias": vheads, "A_log": vheads,
            "out_proj.weight": Shard(1, _pieces((v0 * V, v1 * V)))}


def _attention_rules(m, N: int, r: int) -> dict:
    H, Hkv, Dh = m.H, m.Hkv, m.Dh
    g = 2 if m.output_gate else 1
    q0, q1 = _split(H, N, r)
    c0, cl = kv_heads(H, Hkv, N, r)
    q = Shard(0, _pieces((q0 * g * Dh, q1 * g * Dh)))
    kv = Shard(0, _pieces((c0 * Dh, (c0 + cl) * Dh)))
    return {"q_proj.weight": q, "q_proj.bias": q, "k_proj.weight": kv, "k_proj.bias": kv,
            "v_proj.weight": kv, "v_proj.bias": kv, "o_proj.weight": Shard(1, _pieces((q0 * Dh, q1 * Dh))),
            "o_proj.bias": ROOT_ONLY}


def _mlp_rules(m, N: int, r: int, prefix: str = "") -> dict:
    """GatedMLP (gate/up/down) or PlainMLP (up/down)."""
    inter = m.up_proj.weight.shape[0]
    cols = Shard(0, _pieces(_split(inter, N, r)))
    out = {prefix + "up_proj.weight": cols, prefix + "up_proj.bias": cols,
           prefix + "down_proj.weight": Shard(1, _pieces(_split(inter, N, r))),
           prefix + "down_proj.bias": ROOT_ONLY}
    if hasattr(m, "gate_proj"):
        out.update({prefix + "gate_proj.weight": cols, prefix + "gate_proj.bias": cols})
    return out


def _stacked_experts_rules(I: int, shared, shared_prefix: str, N: int, r: int) -> dict:
    """Experts stacked as ``gate_up_proj [E, 2I, D]`` (``[gate | up]``) and ``down_proj
    [E, D, I]``, split along ``I``; the SwiGLU shared expert(s) ``shared`` (or None) by rows."""
    a, b = _split(I, N, r)
    out = {"experts.gate_up_proj": Shard(1, _pieces((a, b), (I + a, I + b))),
           "experts.down_proj": Shard(2, _pieces((a, b)))}
    if shared is not None:
        out.update(_mlp_rules(shared, N, r, shared_prefix))
    return out


def _softmax_moe_rules(m, N: int, r: int) -> dict:
    return _stacked_experts_rules(m.experts.gate_up_proj.shape[1] // 2, m.shared_expert, "shared_expert.", N, r)


def _sigmoid_moe_rules(m, N: int, r: int) -> dict:
    I = m.experts.up_proj.shape[1]
    rng = _pieces(_split(I, N, r))
    out = {"experts.up_proj": Shard(1, rng), "experts.down_proj": Shard(2, rng),
           "fc2_latent_proj.bias": ROOT_ONLY}
    out.update(_mlp_rules(m.shared_experts, N, r, "shared_experts."))
    return out


def _gdn_separate_rules(m, N: int, r: int) -> dict:
    """Qwen3.5's GDN: ``in_proj_qkv`` rows ``[q | k | v]`` (as the conv channels), ``in_proj_z``
    ``[HV V]``, ``in_proj_b`` / ``in_proj_a`` ``[HV]``: key heads ``[r H/N, ...)`` and their value heads."""
    H, HV, K, V = m.H, m.HV, m.K, m.V
    k0, k1 = _split(H, N, r)
    v0, v1 = _split(HV, N, r)
    qkv = Shard(0, _pieces((k0 * K, k1 * K), (H * K + k0 * K, H * K + k1 * K),
                           (2 * H * K + v0 * V, 2 * H * K + v1 * V)))
    vheads = Shard(0, _pieces((v0, v1)))
    return {"in_proj_qkv.weight": qkv, "conv1d.weight": qkv, "in_proj_z.weight": Shard(0, _pieces((v0 * V, v1 * V))),
            "in_proj_b.weight": vheads, "in_proj_a.weight": vheads, "dt_bias": vheads, "A_log": vheads,
            "out_proj.weight": Shard(1, _pieces((v0 * V, v1 * V)))}


def _kda_rules(m, N: int, r: int) -> dict:
    """KDA (``H`` heads of ``K`` channels): every ``[H K]`` row block (q/k/v projections and
    convs, ``f_b_proj``, ``dt_bias``, ``g_b_proj``) by head, ``A_log [1, 1, H, 1]`` and
    ``b_proj [H]`` by head, ``o_proj`` columns by head."""
    h0, h1 = _split(m.H, N, r)
    ch = Shard(0, _pieces((h0 * m.K, h1 * m.K)))
    out = {f"{n}.{p}": ch for n in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj") for p in ("weight", "bias")}
    out.update({f"{n}_conv1d.weight": ch for n in "qkv"})
    heads = Shard(0, _pieces((h0, h1)))
    out.update({"dt_bias": ch, "A_log": Shard(2, _pieces((h0, h1))), "b_proj.weight": heads, "b_proj.bias": heads,
                "o_proj.weight": Shard(1, _pieces((h0 * m.K, h1 * m.K))), "o_proj.bias": ROOT_ONLY})
    return out


def _mla_rules(m, N: int, r: int) -> dict:
    """MLA (``H`` heads): ``q_proj`` / ``q_b_proj`` rows ``[dn + dr]`` per head, ``kv_b_proj``
    rows ``[dn + dv]`` per head, ``o_proj`` columns ``[dv]`` per head; the latent path
    (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) replicated."""
    h0, h1 = _split(m.H, N, r)
    dq, dkv = m.dn + m.dr, m.dn + m.dv
    q = Shard(0, _pieces((h0 * dq, h1 * dq)))
    return {"q_proj.weight": q, "q_b_proj.weight": q, "kv_b_proj.weight": Shard(0, _pieces((h0 * dkv, h1 * dkv))),
            "o_proj.weight": Shard(1, _pieces((h0 * m.dv, h1 * m.dv))), "o_proj.bias": ROOT_ONLY}


def _gated_sigmoid_moe_rules(m, N: int, r: int) -> dict:
    """Kimi-Linear's MoE: experts ``gate_up_proj [E, 2I, D]`` (``[gate | up]``), ``down_proj
    [E, D, I]``, the SwiGLU shared experts; router and correction bias replicated."""
    return _stacked_experts_rules(m.experts.down_proj.shape[2], m.shared_experts, "shared_experts.", N, r)


def _granite_mlp_rules(m, N: int, r: int) -> dict:
    """Granite's shared MLP: ``input_linear = [gate (S) | up (S)]`` rows, ``output_linear`` columns."""
    S = m.output_linear.weight.shape[1]
    a, b = _split(S, N, r)
    return {"input_linear.weight": Shard(0, _pieces((a, b), (S + a, S + b))),
            "output_linear.weight": Shard(1, _pieces((a, b))), "output_linear.bias": ROOT_ONLY}


def _granite_moe_rules(m, N: int, r: int) -> dict:
    """Granite's experts: ``input_linear [E, 2I, D]`` (``[gate | up]``), ``output_linear [E, D, I]``."""
    I = m.output_linear.weight.shape[2]
    a, b = _split(I, N, r)
    return {"input_linear.weight": Shard(1, _pieces((a, b), (I + a, I + b))),
            "output_linear.weight": Shard(2, _pieces((a, b)))}


def _zamba2_shared_rules(m, cfg, N: int, r: int) -> dict:
    """A Zamba2 shared block: attention and MLP as above; adapters ``.0`` (A) replicated,
    ``.1`` (B) split like the rows of the projection they add to."""
    att = type("Dims", (), dict(H=cfg.num_attention_heads, Hkv=cfg.num_key_value_heads, Dh=cfg.head_dim,
                                output_gate=False))
    out = {"self_attn." + k: v for k, v in _attention_rules(att, N, r).items()}
    I = cfg.intermediate_size
    a, b = _split(I, N, r)
    gu = Shard(0, _pieces((a, b), (I + a, I + b)))
    out.update({"feed_forward.gate_up_proj.weight": gu, "feed_forward.gate_up_proj.bias": gu,
                "feed_forward.down_proj.weight": Shard(1, _pieces((a, b))), "feed_forward.down_proj.bias": ROOT_ONLY})
    for j in range(len(cfg.hybrid_layer_ids)):
        for w in "qkv":
            out[f"self_attn.linear_{w}_adapter_list.{j}.1.weight"] = out[f"self_attn.{w}_proj.weight"]
        out[f"feed_forward.gate_up_proj_adapter_list.{j}.1.weight"] = gu
    return out


def _held_rules(model, N: int, r: int) -> dict:
    """Rules of sharded modules that no sub-block lists: Granite's experts (run by its shared
    MLP), Zamba2's hybrid layers (their Mamba-2 mixer and the shared blocks)."""
    out = {}

    def put(prefix, rules):
        out.update({f"{prefix}.{k}": rule for k, rule in rules.items()})

    for name, mod in model.named_modules():
        if isinstance(mod, GraniteMoE):
            put(name, _granite_moe_rules(mod, N, r))
        elif isinstance(mod, HybridBlock):
            put(name + ".mamba_decoder.mamba", _mamba_rules(mod.mamba_decoder.mamba, N, r))
        elif isinstance(mod, SharedTransformer):
            put(name, _zamba2_shared_rules(mod, model.config, N, r))
    return out


def _layer_rules(m, N: int, r: int) -> dict:
    for cls, fn in ((Qwen3_5GatedDeltaNet, _gdn_separate_rules), (GraniteSharedMLP, _granite_mlp_rules),
                    (KimiDeltaAttention, _kda_rules), (MLAttention, _mla_rules),
                    (GatedSigmoidMoE, _gated_sigmoid_moe_rules)):
        if isinstance(m, cls):
            return fn(m, N, r)
    for cls, fn in ((Mamba2Mixer, _mamba_rules), (GatedDeltaNet, _gdn_rules), (Attention, _attention_rules),
                    (SoftmaxMoE, _softmax_moe_rules), (SigmoidMoE, _sigmoid_moe_rules),
                    (GatedMLP, _mlp_rules), (PlainMLP, _mlp_rules)):
        if isinstance(m, cls):
            return fn(m, N, r)
    raise ValueError(f"tensor parallelism has no sharding rule for a {type(m).__name__} sub-block")


def shard_rules(model, N: int, rank: int) -> dict:
    """``{parameter name: Shard | ROOT_ONLY}`` of rank ``rank`` for the *global* ``model``
    (built on the meta device; its MTP head's layers too); parameters not listed are replicated."""
    names = {id(mod): name for name, mod in model.named_modules()}
    params = dict(model.named_parameters())
    rules: dict = {}
    head = getattr(model, "mtp", None)
    for blk in list(model.blocks) + (list(head.blocks) if head is not None else []):
        for _, mixer_name in blk.subs:
            mixer = getattr(blk, mixer_name)
            prefix = names[id(mixer)] + "."
            for k, rule in _layer_rules(mixer, N, rank).items():
                if prefix + k in params:
                    rules[prefix + k] = rule
    rules.update({k: v for k, v in _held_rules(model, N, rank).items() if k in params})
    V = model.config.vocab_size
    lo, real, Vs = vocab_shard(V, N, rank)
    vocab = Shard(0, _pieces((lo, lo + real)), pad_to=Vs)
    root, embed, _ = model._names
    rules[f"{root}.{embed}.weight"] = vocab
    if "lm_head.weight" in params:
        rules["lm_head.weight"] = vocab
    return rules
