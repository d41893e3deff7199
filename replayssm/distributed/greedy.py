"""Greedy tokens of a vocabulary-parallel LM head without gathering the logits.

Rank ``r`` holds the logits of its vocabulary shard, columns ``[lo_r, lo_r + Vs)`` of the
global ``[..., V]`` (the last shard may hold padding past ``V``).  The greedy token of a row
is ``argmax_v logits[v]``, the first index on ties (``torch.argmax``).  Each rank takes its
shard's ``(m_r, i_r) = (max, lo_r + first argmax)`` over its real columns; the ranks
all-gather those pairs (``[..., 2]`` float64 per rank: 16 bytes a row instead of
``Vs`` logits) and every rank picks

    m = max_r m_r,    token = min { i_r : m_r = m }

which is ``torch.argmax`` over the full row: shards are ordered, so among equal maxima the
lowest global index wins whichever ranks hold them.  NaN counts as the largest value, as in
``torch.argmax`` (the first NaN wins).  Values are compared exactly: float32/float64 logits
and integer indices below ``2**53`` are exact in float64.

:func:`argmax_over_shards_reference` is the plain version the tests compare against
(gather every shard, cut to ``V``, ``argmax``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["argmax_over_shards", "argmax_over_shards_reference", "combine_shard_maxima", "greedy_local_enabled",
           "shard_maxima"]

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def greedy_local_enabled() -> bool:
    """``REPLAYSSM_TP_GREEDY_LOCAL`` (default ``1``): greedy steps exchange each shard's
    ``(max, index)`` instead of gathering the logits.  ``0`` restores the gather."""
    v = os.environ.get("REPLAYSSM_TP_GREEDY_LOCAL", "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"REPLAYSSM_TP_GREEDY_LOCAL must be 0 or 1, got {v!r}")
    return v not in ("0", "false", "off")


def shard_maxima(local: Tensor, vocab_start: int, vocab_size: int) -> Tensor:
    """``local [..., Vs]`` (this rank's logits, global columns ``vocab_start + j``) ->
    ``[..., 2]`` float64: each row's max over the real columns (``< vocab_size``) and the
    global index of its first occurrence.  A shard with no real column gives
    ``(-inf, vocab_size)``, which never wins."""
    real = max(0, min(local.shape[-1], vocab_size - vocab_start))
    if real == 0:
        out = torch.empty(*local.shape[:-1], 2, dtype=torch.float64, device=local.device)
        out[..., 0], out[..., 1] = float("-inf"), float(vocab_size)
        return out
    val, idx = local[..., :real].max(-1)
    return torch.stack([val.to(torch.float64), (idx + vocab_start).to(torch.float64)], -1)


def combine_shard_maxima(pairs: Tensor) -> Tensor:
    """``pairs [N, ..., 2]`` (every rank's :func:`shard_maxima`, rank order) -> tokens
    ``[...]`` int64: the lowest index among the largest maxima (NaN largest)."""
    vals, idx = pairs[..., 0], pairs[..., 1]
    nan = vals.isnan()
    hit = torch.where(nan.any(0, keepdim=True), nan, vals == vals.max(0, keepdim=True).values)
    return torch.where(hit, idx, float("inf")).min(0).values.long()


def argmax_over_shards(local: Tensor, vocab_start: int, vocab_size: int, size: int, group=None) -> Tensor:
    """Every rank's ``local [..., Vs]`` -> the greedy tokens ``[...]`` int64 of the global
    ``[..., vocab_size]`` row (identical on every rank): one all-gather of ``[..., 2]``."""
    mine = shard_maxima(local, vocab_start, vocab_size)
    flat = mine.reshape(-1, 2).contiguous()
    out = flat.new_empty(size * flat.shape[0], 2)
    _all_gather_into(out, flat, group=group)
    return combine_shard_maxima(out.view(size, *mine.shape))


def argmax_over_shards_reference(shards: list[Tensor], vocab_size: int) -> Tensor:
    """The plain version: shards ``[..., Vs]`` in rank order concatenated, cut to
    ``vocab_size``, ``argmax``."""
    return torch.cat(shards, -1)[..., :vocab_size].argmax(-1)
