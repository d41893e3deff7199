"""Input checks and the key mask shared by the paged-attention reference ops
(:mod:`.naive`) and the absorbed MLA op (:mod:`.mla`): cache / index shapes, the write's slot
mapping, and which keys a query may read (causal, or a draft tree's ancestors).  Layout and
notation: :mod:`.naive`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import shape_str, want_check

__all__ = ["check_paged", "check_write", "allowed_keys"]

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
