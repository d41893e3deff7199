"""The drafter registry (:mod:`replayssm.engine.spec`): ``prepare_drafter(...).build(...)`` picks,
loads and builds every drafter on the shipped tiny models, the drafters declare their graph
shapes, and the shared batching helpers pad as the runners did."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import replayssm
from engine_helpers import reference_greedy
from replayssm.cache.spec import CacheSpec
from replayssm.engine.batching import batch_buckets, bucket_for, pad_chain_parent, pad_rows
from replayssm.engine.config import SPEC_METHODS, SamplingParams, SpeculativeConfig
from replayssm.engine.model_runner import GraphKey, ModelRunner
from replayssm.engine.sampler import Sampler
from replayssm.engine.sequence import Sequence
from replayssm.engine.spec import (DRAFTERS, DraftModelDrafter, DraftTreeDrafter, MTPDrafter, NgramDrafter,
                                   NgramTreeDrafter, drafter_class, prepare_drafter)
from replayssm.models import load_model

ASSETS = os.path.join(os.path.dirname(replayssm.__file__), "assets")
TARGET, DRAFT = os.path.join(ASSETS, "tiny-mamba2"), os.path.join(ASSETS, "tiny-mamba2-draft")
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8], [9] * 6]
DT = torch.float64


@pytest.fixture(scope="module")
def shipped():
    """The shipped tiny Mamba-2 with its MTP head, in float64."""
    return load_model(TARGET, dtype="float64", mtp=True)


def _spec(sp: SpeculativeConfig, mode: str = "replay") -> CacheSpec:
    return CacheSpec(mode=mode, buffer_size=max(16, 2 * sp.verify_tokens), max_new=sp.verify_tokens, max_seq_len=64)


def _parts(target, spec: CacheSpec, num_slots: int, pad: bool = False):
    cache = target.make_cache(num_slots + 1, spec, device="cpu")
    runner = ModelRunner(target, cache, "cpu", num_slots, pad_batches=pad)
    sampler = Sampler("cpu", 0, num_slots=num_slots + 1, vocab_size=int(target.config.vocab_size))
    return dict(target=target, cache=cache, sampler=sampler, runner=runner, num_slots=num_slots)


def _seqs(prompts, max_tokens: int = 16):
    seqs = [Sequence(p, SamplingParams(max_tokens=max_tokens), request_id=("reg", i)) for i, p in enumerate(prompts)]
    for i, s in enumerate(seqs):
        s.slot = i + 1
    return seqs


# -- the registry ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sp, cls", [
    (SpeculativeConfig("ngram"), NgramDrafter),
    (SpeculativeConfig("draft", draft_model=DRAFT), DraftModelDrafter),
    (SpeculativeConfig("tree"), NgramTreeDrafter),
    (SpeculativeConfig("tree", draft_model=DRAFT), DraftTreeDrafter),
    (SpeculativeConfig("mtp"), MTPDrafter),
])
def test_registry_resolves_every_method(sp, cls):
    assert set(DRAFTERS) == set(SPEC_METHODS)   # every method SpeculativeConfig accepts has a drafter
    assert drafter_class(sp) is cls


def test_no_speculation_prepares_nothing(shipped):
    assert prepare_drafter(None, shipped, CacheSpec(), "cpu", DT) is None


@pytest.mark.parametrize("graphs", [False, True])
def test_ngram_drafters_pad_with_the_runners_graphs_and_declare_shapes(graphs):
    runner = SimpleNamespace(use_graphs=graphs, pad_batches=graphs)   # only what the build reads
    sp = SpeculativeConfig("ngram", num_tokens=3)
    setup = prepare_drafter(sp, None, _spec(sp), "cpu", DT)
    assert setup.draft_model is None and setup.layout is None
    d = setup.build(target=None, cache=None, sampler=None, runner=runner, num_slots=4)
    assert isinstance(d, NgramDrafter) and d.pad is graphs and d.k == 3
    assert d.graph_shapes() == [(4, False)] and d.sampled_shapes() == [(4, False, False)]
    sp = SpeculativeConfig("tree", tree_width=2, num_tokens=3)
    t = prepare_drafter(sp, None, _spec(sp), "cpu", DT).build(target=None, cache=None, sampler=None,
                                                               runner=runner, num_slots=4)
    assert isinstance(t, NgramTreeDrafter) and (t.w, t.d) == (2, 3)
    assert t.graph_shapes() == [] and t.sampled_shapes() == [] and t.capture() == 0
    seqs = _seqs(PROMPTS)
    prop = d.propose(seqs)   # rows 0 and 2 repeat themselves
    assert prop.tokens.shape == (3, 4) if graphs else prop.tokens.shape[1] <= 4
    assert prop.tokens[:, 0].tolist() == [s.last_token for s in seqs]


def test_draft_model_vocab_must_match_the_target(shipped):
    import dataclasses

    other = load_model(DRAFT, dtype="float64")   # a loaded model of another vocabulary
    other.config = dataclasses.replace(other.config, vocab_size=int(shipped.config.vocab_size) + 1)
    sp = SpeculativeConfig("draft", draft_model=other)
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_drafter(sp, shipped, _spec(sp), "cpu", DT)


def test_draft_chain_loads_plans_builds_and_proposes_the_greedy_chain(shipped):
    sp = SpeculativeConfig("draft", draft_model=DRAFT, num_tokens=3)
    spec = _spec(sp)
    setup = prepare_drafter(sp, shipped, spec, "cpu", DT)
    dm = setup.draft_model
    assert dm is not None and dm.dtype == DT
    assert setup.layout == dm.cache_layout(spec.for_draft())
    d = setup.build(**_parts(shipped, spec, 4))
    assert isinstance(d, DraftModelDrafter) and d.runner.use_graphs is False
    assert d.graph_shapes() == [(4, False)] and d.sampled_shapes() == [(4, False, True)]
    assert d.capture() == 0   # no CUDA here
    seqs = _seqs(PROMPTS)
    d.prefill(seqs)
    for s in seqs:
        s.output_ids.append(5)
    prop = d.propose(seqs)
    assert not prop.tree and prop.q is None and prop.valid.all()
    for s, row in zip(seqs, prop.tokens.tolist()):
        assert row == [s.last_token] + reference_greedy(dm, s.all_ids, 3)
    # greedy: the draft cache holds every token up to the last, the drafts were rolled back
    assert [s.draft_cached for s in seqs] == [s.num_tokens for s in seqs]
    d.accepted(seqs, [2, 1, 4], None)
    assert [s.draft_cached for s in seqs] == [s.num_tokens for s in seqs]
    for s, row, a in zip(seqs, prop.tokens.tolist(), [2, 1, 4]):   # the accepted drafts + a bonus token
        s.output_ids += row[1:a] + [7]
    prop = d.propose(seqs, 2)    # catches up 1..4 pending tokens in one verify
    for s, row in zip(seqs, prop.tokens.tolist()):
        assert row == [s.last_token] + reference_greedy(dm, s.all_ids, 2)
    for s in seqs:
        d.release(s)


@pytest.mark.parametrize("shape", ["beam", [(0,), (1,), (0, 0)]])
def test_draft_tree_builds_with_a_fixed_node_count(shipped, shape):
    sp = SpeculativeConfig("tree", draft_model=DRAFT, tree=shape, tree_width=2, num_tokens=2)
    spec = _spec(sp)
    setup = prepare_drafter(sp, shipped, spec, "cpu", DT)
    d = setup.build(**_parts(shipped, spec, 4))
    assert isinstance(d, DraftTreeDrafter)
    N = d.num_nodes
    assert N == (5 if shape == "beam" else 4)
    assert d.graph_shapes() == [(N, True)] and d.sampled_shapes() == [(N, True, True)]
    seqs = _seqs(PROMPTS[:2])
    d.prefill(seqs)
    for s in seqs:
        s.output_ids.append(5)
    prop = d.propose(seqs)
    assert prop.tree and prop.tokens.shape == (2, N)
    for s, row in zip(seqs, prop.tokens.tolist()):   # node 1: the draft's top choice at the root
        assert row[:2] == [s.last_token] + reference_greedy(setup.draft_model, s.all_ids, 1)


@pytest.mark.parametrize("tree", [None, "topk"])
def test_mtp_drafter_through_the_registry_pads_like_it_runs_unpadded(shipped, tree):
    """The MTP head's cache follows ``spec.for_draft()``; its padded greedy step (3 rows in
    a bucket of 4, through the shared padding helpers) proposes what the unpadded one does."""
    sp = SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2)
    spec = _spec(sp)
    setup = prepare_drafter(sp, shipped, spec, "cpu", DT)
    assert setup.draft_model is None and setup.layout == shipped.mtp.cache_layout(spec.for_draft())
    props = []
    for pad in (False, True):
        parts = _parts(shipped, spec, 4, pad=pad)
        d = setup.build(**parts)
        assert isinstance(d, MTPDrafter) and d.runner.pad is pad
        assert d.cache.spec == spec.for_draft()
        assert d.graph_shapes() == [(d.num_nodes, d.tree)] and d.sampled_shapes() == [(d.num_nodes, d.tree, True)]
        assert d.capture() == 0
        seqs = _seqs(PROMPTS)
        logits = parts["runner"].prefill([s.slot for s in seqs], [s.prompt_ids for s in seqs])
        d.prefill(seqs)
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.output_ids.append(t)
        props.append(d.propose(seqs))
    a, b = props
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parent, b.parent) and a.tree == b.tree
    assert a.tokens.shape == (3, 1 + (6 if tree else 3))


# -- batching helpers and graph keys ---------------------------------------------------------------
def test_batch_buckets_and_padding():
    assert batch_buckets(1) == [1]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(200)[-4:] == [128, 160, 192, 200]
    b = batch_buckets(40)
    assert [bucket_for(b, n) for n in (1, 3, 9, 33, 40, 41)] == [1, 4, 16, 40, 40, 41]
    x = torch.arange(6).view(3, 2)
    assert pad_rows(x, 3) is x
    assert pad_rows(x, 5, 7).tolist() == [[0, 1], [2, 3], [4, 5], [7, 7], [7, 7]]
    par = torch.tensor([[-1, 0, 0]])
    assert pad_chain_parent(par, 3).tolist() == [[-1, 0, 0], [-1, 0, 1], [-1, 0, 1]]


def test_graph_keys_are_values():
    k = GraphKey("sspec", 4, "replay", 5, True, True, (False, True, False, False, -1))
    assert k == GraphKey("sspec", 4, "replay", 5, True, True, (False, True, False, False, -1))
    assert len({k, GraphKey("spec", 4, "replay", 5, True), GraphKey("decode", 4, "replay")}) == 3
    with pytest.raises(AttributeError):
        k.batch = 8


def test_padded_runner_steps_equal_unpadded(shipped):
    """ModelRunner's padded verify step (3 rows in a bucket of 4) accepts what the unpadded
    one does, for chains and trees."""
    spec = CacheSpec(max_new=4, max_seq_len=64)
    outs = []
    for pad in (False, True):
        r = ModelRunner(shipped, shipped.make_cache(5, spec, device="cpu"), "cpu", 4, pad_batches=pad)
        seqs = _seqs(PROMPTS)
        r.prefill([s.slot for s in seqs], [s.prompt_ids for s in seqs])
        toks = torch.tensor([[s.last_token, 1, 2, 3] for s in seqs])
        chain = torch.arange(-1, 3).expand(3, 4).contiguous()
        tree = torch.tensor([[-1, 0, 0, 1]] * 3)
        valid = torch.ones(3, 4, dtype=torch.bool)
        a = r.greedy_verify_step([s.slot for s in seqs], toks, chain, valid, False)
        b = r.greedy_verify_step([s.slot for s in seqs], toks, tree, valid, True)
        outs.append([x for x in a + b if x is not None])
    assert all(torch.equal(x, y) for x, y in zip(*outs))
