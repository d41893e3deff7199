"""MTP speculation in the engine: greedy output equals plain decoding for the three model
types in every decode form, chains and trees; every proposal equals the MTP head's drafts
recomputed without a cache; speculative sampling stays lossless."""

from __future__ import annotations

import os
import random
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402
from engine_helpers import reference_greedy  # noqa: E402
import mtp_checkpoint as M  # noqa: E402
from test_engine_sampling import assert_first_three_follow, joint3  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.layers.context import StepContext  # noqa: E402
from replayssm.models import load_model  # noqa: E402

N = 14
MAXLEN = 64
_rng = random.Random(0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9] * 12, [_rng.randrange(61) for _ in range(20)]]
# the fc's noise sets how often the head guesses wrong: acceptance in between, so catch-ups of
# every length and rejected drafts both occur
NOISE = {"mamba2": 0.8, "qwen3_next": 1.5, "nemotron_h": 1.5}
ARCHS = list(NOISE)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """``name -> (our float64 model with head, its greedy continuations of PROMPTS, dir)``."""
    root = tmp_path_factory.mktemp("engine_mtp")
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name in ARCHS:
        fn, over = H.SPECS[name]
        d = str(root / name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(seed=1, **over).save_pretrained(d)
        M.add_mtp(d, seed=3)
        M.make_predictable(d, seed=1, mtp_noise=NOISE[name])
        m = load_model(d, dtype="float64", mtp=True)
        out[name] = (m, [reference_greedy(m, p, N) for p in PROMPTS], d)
    torch.set_num_threads(threads)
    return out


def _spec(tree):
    return SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2)


@pytest.mark.parametrize("tree", [None, "topk"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_speculation_keeps_greedy_output(mtp_models, arch, mode, tree):
    m, expected, _ = mtp_models[arch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(m, dtype="float64", decode_mode=mode, speculative=_spec(tree), auto_threshold=10,
                  max_seq_len=MAXLEN, pad_batches=(mode == "replay"))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    acc = [o.mean_accepted_length for o in outs]
    assert max(acc) > 1.5 and min(acc) < 4.0, acc   # long accepts and rejections both happened


@pytest.mark.parametrize("tree", [None, "topk"])
def test_mtp_with_chunked_prefill_and_forked_samples(mtp_models, tree):
    """Prompts prefilled in chunks of a few tokens (the head reads every chunk's hidden
    states) and n greedy samples forked from one prefill (the kept hidden states and the
    prompt's travel with the fork) keep the greedy output."""
    m, expected, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=_spec(tree), max_seq_len=MAXLEN, max_num_batched_tokens=5)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    forked = LLM(m, dtype="float64", speculative=_spec(tree), max_seq_len=MAXLEN, max_num_seqs=4)
    out = forked.generate([PROMPTS[3]], SamplingParams(max_tokens=N, n=3))[0]
    assert [s.token_ids for s in out.samples] == [expected[3]] * 3
    assert forked.runner.num_calls["prefill"] == 1
    alone = forked.generate([PROMPTS[3]], SamplingParams(max_tokens=N))[0]   # the same drafts, accepted alike
    assert [s.num_accepted for s in out.samples] == [alone.num_accepted] * 3


def test_mtp_head_over_the_computed_part_of_a_prompt(mtp_models):
    """When the target computed only the last tokens of a prompt (a prefix it did not
    recompute), the head runs over the pairs it has hidden states for: same output."""
    m, expected, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=_spec(None), max_seq_len=MAXLEN)
    take = llm.cache.take_prompt_hidden
    llm.cache.take_prompt_hidden = lambda slot: (lambda ph: None if ph is None else ph[-3:])(take(slot))
    assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N))] == expected


def test_mtp_preempts_a_request_whose_prompt_left_the_head_no_pair(mtp_models):
    """A one-token prompt gives the head no pair to prefill: its slot starts empty
    (``ModelCache.start``) and swaps out and back like the others, output unchanged."""
    m, expected, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=_spec(None), max_seq_len=MAXLEN)
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS]
    step = 0
    while llm.has_unfinished():
        llm.step()
        step += 1
        if step % 2 == 0:
            for s in [s for s in llm.scheduler.running if not s.prefilling]:
                llm.scheduler.preempt(s)
    assert [s.output_ids for s in seqs] == expected
    assert llm.stats["preemptions"] >= len(PROMPTS)
    with pytest.raises(ValueError, match="start: slot must be a free slot"):
        llm.drafter.cache.start(0)


def test_mtp_recover_forgets_a_half_done_draft_step(mtp_models):
    """A step that fails after the head's tentative verify leaves nothing pending."""
    m, expected, _ = mtp_models["mamba2"]
    llm = LLM(m, dtype="float64", speculative=_spec(None), max_seq_len=MAXLEN)
    drafter = llm.drafter
    slots = torch.tensor([1])
    drafter.cache._in_use.add(1)
    drafter.head.verify(drafter.cache, slots, torch.tensor([[3, 4]]), torch.randn(1, 2, m.config.hidden_size,
                                                                                 dtype=torch.float64))
    assert drafter.cache.pending is not None
    llm.recover()
    assert drafter.cache.pending is None
    drafter.cache._in_use.discard(1)
    drafter.cache.release([1])
    assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N))] == expected


# ---- every proposal against the head run without a cache ---------------------------------
def _hidden(model, ids):
    """The target's final-normed hidden states ``[1, T, D]`` (full forward)."""
    T = ids.shape[1]
    ctx = StepContext(kind="full", T=T, positions=torch.arange(T)[None])
    return model.final_norm()(model._trunk(ids, ctx))


def _reference(model, all_ids, parent, rank):
    """Tokens of the proposal the head makes after ``all_ids`` (its last token not yet seen by
    the target): node ``i``'s token is the ``rank[i]``-th choice after its parent, whose
    ``g`` comes from the head over every committed pair and the pairs along its path."""
    head = model.mtp
    x = torch.tensor([all_ids])
    h = _hidden(model, x[:, :-1])
    toks, hid = [x[:, 1:]], [h]
    g = {0: head(x[:, 1:], h)[:, -1]}
    path = {0: ([], [])}                    # node -> (tokens, hidden inputs) of its path's pairs
    out = [all_ids[-1]]
    for i in range(1, len(parent)):
        p = parent[i]
        tok = head.logits(g[p]).topk(rank[i] + 1, -1).indices[:, rank[i]]
        out.append(int(tok))
        pt, ph = path[p]
        path[i] = (pt + [tok[:, None]], ph + [g[p][:, None]])
        if any(parent[j] == i for j in range(i + 1, len(parent))):
            gi = head(torch.cat(toks + path[i][0], 1), torch.cat(hid + path[i][1], 1))
            g[i] = gi[:, -1]
    return out


def _check_proposals(m, drafter) -> list:
    """Wrap ``drafter.propose`` so every proposal is compared with the head recomputed without
    a cache (:func:`_reference`; a chain takes the top choice at every node); returns the list
    that collects, per checked row, the sequence's output length at the time."""
    checked, propose = [], drafter.propose

    def checking(seqs, k=None):
        prop = propose(seqs, k)
        n = prop.tokens.shape[1]
        for b, s in enumerate(seqs):
            rank = drafter.rank if drafter.tree else [0] * drafter.num_nodes
            want = _reference(m, s.all_ids, drafter.parent, rank)
            assert prop.tokens[b].tolist() == (want if drafter.tree else want[:n]), (s.all_ids, b)
            checked.append(len(s.output_ids))
        return prop

    drafter.propose = checking
    return checked


@pytest.mark.parametrize("tree", [None, "topk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_equal_the_head_without_cache(mtp_models, arch, tree):
    m, expected, _ = mtp_models[arch]
    mode = {"mamba2": "replay", "qwen3_next": "auto", "nemotron_h": "recurrent"}[arch]
    llm = LLM(m, dtype="float64", decode_mode=mode, speculative=_spec(tree), auto_threshold=10, max_seq_len=MAXLEN)
    drafter = llm.drafter
    checked = _check_proposals(m, drafter)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert len(checked) > len(PROMPTS) * 3


# ---- sampling -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab4(tmp_path_factory):
    """A tiny Mamba-2 over 4 tokens with a random MTP head (its guesses differ from the target)."""
    d = str(tmp_path_factory.mktemp("mtp_v4") / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        H.tiny_mamba2(seed=2, vocab_size=4, num_hidden_layers=2).save_pretrained(d)
    M.add_mtp(d, seed=5)
    return load_model(d, dtype="float64", mtp=True)


@pytest.mark.parametrize("tree", [None, "topk"])
def test_mtp_speculative_sampling_distribution(vocab4, tree):
    """The first three sampled tokens (two of them from MTP speculative steps) follow the
    model's own joint distribution (chi-square over the 64 cells)."""
    target, prompt = vocab4, [1, 2]
    expect = joint3(target, prompt)
    sp = SpeculativeConfig("mtp", num_tokens=2, tree=tree, tree_width=2)
    llm = LLM(target, dtype="float64", speculative=sp, max_num_seqs=256, seed=3, max_seq_len=16)
    M_ = 4000
    outs = llm.generate([prompt] * M_, SamplingParams(max_tokens=3, temperature=1.0))
    assert_first_three_follow(outs, expect)
    assert 0 < sum(o.num_accepted for o in outs) < sum(o.num_drafted for o in outs)


def test_seeded_mtp_sampling_is_reproducible_and_mixes_with_greedy(mtp_models):
    m, expected, _ = mtp_models["qwen3_next"]
    sp = SpeculativeConfig("mtp", num_tokens=3)
    params = [SamplingParams(max_tokens=N, temperature=0.8, seed=7), SamplingParams(max_tokens=N),
              SamplingParams(max_tokens=N, temperature=1.0, top_k=5, seed=9)]
    runs = [[o.token_ids for o in LLM(m, dtype="float64", speculative=sp, max_seq_len=MAXLEN)
             .generate(PROMPTS[:3], params)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][1] == expected[1]             # the greedy request in a sampling batch


def test_cli_generate_with_mtp(mtp_models, capsys):
    from replayssm.engine import cli

    _, expected, d = mtp_models["mamba2"]
    rc = cli.main(["--model", d, "--token-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", str(N),
                   "--dtype", "float64", "--speculative", "mtp", "--num-tokens", "3"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert cap.out.split() == [str(t) for t in expected[0]]
    assert "speculative=mtp" in cap.err


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_mtp_with_prefix_caching_keeps_greedy_output(mtp_models, arch):
    """A prefix-cache hit skips the cached tokens' prefill, so the target keeps no hidden
    states for them: the head drafts from the computed part, and output stays greedy-exact
    for hits (one request after another, sharing prompts and a prefix)."""
    m, expected, _ = mtp_models[arch]
    shared = PROMPTS[3]
    prompts = [shared, shared, shared[:13] + [5, 6], PROMPTS[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = LLM(m, dtype="float64", decode_mode="recurrent", max_seq_len=MAXLEN)
        want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=N))]
        llm = LLM(m, dtype="float64", decode_mode="replay", speculative=_spec(None), max_seq_len=MAXLEN,
                  enable_prefix_caching=True, kv_block_size=4, prefix_checkpoint_interval=8)
        got = [llm.generate([p], SamplingParams(max_tokens=N))[0].token_ids for p in prompts]
    assert got == want
    assert want[0] == expected[3]
    assert llm.stats["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("tree,window", [(None, 0), ("topk", 0), (None, 16), ("topk", 3)])
@pytest.mark.parametrize("mode", ["replay", "recurrent"])
def test_mtp_head_stays_exact_across_steps_without_speculation(mtp_models, mode, tree, window):
    """``disable_by_batch_size=2``: while 3-4 requests run, steps decode plainly (without a
    window the head commits its pending pairs before each; with one they wait in the window,
    committed when drafting resumes or the window fills); once 2 are left they speculate.
    Greedy output is unchanged, and the head's first-draft logits equal those of an
    always-speculating run at the same position of the same request (its cache holds the
    same pairs either way)."""
    import dataclasses

    m, expected, _ = mtp_models["qwen3_next"]
    lens = [N, N - 2, 6, 4]

    def run(limit):
        sp = dataclasses.replace(_spec(tree), disable_by_batch_size=limit, mtp_window=window)
        llm = LLM(m, dtype="float64", decode_mode=mode, speculative=sp, max_seq_len=MAXLEN, max_num_seqs=4)
        first, order, cur = {}, {}, {"keys": None}
        propose, head_logits = llm.drafter.propose, llm.drafter.head.logits

        def recording(batch, k=None):     # (request, tokens generated so far) of each row
            cur["keys"] = [(order[id(s)], len(s.output_ids)) for s in batch]
            return propose(batch, k)

        def logits(g):            # the first call of a proposal: draft 1's distribution
            out = head_logits(g)
            if cur["keys"] is not None:
                first.update({k: row.clone() for k, row in zip(cur["keys"], out)})
                cur["keys"] = None
            return out

        llm.drafter.propose, llm.drafter.head.logits = recording, logits
        widths = []   # pairs per row of each catch-up before a plain step
        for r in (llm.drafter.steps.plain_runner, llm.drafter.steps.plain_runner1):
            r.run = (lambda run: lambda *a: (widths.append(a[1].shape[1]), run(*a))[1])(r.run)
        seqs = [llm.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, lens)]
        order.update({id(s): i for i, s in enumerate(seqs)})
        while llm.has_unfinished():
            llm.step()
        assert [s.output_ids for s in seqs] == [e[:n] for e, n in zip(expected, lens)]
        return first, seqs, widths, llm.drafter

    always, _, _, _ = run(None)
    limited, seqs, widths, drafter = run(2)
    assert all(s.num_verify_steps < s.num_steps for s in seqs[:2])   # plain steps happened
    if window:   # no catch-up before a plain step: the window passes commit the pairs
        assert widths == [] and drafter.num_deferred > 0 and drafter.num_flushes > 0
        assert drafter.window == -(-window // drafter.width) * drafter.width
    else:   # runs of plain steps catch up one pair per row; after a prefill the pending pairs
        # are also one per row
        assert set(widths) == {1}, widths
    common = sorted(set(always) & set(limited))
    assert common, "no position was drafted in both runs"
    for k in common:
        torch.testing.assert_close(limited[k], always[k], rtol=1e-9, atol=1e-9, msg=f"request, position {k}")


@pytest.mark.parametrize("tree", [None, "topk"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_mtp_with_forced_random_draft_lengths_keeps_greedy_output(mtp_models, mode, tree):
    """The length policy forced through random draft lengths, 0 (plain steps: the head
    commits its pending pairs first) included: greedy output equals plain decoding."""
    from replayssm.engine.spec.policy import ScriptedLengths

    m, expected, _ = mtp_models["nemotron_h"]
    rng = random.Random(len(mode))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(m, dtype="float64", decode_mode=mode, speculative=_spec(tree), auto_threshold=10,
                  max_seq_len=MAXLEN, pad_batches=(mode == "replay"))
        L = llm.executor.lengths
        llm.executor.lengths = ScriptedLengths(
            L.lengths, [0 if i % 3 == 1 else rng.randrange(L.max + 1) for i in range(40)], L.tree, L.depth)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    hist = {T: llm.stats[f"spec_T{T}_steps"] for T in (0,) + L.lengths}
    assert hist[0] > 0 and sum(v for T, v in hist.items() if T) > 0, hist
    if tree is None:   # chains of several lengths were verified
        assert sum(hist[T] > 0 for T in L.lengths) >= 2, hist



@pytest.mark.parametrize("tree", [None, "topk"])
def test_mtp_adaptive_policy_keeps_plain_replays_greedy_output(mtp_models, tree):
    """The adaptive policy in replay form with a table where drafting pays at one or two rows
    and loses at more: plain steps while the batch is full, MTP drafts once it drains, and
    every output equals plain replay's."""
    from replayssm.engine.spec.policy import AdaptiveLengths

    m, expected, _ = mtp_models["mamba2"]
    lens = _spec(tree).candidate_lengths
    table = {(b, t): 1.0 + (0.5 * t * b if b > 2 else 0.0) for b in (1, 2, 4, 8) for t in (0,) + lens}
    sp = SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2, step_costs=table)
    params = [SamplingParams(max_tokens=N if i in (0, 3) else N // 2) for i in range(len(PROMPTS))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = LLM(m, dtype="float64", decode_mode="replay", max_seq_len=MAXLEN, pad_batches=True)
        base = [o.token_ids for o in plain.generate(PROMPTS, params)]
        llm = LLM(m, dtype="float64", decode_mode="replay", speculative=sp, max_seq_len=MAXLEN, pad_batches=True)
        outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert outs == base == [e[:p.max_tokens] for e, p in zip(expected, params)]
    L = llm.executor.lengths
    hist = {T: llm.stats.get(f"spec_T{T}_steps", 0) for T in (0,) + L.lengths}
    assert isinstance(L, AdaptiveLengths) and hist[0] > 0 and sum(hist.values()) - hist[0] > L.probes, hist


@pytest.mark.parametrize("mode", ["replay", "kv"])
@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_plain_step_runs_catch_up_one_pair_per_row_and_proposals_stay_the_heads(mtp_models, arch, mode):
    """Scripted lengths with runs of plain steps: the catch-up before a plain step that
    follows a speculative one takes up to K+1 pairs per row, the one before a plain step that
    follows a plain step one pair per row; every later proposal equals the head's own drafts
    recomputed without a cache, and the output equals plain decoding."""
    from replayssm.engine.spec.policy import ScriptedLengths

    import dataclasses

    m, expected, _ = mtp_models[arch]
    llm = LLM(m, dtype="float64", decode_mode=mode, speculative=dataclasses.replace(_spec(None), mtp_window=0),
              max_seq_len=MAXLEN, pad_batches=(mode == "replay"))
    L, drafter = llm.executor.lengths, llm.drafter
    llm.executor.lengths = ScriptedLengths(L.lengths, [3, 0, 0, 0, 2, 0, 3, 0, 0, 1], L.tree, L.depth)
    widths = []
    for r in (drafter.steps.plain_runner, drafter.steps.plain_runner1):
        r.run = (lambda run: lambda *a: (widths.append((a[1].shape[1], a[3].max().item())), run(*a))[1])(r.run)
    checked = _check_proposals(m, drafter)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert {w for w, _ in widths} == {1, drafter.width}, widths
    assert all(c == 1 for w, c in widths if w == 1) and max(c for _, c in widths) > 1, widths
    assert checked

@pytest.mark.parametrize("tree", [None, "topk"])
def test_cost_table_adds_the_mtp_draft_step_and_leaves_requests_exact(mtp_models, tree):
    """The adaptive policy's start-up table (CUDA's; callable anywhere) prices a step of ``T``
    drafts as the verify step plus the head's draft step, and ``T = 0`` as a decode step plus
    the head's catch-up.  The drafter's probe covers every bucket and length; run between
    steps of live requests it writes only the null slot's entries (row 0 of the head's
    stores, nothing of the target's cache), and the outputs stay exact."""
    from replayssm.engine.warmup import measure_catchup_costs, measure_draft_costs

    m, expected, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=_spec(tree), max_seq_len=MAXLEN, max_num_seqs=5, pad_batches=True)
    L, buckets = llm.executor.lengths, llm.runner.buckets
    keys = {(b, T) for b in buckets for T in (0,) + L.lengths}
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS]
    for _ in range(3):
        llm.step()
    head, target = [t.clone() for t in llm.drafter.cache.tensors()], [t.clone() for t in llm.cache.tensors()]
    window = llm.drafter.steps.stash_buf.clone()
    draft = measure_draft_costs(llm.drafter, buckets, L.lengths, llm.device, reps=1)
    assert set(draft) == keys and all(v > 0 for v in draft.values())
    passes = measure_catchup_costs(llm.drafter, buckets, llm.device, reps=1)
    assert set(passes) == set(buckets) and all(v > 0 for v in passes.values())
    table = llm.executor._cost_table(L, reps=1)
    assert set(table) == keys and all(v > 0 for v in table.values())
    assert all(L.costs.table[k] == table[k] for k in keys)
    assert all(L.costs.catchup_cost(b) > 0 for b in buckets) and L.passes == llm.drafter.catchup_passes
    assert torch.equal(window[1:], llm.drafter.steps.stash_buf[1:])
    for a, b in zip(head, llm.drafter.cache.tensors()):
        assert torch.equal(a[1:], b[1:])
    for a, b in zip(target, llm.cache.tensors()):   # the verify/decode probes: null slot only
        assert torch.equal(a[1:], b[1:])
    while llm.has_unfinished():
        llm.step()
    assert [s.output_ids for s in seqs] == expected
    for bad in [(0, 1), (2, -1), (2, L.max + 1 if tree is None else 99), (True, 1)]:
        with pytest.raises(ValueError, match="draft-step probe"):
            llm.drafter.null_step(*bad)


@pytest.mark.parametrize("mode,window,preempt", [("replay", 16, False), ("kv", 4, True), ("recurrent", 8, True),
                                                 ("auto", 4, False)])
def test_mtp_window_defers_catch_up_and_proposals_stay_the_heads(mtp_models, mode, window, preempt):
    """Scripted lengths with runs of plain steps longer than the window, rows of different
    lengths (some finish with pairs still deferred), chunked prefill and (some cases)
    preemption every few steps: no catch-up runs before a plain step (the pairs wait in the
    window; a full window is committed before the plain step, the rest when drafting
    resumes), every proposal equals the head's drafts recomputed without a cache over all
    pairs (nothing lost), and the output equals plain decoding."""
    import dataclasses

    from replayssm.engine.spec.policy import ScriptedLengths

    m, expected, _ = mtp_models["qwen3_next"]
    sp = dataclasses.replace(_spec(None), mtp_window=window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(m, dtype="float64", decode_mode=mode, speculative=sp, max_seq_len=MAXLEN, auto_threshold=10,
                  pad_batches=(mode == "replay"), max_num_batched_tokens=8)
    L, drafter = llm.executor.lengths, llm.drafter
    llm.executor.lengths = ScriptedLengths(L.lengths, [3] + [0] * 9 + [2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3], L.tree,
                                           L.depth)
    ran = []
    for r in (drafter.steps.plain_runner, drafter.steps.plain_runner1):
        r.run = (lambda run: lambda *a: (ran.append(a), run(*a))[1])(r.run)
    checked = _check_proposals(m, drafter)
    lens = [N, 5, N - 3, 9]
    seqs = [llm.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, lens)]
    step = 0
    while llm.has_unfinished():
        llm.step()
        step += 1
        if preempt and step % 5 == 0:
            for s in [s for s in llm.scheduler.running if not s.prefilling][:2]:
                llm.scheduler.preempt(s)
    assert [s.output_ids for s in seqs] == [e[:n] for e, n in zip(expected, lens)]
    assert ran == [] and checked and drafter.num_deferred > 0 and drafter.num_flushes > 0
    assert drafter._stashed == {} and drafter._nodes == {}
    if preempt:
        assert llm.stats["preemptions"] > 0


def test_mtp_window_bad_input_and_pass_counts(mtp_models):
    """``mtp_window`` must be an int >= 0; the window is whole passes; ``catchup_passes``
    counts the passes a step runs first (speculative: all deferred pairs; plain: only a
    window about to overflow); a stash beyond the window raises before any write."""
    import dataclasses

    from replayssm.engine.sequence import Sequence

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="mtp_window"):
            SpeculativeConfig("mtp", num_tokens=3, mtp_window=bad)
    m, _, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=dataclasses.replace(_spec(None), mtp_window=5), max_seq_len=MAXLEN)
    d = llm.drafter
    assert (d.width, d.window, d.chunks) == (4, 8, 2)
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=4), request_id=7)
    d._nodes[7], d._stashed[7] = [0, 1, 2], 5
    assert d.catchup_passes([s], 2) == 2 and d.catchup_passes([s], 0) == 0
    d._stashed[7] = 6
    assert d.catchup_passes([s], 0) == 2 and d.catchup_passes([s], 1) == 2
    d._stashed[7] = 0
    assert d.catchup_passes([s], 3) == 0
    before = d.steps.stash_buf.clone()
    with pytest.raises(ValueError, match="exceed the window"):
        d.steps.stash([(1, 0, [0]), (2, 7, [0, 1])])
    assert torch.equal(before, d.steps.stash_buf)
    assert d.null_flush(2) is not None and d.null_step(3, 0) is not None
    with pytest.raises(ValueError, match="draft-step probe"):
        d.null_flush(0)


# names whose call reads a device tensor on the host (a CUDA stream sync), or a host tensor's
# pageable copy; the graph bodies (replayed on CUDA, never run by the host) are exempt
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
               "masked_select", "unique", "repeat_interleave", "equal"}


@pytest.mark.parametrize("tree", [None, "topk"])
def test_no_host_read_between_propose_and_verify(mtp_models, tree):
    """From the start of ``propose`` to the verify step's return, and in a plain step's
    window write, the host reads no tensor (no ``.item()``, ``.tolist()``, ``bool()``,
    ``nonzero`` ...): each would wait for the device on CUDA.  The graph bodies are exempt
    (on CUDA they are replays); tensors reach the device through ``host_to_device``."""
    from torch.overrides import TorchFunctionMode

    from replayssm.engine.spec.policy import ScriptedLengths

    m, expected, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=_spec(tree), max_seq_len=MAXLEN, pad_batches=True)
    d, st, runner = llm.drafter, llm.drafter.steps, llm.runner
    depth, hits = {"body": 0, "window": 0}, []

    def body(f):
        def g(*a, **k):
            depth["body"] += 1
            try:
                return f(*a, **k)
            finally:
                depth["body"] -= 1
        return g

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if depth["window"] and not depth["body"] and getattr(func, "__name__", "") in _HOST_READS:
                hits.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def window(f):
        def g(*a, **k):
            depth["window"] += 1
            try:
                return f(*a, **k)
            finally:
                depth["window"] -= 1
        return g

    for r in (st.runner, st.plain_runner, st.plain_runner1, st.stash_runner):
        r.body = body(r.body)
    runner._greedy_body = body(runner._greedy_body)
    propose, verify = d.propose, runner.greedy_verify_step
    d.propose = lambda seqs, k=None: (depth.__setitem__("window", depth["window"] + 1), propose(seqs, k))[1]

    def closing(*a, **k):
        try:
            return verify(*a, **k)
        finally:
            depth["window"] -= 1

    runner.greedy_verify_step = closing
    d.plain_step = window(d.plain_step)
    L = llm.executor.lengths
    llm.executor.lengths = ScriptedLengths(L.lengths, [3, 0, 0, 2, 0, 1], L.tree, L.depth)
    with Reads():
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert llm.stats["spec_T0_steps"] > 0 and d.num_flushes > 0 and depth["window"] == 0
    assert hits == [], sorted(set(hits))
    depth["window"] = 1   # the check itself: a read in the window is caught

    with Reads():
        torch.ones(2).sum().item()
    assert hits == ["item"]


@pytest.mark.parametrize("tree", [None, "topk"])
@pytest.mark.parametrize("mode", ["replay", "kv", "recurrent", "auto"])
def test_fused_draft_and_verify_step_equals_the_two_steps(mtp_models, mode, tree):
    """``mtp_fused``: the head's draft step and the target's verify/accept/commit as one
    function (one graph per bucket and length on CUDA; run eagerly here, padded to buckets in
    replay form; trees over KV-only slots keep the two steps).  Stepped in lockstep with the
    unfused engine through scripted lengths (0 included), every step's outputs and both
    caches (the target's and the head's, every slot but the null one) are equal, and the
    output equals plain decoding."""
    import dataclasses

    from replayssm.engine.spec.policy import ScriptedLengths

    m, expected, _ = mtp_models["qwen3_next"]
    engines = []
    for fused in (False, True):
        sp = dataclasses.replace(_spec(tree), mtp_fused=fused, mtp_window=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(m, dtype="float64", decode_mode=mode, speculative=sp, auto_threshold=10, max_seq_len=MAXLEN,
                      pad_batches=(mode == "replay"))
        L = llm.executor.lengths
        llm.executor.lengths = ScriptedLengths(L.lengths, [3, 0, 2, 0, 0, 1, 3], L.tree, L.depth)
        engines.append(llm)
    plain, fused = engines
    assert plain.drafter.fused is None and fused.drafter.fused is not None
    calls = []
    body = fused.drafter.fused.body
    fused.drafter.fused.body = lambda *a: (calls.append(a[-1]), body(*a))[1]
    lens = [N, 6, N - 2, 9]
    seqs = [[llm.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, lens)] for llm in engines]
    while plain.has_unfinished() or fused.has_unfinished():
        a, b = plain.step(), fused.step()
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(plain.cache.tensors() + plain.drafter.cache.tensors(),
                        fused.cache.tensors() + fused.drafter.cache.tensors()):
            assert torch.equal(x[1:], y[1:])
    assert [s.output_ids for s in seqs[1]] == [s.output_ids for s in seqs[0]] == [e[:n] for e, n in
                                                                                  zip(expected, lens)]
    counts = {k: v for k, v in plain.stats.items() if isinstance(v, int)}
    assert counts == {k: v for k, v in fused.stats.items() if isinstance(v, int)}
    assert bool(calls) == (not tree or mode != "kv")   # trees over KV-only slots: the two steps
    assert fused.runner.num_calls == plain.runner.num_calls


def test_fused_step_falls_back_for_sampling_rows_and_bad_config(mtp_models):
    """Sampling rows use the two steps (the fused graph is greedy); ``mtp_fused`` is MTP's."""
    import dataclasses

    with pytest.raises(ValueError, match="mtp_fused"):
        SpeculativeConfig("ngram", mtp_fused=True)
    with pytest.raises(ValueError, match="mtp_fused must be a bool"):
        SpeculativeConfig("mtp", mtp_fused=1)
    m, expected, _ = mtp_models["qwen3_next"]
    llm = LLM(m, dtype="float64", speculative=dataclasses.replace(_spec(None), mtp_fused=True), max_seq_len=MAXLEN)
    calls = []
    body = llm.drafter.fused.body
    llm.drafter.fused.body = lambda *a: (calls.append(a[-1]), body(*a))[1]
    out = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=N, temperature=0.8, seed=1),
                                     SamplingParams(max_tokens=N)])
    assert calls == [] and out[1].token_ids == expected[1] and len(out[0].token_ids) == N
    assert llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=N))[0].token_ids == expected[1] and calls
    # a failed fused capture (CUDA) leaves neither cache with a half-done verify
    d = llm.drafter
    d.cache._in_use.add(1)
    slots = torch.tensor([1])
    d.head.verify(d.cache, slots, torch.tensor([[3, 4]]), torch.randn(1, 2, m.config.hidden_size, dtype=torch.float64))
    m.verify(llm.cache, slots, torch.tensor([[3, 4]]))
    assert d.cache.pending is not None and llm.cache.pending is not None
    d.fused._drop_pending()
    assert d.cache.pending is None and llm.cache.pending is None
    d.cache._in_use.discard(1)
