"""Greedy tokens of a vocabulary-parallel LM head from the shards' ``(max, index)`` pairs.

The combination rule on its own (any number of shards, ties across and at shard boundaries,
padding, empty shards, -inf and NaN rows), the model's and runner's greedy decode on one
rank (tokens and every cache tensor equal to the logits path), and two ranks over gloo: a
head that ties at its shard boundary on purpose, greedy output equal to one rank in every
decode mode with the exchange on and off (``REPLAYSSM_TP_GREEDY_LOCAL``), and mixed greedy
and sampled batches (those gather the logits).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

import tp_greedy as G  # noqa: E402
from engine_helpers import simulate_decode_graphs  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.distributed.greedy import (argmax_over_shards_reference, combine_shard_maxima,  # noqa: E402
                                          greedy_local_enabled, shard_maxima)
from replayssm.distributed.sharding import vocab_shard  # noqa: E402
from replayssm.models import load_model  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes)."""


def _shards(full: torch.Tensor, N: int) -> list[torch.Tensor]:
    """``full [..., V]`` cut as the ranks hold it: ``N`` shards of ``Vs`` columns, the last ones
    padded with junk (a padded head row's logit, here large so it would win if counted)."""
    V = full.shape[-1]
    out = []
    for r in range(N):
        lo, n, Vs = vocab_shard(V, N, r)
        pad = torch.full((*full.shape[:-1], Vs - n), 1e30, dtype=full.dtype)
        out.append(torch.cat([full[..., lo:lo + n], pad], -1))
    return out


def _combined(full: torch.Tensor, N: int) -> torch.Tensor:
    V = full.shape[-1]
    pairs = [shard_maxima(s, vocab_shard(V, N, r)[0], V) for r, s in enumerate(_shards(full, N))]
    return combine_shard_maxima(torch.stack(pairs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,V", [(1, 7), (2, 61), (3, 10), (4, 67), (4, 5), (5, 23)])
def test_shard_maxima_combine_to_the_full_argmax(N, V, dtype):
    """Random rows, and rows built to tie: across every shard boundary, between the first
    and last shard, all equal, all -inf, NaN (first NaN wins, as torch.argmax), +inf."""
    g = torch.Generator().manual_seed(N * 100 + V)
    full = torch.randn(40, V, generator=g, dtype=torch.float64).to(dtype)
    full[:, :] = torch.where(torch.rand(40, V, generator=g) < 0.3, full.round(), full)   # many small ties
    Vs = -(-V // N)
    for i, b in enumerate(G.boundaries(V, N)):
        full[i, b - 1] = full[i, b] = 9.0                  # tie at the boundary
        full[10 + i, b] = full[10 + i, V - 1] = 9.0        # tie between later shards
        full[20 + i, b] = 9.0                              # a later shard wins alone
    full[30, 0] = full[30, V - 1] = 9.0
    full[31] = 2.0
    full[32] = float("-inf")
    full[33, V // 2] = float("nan")
    full[34, V - 1] = full[34, 0] = float("nan")
    full[35, V - 1] = float("inf")
    full[36, min(Vs, V - 1)] = float("inf")
    full[36, V - 1] = float("nan")
    want = full.argmax(-1)
    got = _combined(full, N)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(argmax_over_shards_reference(_shards(full, N), V), want)
    # batched leading dims
    assert torch.equal(_combined(full.view(4, 10, V), N), want.view(4, 10))


def test_a_shard_without_real_rows_never_wins():
    """Four ranks over V = 5: shards 2, 2, 1 and 0 real columns; the empty one gives
    ``(-inf, V)`` however large its padding."""
    pad_only = torch.full((3, 2), 1e30, dtype=torch.float64)
    m = shard_maxima(pad_only, 5, 5)
    assert torch.equal(m, torch.tensor([[float("-inf"), 5.0]] * 3, dtype=torch.float64))
    full = torch.full((3, 5), float("-inf"), dtype=torch.float64)
    assert torch.equal(_combined(full, 4), torch.zeros(3, dtype=torch.long))


def test_the_switch_is_validated(monkeypatch):
    for v, want in (("1", True), ("0", False), ("off", False), ("", True)):
        monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", v)
        assert greedy_local_enabled() is want
    monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", "maybe")
    with pytest.raises(ValueError, match="REPLAYSSM_TP_GREEDY_LOCAL"):
        greedy_local_enabled()


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return G.tied_head_checkpoint(str(tmp_path_factory.mktemp("tp_greedy") / "m"), 61, 2,
                                  num_heads=6, head_dim=5, hidden_size=15, n_groups=1)


@pytest.fixture(scope="module")
def models(tied, group):
    return load_model(tied, dtype="float64"), group.load_model(tied, dtype="float64")


def test_model_greedy_decode_is_the_logits_argmax_and_touches_the_cache_alike(tied):
    """One rank: ``decode(..., greedy=True)`` returns the argmax of ``decode``'s logits, and
    both leave every cache tensor (states, rings, kept hidden states) the same."""
    m = load_model(tied, dtype="float64")
    caches = [m.make_cache(4, max_seq_len=32, mode="replay") for _ in range(2)]
    for c in caches:
        c.keep_hidden(m.config.hidden_size)
    slots = torch.tensor([1, 3, 2])
    ids = torch.tensor([[5, 30, 31, 2], [7, 7, 1, 0], [60, 59, 3, 4]])
    for c in caches:
        for s in slots.tolist():
            c.reserve(s, 32)
        m.prefill(c, slots, ids, torch.tensor([4, 3, 2]))
    toks = torch.tensor([31, 30, 2])
    for _ in range(3):
        logits = m.decode(caches[0], slots, toks)
        greedy = m.decode(caches[1], slots, toks, greedy=True)
        assert greedy.dtype == torch.long and greedy.shape == (3,)
        assert torch.equal(greedy, logits.argmax(-1))
        toks = greedy
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="input_ids"):
        m.decode(caches[1], slots, torch.tensor([1.0, 2.0, 3.0]), greedy=True)


@pytest.mark.parametrize("tree", [False, True])
def test_model_greedy_verify_is_the_logits_argmax_and_commits_alike(tied, tree):
    """``verify`` / ``verify_tree(..., greedy=True)`` return the argmax tokens ``[B, N]`` of
    the logits; after the same commit every cache tensor is the same."""
    from replayssm.engine.sampler import accept_greedy

    m = load_model(tied, dtype="float64")
    caches = [m.make_cache(4, max_seq_len=32, mode="replay", max_new=4) for _ in range(2)]
    slots = torch.tensor([2, 1])
    for c in caches:
        for s in slots.tolist():
            c.reserve(s, 32)
        m.prefill(c, slots, torch.tensor([[5, 30, 31], [7, 1, 0]]), torch.tensor([3, 2]))
    toks = torch.tensor([[31, 30, 2, 30], [2, 31, 31, 5]])
    parent = torch.tensor([-1, 0, 0, 1]) if tree else torch.tensor([-1, 0, 1, 2])
    valid = torch.ones(2, 4, dtype=torch.bool)
    if tree:
        logits = m.verify_tree(caches[0], slots, toks, parent)
        g = m.verify_tree(caches[1], slots, toks, parent, greedy=True)
    else:
        logits = m.verify(caches[0], slots, toks)
        g = m.verify(caches[1], slots, toks, greedy=True)
    assert g.dtype == torch.long and torch.equal(g, logits.argmax(-1))
    par = parent.expand(2, 4)
    want = accept_greedy(logits, toks, par, valid)
    got = accept_greedy(None, toks, par, valid, g=g)
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    acc = want[0]
    for c in caches:
        if tree:
            from replayssm.cache.tree import path_to
            m.commit(c, acc, path_to(par, want[1])[0])
        else:
            m.commit(c, acc)
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        assert torch.equal(a, b)


def test_runner_greedy_decode_graphs_are_their_own_keys(tied):
    """A runner with ``greedy_decode`` (forced on one rank) runs plain greedy steps through
    "gdecode" graphs (simulated on CPU) and the same tokens as the logits path."""
    m = load_model(tied, dtype="float64")
    want, n_greedy, _ = G.generate(m, pad_batches=True)
    assert n_greedy == 0                     # one rank: no argmax head, logits as before
    llm = LLM(m, max_seq_len=64, pad_batches=True)
    keys = simulate_decode_graphs(llm.runner)
    llm.runner.greedy_decode = True
    outs = llm.generate(G.PROMPTS, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == want
    assert keys and {k.kind for k in keys} == {"gdecode"}
    assert llm.runner.num_calls["greedy_decode"] > 0 and llm.runner.num_calls["decode"] == 0


def _expected(model, n_new=12):
    """Greedy continuations by full forwards of the one-rank model (the ground truth)."""
    rows = []
    for p in G.PROMPTS:
        ids, gen = torch.tensor([p]), []
        for _ in range(n_new):
            t = int(model(ids)[0, -1].argmax())
            gen.append(t)
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
        rows.append(gen)
    return rows


@pytest.mark.parametrize("mode", ["replay", "kv", "recurrent", "auto"])
def test_two_ranks_greedy_equals_one_rank_through_the_tie(models, mode, monkeypatch):
    """Two ranks over gloo, float64: the exchange (on) and the gather (off) give the one-rank
    tokens; the boundary tie (rows 30 and 31 of V = 61: shards of 31) is met and row 30 wins."""
    ref, tp = models
    want = _expected(ref)
    assert any(30 in row for row in want)          # the tie decided some tokens
    kw = dict(decode_mode=mode, auto_threshold=6, pad_batches=mode == "replay")
    monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", "1")
    got, n_greedy, n_logits = G.generate(tp, **kw)
    assert got == want and n_greedy > 0 and n_logits == 0
    monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", "0")
    got, n_greedy, n_logits = G.generate(tp, **kw)
    assert got == want and n_greedy == 0 and n_logits > 0


@pytest.mark.parametrize("method", ["ngram", "tree"])
def test_two_ranks_greedy_speculation_equals_one_rank(models, method, monkeypatch):
    """Greedy verify steps take the argmax tokens too (switch on) or the gathered logits
    (off): the one-rank tokens either way, drafts accepted."""
    from replayssm import SpeculativeConfig

    ref, tp = models
    want = _expected(ref)
    sp = SpeculativeConfig("ngram", num_tokens=3) if method == "ngram" else \
        SpeculativeConfig("tree", num_tokens=3, tree_width=2)
    for env in ("1", "0"):
        monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", env)
        with LLM(tp, max_seq_len=64, decode_mode="replay", speculative=sp) as llm:
            assert llm.runner.greedy_decode is (env == "1")
            outs = llm.generate(G.PROMPTS, SamplingParams(max_tokens=12))
        assert [o.token_ids for o in outs] == want
        assert sum(o.num_verify_steps for o in outs) > 0


def test_mixed_greedy_and_sampled_batches_gather_the_logits(models):
    """A batch with sampled, penalised or logprob rows gathers the logits (every row as on
    one rank, sampled rows included); an all-greedy batch does not."""
    ref, tp = models
    ps = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=0.8, seed=3),
          SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, repetition_penalty=1.3),
          SamplingParams(max_tokens=10, logprobs=2)]
    want, _, _ = G.generate(ref, ps, decode_mode="replay")
    got, n_greedy, n_logits = G.generate(tp, ps, decode_mode="replay")
    assert got == want and n_greedy == 0 and n_logits > 0
    # greedy rows alone: the exchange; tokens as the greedy rows above (rows 0 and 2)
    only, n_greedy, _ = G.generate(tp, decode_mode="replay", n_new=10)
    assert n_greedy > 0 and only[0] == want[0] and only[2] == want[2]


def test_direct_model_api_greedy_decode(models):
    """``TensorParallelModel.decode(..., greedy=True)``: the argmax of the gathered logits of
    an identical cache, on every rank alike (the next step agrees too)."""
    ref, tp = models
    caches = [tp.make_cache(3, max_seq_len=32, mode="replay") for _ in range(2)]
    slots = torch.tensor([0, 2])
    for c in caches:
        for s in slots.tolist():
            c.reserve(s, 32)
        tp.prefill(c, slots, torch.tensor([[5, 30, 31], [9, 9, 0]]), torch.tensor([3, 2]))
    toks = torch.tensor([31, 30])
    for _ in range(3):
        logits = tp.decode(caches[0], slots, toks)
        greedy = tp.decode(caches[1], slots, toks, greedy=True)
        assert torch.equal(greedy, logits.argmax(-1))
        toks = greedy
