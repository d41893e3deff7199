"""Grouped-query softmax attention over a paged KV cache: the reference ops (float64-capable).

Layout (one attention layer):

* ``k_cache, v_cache [num_blocks, block_size, Hkv, Dh]`` in the activation dtype.  Block 0 is
  the *null block*: padding rows may write there, nothing reads it as context.
* A sequence's key ``j`` lives in block ``block_table[b, j // block_size]`` at offset
  ``j % block_size``; its *flat slot* is ``block * block_size + offset``.
* A call holds ``N`` sequences.  Sequence ``b`` owns the queries
  ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` (``T_b`` of them, possibly 0), which are its last
  ``T_b`` positions among ``kv_lens[b]`` keys: query ``i`` sits at position
  ``p_i = kv_lens[b] - T_b + i``, and its own key is already written.

Per query head ``h`` (KV head ``g = h // (H // Hkv)``):

    o_i = Σ_{j allowed} softmax_j(scale · q_i·k_j) v_j

with *allowed* = causal (``j <= p_i``), or, given ``tree_bits [N, T]`` (every ``T_b == T``),
the committed keys ``j < kv_lens[b] - T`` plus the new keys whose node is an ancestor-or-self
of node ``i`` (bit ``j - (kv_lens[b] - T)`` of ``tree_bits[b, i]``).  Scores and softmax in
fp32 (fp64 for fp64 inputs); the output has ``q``'s dtype.

The reference gathers, per sequence, only the blocks it holds (``ceil(kv_lens[b] /
block_size)`` of them), so its cost follows the real context and not the block table's
width.  It reads ``cu_seqlens_q`` and ``kv_lens`` on the host (it is the CPU / float64
path; the CUDA kernels read them on the device).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...runtime import compute_dtype
from .checks import allowed_keys, check_paged, check_write

__all__ = ["write_kv", "paged_attention", "mla_attention", "token_positions", "new_slots", "check_paged", "check_write",
           "check_mla"]

def token_positions(cu_seqlens_q: Tensor, kv_lens: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """``(seq [Nt], pos [Nt])``: the sequence of each query token and its key position
    ``kv_lens[b] - T_b + i`` (device ops, no host sync)."""
    dev = cu_seqlens_q.device
    t = torch.arange(num_tokens, device=dev)
    seq = torch.searchsorted(cu_seqlens_q[1:].long().contiguous(), t, right=True)
    seq = seq.clamp(max=max(kv_lens.shape[0] - 1, 0))
    cu = cu_seqlens_q.long()
    pos = kv_lens.long()[seq] - (cu[seq + 1] - cu[seq]) + (t - cu[seq])
    return seq, pos


def new_slots(block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor, block_size: int,
              num_tokens: int, valid: Tensor | None = None) -> Tensor:
    """``slot_mapping [Nt]`` (int64) for writing each query token's own key and value: flat slot
    ``block_table[b, p // bs] * bs + p % bs`` of its position ``p``; ``-1`` where ``valid``
    (``[Nt]`` bool) is False.  Device ops, no host sync."""
    seq, pos = token_positions(cu_seqlens_q, kv_lens, num_tokens)
    pos = pos.clamp(min=0)
    col = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    slot = block_table.long()[seq, col] * block_size + pos % block_size
    if valid is not None:
        slot = torch.where(valid, slot, torch.full_like(slot, -1))
    return slot


# ---------------------------------------------------------------------------- ops
def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
             check: bool | None = None) -> None:
    """``cache.flat[slot_mapping[t]] = (k[t], v[t])`` for every token with a slot ``>= 0``
    (negative slots are padding and are skipped).  ``k, v [Nt, Hkv, Dh]``, cast to the
    cache dtype."""
    check_write(k_cache, v_cache, k, v, slot_mapping, check)
    keep = torch.nonzero(slot_mapping >= 0).flatten()
    if keep.numel() == 0:
        return
    s = slot_mapping.long()[keep]
    NB, BS, Hkv, Dh = k_cache.shape
    k_cache.view(NB * BS, Hkv, Dh)[s] = k[keep].to(k_cache.dtype)
    v_cache.view(NB * BS, Hkv, Dh)[s] = v[keep].to(v_cache.dtype)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                    kv_lens: Tensor, *, scale: float, tree_bits: Tensor | None = None, out: Tensor | None = None,
                    check: bool | None = None) -> Tensor:
    """``o [Nt, H, Dh]``: each query's softmax attention over its sequence's allowed keys.

    ``q [Nt, H, Dh]``, caches ``[num_blocks, block_size, Hkv, Dh]``, ``block_table [N, MB]``,
    ``cu_seqlens_q [N+1]``, ``kv_lens [N]``, ``tree_bits [N, T]`` int32 or None (causal);
    ``out`` receives the result when given.  See the module docstring for the mask.
    """
    N, _, Dh = check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, tree_bits, out, check)
    Nt, H, _ = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    R = H // Hkv
    cdt = compute_dtype(q.dtype, k_cache.dtype)
    o = out if out is not None else torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
    flat_k, flat_v = k_cache.view(NB * BS, Hkv, Dh), v_cache.view(NB * BS, Hkv, Dh)
    for b in range(N):
        t0, t1, L = cu[b], cu[b + 1], lens[b]
        T = t1 - t0
        if T == 0:
            continue
        nb = -(-L // BS)
        blocks = block_table[b, :nb].long()
        rows = (blocks[:, None] * BS + torch.arange(BS, device=q.device)[None, :]).flatten()[:L]
        K, V = flat_k[rows].to(cdt), flat_v[rows].to(cdt)                        # [L, Hkv, Dh]
        allowed = allowed_keys(T, L, None if tree_bits is None else tree_bits[b], q.device)
        qb = q[t0:t1].to(cdt).view(T, Hkv, R, Dh)
        s = torch.einsum("tgrd,lgd->grtl", qb, K) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, -1)
        # keys no query of this call reads contribute nothing (never 0 * garbage)
        V = torch.where(allowed.any(0)[:, None, None], V, torch.zeros((), dtype=cdt, device=q.device))
        ob = torch.einsum("grtl,lgd->tgrd", p, V)
        o[t0:t1] = ob.reshape(T, H, Dh).to(o.dtype)
    return o


from .mla import check_mla, mla_attention  # noqa: E402  (the MLA op, beside: the dispatch's reference table)
