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
  constrained row skips all of it.  The executor calls ``prepare`` before the model call (the
  fill runs on a worker thread while the forward is launched and runs) and ``apply`` after
  it (nothing there waits on the device).

* :mod:`.drafts` — :class:`DraftMasks`: in a speculative step, each constrained row's matcher
  walked over its drafts (llguidance's parallel draft walk, rolled back): the drafts cut at
  the first one the grammar or a ban rejects, and a ``[B, N, V]`` token mask of every verify
  node, applied to the verify logits before acceptance.

Speculation: lossless.  Constrained rows speculate beside free rows in one verify step.  A
grammar-rejected draft is cut (``valid`` shrinks); the mask of node ``i`` (after drafts
``d_1..d_i``) makes the accepted drafts and the bonus token exactly those of plain
constrained decoding (greedy), or samples of the masked target (sampled: the acceptance is
exact for the masked ``p`` with the drafter's own ``q``, so ``q`` is left unmasked, and with
draft distributions a rejected draft is kept, not cut, so that acceptance rejects it and
draws from the residual — a cut would skew the distribution).  Tree proposals: a
constrained row verifies its chain of first children (its other nodes are invalid).  The
output processor then feeds the matcher the accepted tokens and the bonus, as in plain
decoding.  Rows with ``logit_bias`` (not a mask) decode plainly in a step that speculates
(a second model call), as do constrained rows on a runner whose verify steps take no mask.
The drafts are read on the host before verification (a sync for device-drafted proposals,
only in steps with constrained rows); masked verify steps are their own CUDA graph keys,
captured when first met.
"""

from .constraint import ConstraintFactory, RequestConstraint
from .drafts import DraftMasks
from .grammar import GrammarCache, StructuredOutputsUnavailable, require_llguidance
from .logits import LogitsMasker

__all__ = ["ConstraintFactory", "DraftMasks", "GrammarCache", "LogitsMasker", "RequestConstraint",
           "StructuredOutputsUnavailable", "require_llguidance"]
