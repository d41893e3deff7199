"""ModelCache.swap_out / swap_in (preemption): a slot copied to host memory and restored into
another slot continues exactly (every form, hybrids with attention KV), its blocks go back
to the pools while it is out, and bad calls raise before anything is touched."""

from __future__ import annotations

import pytest
import torch

from replayssm.cache.paged import PoolExhausted

from test_cache_fork import _slot_tensors
from test_cached import Stream


def _same(a, b):
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) if a.is_floating_point() else torch.equal(a, b)


@pytest.mark.parametrize("mode,blocks", [("recurrent", None), ("replay", None), ("kv", 40)])
@pytest.mark.parametrize("name", ["mamba2", "nemotron_h"])
def test_swap_out_and_in_to_another_slot_continues_exactly(name, mode, blocks, ours):
    model = ours(name)
    cache = model.make_cache(5, mode=mode, buffer_size=6, max_new=3, max_seq_len=64, block_size=4,
                             kv_num_blocks=blocks, attn_num_blocks=blocks, poison=True)
    cache.keep_hidden(model.config.hidden_size)
    st = Stream(model, cache, [1, 0, 3], seed=5)
    st.prefill([5, 1, 3])
    if blocks:
        for s in (1, 3):
            cache.reserve(s, 32)
    st.decode()
    st.verify(3)      # ring part-filled, conv windows moved, rejected entries left behind
    st.decode()
    before = [t.clone() for t in _slot_tensors(cache, 1)]
    hidden = cache.hidden[1].clone()
    pools = [p for p in (cache.pidx, cache.attn) if p is not None]
    free = [p.free_blocks for p in pools]
    cache.swap_out(1, "req-a")
    assert int(cache.seq_len[1]) == 0 and 1 not in cache._in_use
    assert not blocks or all(p.free_blocks > f for p, f in zip(pools, free))   # its blocks went back
    cache.swap_in(4, "req-a")                                        # another slot
    after = _slot_tensors(cache, 4)
    assert len(before) == len(after) and all(_same(a, b) for a, b in zip(before, after))
    assert _same(cache.hidden[4], hidden) and cache.mode_of(4) == mode and "req-a" not in cache._swapped
    st2 = Stream(model, cache, [4, 3], seed=9)
    st2.seqs = {4: list(st.seqs[1]), 3: list(st.seqs[3])}
    for _ in range(2):
        if blocks:
            for s in (3, 4):
                cache.reserve(s, len(st2.seqs[s]) + 3)
        st2.decode()
        st2.verify(2)
    st2.check_lengths()
    assert st2.err < 1e-9


def test_swap_validates_before_writing(ours):
    model = ours("nemotron_h")
    cache = model.make_cache(4, mode="kv", max_new=1, max_seq_len=32, block_size=4, kv_num_blocks=6,
                             attn_num_blocks=6)
    Stream(model, cache, [1], seed=1).prefill([9])                   # 3 blocks of 6 in each pool
    with pytest.raises(ValueError, match="swap_out: slot"):
        cache.swap_out(2, "x")                                       # holds nothing
    cache.swap_out(1, "x")
    with pytest.raises(ValueError, match="no swapped-out slot"):
        cache.swap_in(2, "y")
    Stream(model, cache, [2], seed=2).prefill([17])                  # 5 blocks: 1 left
    with pytest.raises(ValueError, match="free slot"):
        cache.swap_in(2, "x")
    free = (cache.pidx.free_blocks, cache.attn.free_blocks)
    with pytest.raises(PoolExhausted, match="swap_in into slot 3"):
        cache.swap_in(3, "x")
    assert (cache.pidx.free_blocks, cache.attn.free_blocks) == free and 3 not in cache._in_use
    cache.release([2])
    cache.swap_in(3, "x")
    cache.swap_out(3, "x")
    Stream(model, cache, [1], seed=3).prefill([2])
    with pytest.raises(ValueError, match="already holds"):
        cache.swap_out(1, "x")
    assert 1 in cache._in_use
    cache.drop_swapped("x")
    assert not cache._swapped
