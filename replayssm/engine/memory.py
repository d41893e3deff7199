"""Per-sequence memory estimate from a model config (what the scheduler budgets).

A sequence costs a fixed part (recurrent states, conv windows, replay ring, speculative
scratch) plus a part that grows with its tokens (KV-only buffers, attention KV of hybrid
layers).  Sizes are read from the Hugging Face config fields of ``mamba2``, ``nemotron_h``
and ``qwen3_next`` (with fallbacks), so the estimate works before any cache is allocated.

Per SSM layer (per sequence), ``sb`` state bytes (fp32: 4), ``ab`` activation bytes:

* state ``sb * H * d * n`` (GDN: ``HV * V * K``); conv window ``ab * C * (W - 1 + T)``;
* replay ring: ``L`` entries of ``ab * (H*d + G*n + H)`` (GDN ``HV*V + H*K + HV``);
* recurrent + speculation (snapshot baseline): ``T`` snapshots (one per verified token);
* KV-only: one entry per token (plus the state and ring the cache allocates per slot);
* attention layers: ``2 * ab * kv_heads * head_dim`` per token in every mode;
* verify scratch: ``T * vocab * 4`` bytes of logits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerSizes:
    state: int = 0        # elements of one state
    entry: int = 0        # elements of one ring / KV entry
    conv: int = 0         # conv channels
    conv_width: int = 4
    d: int = 64           # value dim of a head
    n: int = 128          # key dim of a head


@dataclass
class ModelSizes:
    ssm: list
    attn_kv_per_token: int   # elements per token over all attention layers
    vocab_size: int


def _g(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _kinds(cfg) -> list[str]:
    """Layer kinds (``mamba | gdn | attention | mlp | moe``) from any supported config."""
    kinds = getattr(cfg, "layer_kinds", None)
    if kinds is not None:
        return list(kinds)
    mt = getattr(cfg, "model_type", "mamba2")
    L = int(_g(cfg, "num_hidden_layers", "n_layer", default=1))
    if mt == "qwen3_next":
        types = _g(cfg, "layer_types")
        if types is None:
            every = int(_g(cfg, "full_attention_interval", default=4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(L)]
        return ["attention" if t == "full_attention" else "gdn" for t in types]
    if mt == "nemotron_h":
        pat = _g(cfg, "hybrid_override_pattern", default="M" * L)
        return [{"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}.get(c, "mlp") for c in pat]
    return ["mamba"] * L


def model_sizes(cfg) -> ModelSizes:
    V = int(_g(cfg, "vocab_size", default=32000))
    kinds = _kinds(cfg)
    layers = []
    if "mamba" in kinds:
        H = int(_g(cfg, "mamba_num_heads", "num_heads", default=8))
        d = int(_g(cfg, "mamba_head_dim", "head_dim", default=64))
        n = int(_g(cfg, "ssm_state_size", "state_size", "d_state", default=128))
        G = int(_g(cfg, "n_groups", "ngroups", default=1))
        W = int(_g(cfg, "conv_kernel", "d_conv", default=4))
        m = LayerSizes(H * d * n, H * d + G * n + H, H * d + 2 * G * n, W, d, n)
        layers += [m] * kinds.count("mamba")
    if "gdn" in kinds:
        HV = int(_g(cfg, "linear_num_value_heads", default=32))
        H = int(_g(cfg, "linear_num_key_heads", default=16))
        K = int(_g(cfg, "linear_key_head_dim", default=128))
        Vd = int(_g(cfg, "linear_value_head_dim", default=128))
        W = int(_g(cfg, "linear_conv_kernel_dim", default=4))
        lin = LayerSizes(HV * Vd * K, HV * Vd + H * K + HV, 2 * H * K + HV * Vd, W, Vd, K)
        layers += [lin] * kinds.count("gdn")
    n_attn = kinds.count("attention")
    kv = 0
    if n_attn:
        kvh = int(_g(cfg, "num_key_value_heads", default=8))
        hd = int(_g(cfg, "head_dim", "attention_head_dim", default=128))
        kv = 2 * kvh * hd * n_attn
    return ModelSizes(layers, kv, V)


@dataclass
class MemoryModel:
    """Bytes one sequence needs: ``fixed + per_token * tokens``."""

    fixed: int
    per_token: int
    verify_tokens: int
    kv_entry_bytes: int = 0   # per token over SSM layers in KV-only form

    def need(self, tokens: int) -> int:
        return self.fixed + self.per_token * tokens

    def __add__(self, other: "MemoryModel") -> "MemoryModel":
        return MemoryModel(self.fixed + other.fixed, self.per_token + other.per_token,
                           self.verify_tokens, self.kv_entry_bytes + other.kv_entry_bytes)


def memory_model(cfg, mode: str, buffer_size: int, verify_tokens: int, act_bytes: int,
                 state_bytes: int = 4, auto_threshold: int = 0, kv_allocates_state: bool = True) -> MemoryModel:
    """Estimate for one sequence in decode ``mode`` (``recurrent|replay|kv|auto``).

    ``kv_allocates_state``: ``replayssm.models.ModelCache`` allocates a state and a ring per
    slot in every form (KV-only slots may switch to a state), so KV-only saves traffic but
    not resident memory; pass False for the paper's state-free accounting."""
    sz = model_sizes(cfg)
    T = verify_tokens
    fixed, per_tok, kv_entry = 0, sz.attn_kv_per_token * act_bytes, 0
    for lay in sz.ssm:
        conv = act_bytes * lay.conv * (lay.conv_width - 1 + T)
        state = state_bytes * lay.state
        entry = act_bytes * lay.entry
        kv_entry += entry
        if mode == "recurrent":  # with speculation: one snapshot per verified token until commit
            fixed += state * (1 + (T if T > 1 else 0)) + conv
        elif mode == "replay":
            fixed += state + buffer_size * entry + conv
        elif mode == "kv":
            # the KV-only form needs no state, but the cache still allocates one (and a ring)
            # per slot so that a request can switch forms: count what is resident
            fixed += (state + buffer_size * entry if kv_allocates_state else 0) + conv
            per_tok += entry
        elif mode == "auto":  # KV-only up to the threshold, then state + ring
            fixed += state + buffer_size * entry + (auto_threshold + T) * entry + conv
        else:
            raise ValueError(f"unknown decode mode {mode!r}")
    fixed += T * sz.vocab_size * 4  # verify / decode logits
    return MemoryModel(int(fixed), int(per_tok), T, kv_entry)


def head_shape(cfg) -> tuple[int, int]:
    """(d, n) of the first SSM layer's heads."""
    sz = model_sizes(cfg)
    if sz.ssm:
        return sz.ssm[0].d, sz.ssm[0].n
    return 64, 128


def default_auto_threshold(cfg, buffer_size: int, act_bytes: int = 2) -> int:
    """Context length past which KV-only decoding reads more bytes than amortised replay
    (the traffic model of DESIGN §3: about ``n`` or ``d`` tokens; 98 for d=64, n=128)."""
    from ..bench.traffic import HeadShape, kv_switch_threshold

    d, n = head_shape(cfg)
    try:
        return int(kv_switch_threshold(HeadShape(d=d, n=n, vec_bytes=max(1, act_bytes)), max(1, buffer_size)))
    except Exception:  # pragma: no cover - odd shapes
        return int(min(d, n))


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b}"
