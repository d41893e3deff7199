"""Batch-size buckets and row padding, shared by every runner that pads batches.

A CUDA graph is captured per batch bucket, so a batch of ``B`` rows runs as its bucket
``Bp >= B`` with ``Bp - B`` padding rows (they use the null slot 0).  The target's
:class:`~replayssm.engine.model_runner.ModelRunner`, a draft model's runner and the MTP draft
step (:class:`~replayssm.engine.spec.mtp.MTPStepGraphs`) all round and pad through here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes a padded runner uses: powers of two below 16, then steps of 16 up to 128
    and of 32 past it, and ``max_batch`` itself (sorted, distinct)."""
    out, b = [], 1
    while b < min(max_batch, 16):
        out.append(b)
        b *= 2
    b = 16
    while b < max_batch:
        out.append(b)
        b += 16 if b < 128 else 32
    out.append(max_batch)
    return sorted(set(out))


def bucket_for(buckets: list[int], B: int) -> int:
    """The smallest bucket holding ``B`` rows (``B`` itself past the largest)."""
    for b in buckets:
        if b >= B:
            return b
    return B


def pad_rows(x: Tensor, n: int, value=0) -> Tensor:
    """``x [B, ...]`` extended to ``[n, ...]`` with rows filled with ``value`` (``x`` itself
    when it already has ``n`` rows)."""
    if x.shape[0] == n:
        return x
    pad = torch.full((n - x.shape[0],) + tuple(x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], 0)


def pad_chain_parent(parent: Tensor, n: int) -> Tensor:
    """``parent [B, N]`` extended to ``[n, N]``: padding rows are chains (any valid tree
    will do for the null slot)."""
    B, N = parent.shape
    if B == n:
        return parent
    chain = torch.arange(-1, N - 1, device=parent.device).expand(n - B, N)
    return torch.cat([parent, chain], 0)
