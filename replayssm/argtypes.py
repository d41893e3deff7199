"""argparse value types shared by the command-line entry points (no heavy imports).

A bad value becomes argparse's usage error (``prog: error: argument --x: ...``, exit 2)
instead of a traceback from deep inside a benchmark.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "nonnegative_int", "positive_float", "probability", "int_list"]


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
    return v


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int_at_least(text, 1, "a positive int")


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    return _int_at_least(text, 0, "an int >= 0")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return v


def probability(text: str) -> float:
    """A number in ``[0, 1]``."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v


def int_list(text: str) -> str:
    """A comma-separated list of positive ints (kept as the string the code splits later)."""
    parts = [t for t in text.replace(" ", "").split(",") if t]
    if not parts:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive ints, got nothing")
    for t in parts:
        positive_int(t)
    return ",".join(parts)
