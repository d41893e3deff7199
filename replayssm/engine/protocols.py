"""What the engine needs from a model (a structural type: any object with these methods
works, e.g. :class:`replayssm.models.CausalLM` or a test double); what it needs from the
model's cache is :class:`replayssm.models.protocols.ModelCacheLike`.

The full contract — shapes, slot 0 as the null slot, pending verifies, no host sync inside
``decode``/``verify``/``verify_tree``/``commit`` on CUDA — is in ``docs/ARCHITECTURE.md``
("Model-level API").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..cache.spec import CacheSpec
from ..models.protocols import ModelCacheLike


@runtime_checkable
class CachedModel(Protocol):
    """A causal LM with cached, slot-addressed decoding.  A model whose ``argmax_head`` is
    true (tensor parallelism: greedy tokens without the logits gather) also takes
    ``greedy=True`` in ``decode`` / ``verify`` / ``verify_tree``, returning the argmax tokens
    instead of the logits; the runner asks for them only from such models."""

    config: Any               # vocab_size, eos_token_id, ...
    dtype: torch.dtype
    device: torch.device

    def make_cache(self, num_slots: int, spec: CacheSpec | None = None, *, device=None, poison: bool = False,
                   **fields) -> ModelCacheLike:
        """A cache of ``CacheSpec.of(spec, **fields)`` for ``num_slots`` slots (slot 0 null)."""

    def cache_layout(self, spec: CacheSpec | None = None, **fields) -> Any:
        """Bytes ``make_cache`` allocates per slot and per block for
        ``CacheSpec.of(spec, **fields)`` (:class:`replayssm.models.cache.CacheLayout`)."""

    def prefill(self, cache, slots: Tensor, input_ids: Tensor, lengths: Tensor) -> Tensor: ...

    def decode(self, cache, slots: Tensor, input_ids: Tensor) -> Tensor: ...

    def verify(self, cache, slots: Tensor, input_ids: Tensor) -> Tensor: ...

    def verify_tree(self, cache, slots: Tensor, input_ids: Tensor, parent: Tensor) -> Tensor: ...

    def commit(self, cache, accepted: Tensor, path: Tensor | None = None) -> None: ...
