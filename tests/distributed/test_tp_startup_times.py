"""The startup-timing records of a tensor-parallel group (no processes)."""

from __future__ import annotations

import pytest

from replayssm.distributed.startup import StartupTimes, format_times, is_startup_call


def test_phases_add_up_count_and_survive_exceptions():
    t = StartupTimes()
    t.add("load", 1.5)
    t.add("load", 0.25)
    with pytest.raises(KeyError), t.phase("capture"):
        raise KeyError("x")
    assert t.times["load"] == 1.75 and t.counts == {"load": 2, "capture": 1}
    assert list(t.as_dict()) == ["load", "capture"] and t.times["capture"] >= 0
    t.as_dict()["load"] = 0.0                       # a copy
    assert t.times["load"] == 1.75
    t.clear()
    assert t.as_dict() == {} and t.counts == {}


def test_only_startup_calls_are_timed():
    assert is_startup_call("load") and is_startup_call("runner") and is_startup_call("make")
    assert is_startup_call("call", "capture") and is_startup_call("call", "make_cache")
    assert not is_startup_call("call", "decode") and not is_startup_call("call", "reserve")
    assert not is_startup_call("report") and not is_startup_call("stop")


def test_table_has_a_column_per_rank_and_marks_missing_phases():
    text = format_times({1: {"process_start": 2.0, "load": 0.5}, 0: {"spawn": 0.01, "load": 0.75}}, "t")
    lines = text.splitlines()
    assert lines[0] == "t" and lines[1].split() == ["phase", "rank", "0", "rank", "1"]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:]}
    assert list(rows) == ["spawn", "load", "process_start"]      # rank 0's order, then the others'
    assert rows["spawn"] == ["0.010", "-"] and rows["load"] == ["0.750", "0.500"]
    assert rows["process_start"] == ["-", "2.000"]


def test_module_phase_adds_to_the_active_timings_only():
    from replayssm.distributed import startup

    t, before = StartupTimes(), startup._current
    startup.activate(None)
    with startup.phase("symm.rendezvous"):
        pass
    startup.activate(t)
    try:
        with pytest.raises(RuntimeError), startup.phase("symm.rendezvous"):
            raise RuntimeError("x")
        with startup.phase("symm.rendezvous"):
            pass
    finally:
        startup.activate(before)
    assert t.counts == {"symm.rendezvous": 2} and t.times["symm.rendezvous"] >= 0
