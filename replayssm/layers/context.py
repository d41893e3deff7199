"""What every layer of one model call reads: the kind of step, rows, positions, plans.

Built once per call by the model (``replayssm.models.base``) and shared by all layers, so
per-row decisions (slots, positions, flush flags, masks) are computed once, as device
tensors.  ``kind``:

* ``"full"``: plain forward, no cache (``cache is None``).
* ``"prefill"``: up to ``T`` prompt tokens per row (``valid [B, T]``, ``lengths [B]``), run
  *packed*: the hidden states are one stream ``[1, Nt, ...]`` of every row's valid tokens,
  row ``b`` owning ``cu_seqlens[b]:cu_seqlens[b+1]`` (``pack`` / ``unpack`` convert); rows may
  continue a sequence (``fresh [B]`` marks rows that start at position 0).
* ``"decode"``: one token per row, committed by the call itself.
* ``"verify"``: ``T`` tentative tokens per row in a chain; kept until ``commit``.
* ``"tree"``: ``N`` tentative nodes per row with ``parent [B, N]`` and the ancestor-or-self
  mask ``anc [B, N, N]``; kept until ``commit`` along a path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class StepContext:
    kind: str
    T: int
    positions: Tensor                 # [B, T] absolute token positions (RoPE)
    cache: Any = None                 # replayssm.models.cache.ModelCache
    slots: Tensor | None = None       # [B] slot of each row (0 = null slot)
    valid: Tensor | None = None       # [B, T] bool, prefill only
    lengths: Tensor | None = None     # [B] valid tokens per row, prefill only
    fresh: Tensor | None = None       # [B] bool: row starts a new sequence (prefill)
    seq_len: Tensor | None = None     # [B] committed tokens before this call
    parent: Tensor | None = None      # [B, N] tree parents (-1 = last committed token)
    anc: Tensor | None = None         # [B, N, N] ancestor-or-self mask
    tree_bits: Tensor | None = None   # [B, N] int32, ``anc`` as bitmasks (tree kernels; N <= 31)
    # SSM form selection: "recurrent" | "replay" | "kv" | "mixed" (kv rows + replay rows)
    ssm_form: str = "recurrent"
    kv_rows: Tensor | None = None     # [B] bool, rows in KV-only form (mixed / kv)
    state_slots: Tensor | None = None  # [B] slots for the state form (kv rows -> null slot)
    plan: Any = None                  # ring StepPlan over state_slots (replay form)
    pplan: Any = None                 # PagedPlan over KV rows (kv form)
    attn_table: Tensor | None = None  # [B, max_blocks] attention KV blocks of each row (hybrids)
    cu_seqlens: Tensor | None = None  # [B+1] packed prefill: row b's tokens in the stream
    token_index: Tensor | None = None  # [Nt] packed prefill: flat index b*T+t of each token
    token_rows: Tensor | None = None  # [Nt] packed prefill: row of each token
    pending: dict = field(default_factory=dict)  # per-layer data kept until commit

    @property
    def batch(self) -> int:
        return self.slots.shape[0] if self.slots is not None else self.positions.shape[0]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def pack(self, x: Tensor) -> Tensor:
        """``[B, T, ...]`` -> ``[1, Nt, ...]``: every row's valid tokens, in order."""
        return x.reshape(-1, *x.shape[2:])[self.token_index][None]

    def unpack(self, x: Tensor) -> Tensor:
        """``[1, Nt, ...]`` -> ``[B, T, ...]`` (padding positions zero)."""
        B = self.batch
        out = x.new_zeros((B * self.T,) + tuple(x.shape[2:]))
        out[self.token_index] = x[0]
        return out.reshape(B, self.T, *x.shape[2:])

    def rows(self, mask: Tensor, like: Tensor) -> Tensor:
        """A per-row ``mask [B]`` broadcast over ``like`` (``[B, T, ...]``, or ``[1, Nt, ...]``
        when packed: each token takes its row's value)."""
        m = mask[self.token_rows][None] if self.packed else mask[:, None]
        return m.view(*m.shape, *([1] * (like.dim() - 2)))
