"""Small helpers the benchmarks share: waiting for the device, releasing its memory."""

from __future__ import annotations

import gc

import torch


def sync(device) -> None:
    """Wait for ``device``'s queued work (no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device) -> None:
    """Collect garbage and return the caching allocator's free blocks (after an engine is dropped)."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
