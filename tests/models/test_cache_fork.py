"""ModelCache.fork: a forked slot continues exactly like its source (every form, hybrids)."""

from __future__ import annotations

import pytest
import torch

from replayssm.cache.paged import PoolExhausted

from test_cached import Stream


def _paged_rows(index, slot, n):
    bs = index.block_size
    return torch.tensor([b * bs + o for b in index.blocks_of(slot) for o in range(bs)][:n], dtype=torch.long)


def _slot_tensors(cache, slot):
    """Every per-slot tensor row of ``slot`` (states, rings, conv windows) and its
    bookkeeping, plus its KV-only entries and attention KV gathered through its block tables."""
    out = [cache.seq_len[slot], cache.ring.start[slot], cache.ring.length[slot], cache.kv_slot[slot]]
    for store in cache.layers.values():
        for key, v in store.items():
            if v is None:
                continue
            if isinstance(v, torch.Tensor):   # attention k / v pools [blocks, block_size, ...]
                out.append(v.view(-1, *v.shape[2:])[_paged_rows(cache.attn, slot, int(cache.seq_len[slot]))])
                continue
            for t in vars(v).values():
                if not isinstance(t, torch.Tensor):
                    continue
                if key == "kv":
                    n = int(cache.pidx.length[slot])
                    bs = cache.spec.block_size
                    rows = [b * bs + o for b in cache.pidx.blocks_of(slot) for o in range(bs)][:n]
                    out.append(t[torch.tensor(rows, dtype=torch.long)])
                else:
                    out.append(t[slot])
    return out


@pytest.mark.parametrize("mode,blocks", [("recurrent", None), ("replay", None), ("kv", None), ("kv", 40)])
@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_fork_copies_every_slot_tensor_and_continues_exactly(name, mode, blocks, ours):
    model = ours(name)
    cache = model.make_cache(6, mode=mode, buffer_size=6, max_new=3, max_seq_len=64, block_size=4,
                             kv_num_blocks=blocks, poison=True)
    st = Stream(model, cache, [1, 0, 3], seed=5)
    st.prefill([5, 1, 3])
    if blocks:   # a finite block pool: room for the whole test (forks copy the allocation)
        cache.reserve(1, 32)
        cache.reserve(3, 32)
    st.decode()
    st.verify(3)      # ring part-filled, conv windows moved, rejected entries left behind
    st.decode()
    cache.fork(1, [2, 4])
    for d in (2, 4):
        for a, b in zip(_slot_tensors(cache, 1), _slot_tensors(cache, d)):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) if a.is_floating_point() else torch.equal(a, b)
    # the copies and the source go on (different tokens per slot), each exact vs full forward
    st2 = Stream(model, cache, [1, 2, 3, 4], seed=9)
    st2.seqs = {1: list(st.seqs[1]), 2: list(st.seqs[1]), 3: list(st.seqs[3]), 4: list(st.seqs[1])}
    for _ in range(3):
        st2.decode()
        st2.verify(2)
    st2.check_lengths()
    assert st2.err < 1e-9
    cache.release([2])
    assert int(cache.seq_len[2]) == 0 and int(cache.seq_len[1]) == len(st2.seqs[1])


def test_fork_validates_before_writing(ours):
    model = ours("mamba2")
    cache = model.make_cache(5, mode="kv", max_new=1, max_seq_len=32, block_size=4, kv_num_blocks=6)
    Stream(model, cache, [1], seed=1).prefill([9])           # 3 blocks of 6
    before = [t.clone() for t in _slot_tensors(cache, 2)]
    free = cache.pidx.free_blocks
    with pytest.raises(PoolExhausted, match="fork of slot 1"):
        cache.fork(1, [2, 3])                                 # needs 6 blocks, 3 free
    assert cache.pidx.free_blocks == free
    assert all(torch.equal(a, b) for a, b in zip(before, _slot_tensors(cache, 2)))
    for bad in ([1], [0], [2, 2]):
        with pytest.raises(ValueError, match="fork targets"):
            cache.fork(1, bad)
    with pytest.raises(ValueError, match="fork source"):
        cache.fork(3, [2])                                    # slot 3 holds nothing
