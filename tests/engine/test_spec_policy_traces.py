"""The adaptive draft length on synthetic acceptance traces (``spec.simulate``): known per-depth
acceptance and known step costs.  From a cold start it reaches the length an oracle that knows
both would choose within a few steps; where speculation loses it never costs more than the
stated bound over plain decoding; a new request starts from the drafter's pool."""

import pytest

from replayssm.engine.spec.acceptance import expected_tokens
from replayssm.engine.spec.policy import AdaptiveLengths, ScriptedLengths, StepCosts
from replayssm.engine.spec.simulate import Request, best_length, simulate

BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LENGTHS = (1, 2, 3, 4)


def _cost(per_token: float, launch: float = 1.0):
    """``t(B, T) = launch + max(1, B (T + 1) per_token)``: memory-bound up to a knee."""
    return lambda B, T: launch + max(1.0, B * (T + 1) * per_token)


def _policy(cost, **kw):
    table = {(b, T): cost(b, T) for b in BUCKETS for T in (0,) + LENGTHS}
    return AdaptiveLengths(LENGTHS, StepCosts(table), BUCKETS, **kw)


def _rate(alpha, cost, B, T):
    return expected_tokens(alpha, T) / cost(B, T)


# (alpha per depth, cost, batch, steps within which the optimum must hold)
CASES = [
    ([0.8] * 4, _cost(1 / 256), 1, 3),               # free verify: the longest
    ([0.9] * 4, _cost(1 / 512), 96, 3),
    ([0.95, 0.9, 0.4, 0.2], _cost(1 / 256), 64, 3),
    ([0.95, 0.9, 0.4, 0.2], _cost(1 / 128), 128, 3),
    ([0.9, 0.3, 0.3, 0.3], _cost(1 / 160), 160, 3),  # from the cold probe's data straight to T = 1
    ([0.6, 0.5, 0.5, 0.5], _cost(1 / 64), 256, 3),   # speculation loses: plain
    ([0.3] * 4, _cost(1 / 64), 64, 3),
]


@pytest.mark.parametrize("alpha,cost,B,N", CASES)
def test_reaches_the_oracles_length_from_a_cold_start(alpha, cost, B, N):
    opt = best_length(alpha, cost, B, LENGTHS)
    rates = sorted((_rate(alpha, cost, B, T), T) for T in (0,) + LENGTHS)
    assert rates[-1][1] == opt and rates[-1][0] > 1.04 * rates[-2][0]   # a clear optimum
    pol = _policy(cost)
    res = simulate(pol, alpha, cost, B, steps=60, seed=B)
    after = res.chosen[N:]
    probes_after = sum(T == 4 for T in after) if opt != 4 else 0
    assert all(T in (opt, 4) for T in after), res.chosen
    assert probes_after <= pol.probes, (res.chosen, pol.probes)
    # tokens per second over the whole run within a few percent of the oracle's
    assert res.rate >= 0.95 * _rate(alpha, cost, B, opt), (res.rate, _rate(alpha, cost, B, opt))


def test_chooses_per_bucket_after_learning():
    """One policy, batches taking turns (as in a server): each bucket's optimum."""
    alpha, cost = [0.9, 0.3, 0.3, 0.3], _cost(1 / 128)
    pol = _policy(cost)
    for B in (1, 256, 32, 96, 256, 1):
        opt = best_length(alpha, cost, B, LENGTHS)
        res = simulate(pol, alpha, cost, B, steps=30, seed=B)
        assert res.chosen[-10:] == [opt] * 10, (B, opt, res.chosen)


@pytest.mark.parametrize("B", [16, 256])
def test_speculation_that_loses_costs_at_most_the_budget(B):
    """Every verify step costs more than its tokens buy: apart from the cold start's one probe,
    the run loses at most ``probe_budget`` of its time against plain decoding of the same
    tokens, predicted and realized."""
    alpha, budget = [0.5, 0.4, 0.3, 0.2], 0.02
    cost = lambda b, T: 1.0 + 0.6 * T   # noqa: E731 -- every T > 0 loses at every batch
    assert best_length(alpha, cost, B, LENGTHS) == 0
    pol = _policy(cost, probe_interval=4, probe_budget=budget)
    res = simulate(pol, alpha, cost, B, steps=3000, seed=1)
    one_probe = cost(B, 4) - cost(B, 0)      # a probe's loss, at most: its tokens are at least plain's
    assert 2 < pol.probes and res.chosen[0] == 4 and res.chosen.count(0) > 0.97 * len(res.chosen)
    assert pol.probe_loss <= budget * pol.predicted + one_probe + 1e-9
    assert res.seconds - res.plain_seconds <= budget * res.seconds + one_probe + 1e-9, \
        (res.seconds, res.plain_seconds)
    # without a budget: plain steps only, exactly plain's time
    pol0 = _policy(cost, probe_budget=0.0)
    res0 = simulate(pol0, alpha, cost, B, steps=200, seed=1)
    assert set(res0.chosen) == {0} and res0.seconds == pytest.approx(res0.plain_seconds)


@pytest.mark.parametrize("B,tokens", [(1, 64), (64, 64), (256, 64), (16, 16)])
def test_never_slower_than_plain_where_speculation_wins_or_ties(B, tokens):
    """Short requests submitted at once (a benchmark's batch) on a warm policy: the run is
    at least as fast as plain decoding and close to the oracle's fixed length."""
    alpha, cost = [0.8] * 4, _cost(1 / 200)
    pol = _policy(cost)
    simulate(pol, alpha, cost, B, steps=10 ** 6, tokens=4, seed=0)      # warm-up run, as benchmarks do
    res = simulate(pol, alpha, cost, B, steps=10 ** 6, tokens=tokens, seed=2)
    opt = best_length(alpha, cost, B, LENGTHS)
    oracle = simulate(ScriptedLengths(LENGTHS, [opt]), alpha, cost, B, 10 ** 6, tokens, seed=2)
    assert res.seconds <= res.plain_seconds * 1.001, (res.seconds, res.plain_seconds)
    assert res.rate >= 0.95 * oracle.rate, (res.rate, oracle.rate, res.chosen)


def test_a_new_request_starts_from_the_pool():
    """After the drafter's rows showed acceptance 0.9 at B=256, a new request is priced with the
    pool (0.9 at every depth, not the 0.5 prior) and the batch's choice stays the optimum from
    its first step; a cold policy with the prior alone would draft less."""
    alpha, cost = [0.9] * 4, _cost(1 / 512)
    pol = _policy(cost)
    simulate(pol, alpha, cost, 256, steps=20, seed=3)
    assert pol.acceptance.pooled == pytest.approx([0.9] * 4, abs=0.03)
    fresh = [Request(None) for _ in range(256)]
    assert pol.acceptance.alpha(fresh[0]) == pol.acceptance.pooled
    opt = best_length(alpha, cost, 256, LENGTHS)
    assert opt == 4 and pol.choose(fresh) == opt
    cold = _policy(cost, probe_budget=0.0)
    assert cold.choose(fresh) < opt       # the prior 0.5 alone: long drafts look like a loss
    # one short request among veterans of a worse acceptance keeps its own estimate apart
    pol.observe(fresh[:1], 4, [1], None)  # its first draft rejected
    assert pol.acceptance.alpha(fresh[0])[0] < pol.acceptance.pooled[0] - 0.1


def test_simulate_checks_its_inputs():
    pol = _policy(_cost(1 / 256))
    for kw in (dict(batch=0, steps=1), dict(batch=1, steps=-1), dict(batch=1, steps=1, tokens=0)):
        with pytest.raises(ValueError, match="simulate"):
            simulate(pol, [0.5] * 4, _cost(1 / 256), **kw)
    with pytest.raises(ValueError, match="alpha"):
        simulate(pol, [0.5] * 3, _cost(1 / 256), 1, 1)
    with pytest.raises(ValueError, match="alpha"):
        simulate(pol, [0.5, 0.5, 1.5, 0.5], _cost(1 / 256), 1, 1)
