"""Random paged-attention cases and a dense, loop-per-query softmax reference (test helper,
shared by tests/ops/test_attention_naive.py and tests/kernels/test_attention_kernel.py)."""

from __future__ import annotations

import math

import torch


def make_case(g, kv_lens, q_lens, H, Hkv, Dh, BS, dtype=torch.float64, device="cpu", spare_blocks=3,
              extra_cols=1, tree_bits=None):
    """Caches ``[NB, BS, Hkv, Dh]`` with every sequence's blocks at shuffled, non-contiguous ids
    (block 0 is the null block), NaN in every block nobody holds and in the tail of each
    sequence's last block, block-table entries past the held blocks pointing at poisoned blocks,
    and queries for the last ``q_lens[b]`` positions."""
    N = len(kv_lens)
    need = [-(-L // BS) for L in kv_lens]
    NB = 1 + sum(need) + spare_blocks
    ids = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    used, spare = ids[:sum(need)], ids[sum(need):]
    MB = max(need + [1]) + extra_cols
    bt = torch.full((N, MB), spare[0] if spare else 0, dtype=torch.int32)
    kc = torch.full((NB, BS, Hkv, Dh), float("nan"), dtype=torch.float64)
    vc = kc.clone()
    k = 0
    for b, L in enumerate(kv_lens):
        for i in range(need[b]):
            blk = used[k]
            k += 1
            bt[b, i] = blk
            fill = min(BS, L - i * BS)
            kc[blk, :fill] = torch.randn(fill, Hkv, Dh, generator=g, dtype=torch.float64)
            vc[blk, :fill] = torch.randn(fill, Hkv, Dh, generator=g, dtype=torch.float64)
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), H, Dh, generator=g, dtype=torch.float64)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    to = dict(device=device)
    return dict(q=q.to(dtype).to(**to), k_cache=kc.to(dtype).to(**to), v_cache=vc.to(dtype).to(**to),
                block_table=bt.to(**to), cu_seqlens_q=cu.to(**to), kv_lens=lens.to(**to),
                tree_bits=None if tree_bits is None else tree_bits.to(**to))


def random_tree_bits(g, N, T):
    """``[N, T]`` int32 ancestor-or-self bitmasks of random topological trees (node 0 a root;
    later nodes' parents are earlier nodes or -1)."""
    out = torch.zeros(N, T, dtype=torch.int32)
    for b in range(N):
        masks = []
        for i in range(T):
            par = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            m = (1 << i) | (masks[par] if par >= 0 else 0)
            masks.append(m)
        out[b] = torch.tensor(masks, dtype=torch.int32)
    return out


def dense_reference(case, scale):
    """``o [Nt, H, Dh]`` fp64: per query and head, the keys it may read collected one by one
    from the block table, then ``Σ_j e^{s_j - max} v_j / Σ_j e^{s_j - max}``."""
    q, kc, vc = case["q"].double().cpu(), case["k_cache"].double().cpu(), case["v_cache"].double().cpu()
    bt, cu, lens = case["block_table"].cpu(), case["cu_seqlens_q"].cpu(), case["kv_lens"].cpu()
    bits = case["tree_bits"]
    Nt, H, Dh = q.shape
    BS, Hkv = kc.shape[1], kc.shape[2]
    R = H // Hkv
    o = torch.zeros(Nt, H, Dh, dtype=torch.float64)
    for b in range(bt.shape[0]):
        t0, t1, L = int(cu[b]), int(cu[b + 1]), int(lens[b])
        T = t1 - t0
        for i in range(T):
            p = L - T + i
            if bits is None:
                keys = list(range(p + 1))
            else:
                mask = int(bits[b, i])
                keys = [j for j in range(L) if j < L - T or (mask >> (j - (L - T))) & 1]
            for h in range(H):
                gk = h // R
                ks = [kc[int(bt[b, j // BS]), j % BS, gk] for j in keys]
                vs = [vc[int(bt[b, j // BS]), j % BS, gk] for j in keys]
                s = [float(q[t0 + i, h] @ kk) * scale for kk in ks]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                z = sum(w)
                o[t0 + i, h] = sum(wi * vi for wi, vi in zip(w, vs)) / z
    return o
