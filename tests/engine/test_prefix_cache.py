"""Prefix caching (issue 17): the index on its own (hash chain, token-granular longest prefix,
reference counts, LRU eviction of unreferenced leaves), then the engine on tiny random
Mamba-2 / Qwen3-Next / Nemotron-H models in float64: greedy output with cached prefixes is
the full forward's for hits on a checkpoint, one token after, ``L-1`` / ``L`` / ``L+1`` after
(the ring's capacity), just before the next checkpoint, inside the first block, in every
decode form (KV-only sequences too), with speculation, chunked prefill at any budget, n
samples, concurrent requests, a prefix evicted between requests, and under a tight budget
with every freed block poisoned."""

from __future__ import annotations

import warnings

import pytest
import torch

from engine_helpers import reference_greedy

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.prefix import PrefixIndex, block_hash

models = pytest.importorskip("replayssm.models")
transformers = pytest.importorskip("transformers")

N = 6
BS, C, L = 4, 8, 6
BASE = [(7 * i + 3) % 61 for i in range(40)]


def _tail(p, n=3):
    return [(BASE[p] + 1 + j) % 61 if p < len(BASE) else j for j in range(n)]


#: a cached prompt first (BASE), then prompts that share p tokens with it: on a checkpoint
#: (8, 16), one after (9, 17), c+L-1 / c+L / c+L+1 (13, 14, 15: fold past the ring), C-1
#: after (15, 23), inside the first block (3), the whole cached prompt but its last token
PROMPTS = [BASE] + [BASE[:p] + _tail(p) for p in (8, 9, 13, 14, 15, 16, 17, 23, 3, 33)] + [BASE, BASE[:20]]
HITS = [0, 8, 9, 13, 14, 15, 16, 17, 23, 3, 33, 39, 19]


# ---------------------------------------------------------------------------- the index
def _index(blocks=8, ckpts=2, evicted=None):
    return PrefixIndex(4, blocks, ckpts, 8, on_evict=None if evicted is None else evicted.append)


def _insert_chain(ix, tokens, parent=None):
    out = []
    for k in range(len(tokens) // 4):
        b, new = ix.insert(parent, tokens[4 * k:4 * k + 4], ix.alloc_block())
        assert new
        out.append(b)
        parent = b
    return out


def test_hash_chain_and_token_granular_lookup():
    ix = _index()
    toks = list(range(12))
    chain = _insert_chain(ix, toks)
    assert chain[1].hash == block_hash(block_hash(None, toks[:4]), toks[4:8])
    assert [b.index for b in chain] == [0, 1, 2] and chain[2].end == 12
    m = ix.lookup(toks)
    assert m.full == chain and m.partial is None and m.length == 12
    m = ix.lookup(toks[:6] + [99, 98, 97])                 # two tokens into block 1
    assert m.full == chain[:1] and m.partial is chain[1] and m.length == 6
    m = ix.lookup(toks, limit=11)                          # capped one short: partial last block
    assert m.full == chain[:2] and m.partial is chain[2] and m.length == 11
    assert ix.lookup([5, 6, 7]).length == 0
    assert ix.lookup([0, 1]).length == 2 and ix.lookup([0, 1]).partial is chain[0]
    # same tokens after a different parent: a different block (the hash chain)
    other = _insert_chain(ix, [50, 51, 52, 53] + toks[4:8])
    assert other[1].hash != chain[1].hash
    assert ix.lookup([50, 51, 52, 53] + toks[4:8]).full == other
    # a second child of block 0: the lookup picks the child sharing more tokens
    c2, _ = ix.insert(chain[0], [4, 5, 60, 61], ix.alloc_block())
    assert ix.lookup(toks[:4] + [4, 5, 60, 0]).partial is c2
    assert ix.lookup(toks[:4] + [4, 5, 6, 0]).partial is chain[1]
    # inserting an existing block returns it (the caller frees its store block)
    b, new = ix.insert(chain[0], toks[4:8], 99)
    assert b is chain[1] and not new
    with pytest.raises(ValueError):
        ix.insert(None, [1, 2, 3], 5)                      # not a whole block


def test_hash_collision_is_a_miss_never_a_wrong_hit(monkeypatch):
    import replayssm.engine.prefix.index as pc

    ix = _index()
    monkeypatch.setattr(pc, "block_hash", lambda parent, tokens: 7)   # every block collides
    _insert_chain(ix, [1, 2, 3, 4])
    assert ix.lookup([5, 6, 7, 8]).length == 0
    assert ix.lookup([1, 2, 3, 4, 5]).length == 4
    with pytest.raises(ValueError, match="collision"):
        ix.insert(None, [5, 6, 7, 8], ix.alloc_block())


def test_references_protect_blocks_and_eviction_is_lru_over_leaves():
    evicted = []
    ix = _index(blocks=5, evicted=evicted)
    a = _insert_chain(ix, list(range(8)))                  # a0 <- a1
    b = _insert_chain(ix, [9, 9, 9, 9])                    # b0
    ix.acquire(a)                                          # a running sequence reads a0, a1
    c = _insert_chain(ix, [8, 8, 8, 8, 7, 7, 7, 7])        # fills the store (5 blocks)
    assert ix.free_blocks == 0
    ix.acquire([c[0]])
    ix.release([c[0]])                                     # c0 used after b0, but c0 is not a leaf
    got = ix.alloc_block()                                 # evicts the LRU unreferenced leaf: b0
    assert evicted == [b[0]] and got == b[0].store and b[0] not in ix
    ix.free_block(got)
    assert ix.alloc_block() == b[0].store
    assert ix.alloc_block() == c[1].store                  # then c1, then its parent c0 (a leaf now)
    assert ix.alloc_block() == c[0].store
    assert evicted == [b[0], c[1], c[0]]
    assert ix.alloc_block() is None                        # a0, a1 are referenced: never evicted
    assert a[0] in ix and a[1] in ix
    ix.release(a)
    assert ix.alloc_block() == a[1].store                  # leaf first, then its parent
    with pytest.raises(ValueError):
        ix.release([a[0], a[0]])


def test_checkpoint_rows_are_allocated_and_reclaimed():
    evicted = []
    ix = _index(blocks=6, ckpts=1, evicted=evicted)
    a = _insert_chain(ix, list(range(8)))
    a[1].ckpt = ix.alloc_checkpoint()
    ix.acquire(a)
    assert ix.alloc_checkpoint() is None                   # the only row is held by a referenced block
    ix.release(a)
    assert ix.alloc_checkpoint() == 1 and evicted == [a[1]]


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_models")
    out = {}
    torch.manual_seed(0)
    mc = transformers.Mamba2Config(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                   state_size=16, n_groups=2, expand=2, conv_kernel=4, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None)
    torch.manual_seed(2)
    qc = transformers.Qwen3NextConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        eos_token_id=None)
    nc = transformers.NemotronHConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=4, hybrid_override_pattern="M*M-", num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, mamba_n_groups=2, conv_kernel=4, eos_token_id=None)
    for name, cls, cfg, seed in (("mamba2", transformers.Mamba2ForCausalLM, mc, 0),
                                 ("qwen3_next", transformers.Qwen3NextForCausalLM, qc, 2),
                                 ("nemotron_h", transformers.NemotronHForCausalLM, nc, 3)):
        torch.manual_seed(seed)
        d = str(root / name)
        cls(cfg).save_pretrained(d)
        out[name] = models.load_model(d, device="cpu", dtype=torch.float64)
    return out


@pytest.fixture(scope="module")
def expected(loaded):
    """Greedy continuations by full forwards (the ground truth), per model and prompt."""
    cache = {}

    def get(arch, prompt):
        key = (arch, tuple(prompt))
        if key not in cache:
            cache[key] = reference_greedy(loaded[arch], prompt, N)
        return cache[key]

    return get


def _llm(model, mode="replay", **kw):
    kw = {"dtype": "float64", "decode_mode": mode, "max_seq_len": 96, "kv_block_size": BS, "auto_threshold": 12,
          "buffer_size": L, "enable_prefix_caching": True, "prefix_checkpoint_interval": C, **kw}
    return LLM(model, **kw)


def _one_by_one(llm, prompts, params=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [llm.generate([p], params or SamplingParams(max_tokens=N))[0].token_ids for p in prompts]


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next", "nemotron_h"])
def test_greedy_output_is_the_full_forwards_with_hits_at_any_token(loaded, expected, arch, mode):
    llm = _llm(loaded[arch], mode)
    hits = []
    for p in PROMPTS:
        before = llm.stats["prefix_hit_tokens"]
        assert _one_by_one(llm, [p]) == [expected(arch, p)]
        hits.append(llm.stats["prefix_hit_tokens"] - before)
    assert hits == HITS
    s = llm.prefix_stats()
    assert s["prefix_hits"] == len(HITS) - 1 and s["prefix_blocks_saved"] == sum(h // BS for h in HITS)
    assert 0 < s["prefix_hit_rate"] < 1 and s["prefix_cached_blocks"] >= 10
    # every cached prompt block that ends on a multiple of the interval holds a checkpoint
    # (a reply's state-only blocks hold one only at the reply's end)
    idx = llm.prefix_cache.index
    assert all(b.ckpt is not None for b in idx._by_hash.values() if b.end % C == 0 and b.entries)
    assert llm.scheduler.reserved == 0 and all(b.ref == 0 for b in idx._by_hash.values())


@pytest.mark.parametrize("mode", ["auto", "recurrent"])
@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_many_hits_in_one_step_are_loaded_together(loaded, expected, arch, mode):
    """All of a step's hits resume in one batched ``load_prefixes`` call (in auto mode short
    prompts resume KV-only and long ones in a state form, in the same call; some share a
    resume point, so they share a fold); output is the full forward's."""
    llm = _llm(loaded[arch], mode, max_num_seqs=16)
    _one_by_one(llm, [BASE])                                   # cache the base prompt
    calls, forms = [], set()
    orig = llm.cache.load_prefixes

    def spy(reqs):
        calls.append(len(reqs))
        forms.update(llm.cache.mode_of(r[0]) for r in reqs)
        return orig(reqs)

    llm.cache.load_prefixes = spy
    batch = PROMPTS[1:] + [BASE[:17] + _tail(17), BASE[:9] + _tail(9)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = llm.generate(batch, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == [expected(arch, p) for p in batch]
    assert calls and max(calls) >= 8                        # resumed together, not one by one
    assert forms == ({"kv", "replay"} if mode == "auto" else {"recurrent"})
    assert all(b.ref == 0 for b in llm.prefix_cache.index._by_hash.values())


@pytest.mark.parametrize("arch,method", [("mamba2", "ngram"), ("mamba2", "draft"), ("mamba2", "tree"),
                                         ("nemotron_h", "draft"), ("qwen3_next", "tree")])
def test_speculation_with_prefix_caching(loaded, expected, arch, method):
    m = loaded[arch]
    sp = {"ngram": SpeculativeConfig("ngram", num_tokens=2),
          "draft": SpeculativeConfig("draft", num_tokens=2, draft_model=m),
          "tree": SpeculativeConfig("tree", draft_model=m, tree_width=2, tree_depth=2)}[method]
    llm = _llm(m, "kv" if arch == "nemotron_h" else "replay", speculative=sp, buffer_size=None)
    prompts = PROMPTS[:4] + PROMPTS[-2:]
    assert _one_by_one(llm, prompts) == [expected(arch, p) for p in prompts]
    assert llm.stats["prefix_hit_tokens"] == sum(HITS[:4] + HITS[-2:])


@pytest.mark.parametrize("budget", [3, 7])
@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_chunked_prefill_at_any_budget(loaded, expected, arch, budget):
    """Chunks the budget cuts short end on checkpoint boundaries (their state is the
    checkpoint); hits continue in chunks from any token."""
    llm = _llm(loaded[arch], "replay", max_num_batched_tokens=budget)
    calls = []
    orig = llm.cache.prefix_checkpoints
    llm.cache.prefix_checkpoints = lambda jobs: (calls.extend(j.get("slot") for j in jobs), orig(jobs))
    prompts = PROMPTS[:3] + PROMPTS[-2:]
    assert _one_by_one(llm, prompts) == [expected(arch, p) for p in prompts]
    assert calls and (budget == 3 or all(s is not None for s in calls))   # 7 never crosses a boundary mid-chunk


@pytest.mark.parametrize("mode", ["replay", "recurrent", "kv"])
@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_a_chunk_ends_on_the_last_checkpoint_it_crosses(loaded, expected, arch, mode):
    """A 37-token prompt with an unlimited budget is one chunk in every form: its checkpoints
    8..32 are folds.  With a budget of 20 tokens a chunk that stops short of the prompt's end
    ends on the last boundary it crosses (16, then 32: in a state form those checkpoints are
    the slot's state, copies; 8 and 24 fold); KV-only slots keep the budget's chunks and fold
    every checkpoint.  Output is the full forward's either way."""
    prompt = BASE[:37]
    for budget, want_chunks, want_copies in ((None, [37], 0), (20, [16, 16, 5], 2)):
        llm = _llm(loaded[arch], mode, **({} if budget is None else {"max_num_batched_tokens": budget}))
        jobs, chunks = [], []
        orig_ck, orig_align = llm.cache.prefix_checkpoints, llm.prefix_cache.align
        llm.cache.prefix_checkpoints = lambda js: (jobs.extend(js), orig_ck(js))
        llm.prefix_cache.align = lambda seq, n: chunks.append(orig_align(seq, n)) or chunks[-1]
        assert _one_by_one(llm, [prompt]) == [expected(arch, prompt)]
        from_slot = [j["row"] for j in jobs if j.get("slot") is not None]
        folded = sorted(j["stop"] for j in jobs if j.get("slot") is None)
        if mode == "kv":
            assert from_slot == [] and folded == [8, 16, 24, 32]
        else:
            assert chunks == want_chunks, budget
            assert len(from_slot) == want_copies and len(folded) == 4 - want_copies


def test_concurrent_requests_n_samples_and_joining_mid_flight(loaded, expected):
    """Requests admitted together all miss (nothing cached yet) and compute the same blocks:
    the first to finish a block caches it, the others keep theirs.  A request joining while
    they run reads their cached blocks (attention blocks shared with running sequences); n
    samples fork from a resumed first sample."""
    arch = "nemotron_h"
    llm = _llm(loaded[arch], "replay", max_num_seqs=8)
    first = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[6])]
    llm.step()
    llm.step()
    late = llm.add_request(PROMPTS[3], SamplingParams(max_tokens=N))
    pair = llm.add_request(PROMPTS[4], SamplingParams(max_tokens=N, n=2))
    while llm.has_unfinished():
        llm.step()
    for s, p in zip(first, (PROMPTS[0], PROMPTS[1], PROMPTS[6])):
        assert llm.output(s).token_ids == expected(arch, p)
    assert llm.output(late).token_ids == expected(arch, PROMPTS[3])
    assert [llm.output(s).token_ids for s in pair.group] == [expected(arch, PROMPTS[4])] * 2
    assert llm.stats["prefix_hit_tokens"] == HITS[3] + HITS[4]
    assert llm.scheduler.reserved == 0


def test_aborts_give_every_reference_back(loaded, expected):
    """Requests aborted before their resume, mid-prompt and while decoding hold nothing
    afterwards; the cache keeps serving hits."""
    arch = "nemotron_h"
    llm = _llm(loaded[arch], "replay", max_num_batched_tokens=6)
    _one_by_one(llm, [PROMPTS[0]])
    a = llm.add_request(PROMPTS[10], SamplingParams(max_tokens=N))          # admitted, not yet resumed
    b = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=N))
    llm.scheduler.schedule()                                                # admit without running
    llm.abort(a.request_id)
    llm.step()                                                              # b resumed, prefills a chunk
    llm.abort(b.request_id)
    c = llm.add_request(PROMPTS[5], SamplingParams(max_tokens=N))
    while not c.output_ids:
        llm.step()
    llm.abort(c.request_id)
    ix = llm.prefix_cache.index
    assert all(blk.ref == 0 for blk in ix._by_hash.values()) and llm.scheduler.reserved == 0
    assert ix.free_blocks + len(ix) == ix.num_blocks
    assert _one_by_one(llm, [PROMPTS[4]]) == [expected(arch, PROMPTS[4])]


@pytest.mark.parametrize("arch,mode", [("mamba2", "replay"), ("qwen3_next", "recurrent"), ("nemotron_h", "kv")])
def test_a_prefix_evicted_between_two_requests(loaded, expected, arch, mode):
    """A cached prompt evicted whole by another one before it is asked again is a miss and is
    recomputed; one whose last block (the LRU leaf) was evicted resumes where what is left
    of its chain ends (a checkpoint plus the entries after it), exactly (freed blocks poisoned)."""
    other = [(5 * i + 1) % 61 for i in range(40)]
    llm = _llm(loaded[arch], mode, prefix_cache_blocks=10)
    prompts = [PROMPTS[0], other, PROMPTS[2], PROMPTS[1]]
    assert _one_by_one(llm, prompts) == [expected(arch, p) for p in prompts]
    s = llm.prefix_stats()
    assert s["prefix_evictions"] >= 10 and s["prefix_cached_blocks"] <= 10
    assert s["prefix_hit_tokens"] == 8            # BASE evicted by `other`; PROMPTS[1] hits PROMPTS[2]'s blocks
    # 13 blocks: BASE takes 10, a 4-block prompt evicts BASE's last block only (prompts only:
    # replies are not cached here, they would take blocks too)
    llm = _llm(loaded[arch], mode, prefix_cache_blocks=13, prefix_cache_replies=False)
    _poison_frees(llm)
    prompts = [BASE, other[:16], BASE, PROMPTS[8]]
    hits = []
    for p in prompts:
        before = llm.stats["prefix_hit_tokens"]
        assert _one_by_one(llm, [p]) == [expected(arch, p)]
        hits.append(llm.stats["prefix_hit_tokens"] - before)
    # evicted: BASE's last block, then `other`'s last two (BASE's block 9 captured again, the
    # copy of the block PROMPTS[8] matches 3 tokens into)
    assert hits == [0, 0, 36, 23] and llm.prefix_stats()["prefix_evictions"] == 3
    assert all(b.ref == 0 for b in llm.prefix_cache.index._by_hash.values())


def _poison_frees(llm):
    """Fill every store block, checkpoint and attention block with NaN the moment it is freed
    (what a read of a block in use after its eviction would see)."""
    cache, ix = llm.cache, llm.prefix_cache.index
    ssm = [st for st in cache.layers.values() if "prefix" in st]
    bs = cache.spec.block_size

    def poison_store(b):
        for st in ssm:
            for t in st["prefix"].token_tensors():
                t[b * bs:(b + 1) * bs] = float("nan")

    orig_evicted, orig_free = ix.on_evict, ix.free_block

    def on_evict(blk):
        poison_store(blk.store)
        if blk.ckpt is not None:
            for st in ssm:
                st["prefix"].ckpt[blk.ckpt] = float("nan")
        orig_evicted(blk)

    def free_block(b):
        poison_store(b)
        orig_free(b)

    ix.on_evict, ix.free_block = on_evict, free_block
    if cache.attn is not None:
        attn, orig_unref = cache.attn, cache.attn._unref

        def unref(blocks):
            blocks = list(blocks)
            orig_unref(blocks)
            for b in blocks:
                if attn.refcount(b) == 0:
                    for st in cache.layers.values():
                        if "k" in st:
                            st["k"][b] = float("nan")
                            st["v"][b] = float("nan")

        attn._unref = unref


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_tight_budget_evicts_only_unused_blocks(loaded, expected, mode):
    """A budget for few sequences and a store of a few blocks, many requests sharing
    prefixes at once: blocks are evicted all the time, and every freed block is poisoned,
    yet every output is the full forward's; the caches stay within the budget."""
    arch = "nemotron_h"
    m = loaded[arch]
    probe = _llm(m, mode, prefix_cache_blocks=12)
    budget = probe.plan.prefix_store.bytes + 3 * probe.plan.memory.need(50 + N + 1)
    llm = _llm(m, mode, prefix_cache_blocks=12, memory_budget=budget, max_num_seqs=8)
    _poison_frees(llm)
    lay = llm.plan.layout
    null = lay.slot_bytes + lay.block_bytes + lay.attn_block_bytes
    assert llm.cache.nbytes() <= budget + null
    prompts = PROMPTS[:9]
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in prompts]
    while llm.has_unfinished():
        llm.step()
        assert llm.scheduler.reserved <= llm.blocks.pool_bytes
    assert [llm.output(s).token_ids for s in seqs] == [expected(arch, p) for p in prompts]
    assert llm.prefix_stats()["prefix_evictions"] > 0
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS[9:]]   # hits after evictions
    while llm.has_unfinished():
        llm.step()
    assert [llm.output(s).token_ids for s in seqs] == [expected(arch, p) for p in PROMPTS[9:]]
    assert llm.scheduler.reserved == 0
    cached_attn = {b.attn for b in llm.prefix_cache.index._by_hash.values()}
    assert llm.cache.attn.free_blocks == llm.cache.attn.num_blocks - 1 - len(cached_attn)


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_blocks_a_request_reads_are_never_evicted(loaded, expected, arch):
    """A full store; a new prompt needing every block is admitted in the same step as a
    request resuming from the cached blocks, and captures first: it may evict only what no
    one holds (the cached prompt's last block), and the resumed request reads intact blocks
    (every evicted block is poisoned)."""
    llm = _llm(loaded[arch], "replay", prefix_cache_blocks=10)
    assert _one_by_one(llm, [PROMPTS[0]]) == [expected(arch, PROMPTS[0])]
    _poison_frees(llm)
    other = [(5 * i + 1) % 61 for i in range(40)]
    a = llm.add_request(other, SamplingParams(max_tokens=N))
    b = llm.add_request(PROMPTS[10], SamplingParams(max_tokens=N))          # resumes at token 33
    while llm.has_unfinished():
        llm.step()
    assert llm.output(a).token_ids == expected(arch, other)
    assert llm.output(b).token_ids == expected(arch, PROMPTS[10])
    assert llm.stats["prefix_hit_tokens"] == 33 and llm.prefix_stats()["prefix_evictions"] >= 1


def test_settings_are_validated(loaded):
    from recompute_model import tiny_pair

    m = loaded["mamba2"]
    for kw, field in ((dict(prefix_checkpoint_interval=6), "prefix_checkpoint_interval"),
                      (dict(prefix_cache_fraction=1.5), "prefix_cache_fraction"),
                      (dict(prefix_cache_blocks=0), "prefix_cache_blocks"),
                      (dict(enable_prefix_caching="yes"), "enable_prefix_caching")):
        with pytest.raises(ValueError, match=field):
            _llm(m, **kw)
    with pytest.raises(ValueError, match="prefix store"):
        LLM(tiny_pair()[0], enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prefix_cache_fraction"):
        _llm(m, memory_budget=10 ** 6, prefix_cache_fraction=0.001)


def test_stats_reach_the_server_metrics(loaded):
    pytest.importorskip("prometheus_client")
    from replayssm.server.metrics import ServerMetrics

    llm = _llm(loaded["mamba2"])
    _one_by_one(llm, PROMPTS[:3])
    occ = llm.occupancy()
    assert occ["prefix_hit_tokens"] == 17 and occ["prefix_query_tokens"] == sum(len(p) for p in PROMPTS[:3])

    class Loop:
        in_flight, step_failures = 0, 0

    metrics = ServerMetrics("tiny")
    metrics.refresh(llm, Loop())
    metrics.refresh(llm, Loop())                      # counters count each token once
    get = lambda name: metrics.registry.get_sample_value(name, {"model_name": "tiny"})  # noqa: E731
    assert get("replayssm:prefix_cache_hits_total") == 17
    assert get("replayssm:prefix_cache_queries_total") == occ["prefix_query_tokens"]
    assert get("replayssm:prefix_cache_hit_rate") == pytest.approx(occ["prefix_hit_rate"])
    assert get("replayssm:prefix_cache_blocks_saved_total") == 4
    assert get("replayssm:prefix_cache_blocks") == occ["prefix_cached_blocks"] > 0


def test_serve_flag_builds_a_caching_engine():
    from replayssm.server.cli import build_engine, build_parser

    args = build_parser().parse_args(["MODEL", "--enable-prefix-caching", "--prefix-checkpoint-interval", "32",
                                      "--device", "cpu", "--max-num-seqs", "2", "--max-seq-len", "128"])
    from pathlib import Path

    llm = build_engine(str(Path(__file__).resolve().parents[2] / "replayssm" / "assets" / "tiny-mamba2"), args)
    assert llm.prefix_cache is not None and llm.prefix_cache.interval == 32


def test_eviction_queue_stays_bounded():
    """Blocks used over and over without being evicted leave no pile of stale queue entries."""
    ix = _index(blocks=4)
    chain = _insert_chain(ix, list(range(16)))
    for _ in range(2000):
        ix.acquire(chain)
        ix.release(chain)
    assert len(ix._heap) <= 4 * len(ix) + 64 + 4
    assert ix.alloc_block() == chain[-1].store           # still LRU over leaves
