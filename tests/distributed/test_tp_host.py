"""Rank 0's per-step host work under tensor parallelism: a decode step is at most two
messages to the workers whatever the batch (the step's block reservations in one
``reserve_step`` call, then the decode call), small CPU tensors ride inside the message, and
``reserve_step`` is exactly the per-slot ``reserve`` calls plus ``write_pending`` it replaces
(every cache tensor compared; a failed slot is left unchanged, the others still reserved)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tp_greedy as G  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.cache.spec import CacheSpec  # noqa: E402
from replayssm.models import load_model  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes)."""


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return G.tied_head_checkpoint(str(tmp_path_factory.mktemp("tp_host") / "m"), 61, 2,
                                  num_heads=6, head_dim=5, hidden_size=15, n_groups=1)


def _kv_cache(m, blocks):
    spec = CacheSpec(mode="kv", max_seq_len=40, block_size=4, kv_num_blocks=blocks)
    c = m.make_cache(5, spec)
    ids = torch.tensor([[3, 4, 5, 6, 7], [1, 2, 0, 0, 0], [9, 8, 7, 6, 0]])
    slots = torch.tensor([1, 2, 4])
    for s, n in zip(slots.tolist(), (5, 2, 4)):
        c.reserve(s, n)
    m.prefill(c, slots, ids, torch.tensor([5, 2, 4]))
    return c


def test_reserve_step_equals_the_per_slot_calls(path):
    m = load_model(path, dtype="float64")
    a, b = _kv_cache(m, 12), _kv_cache(m, 12)
    slots, totals = [1, 2, 4], [9, 13, 6]
    for s, n in zip(slots, totals):
        a.reserve(s, n, defer=True)
    a.write_pending()
    assert b.reserve_step(slots, totals) == [None, None, None]
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y)
    # a slot whose reservation fails (past max_seq_len; then a pool too small) is left as it
    # was and named, the others are reserved and written
    c, d = _kv_cache(m, 9), _kv_cache(m, 9)
    errs = d.reserve_step([1, 2, 4], [41, 30, 8])
    assert errs[0] is not None and "max_seq_len" in errs[0]
    assert errs[1] is not None and errs[2] is None
    c.reserve(4, 8, defer=True)
    c.write_pending()
    for x, y in zip(c.tensors(), d.tensors()):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="2 slots but 1 totals"):
        d.reserve_step([1, 2], [5])


@pytest.mark.parametrize("mode", ["kv", "replay"])
def test_a_decode_step_is_at_most_two_messages(path, group, mode):
    """KV-only slots (paged pools: reservations every step) and replay (none): two messages
    per decode step at most for 5 rows (before: one ``reserve`` per row, then
    ``write_pending``, then the decode), and one ``release`` per step that finished requests
    (before: one per request); tokens as on one rank."""
    tp = group.load_model(path, dtype="float64")
    ref = load_model(path, dtype="float64")
    sent = []
    orig = group.comm.send
    group.comm.send = lambda msg, tensors: (sent.append((msg, len(tensors))), orig(msg, tensors))[1]
    try:
        with LLM(tp, max_seq_len=64, decode_mode=mode) as llm:
            for p in G.PROMPTS:
                llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
            llm.step()                      # the prefills (every request finishes in the same step)
            steps = finishing = 0
            sent.clear()
            while llm.has_unfinished():
                finishing += any(o.finished for o in llm.step())
                steps += 1
            got = [o for o in sent if o[0][0] == "call"]
        names = [m[1][1] for m, _ in got]
        assert finishing == 1
        assert names.count("release") == finishing   # one per step that finished requests, not one per request
        got = [o for o, n in zip(got, names) if n != "release"]
        names = [n for n in names if n != "release"]
        assert names.count("decode") == steps and len(got) <= 2 * steps
        assert ("reserve_step" in names) == (mode == "kv") and "reserve" not in names
        assert all(n == 0 for _, n in got)    # the tokens rode in the message (no gloo broadcast)
    finally:
        group.comm.send = orig
    want, _, _ = G.generate(ref, decode_mode=mode)
    got_tokens, _, _ = G.generate(tp, decode_mode=mode)
    assert got_tokens == want
    tp.close()
