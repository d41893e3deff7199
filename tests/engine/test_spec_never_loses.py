"""Speculation never loses: the adaptive policy's flush pricing against the ring it models,
its choices against synthetic cost tables (T = 0 whenever no draft length predicts strictly
more tokens per second; probes bounded by their budget; per batch bucket), and the start-up
measurement on distinct real slots of a replay-form cache (greedy output unchanged)."""

import random

import pytest
import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.cache.ring import RingIndex
from replayssm.engine.spec.policy import AdaptiveLengths, StepCosts, expected_tokens, flush_fraction

BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


class _Seq:
    """A stand-in request (the policy only keys on identity)."""


def _ring_flush_share(L: int, nodes: int, accepted: list[int]) -> float:
    """Flushes per step of one slot of a real :class:`RingIndex` over the accepted counts."""
    r = RingIndex(1, L)
    slots = torch.tensor([1])
    n = 0
    for a in accepted:
        plan = r.plan_decode(slots) if nodes == 1 else r.plan_verify(slots, nodes)
        n += int(plan.flush[0])
        r.commit(plan) if nodes == 1 else r.commit(plan, torch.tensor([a]), check=True)
    return n / len(accepted)


def test_flush_fraction_against_the_ring():
    # exact where the accepted count is constant and divides the room R = L - 2 nodes
    for L, nodes, a in [(16, 1, 1), (32, 1, 1), (16, 5, 1), (16, 5, 2), (16, 5, 3), (16, 4, 4), (24, 3, 3),
                        (16, 2, 1), (16, 2, 2), (16, 8, 1), (20, 4, 4)]:
        share = _ring_flush_share(L, nodes, [a] * (L * 12))
        assert flush_fraction(L, nodes, float(a)) == pytest.approx(share, abs=1e-2), (L, nodes, a)
    # random acceptance: the renewal approximation within a few points of the ring's own share
    rng = random.Random(0)
    for L, nodes, p in [(16, 5, 0.8), (16, 3, 0.6), (32, 5, 0.8), (16, 2, 0.5)]:
        acc = []
        for _ in range(3000):
            a = 1
            while a < nodes and rng.random() < p:
                a += 1
            acc.append(a)
        mean = sum(acc) / len(acc)
        share = _ring_flush_share(L, nodes, acc)
        assert flush_fraction(L, nodes, mean) == pytest.approx(share, abs=0.06), (L, nodes, p, share)
    assert flush_fraction(16, 5, 3.36) > 5 * flush_fraction(16, 1, 1.0)   # long drafts flush often
    for bad in [(0, 1, 1.0), (16, 0, 1.0), (16, 2, 0.0)]:
        with pytest.raises(ValueError, match="flush_fraction"):
            flush_fraction(*bad)


def _seqs(pol, n: int, p: float):
    """``n`` requests whose estimated acceptance is ``p`` at every depth: a pool that has seen
    nothing but ``p`` (enough trials at each depth that the prior does not show)."""
    acc = pol.acceptance
    acc.hits, acc.trials = [p * 1e12] * acc.depth, [1e12] * acc.depth
    acc._refresh_pool()
    acc._version += 1
    pol._drafted_top = True   # past the cold start
    return [_Seq() for _ in range(n)]


def _rate_of(pol, seqs, T):
    Bp = pol.bucket(len(seqs))
    N = 1 if T == 0 else pol.nodes[T]
    tok = sum(pol.acceptance.expected(s)[0 if T == 0 else pol.depth[T]] for s in seqs)
    return tok / pol.costs.step_time(Bp, T, N, tok / len(seqs))


def test_every_draft_length_losing_means_plain_steps_only():
    """A table where each verify step costs more than its expected tokens buy (acceptance
    0.8, T drafts cost 1 + 0.9 E(T) decode steps): T = 0 on every step, no probe without a
    budget, and with the default 1% budget the predicted time lost to probes stays under 1%."""
    E = {T: expected_tokens([0.8] * 4, T) for T in (1, 2, 4)}
    table = {(b, 0): 1.0 for b in BUCKETS}
    table.update({(b, T): 1.0 + 0.9 * E[T] for b in BUCKETS for T in (1, 2, 4)})
    for budget in (0.0, 0.01):
        pol = AdaptiveLengths((1, 2, 4), StepCosts(table), BUCKETS, probe_interval=4, probe_budget=budget)
        seqs = _seqs(pol, 64, 0.8)
        chosen = []
        lost = total = 0.0
        for _ in range(3000):
            T = pol.choose(seqs)
            chosen.append(T)
            t_T = pol.costs.step_time(64, T, pol.nodes.get(T, 1), 1.0)
            total += t_T
            lost += t_T - sum(pol.acceptance.expected(s)[pol.depth.get(T, 0)] for s in seqs) / 64.0   # vs plain
        if budget == 0.0:
            assert set(chosen) == {0} and pol.probes == 0
        else:
            assert 0 < pol.probes and chosen.count(0) > 0.98 * len(chosen) and set(chosen) == {0, 4}
            assert lost <= 0.01 * total + 1e-9, (lost, total)
            assert pol.probe_loss <= 0.01 * pol.predicted + 1e-9


def test_ties_go_to_plain_and_strictly_better_lengths_win():
    table = {(1, 0): 1.0, (1, 1): 1.5, (1, 2): 1.75, (1, 4): 1.9375}   # E(0.5, T) exactly: every T ties
    pol = AdaptiveLengths((1, 2, 4), StepCosts(table), [1], probe_budget=0.0)
    s = _seqs(pol, 1, 0.5)
    assert pol.choose(s) == 0
    pol.costs.table[(1, 2)] = 1.74                                        # one strictly better
    assert pol.choose(s) == 2


def test_flushes_priced_in_change_the_choice():
    """Without flush prices T = 4 wins; the ring flushes every other step at T = 4 (L = 16,
    acceptance 0.8) against one step in 16 plain, and an all-flush surcharge of 3 decode
    steps makes a shorter length win: the choice is the brute-force argmax of
    ``E / (t + φ flush)``."""
    table = {(256, 0): 1.0, (256, 1): 1.5, (256, 2): 2.0, (256, 4): 2.6}
    flush = {(256, 0): 3.0, (256, 1): 3.0, (256, 2): 3.0, (256, 4): 3.0}
    bare = AdaptiveLengths((1, 2, 4), StepCosts(table), [256], probe_budget=0.0)
    priced = AdaptiveLengths((1, 2, 4), StepCosts(table, flush=flush, ring=16), [256], probe_budget=0.0)
    sb, sp = _seqs(bare, 200, 0.8), _seqs(priced, 200, 0.8)
    assert bare.choose(sb) == 4
    best = max((0, 1, 2, 4), key=lambda T: (_rate_of(priced, sp, T), -T))
    assert priced.choose(sp) == best and best < 4
    # the same flush prices without a ring (recurrent or KV form): ignored
    no_ring = AdaptiveLengths((1, 2, 4), StepCosts(table, flush=flush), [256], probe_budget=0.0)
    assert no_ring.choose(_seqs(no_ring, 200, 0.8)) == 4


def test_choices_per_batch_bucket():
    """Small buckets verify for free, large ones pay per token (a compute-bound dense MLP):
    long drafts at B=1, shorter ones in the middle, plain at B=256; every choice is the
    brute-force argmax and never predicts less than a plain step."""
    table = {}
    for b in BUCKETS:
        for T in (0, 1, 2, 4):
            table[(b, T)] = max(1.0, b * (T + 1) / 128.0)
    pol = AdaptiveLengths((1, 2, 4), StepCosts(table), BUCKETS, probe_budget=0.0)
    picks = {}
    for B in (1, 3, 16, 64, 100, 256):
        seqs = _seqs(pol, B, 0.8)
        T = pol.choose(seqs)
        rates = {t: _rate_of(pol, seqs, t) for t in (0, 1, 2, 4)}
        assert rates[T] == max(rates.values()) and rates[T] >= rates[0]
        picks[B] = T
    assert picks[1] == picks[3] == picks[16] == 4 and picks[64] == 1 and picks[100] == picks[256] == 0, picks


def test_online_refinement_keeps_the_flush_share_apart():
    """Observed steps include their flushes; the table keeps the flush-free part, so steps
    that all flush at once (synchronised rows) do not inflate ``t(B, T)``."""
    table = {(8, 0): 1.0, (8, 4): 2.0}
    costs = StepCosts(table, online=True, decay=0.5, flush={(8, 0): 1.6, (8, 4): 2.0}, ring=16)
    pol = AdaptiveLengths((4,), costs, [8], probe_budget=0.0)
    seqs = _seqs(pol, 8, 0.8)
    pol.choose(seqs)
    share = flush_fraction(16, 5, expected_tokens([0.8] * 4, 4))
    for sec in (9.0, 2.0 + share * 2.0, 2.0 + share * 2.0):   # the first is dropped; the others are right
        pol.observe(seqs, 4, [4] * 8, sec)
    assert costs.get(8, 4) == pytest.approx(2.0, abs=1e-2)   # (plus the policy's own host time, microseconds)


# ---- the start-up measurement on a real replay cache ---------------------------------------
@pytest.fixture(scope="module")
def qwen35_tiny():
    from replayssm.bench.hybrid_presets import preset_config
    from replayssm.models.registry import model_class, parse_config

    torch.manual_seed(0)
    c = parse_config(dict(preset_config("qwen3.5-tiny"), vocab_size=64))
    return model_class(c)(c, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_measured_costs_on_real_slots_price_flushes_and_leave_outputs_exact(qwen35_tiny, mode):
    """Replay form: a flush-free and an all-flush time per key; KV-only form: no flush
    table.  Distinct real slots every bucket, released afterwards; greedy output unchanged."""
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
    params = SamplingParams(max_tokens=10)
    ref = [o.token_ids for o in LLM(qwen35_tiny, decode_mode="recurrent", max_seq_len=64).generate(prompts, params)]
    from replayssm.engine.warmup import measure_step_costs

    sp = SpeculativeConfig("ngram", num_tokens=3)
    llm = LLM(qwen35_tiny, decode_mode=mode, speculative=sp, max_num_seqs=4, pad_batches=True, max_seq_len=64)
    L, cache = llm.executor.lengths, llm.cache
    free = sorted(llm.executor.blocks.free_slots)
    seen = []
    decode = llm.runner.decode

    def spy(slots, tokens):
        seen.append(list(slots))
        return decode(slots, tokens)

    llm.runner.decode = spy
    table, flush = measure_step_costs(llm.runner, [(T, L.nodes[T], False) for T in L.lengths], reps=1, slots=free)
    llm.runner.decode = decode
    keys = {(b, T) for b in llm.runner.buckets for T in (0,) + L.lengths}
    assert set(table) == keys and set(flush) == (keys if mode == "replay" else set())
    assert all(v > 0 for v in table.values()) and all(v >= 0 for v in flush.values())
    assert all(len(set(s)) == min(len(s), len(free)) and 0 not in s for s in seen)   # distinct real slots
    assert int(cache.ring.length[1:].abs().sum()) == 0 and int(cache.seq_len[1:].abs().sum()) == 0   # released
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    with pytest.raises(ValueError, match="slots must be in"):
        measure_step_costs(llm.runner, [], reps=1, slots=[0])


def test_online_refinement_is_a_running_mean_with_the_seed_then_an_ema():
    """Host work the start-up timing leaves out shows within a few steps: the seed counts as
    one sample until the mean weighs a sample less than ``decay``."""
    c = StepCosts({(1, 0): 1.0}, online=True, decay=0.2)
    got = []
    for x in [9.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]:
        c.observe(1, 0, x)
        got.append(c.get(1, 0))
    mean = [1.0, 1.5, 5 / 3, 1.75, 1.8]            # (1 + 2 k) / (k + 1), the first sample dropped
    ref = mean + [1.8 + 0.2 * 0.2, 1.84 + 0.2 * 0.16]
    assert got == pytest.approx(ref, rel=1e-12)


def test_the_policys_own_host_time_is_charged_to_the_step():
    """The bookkeeping of a step (choose, then the acceptance update) is added to the time
    the step is observed to take, so a length that only just wins on device time is dropped
    when the host work of speculating eats the gain; the acceptance update is one pass equal
    to per-row updates in order."""
    import time as _time

    table = {(256, 0): 1.0, (256, 4): 2.0}
    pol = AdaptiveLengths((4,), StepCosts(table, online=True, decay=0.5), [256], probe_budget=0.0)
    seqs = _seqs(pol, 256, 0.8)
    slow = pol._choose

    def slow_choose(s):
        _time.sleep(0.05)
        return slow(s)

    pol._choose = slow_choose
    for _ in range(3):
        T = pol.choose(seqs)
        pol.observe(seqs, T, [3] * 256, 1e-3)
    assert pol.costs.get(256, T) > 0.05   # the first observation dropped, then ~50 ms each

    # the acceptance update is one pass over the batch equal to per-row updates in order
    from replayssm.engine.spec.policy import AcceptanceStats

    rng = random.Random(1)
    one, each = AcceptanceStats(4, 0.5), AcceptanceStats(4, 0.5)
    rows = [_Seq() for _ in range(7)]
    for _ in range(20):
        tried = rng.randrange(1, 5)
        acc = [rng.randrange(tried + 1) for _ in rows]
        one.observe_batch(rows, tried, acc)
        for s, x in zip(rows, acc):
            each.observe(s, tried, x)
    assert one.hits == pytest.approx(each.hits, rel=1e-12) and one.trials == each.trials
    for s in rows:
        assert one.alpha(s) == pytest.approx(each.alpha(s), rel=1e-12)
        assert one.expected(s) == pytest.approx([expected_tokens(one.alpha(s), d) for d in range(5)], rel=1e-12)
    with pytest.raises(ValueError, match="accepted"):
        one.observe_batch(rows[:2], 2, [1, 3])
