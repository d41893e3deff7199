"""The per-step draft length (``spec.policy``): its arithmetic against plain references, its
choices against a brute-force argmax, and greedy output identical to plain decoding whatever
sequence of lengths (0 included) the engine is forced through."""

import itertools
import random

import pytest

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.spec.policy import (AcceptanceStats, AdaptiveLengths, FixedLengths, ScriptedLengths,
                                          StepCosts, analytic_step_cost, default_lengths, expected_tokens,
                                          length_policy)

from engine_helpers import PROMPTS, reference_greedy

N = 20


class _Seq:
    """A stand-in request (the policy only keys on identity)."""


# ---- arithmetic ------------------------------------------------------------------------------
def test_expected_tokens_is_the_mean_of_an_explicit_enumeration():
    """E(α, T) equals the mean tokens over every accept/reject outcome, weighted exactly."""
    alpha = [0.9, 0.55, 0.3, 0.05, 1.0]
    for T in range(len(alpha) + 1):
        mean = 0.0
        for outcome in itertools.product([0, 1], repeat=T):
            w = 1.0
            for a, o in zip(alpha, outcome):
                w *= a if o else 1 - a
            acc = next((i for i, o in enumerate(outcome) if not o), T)   # first rejection
            mean += w * (1 + acc)
        assert expected_tokens(alpha, T) == pytest.approx(mean, rel=1e-12), T
    assert expected_tokens([], 0) == 1.0
    with pytest.raises(ValueError, match="2 drafts need 2"):
        expected_tokens([0.5], 2)


def test_default_lengths_and_the_analytic_cost():
    assert default_lengths(1) == (1,)
    assert default_lengths(4) == (1, 2, 3, 4)
    assert default_lengths(5) == (1, 2, 4, 5)
    assert default_lengths(7) == (1, 2, 4, 7)
    assert default_lengths(8) == (1, 2, 4, 8)
    # memory-bound: equal costs at small batches; linear in tokens past the roofline's knee
    assert analytic_step_cost(1, 0) == analytic_step_cost(1, 7) == analytic_step_cost(64, 3) == 2.0
    assert analytic_step_cost(256, 0) == 2.0 and analytic_step_cost(256, 3) == 5.0


def _trial_lists(trace, D):
    """Per row and depth, the outcomes (1: accepted, 0: rejected) of every trial in order,
    read off an explicit walk of each row's drafts; and the same pooled over rows."""
    rows, pool = {}, [[] for _ in range(D)]
    for seqs, tried, accs in trace:
        for s, a in zip(seqs, accs):
            r = rows.setdefault(id(s), [[] for _ in range(D)])
            for depth in range(1, min(tried, D) + 1):
                if depth > a + 1:          # never reached: the draft above was rejected
                    break
                hit = int(depth <= a)
                r[depth - 1].append(hit)
                pool[depth - 1].append(hit)
    return rows, pool


def test_acceptance_stats_are_shrunk_counts():
    """Without forgetting, the pool's rate at depth j is (successes + s p_{j-1}) / (trials + s)
    from p_0 = prior, and a row's is (own successes + k p_j) / (own trials + k); a row's
    trials fade geometrically with row_memory; the pool keeps its last pool_memory trials."""
    rng = random.Random(5)
    D, prior, s_, k = 4, 0.4, 3.0, 5.0
    st = AcceptanceStats(D, prior, strength=s_, pool_memory=1e9, row_weight=k, row_memory=1e18)
    seqs = [_Seq() for _ in range(5)]
    trace = []
    for _ in range(30):
        rows = rng.sample(seqs, rng.randrange(1, 6))
        tried = rng.randrange(0, 6)          # 5 > D: deeper drafts are not tracked
        accs = [rng.randrange(tried + 1) for _ in rows]
        st.observe_batch(rows, tried, accs)
        trace.append((rows, tried, accs))
    per_row, pool = _trial_lists(trace, D)
    ref, p = [], prior
    for j in range(D):
        p = (sum(pool[j]) + s_ * p) / (len(pool[j]) + s_)
        ref.append(p)
        assert st.trials_at(j + 1) == len(pool[j])
    assert st.pooled == pytest.approx(ref, rel=1e-12)
    for s in seqs:
        if id(s) not in per_row:
            continue
        mine = [(sum(per_row[id(s)][j]) + k * ref[j]) / (len(per_row[id(s)][j]) + k) for j in range(D)]
        assert st.alpha(s) == pytest.approx(mine, rel=1e-12)
        assert st.expected(s) == pytest.approx([expected_tokens(mine, d) for d in range(D + 1)], rel=1e-12)
    fresh = _Seq()
    assert st.alpha(fresh) == st.pooled                       # a new request starts from the pool
    assert st.expected(fresh) == pytest.approx([expected_tokens(ref, d) for d in range(D + 1)], rel=1e-12)
    st.prune([fresh])
    assert st.alpha(seqs[0]) == st.pooled                     # forgotten; the pool keeps its counts
    # a depth never reached takes the rate above it (truncated geometric), not the prior
    g = AcceptanceStats(3, 0.5, strength=2.0)
    g.observe_batch([_Seq() for _ in range(200)], 1, [1] * 180 + [0] * 20)
    assert g.pooled[0] == pytest.approx(181 / 202) and g.pooled[1] == g.pooled[2] == g.pooled[0]
    # row memory: the j-th last trial weighs gamma^j
    gamma, r = 0.75, _Seq()
    m = AcceptanceStats(1, 0.5, row_weight=1.0, row_memory=4.0, pool_memory=1e9)
    hits = [1, 1, 0, 1, 0, 0, 1]
    for h in hits:
        m.observe(r, 1, h)
    w = [gamma ** (len(hits) - 1 - i) for i in range(len(hits))]
    pool = (sum(hits) + 2.0 * 0.5) / (len(hits) + 2.0)
    assert m.alpha(r)[0] == pytest.approx((sum(x * y for x, y in zip(w, hits)) + pool) / (sum(w) + 1.0), rel=1e-12)
    # pool memory: older trials fade proportionally past pool_memory
    q = AcceptanceStats(1, 0.5, strength=2.0, pool_memory=4.0)
    for _ in range(10):
        q.observe(_Seq(), 1, 1)
    q.observe(_Seq(), 1, 0)
    assert q.hits == pytest.approx([3.2]) and q.trials == [4.0] and q.pooled[0] == pytest.approx(4.2 / 6)
    with pytest.raises(ValueError, match="accepted"):
        st.observe(seqs[0], 1, 2)
    with pytest.raises(ValueError, match="rows"):
        st.observe_batch(seqs[:2], 1, [1])
    with pytest.raises(ValueError, match="tried"):
        st.observe(seqs[0], -1, 0)
    with pytest.raises(ValueError, match="depth"):
        AcceptanceStats(0)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceStats(2, prior=1.5)
    for kw in (dict(strength=0.0), dict(row_weight=-1.0), dict(pool_memory=0.5), dict(row_memory=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(kw))):
            AcceptanceStats(2, **kw)
    with pytest.raises(ValueError, match="trials_at"):
        st.trials_at(D + 1)


def test_step_costs_lookup_and_online_refinement():
    c = StepCosts({(1, 0): 1.0, (16, 0): 2.0, (16, 3): 3.0}, online=True, decay=0.5)
    assert c.get(1, 0) == 1.0 and c.get(8, 0) == 2.0 and c.get(999, 0) == 2.0   # next larger key, else the last
    assert c.get(4, 3) == 3.0
    assert c.get(4, 1) == analytic_step_cost(4, 1)                              # no key of that T
    c.observe(16, 3, 100.0)          # the first sample of a key is dropped (compile / capture)
    assert c.get(16, 3) == 3.0
    c.observe(16, 3, 6.0)            # then an EMA from the measured seed
    assert c.get(16, 3) == pytest.approx(3.0 + 0.5 * (6.0 - 3.0))
    c.observe(16, 3, 100.0)          # clipped to 4x, then EMA
    assert c.get(16, 3) == pytest.approx(4.5 + 0.5 * (18.0 - 4.5))
    c.observe(64, 2, 1.0)
    c.observe(64, 2, 7.0)            # a key without an entry takes its first kept sample
    assert c.get(64, 2) == 7.0
    c.observe(64, 2, 9.0, flush_part=4.0)   # less the flush time predicted in the step
    assert c.get(64, 2) == pytest.approx(7.0 + 0.5 * (5.0 - 7.0))
    off = StepCosts({(1, 0): 1.0})
    off.observe(1, 0, 5.0)
    off.observe(1, 0, 5.0)
    assert off.get(1, 0) == 1.0      # a given table stays as given
    for bad in ({(0, 0): 1.0}, {(1, -1): 1.0}, {(1, 0): 0.0}, {(1, 0): float("inf")}):
        with pytest.raises(ValueError, match="step cost table"):
            StepCosts(bad)
    with pytest.raises(ValueError, match="flush cost table"):
        StepCosts({(1, 0): 1.0}, flush={(1, 0): -1.0})
    with pytest.raises(ValueError, match="ring"):
        StepCosts({(1, 0): 1.0}, ring=0)


def _brute(policy, seqs):
    Bp = policy.bucket(len(seqs))
    best, arg = None, None
    for T in (0,) + policy.lengths:
        d = 0 if T == 0 else policy.depth[T]
        tot = 0.0
        for s in seqs:
            a, p, e = policy.acceptance.alpha(s), 1.0, 1.0
            for j in range(d):
                p *= a[j]
                e += p
            tot += e
        v = tot / policy.costs.get(Bp, T)
        if best is None or v > best:
            best, arg = v, T
    return arg


def test_adaptive_choice_is_the_brute_force_argmax():
    rng = random.Random(0)
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for trial in range(40):
        table = {(b, t): rng.uniform(0.5, 4.0) * (1 + t * b / rng.choice([16, 64, 512]))
                 for b in buckets for t in (0, 1, 2, 4)}
        pol = AdaptiveLengths((1, 2, 4), StepCosts(table), buckets, probe_budget=0.0)   # no probes
        seqs = [_Seq() for _ in range(rng.choice([1, 3, 17, 200]))]
        for s in seqs:
            for _ in range(rng.randrange(4)):
                t = rng.randrange(5)
                pol.acceptance.observe(s, t, rng.randrange(t + 1))
        assert pol.choose(seqs) == _brute(pol, seqs), trial


def test_adaptive_turns_speculation_off_when_it_loses_and_probes():
    """Costs where a verify step is 3x a decode step and acceptance is nil: T = 0, except
    probes of the longest length (every depth observed at once): one at the cold start
    (nothing seen at the deepest depth), then one every ``probe_interval`` steps, backing off
    to 16x; high acceptance: the longest."""
    table = {(1, 0): 1.0, (1, 1): 3.0, (1, 2): 3.0, (1, 4): 3.0}
    pol = AdaptiveLengths((1, 2, 4), StepCosts(table), [1], probe_interval=4, probe_budget=1.0)
    s = [_Seq()]
    chosen = []
    for _ in range(1 + 4 + 8 + 16 + 32 + 64 + 64):
        T = pol.choose(s)
        chosen.append(T)
        pol.observe(s, T, [1] * len(s), 0.0)   # nothing accepted
    probes = [i + 1 for i, T in enumerate(chosen) if T]
    assert set(chosen) == {0, 4} and probes == [1, 5, 13, 29, 61, 125, 189], probes
    assert pol.probes == len(probes)
    for _ in range(40):                          # now everything is accepted
        pol.observe(s, 4, [5], 0.0)
    assert pol.choose(s) == 4
    assert pol._interval == 4                    # back to the base rate


def test_adaptive_prices_the_drafters_catch_up_passes():
    """A drafter that deferred work (MTP's window) makes the step that resumes drafting run
    ``passes(seqs, T)`` catch-up passes first: each is priced ``catchup_cost(B)`` on top of
    the step (a step that would win on its own loses when the passes eat the gain), the
    observed time of such a step is refined with their predicted part taken out, and bad
    entries raise."""
    table = {(4, 0): 1.0, (4, 1): 1.2, (4, 2): 1.3}
    costs = StepCosts(table, online=True, catchup={4: 0.8})
    assert costs.catchup_cost(3) == costs.catchup_cost(9) == 0.8 and StepCosts(table).catchup_cost(4) == 0.0
    pol = AdaptiveLengths((1, 2), costs, [4], probe_budget=0.0)
    seqs = [_Seq() for _ in range(4)]
    for s in seqs:
        for _ in range(30):
            pol.acceptance.observe(s, 2, 2)      # everything accepted: E(2) = 3 per row
    deferred = {"passes": 0}
    pol.passes = lambda ss, T: deferred["passes"] if T else 0
    assert pol.choose(seqs) == 2                 # 12 / 1.3 > 4 / 1.0
    deferred["passes"] = 3                       # about 12 / (1.3 + 2.4) = 3.24 < 4: stay plain
    sc, tokens = pol.scores(seqs), pol._rates(seqs)[1]
    assert tokens[2] > 11.5 and sc[2] == pytest.approx(tokens[2] / (1.3 + 2.4)) and sc[0] == pytest.approx(4.0)
    assert pol.choose(seqs) == 0
    deferred["passes"] = 1                       # 12 / 2.1 > 4
    assert pol.choose(seqs) == 2
    costs.observe(4, 2, 2.1)                     # the first observation of a key is dropped
    pol.observe(seqs, 2, [3] * 4, 2.1)           # 0.8 of it predicted as the pass: t(4, 2) stays 1.3
    assert costs.table[(4, 2)] == pytest.approx(1.3, abs=0.01)
    for bad in ({0: 1.0}, {4: -1.0}, {4: float("inf")}):
        with pytest.raises(ValueError, match="catch-up cost table"):
            StepCosts(table, catchup=bad)


def test_fixed_and_scripted_lengths():
    f = FixedLengths((4,))
    assert f.choose([_Seq()]) == 4
    sc = ScriptedLengths((1, 2, 4), [0, 3, 9, 1, 2])
    assert [sc.choose([]) for _ in range(7)] == [0, 2, 4, 1, 2, 0, 2]
    tree = ScriptedLengths((6,), [0, 1, 6], tree=True, depth={6: 3})
    assert [tree.choose([]) for _ in range(3)] == [0, 6, 6]
    with pytest.raises(ValueError, match="positive ints"):
        FixedLengths((0,))
    with pytest.raises(ValueError, match="one length"):
        FixedLengths((2, 4), tree=True)
    with pytest.raises(ValueError, match="depth"):
        FixedLengths((4,), depth={4: 5})
    with pytest.raises(ValueError, match="non-negative"):
        ScriptedLengths((1,), [-1])


def test_config_fields_are_validated():
    sp = SpeculativeConfig("ngram", num_tokens=5, draft_lengths=[5, 1, 3, 3])
    assert sp.draft_lengths == (1, 3, 5) and sp.spec_policy == "adaptive"
    bad = [dict(spec_policy="greedy"), dict(draft_lengths=[0]), dict(draft_lengths=[9]), dict(draft_lengths="12"),
           dict(draft_lengths=[]), dict(step_costs={}), dict(step_costs={(0, 1): 1.0}),
           dict(step_costs={(1, 1): -1.0}), dict(step_costs={(1, 1): float("inf")}), dict(step_costs={1: 1.0}),
           dict(probe_interval=0), dict(step_costs={(1, 0): 1.0, (1, 4): 2.0})]   # T = 1..3 unpriced
    for kw in bad:
        with pytest.raises(ValueError, match="SpeculativeConfig"):
            SpeculativeConfig("ngram", num_tokens=4, **kw)


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(target):
    return [reference_greedy(target, p, N) for p in PROMPTS]


def _specs(draft):
    return {
        "ngram": SpeculativeConfig("ngram", num_tokens=4),
        "draft": SpeculativeConfig("draft", num_tokens=4, draft_model=draft),
        "ngram-tree": SpeculativeConfig("tree", num_tokens=3, tree_width=2),
        "tree-beam": SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=3),
    }


def _script(seed: int, top: int) -> list[int]:
    """Random lengths in ``0..top``, every third one 0."""
    rng = random.Random(seed)
    return [0 if i % 3 == 1 else rng.randrange(top + 1) for i in range(64)]


@pytest.mark.parametrize("mode", ["replay", "recurrent", "kv", "auto"])
@pytest.mark.parametrize("name", ["ngram", "draft", "ngram-tree", "tree-beam"])
def test_forced_random_lengths_keep_greedy_output(target, draft, expected, name, mode):
    sp = _specs(draft)[name]
    llm = LLM(target, decode_mode=mode, speculative=sp, buffer_size=16, auto_threshold=10,
              pad_batches=(mode == "replay"))
    L = llm.executor.lengths
    if name == "ngram":
        llm.drafter.pad = True   # as with CUDA graphs: chains padded to the chosen length
    sc = llm.executor.lengths = ScriptedLengths(L.lengths, _script(len(name) * 7 + len(mode), L.max), L.tree,
                                                L.depth)
    chosen, choose = [], sc.choose
    sc.choose = lambda seqs: chosen.append(choose(seqs)) or chosen[-1]
    calls = {"propose": 0}
    propose = llm.drafter.propose

    def counting(seqs, k=None):
        calls["propose"] += 1
        if not L.tree:
            assert k in L.lengths, k      # the drafter is asked for the chosen length
        return propose(seqs, k)

    llm.drafter.propose = counting
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    hist = {T: llm.stats[f"spec_T{T}_steps"] for T in (0,) + L.lengths}
    assert hist[0] > 0 and sum(hist.values()) - hist[0] > 0, hist
    assert sum(hist.values()) == sum(llm.executor.lengths.histogram.values())
    assert calls["propose"] == sum(T > 0 for T in chosen)   # T = 0 steps never call the drafter
    assert hist[0] >= chosen.count(0)   # (and a proposal of nothing decodes plainly too)
    for o in outs:
        assert o.num_accepted <= o.num_drafted
    if not L.tree:   # every chosen chain length ran as its own verify shape
        shapes = {c[2] for c in llm.cache.calls if c[0] == "verify"}
        assert shapes <= {T + 1 for T in L.lengths} and len(shapes) >= 2, shapes


def test_adaptive_policy_decodes_plainly_where_speculation_loses(target, draft, expected):
    """A cost table in which every verify step costs 5 decode steps: the adaptive policy runs
    plain decode steps (and periodic probes), the drafter is not called on them, and greedy
    output is unchanged; with a table where verifying is free it drafts the most."""
    costly = {(b, t): (1.0 if t == 0 else 5.0) for b in (1, 2, 4, 8) for t in range(5)}
    free = {(b, t): 1.0 for b in (1, 2, 4, 8) for t in range(5)}
    hist = {}
    for label, table in (("costly", costly), ("free", free)):
        sp = SpeculativeConfig("draft", num_tokens=4, draft_model=draft, step_costs=table, probe_interval=8)
        llm = LLM(target, speculative=sp)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
        assert [o.token_ids for o in outs] == expected
        hist[label] = {T: llm.stats[f"spec_T{T}_steps"] for T in range(5)}
    c, f = hist["costly"], hist["free"]
    # one probe at the cold start (borrowed); the next would lose 3.5 decode steps' time: more
    # than 1% of this short run affords
    assert c[0] > 0 and c[1] == c[2] == c[3] == 0 and c[4] <= 1, c
    assert f[4] > 0 and f[1] == f[2] == f[3] == 0, f


def test_fixed_policy_always_drafts_the_most(target, expected):
    sp = SpeculativeConfig("ngram", num_tokens=3, spec_policy="fixed")
    llm = LLM(target, speculative=sp)
    assert isinstance(llm.executor.lengths, FixedLengths) and llm.executor.lengths.lengths == (3,)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert llm.stats["spec_T3_steps"] > 0 and "spec_T1_steps" not in llm.stats


def test_length_policy_of_each_drafter_kind(target, draft):
    class R:
        buckets = [1, 2, 4]

        class device:
            type = "cpu"

    chain = length_policy(SpeculativeConfig("ngram", num_tokens=6), R)
    assert chain.lengths == (1, 2, 4, 6) and not chain.tree and not chain.costs.online
    tree = length_policy(SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=3), R)
    assert tree.lengths == (6,) and tree.tree and tree.depth == {6: 3} and tree.nodes == {6: 7}
    given = length_policy(SpeculativeConfig("ngram", num_tokens=2, step_costs={(1, 0): 1.0, (1, 1): 1.0,
                                                                             (1, 2): 1.5}), R)
    assert given.costs.get(1, 0) == 1.0 and not given.costs.online


def test_sampled_steps_with_forced_lengths_stay_distribution_exact():
    """End to end on a 4-token vocabulary, steps forced through draft lengths 0, 1, 2, 3 in
    turn: the first three sampled tokens follow the model's own joint distribution."""
    from recompute_model import tiny_pair
    from test_engine_sampling import assert_first_three_follow, joint3

    target, draft = tiny_pair(vocab_size=4, draft_noise=1.0)
    prompt = [1, 2]
    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=draft, draft_lengths=[1, 2, 3])
    llm = LLM(target, speculative=sp, max_num_seqs=256, seed=3)
    llm.executor.lengths = ScriptedLengths((1, 2, 3), [0, 1, 2, 3, 2])
    outs = llm.generate([prompt] * 4000, SamplingParams(max_tokens=3, temperature=1.0))
    assert_first_three_follow(outs, joint3(target, prompt))
    assert sum(o.num_accepted for o in outs) > 0
    assert all(llm.stats[f"spec_T{T}_steps"] > 0 for T in (0, 1, 2, 3))


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_measured_step_costs_cover_every_bucket_and_leave_requests_exact(target, draft, expected, mode):
    """The start-up measurement (CUDA's; callable anywhere) times a decode step and a verify
    step of each length at every bucket on the null slot: a positive time per key, and the
    engine's outputs afterwards are unchanged."""
    from replayssm.engine.warmup import measure_step_costs

    for sp in (SpeculativeConfig("ngram", num_tokens=4),
               SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=2)):
        llm = LLM(target, decode_mode=mode, speculative=sp, max_num_seqs=5, pad_batches=True)
        L = llm.executor.lengths
        table, flush = measure_step_costs(llm.runner, [(T, L.nodes[T], L.tree) for T in L.lengths], reps=1)
        assert set(table) == {(b, T) for b in llm.runner.buckets for T in (0,) + L.lengths} and flush == {}
        assert all(v > 0 for v in table.values())
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
        assert [o.token_ids for o in outs] == expected


def test_cost_table_adds_the_draft_models_chain(target, draft, expected):
    """A draft-model chain's probe (its greedy chain graph on the null slot) prices every
    length at every bucket, not ``T = 0`` (plain steps leave the draft model behind); between
    steps of live requests it touches only the draft cache's null slot, and the outputs stay exact."""
    from replayssm.engine.warmup import measure_draft_costs

    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=draft)
    llm = LLM(target, speculative=sp, max_num_seqs=5, pad_batches=True)
    L, d = llm.executor.lengths, llm.drafter
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS]
    for _ in range(3):
        llm.step()
    before = [list(h) for h in d.cache.history]   # the recompute cache: each slot's token history
    costs = measure_draft_costs(d, llm.runner.buckets, L.lengths, llm.device, reps=1)
    assert set(costs) == {(b, T) for b in llm.runner.buckets for T in L.lengths}
    assert all(v > 0 for v in costs.values())
    assert d.cache.history[1:] == before[1:] and d.cache.pending is None
    while llm.has_unfinished():
        llm.step()
    assert [s.output_ids for s in seqs] == expected
    with pytest.raises(ValueError, match="draft-step probe"):
        d.null_step(4, 0.5)


@pytest.mark.parametrize("mode", ["replay", "recurrent", "kv"])
def test_draft_model_catches_up_after_plain_steps_exactly(target, draft, expected, mode):
    """Runs of plain steps (T = 0) leave the draft model behind; its catch-up (decode steps
    for short gaps, one prefill chunk per row for long ones) leaves its cache as if it had
    decoded every token: each proposal equals the draft model's own greedy chain."""
    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=draft)
    llm = LLM(target, decode_mode=mode, speculative=sp)
    llm.executor.lengths = ScriptedLengths((1, 2, 3), [0, 0, 0, 0, 0, 3, 0, 1, 0, 0, 2, 3, 3])
    propose, checked = llm.drafter.propose, []

    def checking(seqs, k=None):
        gaps = [s.num_tokens - s.draft_cached for s in seqs]
        prop = propose(seqs, k)
        for s, row in zip(seqs, prop.tokens.tolist()):
            assert row == [s.last_token] + reference_greedy(draft, s.all_ids, k), s.all_ids
        checked.extend(gaps)
        return prop

    llm.drafter.propose = checking
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert max(checked) > 2 + 1 and min(checked) == 1, checked   # long gaps (prefill) and none


def test_a_drafter_that_ignores_the_length_is_cut_to_it(target, expected):
    """A drafter that always proposes its whole chain (one written before lengths existed):
    the executor keeps the first ``T + 1`` nodes, so verify shapes follow the policy and the
    output is unchanged."""
    import torch

    from replayssm.engine.spec import Proposal

    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_tokens=4))
    llm.drafter.pad = True
    propose = llm.drafter.propose
    llm.drafter.propose = lambda seqs, k=None: propose(seqs)          # always 4 drafts
    llm.executor.lengths = ScriptedLengths((1, 2, 3, 4), [1, 0, 2, 3])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    shapes = {c[2] for c in llm.cache.calls if c[0] == "verify"}
    assert shapes and shapes <= {2, 3, 4}, shapes
    p = Proposal(torch.arange(6).view(2, 3), torch.tensor([[-1, 0, 0]] * 2), torch.ones(2, 3, dtype=torch.bool),
                 torch.rand(2, 3, 5), tree=True)
    t = p.truncate(2)
    assert t.tokens.tolist() == [[0, 1], [3, 4]] and t.parent.tolist() == [[-1, 0]] * 2 and t.tree
    assert torch.equal(t.q, p.q[:, :2]) and t.valid.shape == (2, 2)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="truncate"):
            p.truncate(bad)


def test_a_drafter_that_finds_nothing_is_asked_less(target, expected):
    """Prompt lookup on prompts that never repeat proposes nothing: those steps count as
    rejected drafts, so where speculation costs more than a decode step the policy stops
    asking (bar probes), instead of paying for lookups every step."""
    table = {(b, t): (1.0 if t == 0 else 1.5) for b in (1, 2, 4, 8) for t in range(5)}
    sp = SpeculativeConfig("ngram", num_tokens=4, step_costs=table, probe_interval=4)
    llm = LLM(target, speculative=sp)
    calls = {"n": 0}
    propose = llm.drafter.propose

    def counting(seqs, k=None):
        calls["n"] += 1
        return propose(seqs, k)

    llm.drafter.propose = counting
    prompts = [[3], [5, 6], [7, 8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == [reference_greedy(target, p, N) for p in prompts]
    steps = sum(llm.stats[f"spec_T{T}_steps"] for T in range(5))
    assert calls["n"] < steps / 2, (calls, steps)


@pytest.mark.parametrize("name", ["ngram", "draft", "ngram-tree", "tree-beam"])
def test_adaptive_policy_keeps_plain_replays_greedy_output(target, draft, expected, name):
    """The adaptive policy on, in replay form, with a table where drafting pays at one or two
    rows and loses at more (a compute-bound verify): it drafts the longest at the cold start,
    then switches between plain and verify steps as the batch drains, and every request's
    greedy output equals plain replay's (and the full-forward reference)."""
    table = {(b, t): 1.0 + (0.5 * t * b if b > 2 else 0.0) for b in (1, 2, 4, 8) for t in range(7)}
    sp = _specs(draft)[name]
    sp = SpeculativeConfig(**{**sp.__dict__, "step_costs": {k: v for k, v in table.items()
                                                            if k[1] in (0,) + sp.candidate_lengths}})
    plain = LLM(target, decode_mode="replay", buffer_size=16, pad_batches=True)
    base = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=N))]
    llm = LLM(target, decode_mode="replay", speculative=sp, buffer_size=16, pad_batches=True)
    prompts = PROMPTS + [PROMPTS[3]]                    # a batch of 6 that drains unevenly
    params = [SamplingParams(max_tokens=N if i in (1, 3) else N // 2) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs][:len(PROMPTS)] == [b[:p.max_tokens] for b, p in zip(base, params)]
    assert [o.token_ids for o in outs][:len(PROMPTS)] == [e[:p.max_tokens] for e, p in zip(expected, params)]
    L = llm.executor.lengths
    assert isinstance(L, AdaptiveLengths) and L.probes >= 1
    hist = {T: llm.stats.get(f"spec_T{T}_steps", 0) for T in (0,) + L.lengths}
    assert hist[0] > 0 and sum(hist.values()) - hist[0] > L.probes, hist   # plain at 4+ rows, drafts at 1-2
