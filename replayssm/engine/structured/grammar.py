"""``SamplingParams.structured_outputs`` -> llguidance grammars and matchers (compiled once
per (tokenizer, constraint); llguidance is imported only here, lazily)."""

from __future__ import annotations

import json
from collections import OrderedDict

FIELD = "SamplingParams.structured_outputs"
INSTALL_HINT = "pip install 'replayssm[structured]'"
#: JSON grammars: compact JSON (no free whitespace between tokens: a model cannot stall in an
#: endless run of blanks); a schema's own ``x-guidance`` options override this
JSON_DEFAULTS = {"whitespace_flexible": False}
#: pristine matchers kept per engine
CACHE_SIZE = 256


class StructuredOutputsUnavailable(ValueError, ImportError):
    """llguidance is not installed (a ``ValueError``: the request cannot be served)."""


def require_llguidance():
    """The ``llguidance`` module, or :class:`StructuredOutputsUnavailable` naming the extra."""
    try:
        import llguidance
    except ImportError as e:
        raise StructuredOutputsUnavailable(
            f"{FIELD} needs the llguidance package, which is not installed: install the "
            f"'structured' extra ({INSTALL_HINT})") from e
    return llguidance


def grammar_text(kind: str, value) -> str:
    """The llguidance grammar (its JSON form) of one normalised constraint."""
    llg = require_llguidance()
    M = llg.LLMatcher
    if kind == "json":
        try:
            return M.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{FIELD}['json'] is not a valid JSON schema: {e}") from None
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return M.grammar_from_regex(value)
    if kind == "choice":   # JSON string literals are Lark string literals
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        return M.grammar_from_lark(value)
    raise ValueError(f"{FIELD}: unknown kind {kind!r}")


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_id):
    """An ``llguidance.LLTokenizer`` over the model's vocabulary from a ``tokenizers.Tokenizer``
    or a transformers fast tokenizer (its Rust backend), with the model's EOS id(s)."""
    llg = require_llguidance()
    if tokenizer is None:
        raise ValueError(f"{FIELD} needs a tokenizer (tokenizer.json in the model directory)")
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)   # transformers fast -> tokenizers
    to_str = getattr(backend, "to_str", None)
    if not callable(to_str):
        raise ValueError(f"{FIELD} needs a Hugging Face tokenizers tokenizer (tokenizer.json); "
                         f"got {type(tokenizer).__name__}")
    eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple, set, frozenset)) else eos_token_id
    try:
        return llg.LLTokenizer(to_str(), n_vocab=vocab_size, eos_token=eos)
    except Exception as e:   # llguidance reports unsupported tokenizers as plain exceptions
        raise ValueError(f"{FIELD}: llguidance cannot use this tokenizer: {e}") from None


class GrammarCache:
    """Pristine ``LLMatcher`` per constraint for one tokenizer (LRU, ``size`` entries).
    ``tokenizer``: a zero-argument callable returning the ``LLTokenizer`` (built on first use:
    it costs up to a second for large vocabularies)."""

    def __init__(self, tokenizer, size: int = CACHE_SIZE):
        self._tokenizer, self._ll = tokenizer, None
        self.size = size
        self._cache: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    @property
    def ll(self):
        if self._ll is None:
            self._ll = self._tokenizer()
        return self._ll

    def matcher(self, structured_outputs: dict):
        """A fresh matcher (a copy of the cached compiled one) for a normalised
        ``structured_outputs``; a constraint llguidance rejects raises ``ValueError`` naming
        the field."""
        (kind, value), = structured_outputs.items()
        key = (kind, json.dumps(value, sort_keys=True))
        m = self._cache.get(key)
        if m is None:
            self.misses += 1
            llg = require_llguidance()
            m = llg.LLMatcher(self.ll, grammar_text(kind, value), log_level=0)
            if m.is_error():
                raise ValueError(f"{FIELD}['{kind}'] is invalid: {m.get_error().strip()}")
            self._cache[key] = m
            if len(self._cache) > self.size:
                self._cache.popitem(last=False)
        else:
            self.hits += 1
            self._cache.move_to_end(key)
        return m.deep_copy()
