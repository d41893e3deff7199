"""The drafter's host time in the draft-length policy: ``StepCosts.host`` (measured ``propose``
time per bucket and length, refined online), priced on every ``T > 0`` and taken out of the
device table's online refinement (counted once); the sibling correction of seeded entries not
yet refined.  Traces use the numbers measured on an H200 (Qwen3-Next-4B preset, oracle
acceptance 0.7): a 16 ms plain step and 8.4 ms of n-gram ``propose`` at B=256."""

import pytest

from replayssm.engine.spec.policy import AdaptiveLengths, FixedLengths, StepCosts
from replayssm.engine.spec.simulate import best_length, simulate

MS = 1e-3
BUCKETS = [1, 16, 64, 256]
LENGTHS = (1, 2, 3, 4)
ALPHA = [0.7] * 4


def _device(B, T):
    """B=256: 16 ms plain, +8 ms per draft (4 drafts: 48 ms, as measured); B=1: 5 ms, +0.6 ms."""
    return (16.0 + 8.0 * T) * MS if B > 64 else (5.0 + 0.6 * T) * MS


def _seeded(online=True, **kw):
    return StepCosts({(b, T): _device(b, T) for b in BUCKETS for T in (0,) + LENGTHS}, online=online, **kw)


def test_host_cost_lookup_nearest_length_and_scaled_bucket():
    c = StepCosts({(1, 0): 1.0}, host={(16, 2): 0.004, (16, 4): 0.006, (64, 1): 0.010})
    assert c.host_cost(16, 0) == 0.0                      # a plain step proposes nothing
    assert c.host_cost(16, 2) == 0.004 and c.host_cost(16, 4) == 0.006
    assert c.host_cost(16, 3) == 0.006                    # nearest length, ties to the longer
    assert c.host_cost(16, 1) == 0.004
    assert c.host_cost(64, 4) == 0.010                    # only T = 1 known at 64
    assert c.host_cost(256, 2) == pytest.approx(0.010 * 4)   # nearest bucket below, per row
    assert c.host_cost(1, 2) == pytest.approx(0.004 / 16)    # none below: the smallest above
    assert StepCosts().host_cost(256, 4) == 0.0           # nothing measured yet


@pytest.mark.parametrize("host", [{(4, 0): 0.001}, {(4, 1): -0.001}, {(0, 1): 0.001}, {(4, 1): float("inf")}])
def test_host_table_rejects_bad_entries(host):
    with pytest.raises(ValueError):
        StepCosts(host=host)


def test_observe_host_drops_the_first_then_takes_the_window_median():
    c = StepCosts(online=True, host_window=5, host_min=3)
    c.observe_host(16, 3, 0.100)               # first of the key: may capture or compile
    assert c.host == {}
    c.observe_host(16, 3, 0.004)
    c.observe_host(16, 3, 0.008)
    assert c.host == {}                        # fewer than host_min samples: no price yet
    c.observe_host(16, 3, 0.006)
    assert c.host[(16, 3)] == pytest.approx(0.006)
    c.observe_host(16, 3, 1.0)                 # a pause: the median moves by one rank
    assert c.host[(16, 3)] == pytest.approx(0.007)
    for x in (0.005, 0.005, 0.005, 0.005):     # the window slides past it
        c.observe_host(16, 3, x)
    assert c.host[(16, 3)] == pytest.approx(0.005)
    c.observe_host(16, 0, 0.5)                 # T = 0 has no host entry
    assert (16, 0) not in c.host
    off = StepCosts(host={(16, 3): 0.002})
    for _ in range(5):
        off.observe_host(16, 3, 0.004)
    assert off.host == {(16, 3): 0.002}        # offline tables are not refined


@pytest.mark.parametrize("bad", [{"host_window": 0}, {"host_min": 0}, {"host_window": 3, "host_min": 4},
                                 {"host_window": 2.0}, {"host_min": True}])
def test_host_window_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="host_min"):
        StepCosts(**bad)


@pytest.mark.parametrize("at", [1, 2, 3, 7])
def test_one_host_pause_does_not_stop_speculation(at):
    """B=64, 1 ms of host drafting a step where drafting pays (5 ms plain step): one
    ``propose`` of the run takes 105 ms (a full collection).  Wherever it lands -- even as
    the first kept sample of the only length drafted -- the policy keeps drafting: the price
    stays the median of normal samples (a mean or a single sample would have priced every
    length at the pause and stopped speculation, and with it the samples that correct it)."""
    calls = {"n": 0}

    def host(B, T):
        calls["n"] += 1
        return 105 * MS if calls["n"] == at + 1 else 1 * MS   # call 1 is dropped as a first

    pol = AdaptiveLengths(LENGTHS, _seeded(), BUCKETS)
    res = simulate(pol, ALPHA, _device, 64, 60, seed=2, host=host)
    assert calls["n"] > at + 1                               # the pause happened
    assert 0 not in res.chosen[-50:], res.chosen
    for T in LENGTHS:
        h = pol.costs.host_cost(64, T)
        assert h == 0.0 or h == pytest.approx(1 * MS)
    assert res.plain_seconds / res.seconds > 1.3


def test_host_time_is_counted_once():
    """Steps of ``t + h`` seconds told ``h``: the device table converges to ``t`` and the
    host table to ``h``, so the predicted step is ``t + h`` (not ``t + 2h``), at every length
    the policy drafts; plain steps keep their own entry."""
    host = {1: 1.0 * MS, 2: 1.5 * MS, 3: 2.0 * MS, 4: 2.5 * MS}   # grows with T (MTP-like)
    costs = _seeded()
    pol = AdaptiveLengths(LENGTHS, costs, BUCKETS)
    script = [0, 1, 2, 3, 4] * 30
    seqs = [object() for _ in range(16)]
    for T in script:
        sec = _device(16, T) + (host[T] if T else 0.0)
        pol.observe(seqs, T, [1] * 16, sec, host[T] if T else None)
    for T in LENGTHS:
        assert costs.host_cost(16, T) == pytest.approx(host[T], rel=1e-6)
        assert costs.get(16, T) == pytest.approx(_device(16, T), rel=0.02)   # + the policy's own µs
        assert costs.get(16, T) + costs.host_cost(16, T) < _device(16, T) + 1.1 * host[T]
    assert costs.get(16, 0) == pytest.approx(_device(16, 0), rel=0.02)


def test_without_the_host_argument_the_step_time_keeps_the_drafting():
    """A caller that does not split the host part (a fused draft-and-verify step) refines the
    device table with the whole step and leaves the host table alone."""
    costs = _seeded()
    pol = AdaptiveLengths(LENGTHS, costs, BUCKETS)
    for _ in range(20):
        pol.observe([object()], 2, [1], _device(1, 2) + 3 * MS)
    assert costs.host == {}
    assert costs.get(1, 2) == pytest.approx(_device(1, 2) + 3 * MS, rel=0.02)


def test_best_length_counts_host_time():
    none = lambda B, T: 0.0
    assert best_length(ALPHA, _device, 256, LENGTHS, host=none) == 1     # device alone: T = 1 just wins
    assert best_length(ALPHA, _device, 256, LENGTHS, host=lambda B, T: 8.4 * MS) == 0
    assert best_length(ALPHA, _device, 1, LENGTHS, host=lambda B, T: 0.14 * MS) == 4


def test_large_batch_host_bound_drafter_decodes_plainly():
    """B=256, 8.4 ms of host drafting a step: after a few steps the policy decodes plainly
    and loses little against plain decoding, where always drafting 4 loses about 20%."""
    h = lambda B, T: 8.4 * MS
    pol = AdaptiveLengths(LENGTHS, _seeded(), BUCKETS)
    res = simulate(pol, ALPHA, _device, 256, 60, seed=3, host=h)
    assert res.chosen[-40:].count(0) >= 38                      # probes aside: plain
    assert res.plain_seconds / res.seconds > 0.93               # vs 0.79 for always T = 4
    fixed = simulate(FixedLengths((4,)), ALPHA, _device, 256, 60, seed=3, host=h)
    assert fixed.plain_seconds / fixed.seconds < 0.85
    assert res.rate > 1.1 * fixed.rate
    assert pol.costs.host_cost(256, 1) == pytest.approx(8.4 * MS)


def test_small_host_time_still_drafts():
    """B=1, 0.14 ms of host drafting against a 5 ms step (B=16: 0.4 ms): drafting wins by
    far and the policy drafts on every step (which length: acceptance noise at one row)."""
    for B, h in ((1, 0.14), (16, 0.4)):
        pol = AdaptiveLengths(LENGTHS, _seeded(), BUCKETS)
        res = simulate(pol, ALPHA, _device, B, 60, seed=5, host=lambda b, T, h=h: h * MS)
        assert 0 not in res.chosen[-40:], res.chosen
        assert res.plain_seconds / res.seconds > 1.6
        assert pol.costs.host_cost(B, 4) == pytest.approx(h * MS)


def test_simulate_rejects_negative_host_time():
    pol = AdaptiveLengths(LENGTHS, _seeded(), BUCKETS)
    with pytest.raises(ValueError, match="host"):
        simulate(pol, ALPHA, _device, 4, 10, host=lambda B, T: -1.0)


def test_unrefined_seeds_take_the_correction_of_refined_siblings():
    """B=1 MTP-like: the start-up table (device time only) misses ~3.5 ms of a speculative
    step's Python.  Once T=4 is refined to its true time, T=1 (never drafted) must not look
    cheap only because its seed is bare: it takes T=4's correction, and T=4 stays the best
    choice at acceptance 0.7 (with a bare T=1 seed the policy would switch to T=1)."""
    true = {0: 5.35 * MS, 1: 8.7 * MS, 2: 9.3 * MS, 3: 9.9 * MS, 4: 10.5 * MS}
    seed = {0: 4.5 * MS, 1: 5.1 * MS, 2: 5.6 * MS, 3: 6.1 * MS, 4: 6.6 * MS}
    costs = StepCosts({(1, T): v for T, v in seed.items()}, online=True)
    for _ in range(8):
        costs.observe(1, 4, true[4])
        costs.observe(1, 0, true[0])
    assert costs.get(1, 4) == pytest.approx(true[4], rel=0.15)
    for T in (1, 2, 3):   # seed + the mean correction of the refined drafting keys
        assert costs.get(1, T) == pytest.approx(seed[T] + costs.get(1, 4) - seed[4])
        assert costs.table[(1, T)] == seed[T]             # the entry itself is untouched
    pol = AdaptiveLengths(LENGTHS, costs, [1])
    seqs = [object()]
    for _ in range(40):   # acceptance 0.7 at every depth, observed at depth 4
        for a in (1, 2, 3, 4, 5, 5, 2, 4, 3, 5):
            pol.acceptance.observe_batch(seqs, 4, [a - 1])
    assert pol.choose(seqs) == 4
    bare = StepCosts({(1, T): v for T, v in seed.items()})
    bare.table[(1, 4)], bare.table[(1, 0)] = costs.get(1, 4), costs.get(1, 0)
    pol.costs = bare
    assert pol.choose(seqs) < 4                           # a bare seed looks cheap: shorter
    # the first refinement of a sibling starts from its corrected seed
    costs.observe(1, 1, true[1])
    costs.observe(1, 1, true[1])
    assert costs.get(1, 1) == pytest.approx(true[1], rel=0.1)


def test_engine_passes_propose_time_and_greedy_output_is_unchanged(target):
    """The executor times ``propose`` (here slowed by 3 ms) and hands it to the policy: the
    host table learns it, the device table is observed with it taken out, and greedy output
    equals plain decoding's."""
    import time

    from replayssm import LLM, SamplingParams, SpeculativeConfig
    from engine_helpers import PROMPTS, reference_greedy

    expected = [reference_greedy(target, p, 12) for p in PROMPTS]
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_tokens=4))
    L = llm.executor.lengths
    # host_min=1: a key's price is learnt from its second sample (the first is dropped), so
    # the check below holds however the policy spreads its steps over draft lengths (which
    # depends on the measured step times, i.e. on the machine's load)
    costs = L.costs = StepCosts({(b, T): 1e-3 for b in L.buckets for T in (0,) + L.lengths}, online=True,
                                host_min=1)
    drafter, propose = llm.executor.drafter, llm.executor.drafter.propose

    def slow(seqs, k=None):
        time.sleep(0.003)
        return propose(seqs, k)

    drafter.propose = slow
    told, device = [], []
    observe, dev_observe = L.observe, costs.observe
    L.observe = lambda seqs, T, acc, sec, host=None: (told.append((T, sec, host)), observe(seqs, T, acc, sec, host))
    costs.observe = lambda B, T, sec, flush_part=0.0: (device.append((T, sec)), dev_observe(B, T, sec, flush_part))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == expected
    drafted = [(T, sec, h) for T, sec, h in told if T and sec is not None]
    assert drafted and all(h is not None and h >= 0.003 for _, _, h in drafted)
    for (T, sec, h), (T2, dsec) in zip([x for x in told if x[1] is not None], device):
        assert T == T2
        if T:   # the device table sees the step less the propose time (plus the policy's µs)
            assert sec - h <= dsec < sec - h + 0.002
    assert all(v >= 0.003 for v in costs.host.values())
    if len(drafted) > len({T for T, _, _ in drafted}):   # some draft length was proposed twice
        assert costs.host


def test_sibling_correction_leaves_unseeded_and_other_buckets_alone():
    """Only seeded keys refined online define the correction; an entry that came from
    observations alone is not shifted, nor is another bucket or the plain key."""
    c = StepCosts({(4, 0): 1.0, (4, 1): 2.0, (4, 2): 3.0, (16, 1): 5.0}, online=True, decay=0.5)
    for _ in range(6):
        c.observe(4, 1, 4.0)        # refined towards 4: the drafting correction at bucket 4 grows
        c.observe(4, 3, 9.0)        # no seed: its own samples only
    off = c.get(4, 1) - 2.0
    assert off > 1.5
    assert c.get(4, 2) == pytest.approx(3.0 + off)       # the unrefined sibling
    assert c.get(4, 3) == pytest.approx(9.0)              # unseeded: as observed
    assert c.get(4, 0) == 1.0 and c.get(16, 1) == 5.0     # plain key, other bucket: untouched
