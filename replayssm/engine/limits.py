"""Limits checked before anything is allocated: the context a request may use, and whether
the caches an ``LLM`` is about to allocate fit the device's memory.

* :func:`context_limit`: the longest context the command line sizes a cache for, from the
  model config's ``max_position_embeddings`` when it states one, else
  :data:`DEFAULT_CONTEXT` (SSM configs usually state none).
* :func:`cache_bytes` / :func:`check_cache_fits`: what ``model.make_cache`` (and the draft
  model's cache) will allocate, from the caches' measured layouts, against the memory the
  device has free; too much raises ``ValueError`` naming ``max_seq_len`` /
  ``max_num_seqs`` and the figures, before the allocation is tried.
"""

from __future__ import annotations

import os

from .memory import fmt_bytes

#: context (tokens) the command line sizes its cache for when the config states none
DEFAULT_CONTEXT = 8192


def context_limit(cfg) -> tuple[int, str]:
    """``(tokens, where it comes from)``: the config's ``max_position_embeddings`` when
    present, else :data:`DEFAULT_CONTEXT`."""
    v = getattr(cfg, "max_position_embeddings", None)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v, "the model's max_position_embeddings"
    return DEFAULT_CONTEXT, "the default context limit (replayssm.engine.limits.DEFAULT_CONTEXT)"


def available_memory(device) -> int | None:
    """Bytes free for new allocations on ``device`` (a ``torch.device``; None when unknown)."""
    if device.type == "cuda":
        import torch

        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # pragma: no cover - driver without the query
            return None
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return None
    return None


def cache_bytes(layout, draft_layout, num_slots: int, max_seq_len: int, kv_blocks: int | None = None,
                attn_blocks: int | None = None) -> int:
    """What ``model.make_cache`` (and the draft model's cache) allocate for ``num_slots``
    sequences plus the null slot: the layouts' measured slot bytes, plus the paged pools
    (KV-only entries: ``kv_blocks``; attention KV: ``attn_blocks``; ``None`` is a static pool
    of ``max_seq_len`` per slot) and their null blocks."""
    static = num_slots * -(-max_seq_len // layout.block_size)
    total = (num_slots + 1) * layout.slot_bytes
    if layout.block_bytes:
        total += ((kv_blocks if kv_blocks is not None else static) + 1) * layout.block_bytes
    if layout.attn_block_bytes:
        total += ((attn_blocks if attn_blocks is not None else static) + 1) * layout.attn_block_bytes
    if draft_layout is not None:
        d_static = num_slots * -(-max_seq_len // draft_layout.block_size)
        total += (num_slots + 1) * draft_layout.slot_bytes + (d_static + 1) * draft_layout.attn_block_bytes
    return total


def check_cache_fits(need: int, device, num_slots: int, max_seq_len: int) -> None:
    """Raise ``ValueError`` when ``need`` bytes of cache exceed the memory ``device`` has free."""
    free = available_memory(device)
    if free is not None and need > free:
        raise ValueError(
            f"max_seq_len = {max_seq_len} with max_num_seqs = {num_slots} needs about {fmt_bytes(need)} of "
            f"cache, more than the {fmt_bytes(free)} free on {device}; lower max_seq_len or max_num_seqs "
            f"(or pass memory_budget)")
