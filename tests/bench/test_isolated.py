"""run_isolated: a function in a fresh spawn process, its result, error or timeout back."""

import os
import time

import pytest

from replayssm.bench.isolated import run_isolated


def _result(x, key):
    return {"x": x * 2, "env": os.environ.get(key), "pid": os.getpid()}


def _raise():
    raise RuntimeError("boom in the child")


def _hang():
    time.sleep(60)


def test_result_env_and_errors():
    got = run_isolated(_result, 21, "REPLAYSSM_ISOLATED_TEST", env={"REPLAYSSM_ISOLATED_TEST": "on"}, timeout_s=120)
    assert got["x"] == 42 and got["env"] == "on" and got["pid"] != os.getpid()
    assert "REPLAYSSM_ISOLATED_TEST" not in os.environ          # the parent's environment is untouched
    bad = run_isolated(_raise, timeout_s=120)
    assert "RuntimeError: boom in the child" in bad["error"]
    t0 = time.monotonic()
    slow = run_isolated(_hang, timeout_s=1.0)
    assert "timed out" in slow["error"] and time.monotonic() - t0 < 30
    with pytest.raises(ValueError, match="timeout_s"):
        run_isolated(_result, 1, "X", timeout_s=0)
