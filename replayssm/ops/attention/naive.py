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
from ..common import shape_str, want_check

__all__ = ["write_kv", "paged_attention", "mla_attention", "token_positions", "new_slots", "check_paged", "check_write",
           "check_mla"]

_INDEX = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------- checks
def _index(name: str, t, shape: tuple, device) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be an integer tensor of shape {list(shape)}, got {shape_str(t)}")
    if t.dtype not in _INDEX:
        raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _cache(k_cache, v_cache, device) -> tuple[int, int, int, int]:
    if not isinstance(k_cache, Tensor) or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, Dh], got {shape_str(k_cache)}")
    if not isinstance(v_cache, Tensor) or v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {shape_str(v_cache)}, expected k_cache's {tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or not k_cache.is_floating_point():
        raise ValueError(f"k_cache / v_cache must share one floating dtype, got {k_cache.dtype} / {v_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, inputs on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return tuple(k_cache.shape)


def check_write(k_cache, v_cache, k, v, slot_mapping, check: bool | None = None) -> None:
    """Shapes of :func:`write_kv`'s arguments; with ``check`` (default: CPU tensors) also that
    every slot lies below ``num_blocks * block_size`` (host sync)."""
    if not isinstance(k, Tensor) or k.dim() != 3:
        raise ValueError(f"k must be [Nt, Hkv, Dh], got {shape_str(k)}")
    NB, BS, Hkv, Dh = _cache(k_cache, v_cache, k.device)
    Nt = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (Nt, Hkv, Dh):
            raise ValueError(f"{name} has shape {shape_str(t)}, expected {(Nt, Hkv, Dh)} (Hkv, Dh of the cache)")
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k_cache on {k_cache.device}")
    _index("slot_mapping", slot_mapping, (Nt,), k.device)
    if want_check(check, k, slot_mapping) and Nt and bool((slot_mapping >= NB * BS).any()):
        raise ValueError(f"slot_mapping has slots >= num_blocks * block_size = {NB * BS}: "
                         f"{slot_mapping.tolist()}")


def check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, tree_bits=None, out=None,
                check: bool | None = None) -> tuple[int, int, int]:
    """Validate :func:`paged_attention`'s arguments; returns ``(N, T or 0, Dh)``.

    Shapes, dtypes and devices always; with ``check`` (default: CPU tensors, never during
    graph capture) also the values: ``cu_seqlens_q`` starts at 0, never decreases and ends at
    ``Nt``; ``T_b <= kv_lens[b]``; the blocks a sequence holds fit its block-table row and are
    valid block ids; with ``tree_bits`` every ``T_b == T``."""
    if not isinstance(q, Tensor) or q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating tensor [Nt, H, Dh], got {shape_str(q)}")
    Nt, H, Dh = q.shape
    NB, BS, Hkv, Dhc = _cache(k_cache, v_cache, q.device)
    if Dhc != Dh:
        raise ValueError(f"q has head dim {Dh}, the cache {Dhc}")
    if H % Hkv:
        raise ValueError(f"q has {H} heads, not a multiple of the cache's {Hkv} KV heads")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2:
        raise ValueError(f"block_table must be [N, max_blocks], got {shape_str(block_table)}")
    N, MB = block_table.shape
    _index("block_table", block_table, (N, MB), q.device)
    _index("cu_seqlens_q", cu_seqlens_q, (N + 1,), q.device)
    _index("kv_lens", kv_lens, (N,), q.device)
    T = 0
    if tree_bits is not None:
        if not isinstance(tree_bits, Tensor) or tree_bits.dim() != 2 or tree_bits.shape[0] != N:
            raise ValueError(f"tree_bits must be int32 [N={N}, T], got {shape_str(tree_bits)}")
        T = tree_bits.shape[1]
        if tree_bits.dtype != torch.int32 or tree_bits.device != q.device:
            raise ValueError(f"tree_bits must be int32 on {q.device}, got {tree_bits.dtype} on {tree_bits.device}")
        if not 1 <= T <= 31:
            raise ValueError(f"tree_bits: a tree has 1..31 nodes, got T={T}")
        if Nt != N * T:
            raise ValueError(f"tree_bits: q has {Nt} tokens, expected N*T = {N * T}")
    if out is not None and (not isinstance(out, Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}, "
                         f"got {shape_str(out)}")
    if want_check(check, q, cu_seqlens_q):
        cu, lens = cu_seqlens_q.long().cpu(), kv_lens.long().cpu()
        tb = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != Nt or bool((tb < 0).any()):
            raise ValueError(f"cu_seqlens_q must rise from 0 to Nt={Nt}, got {cu.tolist()}")
        if tree_bits is not None and bool((tb != T).any()):
            raise ValueError(f"tree_bits: every sequence needs T={T} queries, cu_seqlens_q gives {tb.tolist()}")
        if bool((lens < tb).any()):
            raise ValueError(f"kv_lens {lens.tolist()} must be >= each sequence's query count {tb.tolist()}")
        nblk = (lens + BS - 1) // BS
        if bool((nblk > MB).any()):
            raise ValueError(f"kv_lens {lens.tolist()} need up to {int(nblk.max())} blocks, "
                             f"block_table holds {MB} per sequence")
        held = torch.arange(MB)[None, :] < nblk[:, None]
        bt = block_table.long().cpu()
        if bool(((bt < 0) | (bt >= NB))[held].any()):
            raise ValueError(f"block_table holds block ids outside [0, {NB}) for held blocks")
    return N, T, Dh


# ---------------------------------------------------------------------------- helpers
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


def allowed_keys(T: int, L: int, bits: Tensor | None, device) -> Tensor:
    """``[T, L]`` bool: which of a sequence's ``L`` keys each of its last ``T`` queries reads
    (causal, or committed keys plus the ancestor-or-self nodes of ``bits [T]``)."""
    j = torch.arange(L, device=device)
    i = torch.arange(T, device=device)
    if bits is None:
        return j[None, :] <= (L - T + i)[:, None]
    rel = j - (L - T)
    node = ((bits.long()[:, None] >> rel.clamp(min=0)[None, :]) & 1).bool()
    return (rel < 0)[None, :] | node


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


from .mla import check_mla, mla_attention  # noqa: E402  (the MLA op, beside; it uses the helpers above)
