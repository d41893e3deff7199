"""What one sequence costs in memory, from the caches' own layouts (what the scheduler budgets).

Sizes come from :meth:`replayssm.models.cache.ModelCache.layout` (the cache's allocation run
on the ``meta`` device), for the target and the draft model, so admission counts exactly
the bytes the caches allocate.  A sequence costs a fixed part, allocated up front for every
slot, plus a part that grows with its tokens, drawn in blocks from the paged pools:

* fixed: the target's (and draft's) slot bytes — checkpoint states, rings, conv windows,
  bookkeeping — plus per-step scratch: ``T * vocab * 4`` bytes of logits and, for
  speculation in the recurrent form (the snapshot baseline), ``T`` state copies; in
  ``"auto"`` the KV-only entries up to the switch threshold (a per-slot pool);
* per token, in whole blocks of ``block_size`` tokens: the attention keys and values of
  hybrid models (every mode) and one KV-only entry over all SSM layers
  (``decode_mode="kv"``).

With a memory budget the engine allocates ``num_slots`` fixed parts and gives the rest of
the budget to the block pools; a request is admitted when its blocks fit what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..forms.kv import kv_only_threshold


@dataclass
class MemoryModel:
    """Bytes one sequence needs: ``fixed`` plus ``per_token`` bytes for each of its tokens,
    counted in whole blocks of ``block_size`` tokens (:meth:`dynamic`)."""

    fixed: int
    per_token: int
    verify_tokens: int
    block_size: int = 16
    kv_entry_bytes: int = 0   # per token over SSM layers in KV-only form
    kv_block_bytes: int = 0   # per block of the KV-only pool
    attn_block_bytes: int = 0  # per block of the attention KV pool

    def dynamic(self, tokens: int) -> int:
        """Block bytes ``tokens`` tokens draw from the paged pools."""
        return -(-tokens // self.block_size) * self.block_size * self.per_token

    def need(self, tokens: int) -> int:
        return self.fixed + self.dynamic(tokens)


def memory_model(layout, mode: str, verify_tokens: int, vocab_size: int, auto_threshold: int = 0,
                 draft_layout=None, max_seq_len: int = 0) -> MemoryModel:
    """Per-sequence bytes in decode ``mode`` (``recurrent|replay|kv|auto``) from the target's
    cache ``layout`` (and the draft model's, when speculating with one: its attention KV, if
    any, is a static ``max_seq_len`` per slot)."""
    T = verify_tokens
    fixed = layout.slot_bytes + T * vocab_size * 4      # + the logits of one step
    if draft_layout is not None:
        fixed += draft_layout.slot_bytes + -(-max_seq_len // draft_layout.block_size) * draft_layout.attn_block_bytes
    per_token = layout.attn_token_bytes
    if mode == "recurrent":
        if T > 1:  # snapshot speculation: one state per verified token until commit
            fixed += T * layout.state_bytes
    elif mode == "kv":
        per_token += layout.kv_token_bytes
    elif mode == "auto":  # KV-only up to the threshold, then state + ring (both in slot_bytes)
        fixed += auto_kv_blocks(auto_threshold, T, layout.block_size) * layout.block_bytes
    elif mode != "replay":
        raise ValueError(f"unknown decode mode {mode!r}")
    return MemoryModel(int(fixed), int(per_token), T, layout.block_size, layout.kv_token_bytes,
                       layout.block_bytes, layout.attn_block_bytes)


def auto_kv_blocks(threshold: int, verify_tokens: int, block_size: int) -> int:
    """KV-only blocks one slot holds in ``decode_mode="auto"``: its context up to the switch
    threshold plus two verify windows, and one block of slack for block rounding."""
    return -(-(threshold + 2 * verify_tokens + block_size) // block_size) + 1


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
