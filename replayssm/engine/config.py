"""Validated user-facing settings: :class:`SamplingParams`, :class:`SpeculativeConfig`,
:class:`EngineConfig`.

Every dataclass checks itself in ``__post_init__`` and raises :class:`ValueError` naming the
offending field, so impossible settings fail before any model or cache is touched.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from typing import Sequence

from ..cache.ring import check_speculative_capacity
from ..cache.spec import CacheSpec, state_dtype_name

DECODE_MODES = ("recurrent", "replay", "kv", "auto")
PREEMPTION_MODES = ("swap", "off")
SPEC_METHODS = ("ngram", "draft", "tree", "mtp")
SPEC_POLICIES = ("adaptive", "fixed")
MAX_LOGPROBS = 20   # top alternatives per token (OpenAI's limit for chat)
#: most inputs one verify step may carry (the last accepted token + drafts): the verify cost,
#: the replay buffer (``2 x`` this) and the per-step scratch all grow with it, and draft
#: trees past a few dozen nodes accept no more tokens per step
MAX_VERIFY_TOKENS = 128
#: replay buffer capacity when none is given (raised to ``2 * verify_tokens`` under speculation)
DEFAULT_BUFFER_SIZE = 16


def _int(name: str, v, lo: int | None = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def _float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    try:
        v = float(v)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {v!r}") from None
    if v != v:
        raise ValueError(f"{name} must not be NaN")
    return v


#: temperatures below this sample greedily (see :class:`SamplingParams`)
GREEDY_BELOW = 1e-5
#: largest top_k (it is carried in a float64 row of the step's sampling tensor)
MAX_TOP_K = 2 ** 31 - 1
#: smallest repetition penalty (a positive logit is divided by it: smaller ones overflow fp32)
MIN_REPETITION_PENALTY = 1e-2


@dataclass
class SamplingParams:
    """How one request is sampled.

    ``temperature == 0`` is greedy (argmax); so is any temperature below :data:`GREEDY_BELOW`
    (the limit as ``T -> 0``; dividing fp32 logits by a smaller one overflows).  ``top_k == 0``
    and ``top_p == 1`` disable those filters.  ``seed`` gives the request its own ``torch.Generator`` (reproducible regardless
    of what else is in the batch); ``None`` draws from the engine's generator.  Generation
    stops at ``max_tokens`` generated tokens, at the model's EOS (unless ``ignore_eos``), at
    any of ``stop_token_ids`` (the stop token is kept in the output), or when the generated
    text contains one of ``stop`` (the text is cut before it, and tokens a speculative step
    accepted past the one that completed it are dropped).

    Penalties act on the model's logits before the temperature, in this order (as vLLM and
    HF do): ``repetition_penalty`` ``r`` over every token of the prompt and the output so far
    (a positive logit is divided by ``r``, a negative one multiplied), then
    ``frequency_penalty * count + presence_penalty * (count > 0)`` subtracted, counting the
    output tokens only.  Filters act on the tempered distribution: ``top_k``, ``top_p``,
    ``min_p`` (drop tokens below ``min_p`` times the most likely one's probability).  Greedy
    decoding takes the argmax after the penalties.  ``logprobs``: ``None`` for none, else
    each generated token's log-probability under the model (log-softmax of the raw logits)
    and the ``logprobs`` most likely alternatives.  ``n``: independent samples of the same
    prompt (one shared prefill).  ``priority``: lower values are admitted first and preempted
    last (first-come first-served among equal priorities), as vLLM's.

    Constraints (applied to the logits before any penalty, greedy and sampled alike):
    ``structured_outputs`` holds exactly one of ``{"json": schema}`` (a JSON-schema dict or
    its JSON text), ``{"json_object": True}`` (any JSON object), ``{"regex": str}``,
    ``{"choice": [str, ...]}`` or ``{"grammar": str}`` (a Lark grammar in llguidance's
    syntax, which may embed ``%json {...}``); the request ends (``"stop"``) once the
    constraint is complete.  ``min_tokens``: EOS and ``stop_token_ids`` are masked until that
    many tokens were generated.  ``bad_words``: strings whose token sequences must not be
    generated (vLLM: each word is tokenized with and without a leading space; the last token
    of a sequence is banned where the tokens before it were just generated).  ``logit_bias``:
    ``{token id: bias in [-100, 100]}`` added to the logits (ids checked against the
    vocabulary in ``add_request``).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    priority: int = 0
    structured_outputs: dict | None = None
    min_tokens: int = 0
    bad_words: Sequence[str] = ()
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        _int("SamplingParams.max_tokens", self.max_tokens, 1)
        _int("SamplingParams.priority", self.priority, None)
        self.temperature = _float("SamplingParams.temperature", self.temperature)
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        _int("SamplingParams.top_k", self.top_k, 0)
        if self.top_k > MAX_TOP_K:   # any k >= the vocabulary keeps every token; this bounds the tensor it fills
            raise ValueError(f"SamplingParams.top_k must be <= {MAX_TOP_K} (0 disables it), got {self.top_k}")
        self.top_p = _float("SamplingParams.top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _int("SamplingParams.seed", self.seed, None)
        if self.stop_token_ids is None:       # OpenAI-style callers send null for "none"
            self.stop_token_ids = ()
        if self.stop is None:
            self.stop = ()
        for name, one in (("stop_token_ids", int), ("stop", str)):
            v = getattr(self, name)
            if not isinstance(v, (one, list, tuple)):
                raise ValueError(f"SamplingParams.{name} must be a list, got {type(v).__name__}")
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = (self.stop_token_ids,)
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            _int("SamplingParams.stop_token_ids[...]", t, 0)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop entries must be non-empty strings, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        self.min_p = _float("SamplingParams.min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _float(f"SamplingParams.{name}", getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = _float("SamplingParams.repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0:
            raise ValueError(f"SamplingParams.repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 100], "
                             f"got {self.repetition_penalty}")
        if self.logprobs is not None:
            _int("SamplingParams.logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        _int("SamplingParams.n", self.n, 1)
        self._check_constraints()

    def _check_constraints(self) -> None:
        """``structured_outputs``, ``min_tokens``, ``bad_words``, ``logit_bias`` (normalised:
        one bad word becomes a tuple, JSON's string keys of ``logit_bias`` become ints)."""
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        _int("SamplingParams.min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.bad_words is None:
            self.bad_words = ()
        if isinstance(self.bad_words, str):
            self.bad_words = (self.bad_words,)
        if not isinstance(self.bad_words, (list, tuple)):
            raise ValueError(f"SamplingParams.bad_words must be a list of strings, got {type(self.bad_words).__name__}")
        self.bad_words = tuple(self.bad_words)
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                raise ValueError(f"SamplingParams.bad_words entries must be non-empty strings, got {w!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias, "
                                 f"got {type(self.logit_bias).__name__}")
            bias = {}
            for k, v in self.logit_bias.items():
                if isinstance(k, str) and k.strip().isdigit():   # JSON object keys are strings
                    k = int(k)
                _int("SamplingParams.logit_bias key", k, 0)
                v = _float(f"SamplingParams.logit_bias[{k}]", v)
                if not -100.0 <= v <= 100.0:
                    raise ValueError(f"SamplingParams.logit_bias[{k}] must be in [-100, 100], got {v}")
                bias[k] = v
            self.logit_bias = bias or None

    @property
    def constrained(self) -> bool:
        """Whether anything masks or biases this request's logits (structured outputs,
        ``min_tokens``, ``bad_words``, ``logit_bias``)."""
        return bool(self.structured_outputs is not None or self.min_tokens or self.bad_words or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


#: the kinds of :attr:`SamplingParams.structured_outputs`
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _structured_outputs(so) -> dict | None:
    """``SamplingParams.structured_outputs`` checked and normalised (a JSON schema given as
    text is parsed; the grammar itself is compiled in ``add_request``)."""
    name = "SamplingParams.structured_outputs"
    if so is None:
        return None
    if not isinstance(so, dict):
        raise ValueError(f"{name} must be a dict with one of {STRUCTURED_KINDS}, got {type(so).__name__}")
    keys = [k for k, v in so.items() if v is not None]   # {"json": None, "regex": ...}: unset fields
    if len(keys) != 1 or keys[0] not in STRUCTURED_KINDS:
        raise ValueError(f"{name} must have exactly one of {STRUCTURED_KINDS}, got keys {sorted(map(str, so))}")
    kind = keys[0]
    v = so[kind]
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ValueError(f"{name}['json'] is not valid JSON: {e}") from None
        if not isinstance(v, (dict, bool)):
            raise ValueError(f"{name}['json'] must be a JSON schema (an object), got {type(v).__name__}")
    elif kind == "json_object":
        if v is not True:
            raise ValueError(f"{name}['json_object'] must be True, got {v!r}")
    elif kind == "choice":
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError(f"{name}['choice'] must be a non-empty list of strings, got {v!r}")
        if not all(isinstance(c, str) and c for c in v):
            raise ValueError(f"{name}['choice'] entries must be non-empty strings, got {v!r}")
        v = list(v)
    elif not isinstance(v, str) or not v:
        raise ValueError(f"{name}['{kind}'] must be a non-empty string, got {v!r}")
    return {kind: v}


def sampling_params_list(sampling_params, n: int) -> list[SamplingParams]:
    """``generate``'s ``sampling_params`` for ``n`` prompts: one for all (None: the defaults)
    or a list of one per prompt; each must be a :class:`SamplingParams`."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        params = list(sampling_params)
    else:
        params = [SamplingParams() if sampling_params is None else sampling_params] * n
    for sp in params:
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
    return params


@dataclass
class SpeculativeConfig:
    """Speculative decoding.

    * ``method="ngram"``: prompt lookup (no model).  The last ``prompt_lookup_max`` ..
      ``prompt_lookup_min`` tokens are searched for in the request's earlier tokens and the
      ``num_tokens`` tokens that followed the most recent match are proposed.
    * ``method="draft"``: a second model (``draft_model``: a directory or a loaded model)
      proposes a chain of ``num_tokens`` tokens; its cache is rolled back like the target's.
    * ``method="tree"``: a token tree verified in one pass (STree).  With ``draft_model``,
      ``tree="beam"`` (default) grows a beam-search tree ``tree_width`` wide and
      ``tree_depth`` deep from the draft; ``tree`` may instead be a static shape: a list of
      rank paths such as ``[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]`` (node = the
      ``rank``-th choice of its parent's draft distribution).  Without ``draft_model`` the
      tree is a trie of several prompt-lookup continuations.
    * ``method="mtp"``: the target's own multi-token-prediction head (loaded from the
      checkpoint's ``mtp.*`` tensors) drafts a chain of ``num_tokens`` tokens, or a token tree
      with ``tree``: rank paths as above, or ``"topk"`` (the greedy chain of ``num_tokens``
      plus, at every depth, the next ``tree_width - 1`` ranked alternatives).

    ``num_tokens`` is the chain length (linear methods) and, for trees without an explicit
    shape, the depth.  The verifier sees ``num_tokens + 1`` inputs per step (the last
    accepted token plus the drafts), so the replay buffer must hold
    ``buffer_size >= 2 * (num_tokens + 1)`` (trees: ``2 * (nodes + 1)``); left unset, the
    engine picks that (or 16 if larger).  At most ``MAX_VERIFY_TOKENS - 1`` (127) draft
    tokens per step: larger chains or trees (``tree_width x depth``) raise ``ValueError``.

    ``spec_policy``: how many tokens each step drafts.  ``"adaptive"`` (default) picks, per
    step, ``T`` from ``{0} ∪ draft_lengths`` maximising the expected tokens per second
    ``Σ_rows E(α_row, T) / t(B, T)``: ``α`` the measured per-position acceptance of each
    request, ``t(B, T)`` the step time at the batch's bucket with its expected ring flushes
    (measured at start-up on CUDA on the engine's free slots, and refined online from
    observed step times; on CPU a deterministic roofline, see
    :mod:`replayssm.engine.spec.policy`); ``T = 0`` is a plain decode step, so speculation
    never costs more than it yields.  ``"fixed"`` always drafts ``num_tokens`` (or the whole
    tree).  ``draft_lengths``: the candidate chain lengths (each one a captured verify shape;
    default: 1..``num_tokens`` up to 4, else powers of two below it and itself; trees
    choose between 0 and the whole tree).  ``step_costs``: ``{(batch, T): seconds}`` overriding the measured
    table (and switching online refinement off).  ``probe_interval``: after this many steps
    in a row below the largest length, one step drafts the largest (it observes acceptance
    at every depth, so estimates stay current while speculation is off), as long as probes
    have lost less than 1% of the predicted run time (the first such step of an engine
    probes on credit).  Acceptance is estimated per depth from counts pooled over the
    drafter's requests, each request shrunk to the pool (docs/MATH.md, "Choosing the draft
    length").  Greedy output is identical for every
    choice, and sampled output keeps the target's distribution; a seeded sampled request
    repeats exactly when the chosen lengths do (CPU, ``step_costs`` given, or ``"fixed"``:
    with measured step times the lengths depend on timing).

    ``disable_by_batch_size``: a step with more running sequences than this decodes without
    speculation (output unchanged).  At large batches a verify step costs several decode
    steps on models whose dense or MoE layers dominate (H100, Qwen3-Next-class 4B at B=256:
    speculation 0.78x plain decoding), so speculation pays only below some batch.  Drafters
    catch up on the plain steps' tokens.

    ``mtp_window`` (MTP only): plain steps defer the head's catch-up; their pairs wait in a
    per-slot window of this many pairs (rounded up to a multiple of the catch-up width
    ``num_tokens + 1``, or the tree's nodes) and are committed, ``num_tokens + 1`` pairs a
    pass, when drafting resumes or the window fills (then before the plain step).  So a run
    of plain steps costs one head pass per ``num_tokens + 1`` steps instead of one per step,
    and none until speculation pays again.  ``0``: catch up before every plain step.

    ``mtp_fused`` (MTP only): all-greedy steps without constrained rows run the head's draft
    step and the target's verify, acceptance and commit as one function, one CUDA graph per
    (batch bucket, draft length) (default: two graphs launched back to back).  Not under
    tensor parallelism (there the two stay separate).
    """

    method: str = "ngram"
    num_tokens: int = 4
    draft_model: object = None
    tree: object = None
    tree_width: int = 2
    tree_depth: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: int | None = None
    spec_policy: str = "adaptive"
    draft_lengths: tuple | None = None
    step_costs: dict | None = None
    probe_interval: int = 16
    mtp_window: int = 16
    mtp_fused: bool = False

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"SpeculativeConfig.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _int("SpeculativeConfig.num_tokens", self.num_tokens, 1)
        self._check_policy()
        _int("SpeculativeConfig.tree_width", self.tree_width, 1)
        if self.tree_depth is not None:
            _int("SpeculativeConfig.tree_depth", self.tree_depth, 1)
        _int("SpeculativeConfig.prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("SpeculativeConfig.prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_min ({self.prompt_lookup_min}) > "
                f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _int("SpeculativeConfig.disable_by_batch_size", self.disable_by_batch_size, 1)
        _int("SpeculativeConfig.mtp_window", self.mtp_window, 0)
        if not isinstance(self.mtp_fused, bool):
            raise ValueError(f"SpeculativeConfig.mtp_fused must be a bool, got {self.mtp_fused!r}")
        if self.mtp_fused and self.method != "mtp":
            raise ValueError(f"SpeculativeConfig.mtp_fused fuses the MTP draft step into the verify graph; "
                             f"method is {self.method!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("SpeculativeConfig(method='draft') needs draft_model (a directory or model)")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("SpeculativeConfig(method='ngram') drafts from the context; draft_model is not used "
                             "(method='draft' drafts with it)")
        if self.method == "mtp":
            if self.draft_model is not None:
                raise ValueError("SpeculativeConfig(method='mtp') drafts with the target's own MTP head; "
                                 "draft_model must be None")
            if self.tree == "topk":
                self.tree = topk_tree(self.tree_width, self.num_tokens)
            elif self.tree is not None:
                if isinstance(self.tree, str):
                    raise ValueError(f"SpeculativeConfig.tree for method='mtp' must be 'topk' or a list of rank "
                                     f"paths, got {self.tree!r}")
                self.tree = normalize_static_tree(self.tree)
        elif self.method != "tree" and self.tree is not None:
            raise ValueError(f"SpeculativeConfig.tree is only used with method='tree' or 'mtp', not {self.method!r}")
        if self.method == "tree":
            if self.tree is None:
                self.tree = "beam"
            if isinstance(self.tree, str):
                if self.tree != "beam":
                    raise ValueError(f"SpeculativeConfig.tree must be 'beam' or a list of rank paths, got {self.tree!r}")
            else:
                self.tree = normalize_static_tree(self.tree)
                if self.draft_model is None:
                    raise ValueError("SpeculativeConfig: a static tree (rank paths) needs draft_model to rank "
                                     "the candidates; without one, method='tree' builds an n-gram trie")
        if self.verify_tokens > MAX_VERIFY_TOKENS:
            raise ValueError(f"SpeculativeConfig: {self._size_str()} draft tokens per step; at most "
                             f"{MAX_VERIFY_TOKENS - 1} fit one verify step (MAX_VERIFY_TOKENS = "
                             f"{MAX_VERIFY_TOKENS} inputs, the last accepted token included)")
        if self.step_costs is not None:   # a given table must price every choice (no unit mixing)
            missing = sorted({0, *self.candidate_lengths} - {t for _, t in self.step_costs})
            if missing:
                raise ValueError(f"SpeculativeConfig.step_costs has no entry for T = {missing} (it needs T = 0 "
                                 f"and each of {list(self.candidate_lengths)})")

    @property
    def is_tree(self) -> bool:
        """Whether the drafter proposes trees (then a step drafts 0 or the whole tree)."""
        return self.method == "tree" or (self.method == "mtp" and self.tree is not None)

    @property
    def candidate_lengths(self) -> tuple[int, ...]:
        """Draft lengths (besides 0) a step may choose: ``draft_lengths`` or
        :func:`default_lengths` for chains; a tree's draft nodes for trees."""
        if self.is_tree:
            return (self.max_draft_nodes,)
        return self.draft_lengths or default_lengths(self.num_tokens)

    def _check_policy(self) -> None:
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(f"SpeculativeConfig.spec_policy must be one of {SPEC_POLICIES}, got {self.spec_policy!r}")
        _int("SpeculativeConfig.probe_interval", self.probe_interval, 1)
        if self.draft_lengths is not None:
            if isinstance(self.draft_lengths, (str, bytes)) or not hasattr(self.draft_lengths, "__iter__"):
                raise ValueError(f"SpeculativeConfig.draft_lengths must be a list of ints, got {self.draft_lengths!r}")
            lens = tuple(sorted({_int("SpeculativeConfig.draft_lengths[]", t, 1) for t in self.draft_lengths}))
            if not lens or lens[-1] > self.num_tokens:
                raise ValueError(f"SpeculativeConfig.draft_lengths must be non-empty, each in [1, num_tokens = "
                                 f"{self.num_tokens}], got {self.draft_lengths!r}")
            self.draft_lengths = lens
        if self.step_costs is not None:
            if not isinstance(self.step_costs, dict) or not self.step_costs:
                raise ValueError(f"SpeculativeConfig.step_costs must be a non-empty dict {{(batch, T): seconds}}, "
                                 f"got {self.step_costs!r}")
            for k, v in self.step_costs.items():
                ok = isinstance(k, tuple) and len(k) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 for x in k)
                if not ok or k[0] < 1 or k[1] < 0:
                    raise ValueError(f"SpeculativeConfig.step_costs keys must be (batch >= 1, T >= 0), got {k!r}")
                if not _float(f"SpeculativeConfig.step_costs[{k}]", v) > 0 or v == float("inf"):
                    raise ValueError(f"SpeculativeConfig.step_costs[{k}] must be a positive finite time, got {v!r}")

    def _size_str(self) -> str:
        if self.method != "tree":
            return f"num_tokens = {self.num_tokens}"
        if not isinstance(self.tree, str):
            return f"a static tree of {len(self.tree)} nodes = {len(self.tree)}"
        return f"tree_width {self.tree_width} x depth {self.depth} = {self.max_draft_nodes}"

    @property
    def depth(self) -> int:
        if self.method in ("tree", "mtp") and self.tree is not None and not isinstance(self.tree, str):
            return max(len(p) for p in self.tree)
        return self.tree_depth or self.num_tokens

    @property
    def max_draft_nodes(self) -> int:
        """Most draft tokens one verify step carries (excluding the last accepted token)."""
        if self.method == "mtp" and self.tree is not None:
            return len(self.tree)
        if self.method != "tree":
            return self.num_tokens
        if not isinstance(self.tree, str):
            return len(self.tree)
        if self.draft_model is None:  # n-gram trie: up to width chains of depth tokens
            return self.tree_width * self.depth
        return self.tree_width * self.depth

    @property
    def verify_tokens(self) -> int:
        """Inputs per verify step: the last accepted token + the drafts."""
        return self.max_draft_nodes + 1


def default_lengths(k: int) -> tuple[int, ...]:
    """Draft lengths an adaptive policy chooses from besides 0 (each one a captured verify
    shape): every length up to ``k <= 4``; past that, powers of two below ``k``, and ``k``."""
    if k <= 4:
        return tuple(range(1, k + 1))
    out, t = [], 1
    while t < k:
        out.append(t)
        t *= 2
    return tuple(out + [k])


def topk_tree(width: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """Rank paths of the greedy chain of ``depth`` tokens plus, at every depth, the next
    ``width - 1`` ranked alternatives (``width * depth`` nodes): for width 2, depth 2
    ``(0,), (1,), (0, 0), (0, 1)``."""
    return normalize_static_tree([(0,) * d + (r,) for d in range(depth) for r in range(width)])


def normalize_static_tree(tree) -> tuple[tuple[int, ...], ...]:
    """Validate a static tree given as rank paths; returns them sorted by depth (topological)."""
    shape = "SpeculativeConfig.tree must be 'beam' or a list of rank paths like [(0,), (0, 0)]"
    if isinstance(tree, (str, bytes, dict)) or not hasattr(tree, "__iter__"):
        raise ValueError(shape)
    paths = []
    for p in tree:
        if isinstance(p, (str, bytes, dict)) or not hasattr(p, "__iter__"):
            raise ValueError(f"{shape}; got the path {p!r}")
        p = tuple(p)
        if not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in p):
            raise ValueError(f"SpeculativeConfig.tree: ranks must be ints, got the path {p!r}")
        paths.append(tuple(int(r) for r in p))
    if not paths:
        raise ValueError("SpeculativeConfig.tree must have at least one node")
    seen = set()
    for p in paths:
        if not p:
            raise ValueError("SpeculativeConfig.tree: empty rank path")
        if any(r < 0 for r in p):
            raise ValueError(f"SpeculativeConfig.tree: negative rank in {p}")
        if p in seen:
            raise ValueError(f"SpeculativeConfig.tree: duplicate node {p}")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"SpeculativeConfig.tree: node {p} has no parent {p[:-1]}")
        for r in range(p[-1]):
            if p[:-1] + (r,) not in seen:
                raise ValueError(f"SpeculativeConfig.tree: node {p} needs its elder sibling {p[:-1] + (r,)}")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


@dataclass
class EngineConfig:
    """Engine-wide settings (built by :class:`~replayssm.engine.llm.LLM` from its arguments).

    ``decode_mode``: ``"recurrent"`` (state read+written every token; with speculation the
    snapshot baseline), ``"replay"`` (checkpoint + ring buffer), ``"kv"`` (KV-only, no
    state) or ``"auto"`` (KV-only while a request's context is shorter than
    ``auto_threshold`` tokens, then one flush into a state and replay; the default threshold
    is where KV-only stops reading fewer bytes than replay, from the cache's real sizes —
    :func:`replayssm.engine.cache_plan.default_auto_threshold`).
    ``memory_budget``: bytes of cache for the sequences (``None``: on CUDA,
    ``gpu_memory_utilization`` of the free device memory; on CPU only ``max_num_seqs``
    limits concurrency): ``num_slots`` fixed parts (states, rings, conv windows, step scratch)
    and block pools for what grows with the context (attention KV of hybrids, KV-only
    entries) in the rest (:class:`~replayssm.engine.cache_plan.CachePlan`).
    ``max_seq_len``: the most tokens (prompt + generated) one sequence holds, the same with
    or without speculation (the cache keeps room for the verify window on top).  ``None``
    (the default): the model's ``max_position_embeddings`` (else
    :data:`~replayssm.engine.cache_plan.DEFAULT_CONTEXT`), lowered to a multiple of
    ``kv_block_size`` when the caches of ``max_num_seqs`` slots at that context do not fit
    the memory (the budget; without one, the device's free memory); the engine records the
    effective value here and its origin in ``max_seq_len_source``
    (:func:`~replayssm.engine.cache_plan.plan_caches`).  An explicit value is kept, and
    refused when it does not fit.  ``max_num_seqs=None`` (the default): as many slots as
    the budget holds at that context (at most
    :data:`~replayssm.engine.cache_plan.MAX_AUTO_SLOTS`), or
    :data:`~replayssm.engine.cache_plan.DEFAULT_MAX_NUM_SEQS` without a budget (CPU).
    ``cuda_graphs=None`` (the default): on for CUDA devices, off elsewhere; ``True`` on a
    non-CUDA device warns and runs without graphs.
    ``tensor_parallel_size``: split the model by heads over that many processes (rank ``r``
    on ``cuda:<index + r>``, or CPU over gloo; :mod:`replayssm.distributed`); the engine
    starts the workers and closes them.  A model loaded with
    ``TensorParallelGroup.load_model`` brings its own group.  Budgets are per rank.
    ``enable_prefix_caching``: reuse cached prompt prefixes, resumed exactly at any token
    (:mod:`replayssm.engine.prefix`): checkpoints every ``prefix_checkpoint_interval``
    tokens (default from the cache's sizes), a store of ``prefix_cache_blocks`` blocks or
    ``prefix_cache_fraction`` of the memory budget.  ``prefix_cache_replies`` (default on)
    also caches a finished request's state after its prompt and reply, so that the next chat
    turn (the same tokens, then the new message) resumes at the end of the reply.

    ``buffer_size=None`` (the default) picks the replay buffer: ``DEFAULT_BUFFER_SIZE``
    (16), raised to ``2 * verify_tokens`` when the speculation needs more (a draft tree of
    width 2 and depth 4 verifies 9 inputs per step, so its default buffer is 18).  An
    explicit ``buffer_size`` too small for the speculation is an error.

    ``ssm_state_dtype``: storage dtype of the SSM checkpoint states (and of the prefix
    store's checkpoints and a drafter's states): ``"auto"`` (the default: float32, float64
    for a float64 model), ``"float32"``, ``"bfloat16"`` or ``"float16"`` (or the
    ``torch.dtype``).  16-bit states halve the state bytes (more slots in the same memory,
    fewer bytes per replay step); math stays in float32 and a state is rounded once per
    write (docs/MATH.md, "State dtype").  Ring entries keep their dtypes.

    ``gc_freeze`` (off by default): once the engine is built (weights loaded, graphs
    captured, step costs measured) run one full garbage collection and ``gc.freeze()`` the
    survivors, so later full collections walk only the objects made since (the ~190 K
    objects of a process that imported the engine take ~40 ms a full collection on one CPU
    core: a pause the device idles through mid-step).  Process-wide, and frozen objects are
    never collected: meant for one engine per process (a server); ``close()`` unfreezes, so
    close an engine before dropping it and building another (else its cycles, caches
    included, stay).

    ``async_scheduling`` (``None``, the default: on for CUDA devices, off elsewhere, where
    the host runs the model itself and has nothing to overlap): overlap the host work of a decode step (output
    processing, stop criteria, scheduling, the tensor-parallel control message) with the
    device running the previous one.  Only plain greedy decode steps overlap (no prefill,
    no speculation this step — no drafter, or a lazily catching-up one (n-gram, draft model)
    above ``disable_by_batch_size`` —, decode mode ``replay`` or ``recurrent``, no prefix
    caching of replies);
    any other step first finishes the one in flight and runs as usual.  Outputs are exactly
    those of the synchronous engine (:mod:`replayssm.engine.overlap`).
    """

    decode_mode: str = "replay"
    buffer_size: int | None = None
    max_num_seqs: int | None = None
    memory_budget: int | None = None
    max_seq_len: int | None = None
    kv_block_size: int = 16
    auto_threshold: int | None = None
    speculative: SpeculativeConfig | None = None
    cuda_graphs: bool | None = None
    seed: int = 0
    max_num_batched_tokens: int = 8192   # tokens per step: decodes + prompt chunks (chunked prefill)
    # prefix caching (replayssm.engine.prefix_cache): token-granular, exact
    enable_prefix_caching: bool = False
    prefix_checkpoint_interval: int | None = None   # tokens between checkpoints (multiple of kv_block_size)
    prefix_cache_fraction: float = 0.25             # share of memory_budget for the prefix store
    prefix_cache_replies: bool = True               # a finished request's state after its reply is cached too
    prefix_cache_blocks: int | None = None          # store blocks (overrides the fraction)
    gpu_memory_utilization: float | None = 0.8       # share of free CUDA memory for caches (no budget given)
    pad_batches: bool = False                        # pad every batch to its bucket (CUDA graphs do anyway)
    tensor_parallel_size: int | None = None          # None: one rank (or the loaded model's own group)
    # "swap": admit on the prompt's blocks, grow per step, preempt (swap to host) when a pool
    # runs dry; "off": reserve every request's whole-life worst case at admission
    preemption_mode: str = "swap"
    ssm_state_dtype: str = "auto"                    # checkpoint states: auto | float32 | bfloat16 | float16
    gc_freeze: bool = False                          # gc.freeze() once built (one engine per process)
    async_scheduling: bool | None = None             # overlap greedy decode steps' host work (engine.overlap); None: on CUDA
    #: where the effective ``max_seq_len`` came from (set by the engine once it is resolved)
    max_seq_len_source: str | None = field(default=None, init=False, compare=False)

    def __post_init__(self):
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.buffer_size is not None:
            _int("buffer_size", self.buffer_size, 1)
        self.ssm_state_dtype = state_dtype_name(self.ssm_state_dtype)
        if self.max_num_seqs is not None:
            _int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_seq_len is not None:
            _int("max_seq_len", self.max_seq_len, 1)
            if self.max_seq_len < 2:
                raise ValueError(f"max_seq_len {self.max_seq_len} leaves no room for a prompt token and a generated "
                                 f"token (needs >= 2)")
        _int("kv_block_size", self.kv_block_size, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _int("seed", self.seed, None)
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool or None, got {self.cuda_graphs!r}")
        if not isinstance(self.gc_freeze, bool):
            raise ValueError(f"gc_freeze must be a bool, got {self.gc_freeze!r}")
        for name in ("pad_batches", "enable_prefix_caching", "prefix_cache_replies"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        g = self.gpu_memory_utilization
        if g is not None and not (isinstance(g, (int, float)) and not isinstance(g, bool) and 0.0 < g <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] or None, got {g!r}")
        tp = self.tensor_parallel_size
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.memory_budget is not None:
            _int("memory_budget", self.memory_budget, 1)
        if self.auto_threshold is not None:
            _int("auto_threshold", self.auto_threshold, 1)
        if self.prefix_checkpoint_interval is not None:
            _int("prefix_checkpoint_interval", self.prefix_checkpoint_interval, 1)
            if self.prefix_checkpoint_interval % self.kv_block_size:
                raise ValueError(f"prefix_checkpoint_interval {self.prefix_checkpoint_interval} must be a multiple of "
                                 f"kv_block_size {self.kv_block_size} (checkpoints sit at block ends)")
        self.prefix_cache_fraction = _float("prefix_cache_fraction", self.prefix_cache_fraction)
        if not 0.0 < self.prefix_cache_fraction < 1.0:
            raise ValueError(f"prefix_cache_fraction must be in (0, 1), got {self.prefix_cache_fraction}")
        if self.prefix_cache_blocks is not None:
            _int("prefix_cache_blocks", self.prefix_cache_blocks, 1)
            if not self.enable_prefix_caching:
                raise ValueError("prefix_cache_blocks sizes the prefix store: it needs enable_prefix_caching=True")
        if self.speculative is not None:
            if isinstance(self.speculative, dict):
                self.speculative = SpeculativeConfig(**self.speculative)
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")
        need = 2 * self.max_new if self.speculative is not None else 1
        if self.buffer_size is None:
            self.buffer_size = max(DEFAULT_BUFFER_SIZE, need)
        elif self.speculative is not None and self.decode_mode != "recurrent":
            check_speculative_capacity(self.buffer_size, self.max_new, "(draft tokens + 1)",
                                       f" (leave buffer_size unset to get {max(DEFAULT_BUFFER_SIZE, need)})")

    @property
    def max_new(self) -> int:
        return 1 if self.speculative is None else self.speculative.verify_tokens

    def cache_spec(self, max_seq_len: int | None = None) -> CacheSpec:
        """The target cache's spec for a usable context of ``max_seq_len`` tokens (default:
        this config's; pools and prefix store are sized by the engine's
        :class:`~replayssm.engine.cache_plan.CachePlan`).  The cache holds
        ``max_seq_len + max_new`` tokens: the verify window a step appends past the last
        token is the engine's cost, so a sequence holds exactly ``max_seq_len`` tokens
        (prompt + generated) with or without speculation."""
        L = self.max_seq_len if max_seq_len is None else max_seq_len
        if L is None:
            raise ValueError("max_seq_len is not resolved yet (None: the engine picks it from the model and memory)")
        return CacheSpec(mode=self.decode_mode, buffer_size=self.buffer_size, max_new=self.max_new,
                         max_seq_len=L + self.max_new, block_size=self.kv_block_size,
                         ssm_state_dtype=self.ssm_state_dtype)
