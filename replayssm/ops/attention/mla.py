"""Absorbed multi-head latent attention (MLA) over a paged latent cache: the reference op
(float64-capable).

One latent pool ``cache [num_blocks, block_size, 1, D]`` holds per token ``[c | k_rot]``
(``D = rank + dr``: the normalised latent ``c`` of ``rank`` channels and the shared key part);
it is both the key and the value (the value is its first ``rank`` channels).  With the
absorbed queries ``q_h = [W_uk_hᵀ q_nope_h | q_rot_h]`` (``[Nt, H, D]``)::

    o_h = Σ_{j allowed} softmax_j(scale · q_h·lat_j) lat_j[:rank]          ([Nt, H, rank])

(the caller applies ``W_uv_h`` to ``o_h``).  Layout, query positions and the mask (causal,
or ``tree_bits``) are those of :func:`replayssm.ops.attention.naive.paged_attention`; scores
and softmax in fp32 (fp64 for fp64 inputs); the output has ``q``'s dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...runtime import compute_dtype
from ..common import shape_str
from .checks import allowed_keys, check_paged

__all__ = ["mla_attention", "check_mla"]


def check_mla(q, cache, block_table, cu_seqlens_q, kv_lens, rank, tree_bits=None, out=None,
              check: bool | None = None) -> tuple[int, int]:
    """Validate :func:`mla_attention`'s arguments (those of ``paged_attention`` with one
    pool for keys and values, plus: one KV head, ``1 <= rank <= D``, ``out [Nt, H, rank]``);
    returns ``(N, T or 0)``."""
    if not isinstance(cache, Tensor) or cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"cache must be a latent pool [num_blocks, block_size, 1, D], got {shape_str(cache)}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= cache.shape[3]:
        raise ValueError(f"rank must be an int in [1, D={cache.shape[3]}], got {rank!r}")
    N, T, _ = check_paged(q, cache, cache, block_table, cu_seqlens_q, kv_lens, tree_bits, None, check)
    want = (q.shape[0], q.shape[1], rank)
    if out is not None and (not isinstance(out, Tensor) or tuple(out.shape) != want or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {list(want)} on {q.device}, got {shape_str(out)}")
    return N, T


def mla_attention(q: Tensor, cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor, *,
                  rank: int, scale: float, tree_bits: Tensor | None = None, out: Tensor | None = None,
                  check: bool | None = None) -> Tensor:
    """``o [Nt, H, rank]``: each query's softmax over its sequence's allowed latents, summing
    their first ``rank`` channels (see the module docstring).  ``q [Nt, H, D]``, ``cache
    [num_blocks, block_size, 1, D]``, the rest as for ``paged_attention``."""
    N, _ = check_mla(q, cache, block_table, cu_seqlens_q, kv_lens, rank, tree_bits, out, check)
    Nt, H, D = q.shape
    NB, BS = cache.shape[:2]
    cdt = compute_dtype(q.dtype, cache.dtype)
    o = out if out is not None else q.new_empty(Nt, H, rank)
    flat = cache.view(NB * BS, D)
    cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
    for b in range(N):
        t0, t1, L = cu[b], cu[b + 1], lens[b]
        T = t1 - t0
        if T == 0:
            continue
        blocks = block_table[b, :-(-L // BS)].long()
        rows = (blocks[:, None] * BS + torch.arange(BS, device=q.device)[None, :]).flatten()[:L]
        lat = flat[rows].to(cdt)                                                   # [L, D]
        allowed = allowed_keys(T, L, None if tree_bits is None else tree_bits[b], q.device)
        s = torch.einsum("thd,ld->thl", q[t0:t1].to(cdt), lat) * scale
        p = torch.softmax(s.masked_fill(~allowed[:, None, :], float("-inf")), -1)
        # latents no query of this call reads contribute nothing (never 0 * garbage)
        val = torch.where(allowed.any(0)[:, None], lat[:, :rank], torch.zeros((), dtype=cdt, device=q.device))
        o[t0:t1] = torch.einsum("thl,lr->thr", p, val).to(o.dtype)
    return o
