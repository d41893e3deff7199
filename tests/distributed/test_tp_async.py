"""Async scheduling over two ranks (gloo): the overlapped decode steps feed every rank from its
own copy of the previous step's greedy tokens, so their control message carries the slot
and row lists and no tensor; outputs equal the synchronous engine's and one rank's."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.models import load_model  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9], [30, 31, 3], [11, 12]]
PARAMS = [SamplingParams(max_tokens=k) for k in (12, 5, 9, 2, 14)]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory, group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = H.tiny_mamba2(seed=0, num_heads=6, head_dim=5, hidden_size=15)   # heads split over two ranks
        d = H.save_tiny(m, str(tmp_path_factory.mktemp("tp_async") / "m2"))
    return load_model(d, dtype="float64"), group.load_model(d, dtype="float64")


def _generate(model, eos=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=64, **kw) as llm:
            if eos is not None:
                llm.outputs.eos_token_id = eos
            outs = llm.generate(PROMPTS, PARAMS)
            assert not llm.has_unfinished() and len(llm.blocks.free_slots) == llm.num_slots
            return [(o.token_ids, o.finish_reason) for o in outs], dict(llm.stats), dict(llm.runner.num_calls)


@pytest.mark.parametrize("mode", ["replay", "recurrent"])
def test_two_ranks_async_equals_sync_and_one_rank(models, mode):
    ref, tp = models
    want, _, _ = _generate(ref, decode_mode=mode)
    eos = want[0][0][6]   # ends request 0 at step 7 (or earlier), others where it appears
    want_eos, _, _ = _generate(ref, eos=eos, decode_mode=mode)
    sent = []
    send = tp.group._send

    def spy(op, payload, tensors=()):
        if op == "call":
            sent.append((payload[1], len(tensors)))
        return send(op, payload, tensors)

    tp.group._send = spy
    try:
        for e, w in ((None, want), (eos, want_eos)):
            got_sync, _, _ = _generate(tp, eos=e, decode_mode=mode)
            sent.clear()
            got, st, calls = _generate(tp, eos=e, decode_mode=mode, async_scheduling=True)
            assert got == got_sync == w
            assert st["async_steps"] > 0 and calls["rows_decode"] == st["async_steps"] + st["async_wasted_steps"]
            rows_msgs = [n for m, n in sent if m == "decode_rows"]
            assert len(rows_msgs) == calls["rows_decode"] and not any(rows_msgs)   # no tensor travels
    finally:
        tp.group._send = send
    assert any(r == "stop" for _, r in want_eos)


def test_two_ranks_hybrid_with_paged_attention(tmp_path, group):
    """Nemotron-H over two ranks (Mamba groups and attention heads split, paged attention KV in
    blocks of 4, a ring of 4 wrapped many times): async equals sync, EOS mid-batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = H.tiny_nemotron_h(hybrid_override_pattern="M*-EM", mamba_num_heads=6, n_groups=2, num_attention_heads=6,
                              num_key_value_heads=1, intermediate_size=18, moe_intermediate_size=10,
                              moe_shared_expert_intermediate_size=6, moe_latent_size=5)
        tp = group.load_model(H.save_tiny(m, str(tmp_path / "nh")), dtype="float64")
    kw = dict(decode_mode="replay", buffer_size=4, kv_block_size=4)
    try:
        want, _, _ = _generate(tp, **kw)
        eos = want[0][0][5]
        for e in (None, eos):
            want, _, _ = _generate(tp, eos=e, **kw)
            got, st, calls = _generate(tp, eos=e, async_scheduling=True, **kw)
            assert got == want and st["async_steps"] > 0 and calls["rows_decode"] > 0
        assert any(r == "stop" for _, r in want)
    finally:
        tp.close()
