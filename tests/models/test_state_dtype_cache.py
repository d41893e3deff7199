"""``CacheSpec.ssm_state_dtype``: a model cache keeps its checkpoint states (and the prefix
store's checkpoints) in bf16 / fp16, every form runs on them (prefill, chunked prefill,
decode, verify + commit, trees, the KV-only -> state switch), the ring entries keep their
dtypes, swap and the prefix store keep the dtype bit for bit, and the layout counts the
smaller states."""

from __future__ import annotations

import pytest
import torch

from replayssm.cache.spec import CacheSpec

from test_cache_swap import _same
from test_cached import Stream

#: logits error of a 16-bit-state run vs the full forward, relative to the logits' scale
#: (measured on these tiny models: <= 2e-5 with bf16 states, <= 2e-6 with fp16, 5e-7 fp32)
REL_TOL = {"bfloat16": 2e-4, "float16": 2e-5}


def _bufs(cache):
    return [st["buf"] for st in cache.layers.values() if "buf" in st]


@pytest.mark.parametrize("sdt", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv"])
@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_every_form_runs_on_16bit_states(name, mode, sdt, ours):
    model = ours(name, "float32")
    cache = model.make_cache(5, mode=mode, buffer_size=6, max_new=3, max_seq_len=48, block_size=4, poison=True,
                             ssm_state_dtype=sdt)
    want = getattr(torch, sdt)
    assert cache.state_dtype == want and _bufs(cache)
    for b in _bufs(cache):   # the ring's per-head decays (dt / g, last) stay fp32
        assert b.state.dtype == want and b.ring_tensors()[-1].dtype == torch.float32
    st = Stream(model, cache, [3, 0, 1], seed=3)
    st.prefill([5, 2, 7])
    st.decode()
    st.verify(3)
    st.decode()
    st.tree()
    if mode == "kv":
        cache.switch_to_state([3])        # KV-only -> state: one rounded flush
        assert cache.mode_of(3) == "replay"
        st.decode()
        st.verify(2)
        st.prefill([2, 1, 3])             # a chunked prefill continues both forms
        cache.switch_to_state(torch.tensor([1]))
    st.prefill([4, 3, 1])
    st.tree()
    st.verify(2)
    for _ in range(3):
        st.decode()
    st.check_lengths()
    scale = model(torch.tensor([st.seqs[3]]))[0].abs().max().item()
    assert st.err < REL_TOL[sdt] * scale, (st.err, scale)
    assert all(b.state.dtype == want for b in _bufs(cache))


def test_swap_and_prefix_store_keep_the_dtype(ours):
    model = ours("nemotron_h", "float32")
    cache = model.make_cache(4, mode="replay", buffer_size=6, max_new=1, max_seq_len=32, block_size=4,
                             prefix_blocks=6, prefix_checkpoints=2, ssm_state_dtype="bfloat16")
    stores = [st for st in cache.layers.values() if "prefix" in st]
    assert stores and all(st["prefix"].ckpt.dtype == torch.bfloat16 for st in stores)
    st = Stream(model, cache, [1, 2], seed=4)
    st.prefill([8, 5])
    cache.prefix_checkpoint(1, slot=1)     # a slot's state copied bit for bit
    for s in stores:
        assert torch.equal(s["prefix"].ckpt[1], s["buf"].state[1])
    st.decode()
    st.decode()
    before = {lid: s["buf"].state[2].clone() for lid, s in cache.layers.items() if "buf" in s}
    cache.swap_out(2, "k")
    saved = cache._swapped["k"]["layers"]
    assert all(saved[lid][("buf", "state")].dtype == torch.bfloat16 for lid in before)
    cache.swap_in(3, "k")
    for lid, s in before.items():
        assert _same(cache.layers[lid]["buf"].state[3], s)


def test_layout_counts_16bit_states(ours):
    """The measured layout (what the engine's memory plan budgets) halves the states: a slot
    is smaller by half its state bytes, a prefix checkpoint by half its state bytes."""
    model = ours("qwen3_next", "float32")
    base = CacheSpec(mode="replay", buffer_size=8, max_seq_len=64, block_size=4)
    f32 = model.cache_layout(base)
    b16 = model.cache_layout(base, ssm_state_dtype="bfloat16")
    assert model.cache_layout(base, ssm_state_dtype="float32") == f32 and f32.mode == b16.mode
    assert b16.state_bytes * 2 == f32.state_bytes > 0
    assert f32.slot_bytes - b16.slot_bytes == f32.state_bytes // 2
    assert b16.entry_bytes == f32.entry_bytes                 # ring entries are unchanged
    # a checkpoint row: its states halve, its conv window (a state point's, model dtype) stays
    assert f32.checkpoint_bytes - b16.checkpoint_bytes == f32.state_bytes // 2 > 0
    assert ours("qwen3_next").cache_layout(base).state_bytes == 2 * f32.state_bytes   # auto: fp64 for fp64


@pytest.mark.parametrize("bad", ["bf16", "int8", torch.int32, None, 16])
def test_bad_state_dtype_is_refused(bad, ours):
    with pytest.raises(ValueError, match="ssm_state_dtype must be one of"):
        CacheSpec(ssm_state_dtype=bad)
    with pytest.raises(ValueError, match="ssm_state_dtype must be one of"):
        ours("mamba2", "float32").make_cache(3, ssm_state_dtype=bad)
    assert CacheSpec(ssm_state_dtype=torch.bfloat16).ssm_state_dtype == "bfloat16"
