"""argparse value types shared by the command-line entry points (no heavy imports).

A bad value becomes argparse's usage error (``prog: error: argument --x: ...``, exit 2)
instead of a traceback from deep inside a benchmark.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "probability", "int_list",
           "port", "byte_count"]


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


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _number(text)
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return v


def probability(text: str) -> float:
    """A number in ``[0, 1]``."""
    v = _number(text)
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


def port(text: str) -> int:
    """A TCP port, ``0 .. 65535`` (0: any free port)."""
    v = _int_at_least(text, 0, "a port in [0, 65535]")
    if v > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {v}")
    return v


def byte_count(text: str) -> int:
    """A number of bytes >= 1, written as an int or a float (``8e9``)."""
    v = positive_float(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return int(v)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    v = _number(text)
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v
