"""Which form each request's SSM layers run in: a fixed decode mode, or ``auto``.

``decode_mode="auto"`` (KVBuffer's per-request choice) keeps a request KV-only — no state,
every input since the start in paged blocks — while its context is shorter than
``threshold`` tokens, then compresses its entries into a state (one flush) and continues
in replay form.  The engine asks the policy three questions per step; a fixed mode answers
"nothing to do" to all of them.
"""

from __future__ import annotations

from .sequence import Sequence


class FixedModePolicy:
    """``recurrent``, ``replay`` or ``kv`` for every request: no switches."""

    threshold: int | None = None

    def before_prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Sequences to switch to a state before this step's prefill."""
        return []

    def prefill_groups(self, chunks: list[tuple[Sequence, int]], cache) -> list[list[tuple[Sequence, int]]]:
        """The prefill chunks in groups that run as one model call each."""
        return [chunks]

    def after_step(self, running: list[Sequence]) -> list[Sequence]:
        """Running sequences to switch to a state after this step."""
        return []


class AutoModePolicy(FixedModePolicy):
    """KV-only below ``threshold`` tokens of context, a state (replay form) from there on."""

    def __init__(self, threshold: int):
        self.threshold = threshold

    def before_prefill(self, chunks):
        """Prompts already past the threshold skip the KV-only form: an empty slot switched
        to a (zero) state prefills straight into it (so does a prefix-cache hit about to be
        resumed)."""
        return [s for s, _ in chunks if s.num_prompt_tokens >= self.threshold and (
            s.num_prefilled == 0 or (s.prefix is not None and s.prefix.load is not None))]

    def prefill_groups(self, chunks, cache):
        """Each form prefills in its own call: KV-only slots, then state slots."""
        return [[c for c in chunks if cache.mode_of(c[0].slot) == m] for m in ("kv", "replay")]

    def after_step(self, running):
        """KV-only sequences whose context reached the threshold (prefill complete)."""
        return [s for s in running if s.finish_reason is None and s.mode == "kv" and not s.prefilling
                and s.num_cached >= self.threshold]


def decode_policy(mode: str, threshold: int) -> FixedModePolicy:
    """The policy of a decode mode (``threshold``: the ``auto`` switch, in tokens)."""
    return AutoModePolicy(threshold) if mode == "auto" else FixedModePolicy()
