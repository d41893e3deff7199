"""The traffic model reproduces the formulas of docs/MATH.md (Traffic model) and its optimum."""

import math

import pytest

from replayssm.bench import traffic as tr


def test_design_formulas_fp32_state_bf16_vectors():
    d, n = 64, 128
    s = tr.HeadShape(d=d, n=n)
    assert tr.recurrent_bytes(s) == 8 * d * n + 2 * (d + 2 * n + 1)
    for h in (0, 3, 11):
        expect = 4 * d * n + 2 * h * (d + n + 1) + 2 * (d + 2 * n + 1) + 2 * (d + n + 1)
        assert tr.replay_bytes(s, h) == expect
        assert tr.replay_bytes(s, h, flush=True) == expect + 4 * d * n
    assert tr.snapshot_spec_bytes(s, 4) == 4 * d * n + 4 * 4 * d * n + 4 * 2 * (d + 2 * n + 1)


@pytest.mark.parametrize("d,n,expect", [(64, 128, 13), (128, 128, 16)])
def test_optimal_buffer_size_matches_closed_form(d, n, expect):
    s = tr.HeadShape(d=d, n=n)
    assert tr.optimal_buffer_size(s) == pytest.approx(math.sqrt(4 * d * n / (d + n + 1)))
    assert tr.best_buffer_size(s) == expect
    # the integer optimum is a minimum of the amortised cost
    L = tr.best_buffer_size(s)
    assert tr.replay_cycle_bytes(s, L) <= tr.replay_cycle_bytes(s, L - 1)
    assert tr.replay_cycle_bytes(s, L) <= tr.replay_cycle_bytes(s, L + 1)


def test_replay_beats_recurrent_and_snapshot():
    s = tr.HeadShape()
    L = tr.best_buffer_size(s)
    assert tr.replay_cycle_bytes(s, L) < tr.recurrent_bytes(s)
    for T in range(1, 7):
        Ls = max(L, 2 * T)
        for a in range(T + 1):
            assert tr.replay_spec_bytes(s, T, Ls, a) < tr.snapshot_spec_bytes(s, T)


def test_kv_threshold_is_the_crossover():
    s = tr.HeadShape(d=128, n=128)
    L = tr.best_buffer_size(s)
    c = tr.kv_switch_threshold(s, L)
    assert tr.kv_only_bytes(s, c - 1) <= tr.replay_cycle_bytes(s, L) < tr.kv_only_bytes(s, c)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="HeadShape.d"):
        tr.HeadShape(d=0)
    with pytest.raises(ValueError, match="2T"):
        tr.replay_spec_bytes(tr.HeadShape(), T=4, L=7, accepted=1)
    with pytest.raises(ValueError, match="accepted"):
        tr.replay_spec_bytes(tr.HeadShape(), T=2, L=8, accepted=3)


def test_cli_prints_tables(capsys):
    assert tr.main([]) == 0
    out = capsys.readouterr().out
    assert "optimal buffer size" in out and "Gated DeltaNet" in out
    assert tr.main(["--d", "32", "--n", "16", "--json"]) == 0
    assert '"recurrent"' in capsys.readouterr().out


def test_core_threshold_agrees_with_the_traffic_model():
    """The engine's KV-only switch point (closed form on real byte sizes, no bench import)
    is the traffic model's first context where KV-only reads more than amortised replay."""
    import random

    from replayssm.forms.kv import kv_only_threshold

    rng = random.Random(0)
    for _ in range(500):
        s = tr.HeadShape(d=rng.randint(1, 256), n=rng.randint(1, 256), vec_bytes=rng.choice([2, 4]))
        L = rng.randint(1, 64)
        assert kv_only_threshold(s.state, int(s.entry), L) == tr.kv_switch_threshold(s, L)
