"""Constrained decoding: structured outputs (JSON schema, JSON object, regex, choice, Lark
grammar via llguidance), ``min_tokens``, ``bad_words`` and ``logit_bias``.

Three parts:

* :mod:`.grammar` — a request's ``structured_outputs`` -> an llguidance grammar, compiled
  once per (tokenizer, constraint) into a pristine ``LLMatcher`` kept in an LRU cache
  (:class:`GrammarCache`); every sequence gets its own ``deep_copy`` of it.  llguidance is
  imported lazily (the ``structured`` extra), only when a request asks for a grammar.
* :mod:`.constraint` — :class:`RequestConstraint`, one per sequence (``Sequence.constraint``;
  None for free requests): its matcher, its bad-word token sequences, its ``logit_bias``
  and ``min_tokens`` stop ids; ``advance`` feeds it each appended token (the output
  processor) and reports when the grammar is complete (the request ends with ``"stop"``).
  :class:`ConstraintFactory` builds and validates them in ``add_request``.
* :mod:`.logits` — :class:`LogitsMasker`: the step's masks for all constrained rows at once
  (one parallel llguidance fill into a reused bitmask, plus one sparse list of banned /
  biased entries), applied on the device to those rows only, before penalties and
  sampling (greedy and sampled alike).  Free rows' logits are untouched, and a batch with no
  constrained row skips all of it.  The executor calls it right after the model call was
  launched, so on CUDA the host work overlaps the forward (nothing here syncs on logits).

Speculation policy: lossless by construction.  In a step that speculates, the constrained
rows (any of the four features) run a plain decode step of their own and the free rows
speculate as usual (two model calls in that step; the drafters are told through
``plain_step``, as for ``disable_by_batch_size``).  Masking every draft node of a verify step
would let constrained rows speculate too, but needs the matcher advanced along each draft
path (and rolled back); the split keeps the verifier and its CUDA graphs unchanged, and a
constrained request's tokens are exactly those of plain decoding.
"""

from .constraint import ConstraintFactory, RequestConstraint
from .grammar import GrammarCache, StructuredOutputsUnavailable, require_llguidance
from .logits import LogitsMasker

__all__ = ["ConstraintFactory", "RequestConstraint", "GrammarCache", "StructuredOutputsUnavailable",
           "require_llguidance", "LogitsMasker"]
