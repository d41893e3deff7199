"""Cached decoding (prefill / decode / verify / verify_tree / commit) in every cache mode
equals the full forward on the accepted token stream (float64, 1e-9)."""

from __future__ import annotations

import random

import pytest
import torch

from replayssm.cache.spec import CacheSpec
from replayssm.cache.tree import path_to

TOL = 1e-9
MODELS = ["mamba2", "mamba2_g3", "nemotron_h", "qwen3_next", "qwen3_next_dense"]
TREES = [  # parent arrays of 3-node trees (topological, node 0 a root)
    [-1, 0, 0], [-1, 0, 1], [-1, -1, 0], [-1, -1, 1],
]


class Stream:
    """Drives one cache with random steps and checks every logit against ``model(ids)``."""

    def __init__(self, model, cache, slots, seed):
        self.model, self.cache = model, cache
        self.slots = torch.tensor(slots)
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.V = model.vocab_size
        self.seqs = {s: [] for s in slots if s}
        self.err = 0.0

    def _ref(self, seq):
        return self.model(torch.tensor([seq]))[0]

    def _check(self, got, want):
        self.err = max(self.err, (got - want).abs().max().item())

    def prefill(self, lengths):
        B = len(self.slots)
        T = max(lengths)
        ids = torch.randint(0, self.V, (B, T), generator=self.g)
        lg = self.model.prefill(self.cache, self.slots, ids, torch.tensor(lengths))
        for b, s in enumerate(self.slots.tolist()):
            if s:
                self.seqs[s] += ids[b, : lengths[b]].tolist()
                self._check(lg[b], self._ref(self.seqs[s])[-1])

    def decode(self):
        tok = torch.randint(0, self.V, (len(self.slots),), generator=self.g)
        lg = self.model.decode(self.cache, self.slots, tok)
        for b, s in enumerate(self.slots.tolist()):
            if s:
                self.seqs[s].append(int(tok[b]))
                self._check(lg[b], self._ref(self.seqs[s])[-1])
        assert torch.isfinite(lg[self.slots != 0]).all()

    def verify(self, T):
        B = len(self.slots)
        d = torch.randint(0, self.V, (B, T), generator=self.g)
        lg = self.model.verify(self.cache, self.slots, d)
        for b, s in enumerate(self.slots.tolist()):
            if s:
                self._check(lg[b], self._ref(self.seqs[s] + d[b].tolist())[-T:])
        acc = torch.tensor([self.rng.randint(0, T) for _ in range(B)])
        self.model.commit(self.cache, acc)
        for b, s in enumerate(self.slots.tolist()):
            if s:
                self.seqs[s] += d[b, : int(acc[b])].tolist()

    def tree(self):
        B = len(self.slots)
        parent = torch.tensor([self.rng.choice(TREES) for _ in range(B)])
        N = parent.shape[1]
        d = torch.randint(0, self.V, (B, N), generator=self.g)
        lg = self.model.verify_tree(self.cache, self.slots, d, parent)
        for b, s in enumerate(self.slots.tolist()):
            if not s:
                continue
            for i in range(N):
                branch, j = [], i
                while j >= 0:
                    branch.append(int(d[b, j]))
                    j = int(parent[b, j])
                self._check(lg[b, i], self._ref(self.seqs[s] + branch[::-1])[-1])
        leaf = torch.tensor([self.rng.randrange(N) for _ in range(B)])
        path, plen = path_to(parent, leaf)
        acc = torch.tensor([self.rng.randint(0, int(plen[b])) for b in range(B)])
        self.model.commit(self.cache, acc, path)
        for b, s in enumerate(self.slots.tolist()):
            if s:
                self.seqs[s] += [int(d[b, path[b, i]]) for i in range(int(acc[b]))]

    def check_lengths(self):
        for s, seq in self.seqs.items():
            assert int(self.cache.seq_len[s]) == len(seq)


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv"])
@pytest.mark.parametrize("name", MODELS)
def test_modes_match_full_forward(name, mode, ours):
    model = ours(name)
    cache = model.make_cache(5, mode=mode, buffer_size=6, max_new=3, max_seq_len=48, block_size=4,
                             poison=True)
    st = Stream(model, cache, [3, 0, 1], seed=sum(map(ord, name + mode)))
    st.prefill([5, 2, 7])
    st.decode()
    st.verify(3)
    st.decode()
    st.tree()
    if mode == "kv":
        assert cache.mode_of(3) == "kv"
        cache.switch_to_state([3])              # slot 3 -> replay; slot 1 stays KV-only (mixed)
        assert cache.mode_of(3) == "replay" and cache.mode_of(1) == "kv"
        st.decode()
        st.verify(2)
        st.tree()
        st.prefill([2, 1, 3])                   # mixed-form prefill continues both sequences
        cache.switch_to_state(torch.tensor([1]))
    st.tree()
    st.verify(2)
    st.tree()
    for _ in range(3):
        st.decode()
    st.check_lengths()
    assert st.err < TOL, st.err


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_prefill_continues_a_sequence_and_release_resets(mode, ours):
    model = ours("qwen3_next")
    cache = model.make_cache(3, mode=mode, buffer_size=4, max_new=2, max_seq_len=40, block_size=3,
                             poison=True)
    st = Stream(model, cache, [2, 1], seed=7)
    st.prefill([4, 3])
    st.decode()
    st.verify(2)
    st.prefill([3, 5])          # appended to each slot's sequence
    st.decode()
    cache.release([2])
    assert int(cache.seq_len[2]) == 0 and cache.mode_of(2) == CacheSpec(mode=mode).initial_form
    st.seqs[2] = []
    st.prefill([2, 1])          # slot 2 restarts at position 0, slot 1 continues
    st.decode()
    st.check_lengths()
    assert st.err < TOL, st.err


def test_replay_buffer_wraps_many_times(ours):
    model = ours("nemotron_h")
    cache = model.make_cache(2, mode="replay", buffer_size=2, max_new=1, max_seq_len=40)
    st = Stream(model, cache, [1], seed=3)
    st.prefill([3])
    for _ in range(9):
        st.decode()
    assert st.err < TOL, st.err


def test_float32_modes_agree(ours):
    model = ours("mamba2", "float32")
    ids = torch.randint(0, model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    full = model(ids)[0]
    for mode in ("recurrent", "replay", "kv"):
        cache = model.make_cache(2, mode=mode, buffer_size=3, max_seq_len=16)
        s = torch.tensor([1])
        lg = model.prefill(cache, s, ids[:, :5], torch.tensor([5]))
        outs = [lg[0]]
        for t in range(5, 12):
            outs.append(model.decode(cache, s, ids[:, t])[0])
        assert (torch.stack(outs) - full[4:]).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------- API misuse
def test_cache_api_errors_leave_cache_untouched(ours):
    model = ours("qwen3_next")
    with pytest.raises(ValueError, match="cache mode"):
        model.make_cache(3, mode="paged")
    with pytest.raises(ValueError, match="buffer_size"):
        model.make_cache(3, mode="replay", buffer_size=3, max_new=2)
    with pytest.raises(ValueError, match="num_slots"):
        model.make_cache(1)
    with pytest.raises(ValueError, match="unknown cache spec field"):
        model.make_cache(3, kv_block_size=4)
    with pytest.raises(ValueError, match="kv_num_blocks"):
        model.make_cache(3, mode="kv", kv_num_blocks=0)
    cache = model.make_cache(3, mode="replay", buffer_size=4, max_new=2, max_seq_len=10)
    s = torch.tensor([1, 2])
    model.prefill(cache, s, torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2]))
    before = cache.seq_len.clone()
    with pytest.raises(ValueError, match="token ids"):
        model.decode(cache, s, torch.tensor([0, 10_000]))
    with pytest.raises(ValueError, match="duplicate"):
        model.decode(cache, torch.tensor([1, 1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot ids"):
        model.decode(cache, torch.tensor([1, 7]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="max_new"):
        model.verify(cache, s, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="topological"):
        model.verify_tree(cache, s, torch.ones(2, 2, dtype=torch.long), torch.tensor([-1, 1]))
    with pytest.raises(RuntimeError, match="without a pending"):
        model.commit(cache, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="prefill lengths"):
        model.prefill(cache, s, torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.prefill(cache, s, torch.ones(2, 8, dtype=torch.long), torch.tensor([8, 8]))
    assert torch.equal(cache.seq_len, before)
    model.verify(cache, s, torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="waiting for its commit"):
        model.decode(cache, s, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="accepted counts"):
        model.commit(cache, torch.tensor([3, 0]))
    assert torch.equal(cache.seq_len, before)
    model.commit(cache, torch.tensor([2, 0]))
    assert cache.seq_len[1:3].tolist() == [5, 2]
    model.verify_tree(cache, s, torch.ones(2, 2, dtype=torch.long), torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="parent"):
        model.commit(cache, torch.tensor([2, 0]), torch.tensor([[0, 1], [0, 1]]))
    model.commit(cache, torch.tensor([1, 1]), torch.tensor([[1, 0], [0, 1]]))
    assert cache.seq_len[1:3].tolist() == [6, 3]


def test_half_precision_caches_run_in_every_mode(ours):
    """bf16 / fp16 activations with fp32 states: every mode runs and tracks the full forward."""
    for name, dt in (("nemotron_h", "bfloat16"), ("qwen3_next", "float16")):
        model = ours(name, dt)
        ids = torch.randint(0, model.vocab_size, (1, 10), generator=torch.Generator().manual_seed(11))
        full = model(ids)[0].double()
        for mode in ("recurrent", "replay", "kv"):
            cache = model.make_cache(2, mode=mode, buffer_size=4, max_new=2, max_seq_len=16)
            s = torch.tensor([1])
            outs = [model.prefill(cache, s, ids[:, :5], torch.tensor([5]))[0]]
            outs += [model.decode(cache, s, ids[:, t])[0] for t in range(5, 8)]
            outs += list(model.verify(cache, s, ids[:, 8:10])[0])
            model.commit(cache, torch.tensor([2]))
            assert (torch.stack(outs).double() - full[4:10]).abs().max().item() < 0.05


# ---------------------------------------------------------------------------- random schedules
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

_OPS = hs.lists(hs.sampled_from(["decode", "verify1", "verify2", "verify3", "tree", "switch", "restart"]),
                min_size=3, max_size=9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=hs.sampled_from(["mamba2_g3", "qwen3_next", "nemotron_h"]),
       mode=hs.sampled_from(["recurrent", "replay", "kv"]), buffer=hs.integers(6, 9),
       ops=_OPS, seed=hs.integers(0, 10_000))
def test_random_schedules_match_full_forward(ours, name, mode, buffer, ops, seed):
    model = ours(name)
    cache = model.make_cache(4, mode=mode, buffer_size=buffer, max_new=3, max_seq_len=64,
                             block_size=5, poison=True)
    st = Stream(model, cache, [2, 0, 3], seed=seed)
    st.prefill([st.rng.randint(1, 5), 1, st.rng.randint(1, 5)])
    for op in ops:
        if op == "decode":
            st.decode()
        elif op.startswith("verify"):
            st.verify(int(op[-1]))
        elif op == "tree":
            st.tree()
        elif op == "switch" and mode == "kv":
            cache.switch_to_state([st.rng.choice([2, 3])])
        elif op == "restart":
            s = st.rng.choice([2, 3])
            cache.release([s])
            st.seqs[s] = []
            T = st.rng.randint(1, 4)
            ids = torch.randint(0, st.V, (1, T), generator=st.g)
            lg = model.prefill(cache, torch.tensor([s]), ids, torch.tensor([T]))
            st.seqs[s] = ids[0].tolist()
            st._check(lg[0], st._ref(st.seqs[s])[-1])
    st.check_lengths()
    assert st.err < TOL, (st.err, ops)


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h", "qwen3_next"])
def test_layout_is_what_the_cache_allocates(ours, arch, mode):
    """One source of truth for memory: the layout the engine budgets (measured on the meta
    device) equals the bytes a real cache of any size allocates, blocks included."""
    from replayssm.models.cache import ModelCache

    m = ours(arch)
    spec = CacheSpec(mode=mode, buffer_size=8, max_new=3, max_seq_len=48, block_size=4)
    lay = m.cache_layout(spec)
    blocks = 9 if spec.paged else None
    base = ModelCache(m, 2, CacheSpec.of(spec, kv_num_blocks=1 if blocks else None, attn_num_blocks=1)).nbytes()
    cache = ModelCache(m, 6, CacheSpec.of(spec, kv_num_blocks=blocks, attn_num_blocks=7))
    assert cache.nbytes() == base + 4 * lay.slot_bytes + (8 * lay.block_bytes if blocks else 0) \
        + 6 * lay.attn_block_bytes
    assert lay.slot_bytes > 0 and lay.state_bytes > 0 and lay.entry_bytes > 0
    assert (lay.block_bytes > 0) == spec.paged and lay.mode == mode
    assert (lay.attn_block_bytes > 0) == (arch != "mamba2")
