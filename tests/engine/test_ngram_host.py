"""The n-gram drafters' host path: the tail index (O(1) per token, no per-n-gram lists),
the chained index, and ``NgramDrafter.propose`` (one host tensor, rows with nothing left
skipped) against the plain scan :func:`ngram_continuations`."""

import gc
import random

import pytest
import torch

from replayssm import SamplingParams
from replayssm.engine.sequence import Sequence
from replayssm.engine.spec import NgramDrafter, NgramIndex, ngram_continuations
from replayssm.engine.spec.ngram import NgramTailIndex


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4), (3, 3), (1, 5)])
def test_tail_index_first_equals_the_scan(n_min, n_max):
    """Grown by 1..5 tokens at a time from an empty start (the guarded first tokens, then
    the unrolled path), over tiny and large vocabularies and ids outside [0, 2**32)."""
    rng = random.Random(n_min * 10 + n_max)
    for trial in range(30):
        pool = rng.choice([[0, 1], [0, 1, 2], [5, 2**32 - 1, 7], [-3, 4, 2**32, 2**40 + 1], list(range(1000))])
        idx, adv = NgramTailIndex(n_min, n_max), NgramTailIndex(n_min, n_max)
        ids: list[int] = []
        prompt = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
        output: list[int] = []
        for _ in range(rng.randint(1, 25)):
            new = [rng.choice(pool) for _ in range(rng.randint(1, 5))]
            ids += new
            idx.extend(new)
            assert idx.tokens.tolist() == ids
            for length in (0, 1, 3, 7):
                ref = ngram_continuations(ids, n_min, n_max, length, 1)
                assert idx.first(length) == (ref[0] if ref else [])
            # the drafter's path: sync + first in one call, on prompt + a growing output
            output += new
            length = rng.choice([0, 1, 4])
            ref = ngram_continuations(prompt + output, n_min, n_max, length, 1)
            assert adv.advance(prompt, output, length) == (ref[0] if ref else [])
            ref = ngram_continuations(prompt + output, n_min, n_max, 2, 1)   # again, nothing new
            assert adv.advance(prompt, output, 2) == (ref[0] if ref else [])
        assert idx.exact == all(0 <= t < 2**32 for t in ids)
        assert adv.tokens.tolist() == prompt + output


def test_chained_index_with_out_of_range_ids_matches_the_scan():
    """Colliding keys (ids outside [0, 2**32)) are verified against the tokens."""
    rng = random.Random(3)
    for trial in range(30):
        idx = NgramIndex(1, 3)
        ids: list[int] = []
        for _ in range(rng.randint(1, 40)):
            ids.append(rng.choice([-1, 0, 2**32, 2**32 - 1, 1, 2**33]))
            for length, count in ((1, 1), (3, 2), (4, 4)):
                assert idx.continuations(ids, length, count) == ngram_continuations(ids, 1, 3, length, count)


@pytest.mark.parametrize("cls", [NgramIndex, NgramTailIndex])
@pytest.mark.parametrize("bad", [(0, 3), (2, 1), (1.0, 2), (1, None)])
def test_indexes_reject_bad_lengths(cls, bad):
    with pytest.raises(ValueError):
        cls(*bad)


def _seqs(rng, B, max_tokens):
    out = []
    for b in range(B):
        motif = [rng.randrange(50) for _ in range(rng.randint(1, 6))]
        prompt = (motif * 10)[:rng.randint(1, 20)] if b % 2 else [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        s = Sequence(prompt, SamplingParams(max_tokens=max_tokens[b % len(max_tokens)]))
        s.output_ids.append(rng.randrange(50))
        out.append(s)
    return out


@pytest.mark.parametrize("pad", [False, True])
def test_propose_equals_the_scan_and_skips_finished_rows(pad):
    """Every row of every step: root = the last token, drafts = the scan's continuation of
    ``min(k, remaining - 1)`` tokens, then invalid padding (zeros); a step where no row
    finds anything proposes None; chain parents.  Rows at ``remaining <= 1`` draft nothing
    and their index does not move."""
    rng = random.Random(7)
    k = 4
    d = NgramDrafter(k, 1, 3, "cpu", pad=pad)
    seqs = _seqs(rng, 13, [3, 9, 40])
    d.prefill(seqs)
    for step in range(30):
        live = [s for s in seqs if s.remaining > 0]
        if not live:
            break
        kk = rng.choice([None, 1, 2, 4])
        before = {s.request_id: d._index[s.request_id].indexed for s in live}
        prop = d.propose(live, kk)
        want_k = k if kk is None else kk
        conts = []
        for s in live:
            length = min(want_k, max(s.remaining - 1, 0))
            c = ngram_continuations(s.prompt_ids + s.output_ids, 1, 3, length, 1) if length > 0 else []
            conts.append(c[0] if c else [])
            if length <= 0:
                assert d._index[s.request_id].indexed == before[s.request_id]
        n = max(len(c) for c in conts)
        if n == 0:
            assert prop is None
        else:
            N = (want_k if pad else n) + 1
            assert prop.tokens.shape == prop.valid.shape == prop.parent.shape == (len(live), N)
            assert prop.tokens.dtype == torch.long and prop.valid.dtype == torch.bool
            assert prop.parent.tolist() == [list(range(-1, N - 1))] * len(live)
            for s, c, t, v in zip(live, conts, prop.tokens.tolist(), prop.valid.tolist()):
                assert t == [s.last_token] + c + [0] * (N - 1 - len(c))
                assert v == [True] * (1 + len(c)) + [False] * (N - 1 - len(c))
        for s in live:   # the verify step keeps 1..k+1 tokens
            s.output_ids.extend(rng.randrange(50) for _ in range(min(rng.randint(1, k + 1), s.remaining)))


def test_propose_reindexes_a_request_id_used_again_and_release_forgets():
    d = NgramDrafter(3, 1, 2, "cpu")
    a = Sequence([1, 2, 3, 1, 2], SamplingParams(max_tokens=8), request_id="r")
    a.output_ids.append(3)
    assert d.propose([a]).tokens.tolist() == [[3, 1, 2, 3]]
    b = Sequence([7, 8, 9, 7], SamplingParams(max_tokens=8), request_id="r")   # same id, new sequence
    b.output_ids.append(8)
    assert d.propose([b]).tokens.tolist() == [[8, 9, 7, 8]]
    d.release(b)
    assert "r" not in d._index
    assert d.propose([]) is None


def test_indexes_hold_no_objects_the_collector_walks_per_token():
    """Tokens, maps and chains are arrays and int -> int dicts: a long sequence adds a few
    tracked objects per index, none with per-token references for full collections to walk."""
    for cls in (NgramIndex, NgramTailIndex):
        gc.collect()
        n0 = len(gc.get_objects())
        idx = cls(1, 3)
        idx.extend(list(range(5000)) + list(range(100)))
        assert len(gc.get_objects()) - n0 < 16
        assert not any(gc.is_tracked(d) for d in idx.last)            # int -> int dicts
        arrays = (idx.tokens, *getattr(idx, "prev", ()))
        assert all(len(gc.get_referents(a)) <= 1 for a in arrays)     # (at most its type)


def test_plain_steps_call_no_propose_and_output_is_greedy(target):
    """Steps the length policy runs plain (T = 0) never call ``propose``: one call per
    speculative step, and the index catches up on the tokens of the plain steps between."""
    from engine_helpers import PROMPTS, reference_greedy

    from replayssm import LLM
    from replayssm.engine.config import SpeculativeConfig
    from replayssm.engine.spec.policy import ScriptedLengths

    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_tokens=3))
    lengths = llm.executor.lengths = ScriptedLengths((3,), [0, 3, 0, 0, 3])
    chosen, choose = [], lengths.choose
    lengths.choose = lambda seqs: (chosen.append(choose(seqs)), chosen[-1])[1]
    d = llm.executor.drafter
    calls, propose = [], d.propose
    d.propose = lambda seqs, k=None: (calls.append(k), propose(seqs, k))[1]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=14))
    assert [o.token_ids for o in outs] == [reference_greedy(target, p, 14) for p in PROMPTS]
    assert chosen.count(0) > 0 and llm.stats.get("spec_T3_steps", 0) > 0
    assert len(calls) == chosen.count(3) and set(calls) == {3}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned staging)")
def test_cuda_proposals_equal_cpu_ones_back_to_back():
    """Three proposals staged through the one pinned buffer before any is read."""
    rng = random.Random(11)
    batches = [_seqs(rng, 7 + b, [5, 30]) for b in range(3)]
    cpu, gpu = NgramDrafter(4, 1, 3, "cpu", pad=True), NgramDrafter(4, 1, 3, "cuda", pad=True)
    props = []
    for seqs in batches:
        cpu.prefill(seqs)
        gpu.prefill(seqs)
        props.append((cpu.propose(seqs), gpu.propose(seqs)))
    for a, b in props:
        assert (a is None) == (b is None)
        if a is not None:
            assert b.tokens.is_cuda and b.valid.is_cuda
            assert a.tokens.tolist() == b.tokens.tolist() and a.valid.tolist() == b.valid.tolist()
            assert a.parent.tolist() == b.parent.tolist()
