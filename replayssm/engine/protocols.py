"""What the engine needs from a model and its cache (structural types: any object with these
methods works, e.g. :class:`replayssm.models.CausalLM` or a test double).

The full contract — shapes, slot 0 as the null slot, pending verifies, no host sync inside
``decode``/``verify``/``verify_tree``/``commit`` on CUDA — is in ``docs/ARCHITECTURE.md``
("Model-level API").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class ModelCacheLike(Protocol):
    """Per-slot memory of one model (``model.make_cache``)."""

    device: torch.device
    mode: str                 # "recurrent" | "replay" | "kv"
    uses_pages: bool          # slots may hold KV-only paged entries (``reserve`` matters)
    pending: Any              # the verify awaiting its commit, or None

    def mode_of(self, slot: int) -> str: ...

    def reserve(self, slot: int, total_len: int, defer: bool = False) -> None: ...

    def write_pending(self) -> None: ...   # the block-table writes of ``reserve(..., defer=True)``

    def switch_to_state(self, slots) -> None: ...

    def release(self, slots) -> None: ...

    def clear_pending(self) -> None: ...


@runtime_checkable
class CachedModel(Protocol):
    """A causal LM with cached, slot-addressed decoding."""

    config: Any               # vocab_size, eos_token_id, ...
    dtype: torch.dtype
    device: torch.device

    def make_cache(self, num_slots: int, mode: str = "replay", buffer_size: int = 16, max_new: int = 1,
                   max_seq_len: int = 2048, kv_block_size: int = 16, kv_num_blocks: int | None = None,
                   device=None, attn_num_blocks: int | None = None) -> ModelCacheLike: ...

    def cache_layout(self, mode: str = "replay", buffer_size: int = 16, max_new: int = 1,
                     max_seq_len: int = 2048, kv_block_size: int = 16) -> Any:
        """Bytes ``make_cache`` allocates per slot and per KV-only block
        (:class:`replayssm.models.cache.CacheLayout`)."""

    def prefill(self, cache, slots: Tensor, input_ids: Tensor, lengths: Tensor) -> Tensor: ...

    def decode(self, cache, slots: Tensor, input_ids: Tensor) -> Tensor: ...

    def verify(self, cache, slots: Tensor, input_ids: Tensor) -> Tensor: ...

    def verify_tree(self, cache, slots: Tensor, input_ids: Tensor, parent: Tensor) -> Tensor: ...

    def commit(self, cache, accepted: Tensor, path: Tensor | None = None) -> None: ...
