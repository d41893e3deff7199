"""Prefix caching of chat replies (issue 35): a finished request's state after its prompt
and reply is cached as a state point, so the next turn (prompt + reply + a new message)
resumes at the end of the reply.  Greedy output is the full forward's in every decode form,
with speculation, for Mamba-2, Qwen3-Next (GDN) and Nemotron-H (attention); store capacity,
aborts, requests without output, and poisoned store rows."""

from __future__ import annotations

import warnings

import pytest
import torch

import test_prefix_cache as _shared
from test_prefix_cache import BS, N, _llm, _poison_frees

from replayssm import SamplingParams, SpeculativeConfig

#: the fixtures of test_prefix_cache (bound here, so pytest finds them in this module)
expected, loaded = _shared.expected, _shared.loaded

USER = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]


def _gen(llm, prompt, n=N):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return llm.generate([prompt], SamplingParams(max_tokens=n))[0].token_ids


def _chat(llm, expected, arch, first, turns=3, n=N):
    """``turns`` chat turns (each prompt: the previous prompt, its reply, a new message);
    returns the prompt tokens each turn resumed from the cache."""
    prompt, hits = list(first), []
    for t in range(turns):
        before = llm.stats["prefix_hit_tokens"]
        out = _gen(llm, prompt, n)
        assert out == expected(arch, prompt)[:n], (t, prompt)
        hits.append(llm.stats["prefix_hit_tokens"] - before)
        prompt = prompt + out + USER[t % len(USER)]
    return hits


FIRST = [(7 * i + 3) % 61 for i in range(13)]


# ---------------------------------------------------------------------------- the index
def test_index_resumes_state_only_blocks_only_at_state_points():
    """Blocks with entries: a hit at any token; state-only blocks: only at the end of one with
    a checkpoint or of a tail matched whole; never a partial match into a state-only block;
    the longest valid hit wins; entries never follow a state-only block; tails are leaves."""
    from replayssm.engine.prefix import PrefixIndex

    ix = PrefixIndex(4, 16, 8, 8)
    toks = list(range(100, 130))
    e0, _ = ix.insert(None, toks[0:4], ix.alloc_block())
    e1, _ = ix.insert(e0, toks[4:8], ix.alloc_block())                        # prompt: 8 tokens with entries
    s2, _ = ix.insert(e1, toks[8:12], ix.alloc_block(), entries=False)        # reply: state-only
    s3, _ = ix.insert(s2, toks[12:16], ix.alloc_block(), entries=False)
    tail, _ = ix.insert(s3, toks[16:18], ix.alloc_block(), entries=False)     # L = 18
    assert [b.end for b in (e0, e1, s2, s3, tail)] == [4, 8, 12, 16, 18]
    m = ix.lookup(toks[:10] + [1, 1, 1])                    # into a state-only block: back to the entries
    assert (m.length, m.state, m.partial) == (8, False, None) and m.full == [e0, e1]
    m = ix.lookup(toks[:17] + [1, 1])                       # the tail not matched whole: no state point yet
    assert (m.length, m.state) == (8, False)
    tail.ckpt = ix.alloc_checkpoint()
    assert ix.lookup(toks[:17] + [1, 1]).length == 8        # still not whole
    m = ix.lookup(toks[:18] + [1, 1])
    assert (m.length, m.state, m.partial) == (18, True, tail) and m.full == [e0, e1, s2, s3]
    assert ix.lookup(toks[:18] + [1], limit=18).length == 18 and ix.lookup(toks[:18], limit=17).length == 8
    s2.ckpt = ix.alloc_checkpoint()                         # a state point at 12 (a shorter reply)
    m = ix.lookup(toks[:15] + [1])
    assert (m.length, m.state, m.full, m.partial) == (12, True, [e0, e1, s2], None)
    assert ix.lookup(toks[:18] + [1]).length == 18          # the longest wins
    m = ix.lookup(toks[:6] + [1, 1])                        # inside the entries: any token
    assert (m.length, m.state, m.partial) == (6, False, e1)
    with pytest.raises(ValueError, match="never follows"):
        ix.insert(s2, [1, 2, 3, 4], 9)                      # entries after a state-only block
    with pytest.raises(ValueError, match="tail"):
        ix.insert(tail, [1, 2, 3, 4], 9, entries=False)     # a tail has no children
    with pytest.raises(ValueError, match="holds 4 tokens"):
        ix.insert(e1, [1, 2], 9)                            # only state-only blocks may be short
    assert ix.child(s3, toks[16:18]) is tail and ix.child(s3, toks[16:19]) is None
    # eviction takes the tail (a leaf) first and gives its checkpoint row back
    ix2 = PrefixIndex(4, 2, 1, 8)
    a, _ = ix2.insert(None, [1, 2, 3, 4], ix2.alloc_block(), entries=False)
    t, _ = ix2.insert(a, [5], ix2.alloc_block(), entries=False)
    t.ckpt = ix2.alloc_checkpoint()
    assert ix2.alloc_checkpoint() == t.ckpt and t not in ix2 and a in ix2


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next", "nemotron_h"])
def test_next_turn_resumes_at_the_end_of_the_reply(loaded, expected, arch, mode):
    llm = _llm(loaded[arch], mode)
    hits = _chat(llm, expected, arch, FIRST)
    # turn k+1 resumes at prompt_k + reply_k minus the reply's last token (never fed)
    lens = [len(FIRST)]
    for t in range(2):
        lens.append(lens[-1] + N + len(USER[t]))
    assert hits == [0, lens[0] + N - 1, lens[1] + N - 1]
    s = llm.prefix_stats()
    assert s["prefix_states_saved"] == 3 and s["prefix_state_hits"] == 2
    assert llm.scheduler.reserved == 0 and all(b.ref == 0 for b in llm.prefix_cache.index._by_hash.values())


def _poison_store(llm):
    """NaN in every store row, checkpoint row (null rows kept) and free attention block
    before use, and in every row freed later: a read of a row nothing wrote shows."""
    cache = llm.cache
    bs = cache.spec.block_size
    for st in cache.layers.values():
        if "prefix" in st:
            for t in st["prefix"].token_tensors():
                t[bs:] = float("nan")
            st["prefix"].ckpt[1:] = float("nan")
            st["prefix"].ckpt_window[1:] = float("nan")
    if cache.attn is not None:
        free = torch.tensor(cache.attn._free, dtype=torch.long)
        for st in cache.layers.values():
            if "k" in st:
                st["k"][free] = float("nan")
                st["v"][free] = float("nan")
    _poison_frees(llm)


@pytest.mark.parametrize("arch,mode", [("mamba2", "replay"), ("qwen3_next", "kv"), ("nemotron_h", "auto"),
                                       ("nemotron_h", "recurrent")])
def test_poisoned_store_rows_are_never_read(loaded, expected, arch, mode):
    """Every store row, checkpoint row and attention block is NaN until written (and again
    when freed): reply blocks keep no entries, and none is read; output stays exact."""
    llm = _llm(loaded[arch], mode)
    _poison_store(llm)
    hits = _chat(llm, expected, arch, FIRST)
    assert hits[1] == len(FIRST) + N - 1 and llm.prefix_stats()["prefix_state_hits"] == 2
    # a second conversation branching off the first one's second turn; a regenerated turn
    p2 = FIRST + expected(arch, FIRST)[:N] + USER[0]
    for prompt in (p2 + [40, 41], p2):
        assert _gen(llm, prompt) == expected(arch, prompt)


@pytest.mark.parametrize("arch,method,mode", [("mamba2", "ngram", "replay"), ("mamba2", "draft", "replay"),
                                              ("nemotron_h", "draft", "kv"), ("qwen3_next", "draft", "auto"),
                                              ("qwen3_next", "ngram", "replay"), ("nemotron_h", "tree", "replay")])
def test_speculation(loaded, expected, arch, method, mode):
    """Verify steps leave rejected entries in the ring past the committed ones: the state
    point folds only the committed ones.  A reply is cached when the cache holds exactly
    the tokens before its last one (the last is a step's sampled token); when a step's
    accepted drafts run past the reply's end the cache is ahead of it and the reply is not
    cached (counted as skipped); either way output is exact."""
    m = loaded[arch]
    draft = loaded["qwen3_next" if arch == "mamba2" else "mamba2"]    # same vocabulary, other weights
    sp = {"ngram": SpeculativeConfig("ngram", num_tokens=3),
          "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=draft),
          "tree": SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=2)}[method]
    llm = _llm(m, mode, speculative=sp, buffer_size=None)
    prompt = [5, 6, 7, 8, 9] * 2 + [5, 6, 7]
    reused, rejected, last, last_saved = 0, 0, 0, 0
    for t in range(4):
        saved = llm.stats["prefix_states_saved"]
        before = llm.stats["prefix_hit_tokens"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = llm.generate([prompt], SamplingParams(max_tokens=N))[0]
        assert o.token_ids == expected(arch, prompt), t
        rejected += o.num_drafted - o.num_accepted
        if t:
            assert (llm.stats["prefix_hit_tokens"] - before == last) == bool(last_saved), t
            reused += bool(last_saved)
        last, last_saved = len(prompt) + N - 1, llm.stats["prefix_states_saved"] - saved
        prompt = prompt + o.token_ids + USER[t % len(USER)]
    assert reused >= 1 and rejected > 0
    s = llm.prefix_stats()
    assert s["prefix_states_saved"] + s["prefix_replies_skipped"] == 4


@pytest.mark.parametrize("arch,mode", [("mamba2", "replay"), ("qwen3_next", "recurrent"), ("nemotron_h", "kv")])
def test_16bit_states(loaded, arch, mode):
    """``ssm_state_dtype="bfloat16"``: the state point is the slot's state rounded once, as a
    flush rounds it; greedy output is that of the same engine without prefix caching."""
    m = loaded[arch]
    llm = _llm(m, mode, ssm_state_dtype="bfloat16")
    cold = _llm(m, mode, ssm_state_dtype="bfloat16", enable_prefix_caching=False, prefix_checkpoint_interval=None)
    assert llm.cache.state_dtype == torch.bfloat16
    prompt = list(FIRST)
    for t in range(3):
        out = _gen(llm, prompt)
        assert out == _gen(cold, prompt), t
        prompt = prompt + out + USER[t]
    assert llm.prefix_stats()["prefix_state_hits"] == 2


def test_capacity_and_eviction(loaded, expected):
    """A store of 6 blocks (and its checkpoint rows): conversations longer than the store
    cache what fits, evicting unreferenced leaves; the index never holds more than the
    store, every block and row is accounted for, output stays exact (poisoned frees)."""
    arch = "nemotron_h"
    llm = _llm(loaded[arch], "replay", prefix_cache_blocks=6)
    _poison_store(llm)
    ix = llm.prefix_cache.index
    other = [(5 * i + 1) % 61 for i in range(9)]
    for first in (FIRST, other, FIRST):
        _chat(llm, expected, arch, first, turns=3)
        assert len(ix) <= 6 and ix.free_blocks + len(ix) == ix.num_blocks
        rows = [b.ckpt for b in ix._by_hash.values() if b.ckpt is not None]
        assert len(rows) == len(set(rows)) and len(rows) + len(ix._free_ckpts) == ix.num_checkpoints
    s = llm.prefix_stats()
    assert s["prefix_evictions"] > 0 and s["prefix_states_saved"] > 0
    assert llm.scheduler.reserved == 0 and all(b.ref == 0 for b in ix._by_hash.values())
    cached_attn = {b.attn for b in ix._by_hash.values()}
    assert llm.cache.attn.free_blocks == llm.cache.attn.num_blocks - 1 - len(cached_attn)


def test_aborted_requests_and_requests_without_output(loaded, expected):
    """An aborted request with output caches its reply (the tokens its cache holds); one
    aborted before its prompt is complete, or before any output, caches nothing and holds
    nothing afterwards; a one-token reply is a state point at the prompt's end."""
    arch = "nemotron_h"
    llm = _llm(loaded[arch], "replay", max_num_batched_tokens=5)
    ix = llm.prefix_cache.index
    a = llm.add_request(FIRST, SamplingParams(max_tokens=50))
    while len(a.output_ids) < 4:
        llm.step()
    llm.abort(a.request_id)
    assert llm.prefix_stats()["prefix_states_saved"] == 1
    nxt = FIRST + a.output_ids + USER[0]
    before = llm.stats["prefix_hit_tokens"]
    assert _gen(llm, nxt) == expected(arch, nxt)
    assert llm.stats["prefix_hit_tokens"] - before == len(FIRST) + len(a.output_ids) - 1
    saved = llm.prefix_stats()["prefix_states_saved"]
    other = [(5 * i + 1) % 61 for i in range(14)]
    b = llm.add_request(other, SamplingParams(max_tokens=N))
    llm.step()                                            # 5 of 14 prompt tokens
    assert b.num_prefilled < len(other) and not b.output_ids
    llm.abort(b.request_id)
    c = llm.add_request(other + [1], SamplingParams(max_tokens=N))
    llm.scheduler.schedule()                              # admitted, never run
    llm.abort(c.request_id)
    assert llm.prefix_stats()["prefix_states_saved"] == saved
    assert all(blk.ref == 0 for blk in ix._by_hash.values()) and llm.scheduler.reserved == 0
    assert ix.free_blocks + len(ix) == ix.num_blocks
    # one generated token: the cache holds the prompt alone; 13 tokens end in a tail
    for first in (other[:13], other[:12]):
        out = _gen(llm, first, n=1)
        nxt = first + out + [3, 4]
        before = llm.stats["prefix_hit_tokens"]
        assert _gen(llm, nxt) == expected(arch, nxt)
        assert llm.stats["prefix_hit_tokens"] - before == len(first)


def test_opt_out_caches_prompts_only(loaded, expected):
    arch = "mamba2"
    llm = _llm(loaded[arch], "replay", prefix_cache_replies=False)
    hits = _chat(llm, expected, arch, FIRST)
    assert hits[1] == len(FIRST) // BS * BS           # the first prompt's whole blocks only
    assert llm.prefix_stats()["prefix_states_saved"] == 0
    with pytest.raises(ValueError, match="prefix_cache_replies"):
        _llm(loaded[arch], prefix_cache_replies="no")


def test_reply_hits_reach_the_server_metrics(loaded, expected):
    pytest.importorskip("prometheus_client")
    from replayssm.server.metrics import ServerMetrics

    llm = _llm(loaded["mamba2"])
    hits = _chat(llm, expected, "mamba2", FIRST)

    class Loop:
        in_flight, step_failures = 0, 0

    metrics = ServerMetrics("tiny")
    metrics.refresh(llm, Loop())
    metrics.refresh(llm, Loop())
    get = lambda name: metrics.registry.get_sample_value(name, {"model_name": "tiny"})  # noqa: E731
    assert get("replayssm:prefix_cache_hits_total") == sum(hits)          # reply tokens included
    assert get("replayssm:prefix_cache_reply_hits_total") == hits[1] + hits[2]
    assert get("replayssm:prefix_cache_replies_total") == 3


@pytest.mark.parametrize("arch,mode", [("nemotron_h", "replay"), ("qwen3_next", "kv")])
def test_replies_finishing_together_are_saved_in_one_call(loaded, expected, arch, mode):
    """A step's finished replies are saved in one ``prefix_save_states`` call; two equal
    conversations in it keep one state point (the second's row and block go back), whether
    it ends a block or a tail."""
    llm = _llm(loaded[arch], mode, max_num_seqs=4)
    calls = []
    orig = llm.cache.prefix_save_states
    llm.cache.prefix_save_states = lambda jobs: (calls.append(len(jobs)), orig(jobs))
    other = [(5 * i + 1) % 61 for i in range(7)]
    # replies end at 18 / 12 tokens (a tail / a block end), then 27 / 21, then 38 / 32
    prompts = [FIRST, FIRST, other, other]
    for t in range(3):
        before = llm.stats["prefix_hit_tokens"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=N))]
        assert outs == [expected(arch, p) for p in prompts], t
        if t:
            assert llm.stats["prefix_hit_tokens"] - before == sum(len(p) - len(USER[t - 1]) - 1 for p in prompts)
        prompts = [p + o + USER[t] for p, o in zip(prompts, outs)]
    assert calls == [4, 4, 4] and llm.stats["prefix_states_saved"] == 6
    ix = llm.prefix_cache.index
    assert ix.free_blocks + len(ix) == ix.num_blocks and llm.scheduler.reserved == 0
    rows = [b.ckpt for b in ix._by_hash.values() if b.ckpt is not None]
    assert len(rows) + len(ix._free_ckpts) == ix.num_checkpoints


def test_serve_flag_turns_replies_off():
    from pathlib import Path

    from replayssm.server.cli import build_engine, build_parser

    model = str(Path(__file__).resolve().parents[2] / "replayssm" / "assets" / "tiny-mamba2")
    base = ["MODEL", "--enable-prefix-caching", "--device", "cpu", "--max-num-seqs", "2", "--max-seq-len", "128"]
    for flags, on in (([], True), (["--no-prefix-cache-replies"], False)):
        llm = build_engine(model, build_parser().parse_args(base + flags))
        assert llm.prefix_cache.cache_replies is on and llm.config.prefix_cache_replies is on
