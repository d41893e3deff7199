"""The model cache's prefix store: a prefill captures every token's ring entry and conv input
(packed, next to other rows), checkpoints come from a slot's state or from folding stored
entries, and ``load_prefix`` resumes a free slot exactly at any token — every form, every
model type, NaN-poisoned caches (and the attention blocks freed meanwhile poisoned too) —
after which prefill, decode and verify continue as on the full sequence."""

from __future__ import annotations

import pytest
import torch

from replayssm.cache.spec import CacheSpec

from test_cached import Stream

BS, C, L = 4, 8, 6     # block size, checkpoint interval, ring capacity (C - 1 > L: folds happen)
N = 27                 # cached prompt: 6 whole blocks + 3 tokens


def _store(model, mode, poison=True):
    attn = any(not hasattr(x, "conv_dim") for x in model.stateful_layers())
    return model.make_cache(5, mode=mode, buffer_size=L, max_new=3, max_seq_len=64, block_size=BS,
                            kv_num_blocks=40 if mode == "kv" else None, attn_num_blocks=60 if attn else None,
                            poison=poison, prefix_blocks=12, prefix_checkpoints=4)


def _poison_free_attention(cache):
    if cache.attn is not None:
        free = torch.tensor(cache.attn._free, dtype=torch.long)
        for layer in cache.layers.values():
            if "k" in layer:
                layer["k"][free] = float("nan")
                layer["v"][free] = float("nan")


def _cache_prompt(model, cache, mode, g):
    """Prefill slot 1 with a random N-token prompt in two packed calls (slot 2 prefills other
    tokens in the same calls), capturing its whole blocks into store blocks 1..6; checkpoint
    1 at token 8 from the slot's state (state forms) or by folding, checkpoint 2 at token 16
    by folding from checkpoint 1.  Returns the prompt and the attention blocks (retained)."""
    V = model.vocab_size
    ids = torch.randint(0, V, (2, N), generator=g)
    nb = N // BS
    cache.prefix_assign(1, [(k, k + 1) for k in range(nb)])
    slots = torch.tensor([1, 2])
    for s in (1, 2):
        if cache.uses_pages:
            cache.reserve(s, N)
    model.prefill(cache, slots, ids[:, :C], torch.tensor([C, 5]))
    if mode == "kv":
        cache.prefix_checkpoint(1, chain=[1, 2], start=0, stop=C)
    else:
        cache.prefix_checkpoint(1, slot=1)
    rest = torch.cat([ids[:, C:], torch.zeros(2, C, dtype=torch.long)], 1)
    model.prefill(cache, slots, rest, torch.tensor([N - C, 9]))
    cache.prefix_checkpoint(2, chain=list(range(1, nb + 1)), start=C, stop=2 * C, base=1)
    attn = []
    if cache.attn is not None:
        attn = cache.attn.blocks_of(1)[:nb]
        cache.prefix_retain_attn(attn)
    cache.release(torch.tensor([1, 2]))
    _poison_free_attention(cache)
    return ids[0].tolist(), attn


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv"])
@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_load_resumes_exactly_at_any_token(ours, name, mode):
    model = ours(name)
    cache = _store(model, mode)
    g = torch.Generator().manual_seed(3)
    prompt, attn = _cache_prompt(model, cache, mode, g)
    for p in (1, 3, 4, 7, 8, 9, 13, 14, 15, 16, 17, 22, 23, 24):   # c, c+1, c+L-1, c+L, C-1 past c, ...
        ck = (2 * C, 2) if p >= 2 * C else (C, 1) if p >= C else None
        nblk = -(-p // BS)
        cache.load_prefix(3, p, list(range(1, nblk + 1)), attn=attn[:nblk], checkpoint=ck)
        assert int(cache.seq_len[3]) == p
        st = Stream(model, cache, [0, 3], seed=p)
        st.seqs[3] = prompt[:p]
        if cache.uses_pages:
            cache.reserve(3, 40)
        st.prefill([1, 5])
        st.decode()
        st.verify(3)
        st.decode()
        assert st.err < 1e-9, (p, st.err)
        cache.release(torch.tensor([3]))
        _poison_free_attention(cache)


def test_attention_blocks_are_shared_and_copied_on_write(ours):
    """Whole cached blocks enter the slot's table without a copy (one more reference each);
    the block the hit ends inside is the slot's own copy; release gives the references back."""
    model = ours("nemotron_h")
    cache = _store(model, "replay")
    prompt, attn = _cache_prompt(model, cache, "replay", torch.Generator().manual_seed(0))
    refs = [cache.attn.refcount(b) for b in attn]
    assert refs == [1] * len(attn)                       # the cache's own reference
    cache.load_prefix(3, 10, [1, 2, 3], attn=attn[:3], checkpoint=(C, 1))
    table = cache.attn.blocks_of(3)
    assert table[:2] == attn[:2] and table[2] != attn[2]
    assert [cache.attn.refcount(b) for b in attn[:3]] == [2, 2, 1]
    cache.release(torch.tensor([3]))
    assert [cache.attn.refcount(b) for b in attn] == refs
    cache.prefix_drop_attn(attn)
    assert cache.attn.free_blocks == cache.attn.num_blocks - 1


def _snapshot(cache):
    return [t.clone() for t in cache.tensors()] + [list(cache.attn._free) if cache.attn is not None else None]


def _same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))
        else:
            assert x == y


def test_bad_loads_are_refused_before_the_cache_changes(ours):
    model = ours("nemotron_h")
    cache = _store(model, "replay")
    prompt, attn = _cache_prompt(model, cache, "replay", torch.Generator().manual_seed(1))
    cache.load_prefix(4, 5, [1, 2], attn=attn[:2], checkpoint=None)      # slot 4 in use
    cache.ring.length[4] = 1                                 # as after a decode: an entry past its state
    before = _snapshot(cache)
    bad = [
        dict(slot=4, length=5, chain=[1, 2], attn=attn[:2]),                       # slot in use
        dict(slot=3, length=9, chain=[1, 2], attn=attn[:2]),                       # chain too short
        dict(slot=3, length=9, chain=[1, 2, 3], attn=attn[:3], checkpoint=(6, 1)),  # checkpoint off a block
        dict(slot=3, length=9, chain=[1, 2, 3], attn=attn[:3], checkpoint=(12, 1)),  # checkpoint past the hit
        dict(slot=3, length=9, chain=[1, 2, 99], attn=attn[:3]),                   # no such store block
        dict(slot=3, length=9, chain=[1, 2, 3], attn=attn[:2]),                    # attention blocks missing
        dict(slot=3, length=9, chain=[1, 2, 3], attn=[cache.attn._free[-1]] + attn[1:3]),  # a free block
        dict(slot=3, length=0, chain=[], attn=[]),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            cache.load_prefix(**kw)
        _same(before, _snapshot(cache))
    with pytest.raises(ValueError):
        cache.prefix_checkpoint(9)                         # no such checkpoint row
    with pytest.raises(ValueError):
        cache.prefix_checkpoint(3, slot=4)                 # slot 4's ring holds entries past its state
    with pytest.raises(ValueError):
        cache.prefix_assign(3, [(0, 50)])
    _same(before, _snapshot(cache))


def test_layout_measures_the_prefix_store(ours):
    """The layout's prefix sizes are what a cache with a store really allocates."""
    model = ours("qwen3_next")
    spec = CacheSpec(mode="replay", buffer_size=6, max_new=3, max_seq_len=64, block_size=BS, attn_num_blocks=10)
    lay = model.cache_layout(spec)
    a = model.make_cache(3, spec, prefix_blocks=5, prefix_checkpoints=2)
    b = model.make_cache(3, spec, prefix_blocks=7, prefix_checkpoints=5)
    assert b.nbytes() - a.nbytes() == 2 * lay.prefix_block_bytes + 3 * lay.checkpoint_bytes
    # a checkpoint row: the states plus the conv windows (a state point's, ``ckpt_window``)
    wins = sum(st["conv"].window[0].nbytes for st in a.layers.values() if "conv" in st)
    assert lay.checkpoint_bytes == lay.state_bytes + wins
    assert lay.prefix_block_bytes >= BS * lay.entry_bytes > 0


@pytest.mark.parametrize("mode", ["replay", "kv", "recurrent"])
@pytest.mark.parametrize("name", ["mamba2", "qwen3_next", "nemotron_h"])
def test_batched_load_equals_one_by_one(ours, name, mode):
    """``load_prefixes`` (one batched write per layer, one fold per distinct resume point)
    leaves every tensor of the cache as loading the same requests one by one does; a bad request among them (a slot already
    taken by an earlier request of the batch) fails alone and changes nothing of its own."""
    model = ours(name)
    caches = [_store(model, mode, poison=False) for _ in range(2)]
    loaded = []
    for cache in caches:
        prompt, attn = _cache_prompt(model, cache, mode, torch.Generator().manual_seed(5))
        loaded.append(attn)
    attn = loaded[0]
    assert loaded[1] == attn
    reqs = []
    for slot, p in ((1, 23), (2, 9), (3, 16), (4, 23)):   # past checkpoint 2, after 1, on 2, slot 1's again
        ck = (2 * C, 2) if p >= 2 * C else (C, 1) if p >= C else None
        nblk = -(-p // BS)
        reqs.append((slot, p, list(range(1, nblk + 1)), attn[:nblk], ck))
    for r in reqs:
        caches[0].load_prefix(*r)
    errs = caches[1].load_prefixes(reqs[:2] + [(2, 5, [1, 2], attn[:2], None)] + reqs[2:])
    assert [e is None for e in errs] == [True, True, False, True, True]
    assert isinstance(errs[2], ValueError) and "free slot" in str(errs[2])
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        # the same NaN (unwritten) entries; values equal up to float64 rounding (a batched fold
        # may sum in another order than one request's: BLAS picks kernels by shape)
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb)
        torch.testing.assert_close(a.masked_fill(na, 0), b.masked_fill(nb, 0), rtol=1e-12, atol=1e-15)
    assert caches[0].seq_len.tolist() == caches[1].seq_len.tolist()
    assert caches[0].ring.length.tolist() == caches[1].ring.length.tolist()


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_batched_checkpoints_equal_one_by_one(ours, name):
    """``prefix_checkpoints`` writes jobs whose base another job of the call writes after
    that one (batches in base order), and a bad job refuses the whole call unwritten."""
    model = ours(name)
    caches = [_store(model, "replay", poison=False) for _ in range(2)]
    for cache in caches:
        _cache_prompt(model, cache, "replay", torch.Generator().manual_seed(6))
    chain = list(range(1, N // BS + 1))
    jobs = [dict(row=4, chain=chain, start=C, stop=2 * C + BS, base=3),     # waits for row 3
            dict(row=3, chain=chain, start=0, stop=C),
            dict(row=1, chain=chain, start=0, stop=BS)]                      # no base
    for j in (jobs[1], jobs[0], jobs[2]):
        caches[0].prefix_checkpoint(**j)
    before = _snapshot(caches[1])
    with pytest.raises(ValueError):
        caches[1].prefix_checkpoints(jobs + [dict(row=2, chain=chain, start=3, stop=8)])   # not on a block
    _same(before, _snapshot(caches[1]))
    caches[1].prefix_checkpoints(jobs)
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


def test_batched_block_copies_equal_one_by_one(ours):
    """``prefix_copies`` writes what the same ``prefix_copy`` calls write one by one (copy on
    write of partly matched blocks, several requests reading one source); bad or overlapping
    copies are refused before anything is written."""
    model = ours("qwen3_next")
    caches = [_store(model, "replay", poison=False) for _ in range(2)]
    for cache in caches:
        _cache_prompt(model, cache, "replay", torch.Generator().manual_seed(8))
    copies = [(2, 8, 3), (2, 9, 1), (5, 10, 4), (1, 11, 0)]
    for c in copies:
        caches[0].prefix_copy(*c)
    before = _snapshot(caches[1])
    for bad in ([(2, 8, 5)], [(2, 8, 1), (3, 8, 1)], [(2, 8, 2), (8, 9, 1)], [(2, 99, 1)]):
        with pytest.raises(ValueError):
            caches[1].prefix_copies(bad)
        _same(before, _snapshot(caches[1]))
    caches[1].prefix_copies(copies)
    _same(_snapshot(caches[0]), _snapshot(caches[1]))


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv"])
@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_state_point_resumes_after_decode_and_verify(ours, name, mode):
    """A state point (``prefix_save_states``) of a slot that prefilled, decoded and verified
    (rejected entries left in its ring) resumes another slot exactly where it was saved:
    state and conv window from the checkpoint row, the attention blocks shared, no store
    block read (the chain given is NaN-poisoned and never written); the resumed slot then
    prefills, decodes and verifies as on the full sequence, next to a slot that kept
    running."""
    model = ours(name)
    cache = _store(model, mode)                             # NaN everywhere until written
    st = Stream(model, cache, [1, 2], seed=11)
    for s in (1, 2):
        if cache.uses_pages:
            cache.reserve(s, 40)
    st.prefill([9, 6])
    st.decode()
    st.verify(3)
    st.decode()
    st.verify(2)
    n = len(st.seqs[1])
    nblk = -(-n // BS)
    attn = cache.attn.blocks_of(1)[:nblk] if cache.attn is not None else []
    if attn:
        cache.prefix_retain_attn(attn)
    cache.prefix_save_states([(3, 1)])
    cache.release(torch.tensor([1]))
    _poison_free_attention(cache)
    cache.load_prefix(3, n, list(range(8, 8 + nblk)), attn=attn, checkpoint=(n, 3, True))
    assert int(cache.seq_len[3]) == n and int(cache.ring.length[3]) == 0
    assert cache.mode_of(3) == ("recurrent" if mode == "recurrent" else "replay")   # KV-only: a state form
    st2 = Stream(model, cache, [3, 2], seed=12)
    st2.seqs = {3: list(st.seqs[1]), 2: list(st.seqs[2])}
    if cache.uses_pages:
        cache.reserve(3, 60)
        cache.reserve(2, 60)
    st2.prefill([5, 2])
    st2.decode()
    st2.verify(3)
    st2.decode()
    st2.check_lengths()
    assert st.err < 1e-9 and st2.err < 1e-9, (st.err, st2.err)


def test_bad_state_points_are_refused_before_the_cache_changes(ours):
    model = ours("nemotron_h")
    cache = _store(model, "replay")
    st = Stream(model, cache, [1], seed=4)
    cache.reserve(1, 40)
    st.prefill([6])
    st.decode()
    cache.prefix_save_states([(2, 1)])
    attn = cache.attn.blocks_of(1)[:2]
    cache.prefix_retain_attn(attn)
    before = _snapshot(cache)
    for jobs in ([(9, 1)], [(2, 3)], [(2, 1), (3, 1)], [(2, 1), (2, 4)], [(0, 1)]):
        with pytest.raises(ValueError):                     # no such row, a free slot, twice, the null row
            cache.prefix_save_states(jobs)
        _same(before, _snapshot(cache))
    for kw in (dict(length=6, checkpoint=(7, 2, True)),     # a state point resumes only where it was saved
               dict(length=7, checkpoint=(7, None, True)),  # without its row
               dict(length=7, checkpoint=(7, 9, True))):    # no such row
        with pytest.raises(ValueError):
            cache.load_prefix(3, kw["length"], [1, 2], attn=attn, checkpoint=kw["checkpoint"])
        _same(before, _snapshot(cache))
