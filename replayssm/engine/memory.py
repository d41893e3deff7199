"""What one sequence costs in memory, from the caches' own layouts (what the scheduler budgets).

Sizes come from :meth:`replayssm.models.cache.ModelCache.layout` (the cache's allocation run
on the ``meta`` device), for the target and the draft model, so admission counts exactly
the bytes the caches allocate.  A sequence costs a fixed part plus a part that grows with
its tokens:

* fixed: the target's (and draft's) slot bytes — checkpoint states, rings, conv windows,
  attention KV, bookkeeping — plus per-step scratch: ``T * vocab * 4`` bytes of logits and,
  for speculation in the recurrent form (the snapshot baseline), ``T`` state copies;
* per token: one KV-only entry over all SSM layers (``decode_mode="kv"``); in ``"auto"`` the
  KV-only part is bounded by the switch threshold and counted as fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..forms.kv import kv_only_threshold


@dataclass
class MemoryModel:
    """Bytes one sequence needs: ``fixed + per_token * tokens``."""

    fixed: int
    per_token: int
    verify_tokens: int
    kv_entry_bytes: int = 0   # per token over SSM layers in KV-only form
    kv_block_bytes: int = 0   # per block of the KV-only pool

    def need(self, tokens: int) -> int:
        return self.fixed + self.per_token * tokens


def memory_model(layout, mode: str, verify_tokens: int, vocab_size: int, auto_threshold: int = 0,
                 draft_layout=None) -> MemoryModel:
    """Per-sequence bytes in decode ``mode`` (``recurrent|replay|kv|auto``) from the target's
    cache ``layout`` (and the draft model's, when speculating with one)."""
    T = verify_tokens
    fixed = layout.slot_bytes + T * vocab_size * 4      # + the logits of one step
    if draft_layout is not None:
        fixed += draft_layout.slot_bytes
    per_token = 0
    if mode == "recurrent":
        if T > 1:  # snapshot speculation: one state per verified token until commit
            fixed += T * layout.state_bytes
    elif mode == "kv":
        per_token = layout.kv_token_bytes
    elif mode == "auto":  # KV-only up to the threshold, then state + ring (both in slot_bytes)
        fixed += (auto_threshold + T) * layout.kv_token_bytes
    elif mode != "replay":
        raise ValueError(f"unknown decode mode {mode!r}")
    return MemoryModel(int(fixed), int(per_token), T, layout.kv_token_bytes, layout.block_bytes)


def default_auto_threshold(layout, buffer_size: int) -> int:
    """Context length past which KV-only decoding reads more bytes than amortised replay,
    from the layout's real state and entry sizes (:func:`~replayssm.forms.kv.kv_only_threshold`)."""
    if layout.entry_bytes <= 0:       # no SSM layer: KV-only never pays
        return 1
    return kv_only_threshold(layout.state_bytes, layout.entry_bytes, max(1, buffer_size))


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b}"
