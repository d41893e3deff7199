"""What a model's cache holds, in one validated dataclass: :class:`CacheSpec`.

Every place that sizes or allocates a cache — ``model.make_cache``, ``model.cache_layout``,
the tensor-parallel proxies, the drafters' own caches and the engine's memory plan
(:mod:`replayssm.engine.cache_plan`) — takes one ``CacheSpec`` instead of repeating its
fields as keyword arguments.  ``mode`` is the engine's decode mode everywhere
(``recurrent | replay | kv | auto``); what a slot starts in is :attr:`CacheSpec.initial_form`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

#: decode modes: ``auto`` starts a slot KV-only and switches it to a state past a threshold
MODES = ("recurrent", "replay", "kv", "auto")

#: storage dtypes of the SSM checkpoint states (``auto``: fp32, fp64 for an fp64 model)
STATE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_int(name: str, v, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


@dataclass(frozen=True)
class CacheSpec:
    """The shape of one model's per-sequence cache.

    ``mode``: decode mode (:data:`MODES`).  ``buffer_size``: ring capacity ``L`` of the
    replay forms (entries per SSM layer and slot).  ``max_new``: inputs one step may append
    (1 for plain decoding, the verify window with speculation; rings need ``L >= 2 max_new``).
    ``max_seq_len``: the longest context a slot holds.  ``block_size``: tokens per block of
    the paged pools (KV-only entries, attention KV, the prefix store).
    Pools (``None``: static, ``max_seq_len`` per slot): ``kv_num_blocks`` (KV-only entries),
    ``attn_num_blocks`` (attention KV of hybrids).  Prefix store (``None``: no store):
    ``prefix_blocks`` token blocks and ``prefix_checkpoints`` state checkpoints.
    ``ssm_state_dtype``: storage dtype of the SSM checkpoint states (slots' states and the
    prefix store's checkpoints; :data:`STATE_DTYPES`, a name or a ``torch.dtype``): ``auto``
    is fp32 (fp64 for an fp64 model); bf16 / fp16 halve the state bytes.  Math stays in fp32
    (states are upcast when read, rounded once per write); ring entries keep their dtypes.
    """

    mode: str = "replay"
    buffer_size: int = 16
    max_new: int = 1
    max_seq_len: int = 2048
    block_size: int = 16
    kv_num_blocks: int | None = None
    attn_num_blocks: int | None = None
    prefix_blocks: int | None = None
    prefix_checkpoints: int | None = None
    ssm_state_dtype: str = "auto"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"cache mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "ssm_state_dtype", state_dtype_name(self.ssm_state_dtype))
        for name, lo in (("buffer_size", 1), ("max_new", 1), ("max_seq_len", 1), ("block_size", 1)):
            _check_int(name, getattr(self, name), lo)
        for name, lo in (("kv_num_blocks", 1), ("attn_num_blocks", 1), ("prefix_blocks", 0),
                         ("prefix_checkpoints", 0)):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, lo)

    @classmethod
    def of(cls, spec: "CacheSpec | None" = None, **fields) -> "CacheSpec":
        """``spec`` with ``fields`` replaced (a fresh default spec when ``spec`` is None);
        an unknown field name raises ``ValueError`` naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown cache spec field(s) {unknown}; CacheSpec has {sorted(names)}")
        if spec is not None and not isinstance(spec, cls):
            raise ValueError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if spec is None:
            return cls(**fields)
        return dataclasses.replace(spec, **fields) if fields else spec

    def state_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The checkpoint states' storage dtype for a model of ``model_dtype``."""
        dt = STATE_DTYPES[self.ssm_state_dtype]
        if dt is None:
            return torch.float64 if model_dtype == torch.float64 else torch.float32
        return dt

    @property
    def initial_form(self) -> str:
        """The form a fresh slot starts in: ``auto`` starts KV-only."""
        return "kv" if self.mode == "auto" else self.mode

    @property
    def paged(self) -> bool:
        """Whether SSM entries live in the paged KV-only pool (``kv`` and ``auto``)."""
        return self.mode in ("kv", "auto")

    @property
    def max_blocks(self) -> int:
        """Blocks one slot's ``max_seq_len`` tokens span."""
        return -(-self.max_seq_len // self.block_size)

    def for_draft(self) -> "CacheSpec":
        """A draft model's (or MTP head's) cache: the snapshot baseline drafts in the
        recurrent form, everything else in replay form; static pools, no prefix store."""
        return dataclasses.replace(self.sizing(), mode="recurrent" if self.mode == "recurrent" else "replay")

    def sizing(self) -> "CacheSpec":
        """The fields that decide a slot's bytes (what :meth:`ModelCache.layout` measures):
        pools and the prefix store reset to their defaults."""
        return dataclasses.replace(self, kv_num_blocks=None, attn_num_blocks=None, prefix_blocks=None,
                                   prefix_checkpoints=None)


def state_dtype_name(v) -> str:
    """``v`` (a :data:`STATE_DTYPES` name or one of its ``torch.dtype`` values) as its name;
    anything else raises ``ValueError`` naming the choices."""
    if isinstance(v, torch.dtype):
        for name, dt in STATE_DTYPES.items():
            if dt == v:
                return name
    elif isinstance(v, str) and v in STATE_DTYPES:
        return v
    raise ValueError(f"ssm_state_dtype must be one of {list(STATE_DTYPES)}, got {v!r}")
