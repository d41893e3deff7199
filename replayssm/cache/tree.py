"""Draft trees (STree): parent arrays, ancestor masks, and committing an accepted path.

A tree of ``N`` draft nodes is packed in topological order: ``parent[i] < i`` for every
node, and ``parent[i] == -1`` marks a node whose parent is the last committed entry
(node 0 is always such a root).  Trees may differ per row: ``parent`` is ``[B, N]``
(a ``[N]`` tree is shared by every row).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ring import StepPlan


def check_parents(parent: Tensor, batch: int | None = None) -> Tensor:
    """Validate a parent array and return it as ``[B, N]`` int64 (host check)."""
    if not isinstance(parent, Tensor) or parent.dim() not in (1, 2):
        raise ValueError("parent must be an integer tensor [N] or [B, N]")
    if parent.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parent must be int32/int64, got {parent.dtype}")
    p = parent.long()
    if p.dim() == 1:
        p = p[None].expand(batch if batch is not None else 1, -1)
    elif batch is not None and p.shape[0] != batch:
        raise ValueError(f"parent has {p.shape[0]} rows, batch has {batch}")
    n = p.shape[1]
    if n < 1:
        raise ValueError("a tree needs at least one node")
    idx = torch.arange(n, device=p.device)
    bad = (p >= idx) | (p < -1)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"tree is not in topological order: row {b} node {i} has parent {int(p[b, i])} "
            f"(need -1 <= parent[i] < i)"
        )
    return p.contiguous()


def ancestor_mask(parent: Tensor) -> Tensor:
    """``M [B, N, N]`` bool with ``M[b, i, j]`` = node j is node i or one of its ancestors."""
    p = parent if parent.dim() == 2 else parent[None]
    B, N = p.shape
    eye = torch.eye(N, dtype=torch.bool, device=p.device)
    rows = []
    for i in range(N):
        par = p[:, i]
        inherited = torch.stack(rows, 1)[torch.arange(B, device=p.device), par.clamp(min=0)] if i else None
        row = eye[i].expand(B, N).clone()
        if inherited is not None:
            row |= inherited & (par >= 0)[:, None]
        rows.append(row)
    return torch.stack(rows, 1)


def ancestor_bits(mask: Tensor) -> Tensor:
    """``bits [B, N]`` int32 from an ancestor-or-self mask ``[B, N, N]``: bit ``j`` of node
    ``i`` is ``mask[b, i, j]`` (the tree kernels' form; ``N <= 31``)."""
    N = mask.shape[-1]
    if N > 31:
        raise ValueError(f"tree kernels support at most 31 nodes, got {N}")
    w = 1 << torch.arange(N, device=mask.device, dtype=torch.int64)
    return (mask.long() * w).sum(-1).to(torch.int32).contiguous()


def path_to(parent: Tensor, leaf: Tensor) -> tuple[Tensor, Tensor]:
    """Root-to-``leaf`` node indices per row.

    Returns ``path [B, N]`` (padded with the last node) and ``length [B]``.
    """
    M = ancestor_mask(parent)
    if M.shape[0] == 1 and leaf.shape[0] != 1:  # one [N] tree shared by every row
        M = M.expand(leaf.shape[0], -1, -1)
    B, N, _ = M.shape
    on_path = M[torch.arange(B, device=M.device), leaf.long()]  # [B, N]: ancestors of leaf
    length = on_path.sum(-1)
    idx = torch.arange(N, device=M.device).expand(B, N)
    key = torch.where(on_path, idx, idx + N)  # path nodes first, in increasing (topological) order
    order = key.argsort(-1)
    last = order.gather(1, (length - 1).clamp(min=0)[:, None])
    path = torch.where(idx < length[:, None], order, last)
    return path, length


def check_path(parent: Tensor, path: Tensor, accepted: Tensor) -> None:
    """Raise ValueError unless ``path[:, :accepted]`` is a root-down chain of the tree."""
    p = check_parents(parent, path.shape[0])
    B, N = p.shape
    if path.shape != (B, N):
        raise ValueError(f"path must have shape {(B, N)}, got {tuple(path.shape)}")
    if accepted.shape != (B,):
        raise ValueError(f"accepted must have shape [{B}]")
    if bool(((accepted < 0) | (accepted > N)).any()):
        raise ValueError(f"accepted counts must be in [0, {N}]")
    if bool(((path < 0) | (path >= N)).any()):
        raise ValueError(f"path node ids must be in [0, {N})")
    for b in range(B):
        prev = -1
        for i in range(int(accepted[b])):
            node = int(path[b, i])
            if int(p[b, node]) != prev:
                raise ValueError(
                    f"row {b}: accepted path step {i} is node {node}, whose parent is "
                    f"{int(p[b, node])}, not {prev}"
                )
            prev = node


def gather_path(buffers: list[Tensor], plan: StepPlan, path: Tensor, accepted: Tensor) -> None:
    """Move each row's accepted tree entries to the front of its new entries.

    For ``i < accepted[b]``: entry ``h + path[b, i]`` is copied to ``h + i`` (ring
    positions counted from ``start``) in every buffer ``[P, L, ...]``.  Rows with
    fewer accepted nodes copy entries onto themselves.  No host synchronisation.
    """
    N = plan.num_new
    i = torch.arange(N, device=plan.slot.device)
    src = torch.where(i[None, :] < accepted[:, None], path.long(), i[None, :])
    base = plan.start + plan.hist
    dst_pos = (base[:, None] + i[None, :]) % plan.capacity
    src_pos = (base[:, None] + src) % plan.capacity
    rows = plan.slot[:, None]
    for buf in buffers:
        vals = buf[rows, src_pos]  # read all sources before any write
        buf[rows, dst_pos] = vals
