"""One sequence's constraints (:class:`RequestConstraint`) and their validated construction
in ``add_request`` (:class:`ConstraintFactory`)."""

from __future__ import annotations

from .grammar import GrammarCache, ll_tokenizer


def _encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (``tokenizers`` or transformers)."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(enc, "ids", enc))


def bad_word_ids(tokenizer, words) -> list[list[int]]:
    """vLLM's bad-word token sequences: each word as is (leading blanks stripped) and, where
    the tokenizer gives it a distinct first token of the same length, with a leading space."""
    out: list[list[int]] = []
    for w in words:
        base = _encode_plain(tokenizer, w.lstrip())
        if not base:
            continue
        out.append(base)
        spaced = _encode_plain(tokenizer, " " + w.lstrip())
        if spaced and spaced[0] != base[0] and len(spaced) == len(base):
            out.append(spaced)
    return out


class RequestConstraint:
    """What masks or biases one sequence's logits.

    ``matcher``: its llguidance matcher (None without ``structured_outputs``); ``bad_words``:
    token sequences (the last token of one is banned where the output ends with the others);
    ``bias``: ``(ids, values)``; ``min_tokens`` and ``stop_ids`` (EOS and stop tokens, banned
    while fewer than ``min_tokens`` tokens were generated)."""

    def __init__(self, matcher=None, bad_words=(), bias=None, min_tokens: int = 0, stop_ids=()):
        self.matcher = matcher
        self.bad_words = [list(w) for w in bad_words]
        self.bias = bias or ([], [])
        self.min_tokens, self.stop_ids = min_tokens, sorted(set(stop_ids))
        self.done = False   # the grammar is complete: no token but EOS may follow
        self.mask_vocab = 0   # tokens the matcher's bitmask covers (llguidance's vocabulary)

    def copy(self, matcher=None) -> "RequestConstraint":
        """The same constraints for another sample, with its own ``matcher``."""
        return RequestConstraint(matcher, self.bad_words, self.bias, self.min_tokens, self.stop_ids)

    @property
    def speculates(self) -> bool:
        """Whether the row may take part in speculative steps: every feature but
        ``logit_bias`` is a per-position mask (a biased row decodes plainly)."""
        return not self.bias[0]

    def banned(self, output_ids: list[int]) -> list[int]:
        """Token ids banned for the next token after ``output_ids``."""
        out = list(self.stop_ids) if len(output_ids) < self.min_tokens else []
        for w in self.bad_words:
            k = len(w) - 1
            if k == 0 or (k <= len(output_ids) and output_ids[len(output_ids) - k:] == w[:k]):
                out.append(w[-1])
        return out

    def advance(self, token: int) -> bool:
        """Feed one appended token to the matcher; True when the request must end ("stop"):
        the grammar is complete (only EOS may follow) or the token broke it."""
        m = self.matcher
        if m is None or self.done:
            return self.done
        ok = m.consume_token(int(token))
        self.done = (not ok) or m.is_stopped()
        return self.done


class ConstraintFactory:
    """Builds (and thereby validates) requests' constraints for one engine: ``tokenizer``
    (for grammars and bad words), the model's ``vocab_size`` and ``eos_token_id``.  The
    grammar cache and llguidance's tokenizer are made on the first structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._grammars: GrammarCache | None = None

    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            self._grammars = GrammarCache(lambda: ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_id))
        return self._grammars

    def _eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else list(e) if isinstance(e, (list, tuple, set, frozenset)) else [e]

    def build(self, params, n: int = 1) -> list[RequestConstraint | None]:
        """One constraint per sample (``n``), or ``[None] * n`` for a free request; raises
        ``ValueError`` naming the field for anything this engine cannot honour."""
        if not params.constrained:
            return [None] * n
        ids, vals = [], []
        for t, v in (params.logit_bias or {}).items():
            if t >= self.vocab_size:
                raise ValueError(f"SamplingParams.logit_bias has token id {t}, outside the model's vocabulary "
                                 f"(0 .. {self.vocab_size - 1})")
            ids.append(t)
            vals.append(v)
        bad = []
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.bad_words needs a tokenizer (tokenizer.json in the model directory)")
            bad = bad_word_ids(self.tokenizer, params.bad_words)
            for w in bad:
                if max(w) >= self.vocab_size:
                    raise ValueError(f"SamplingParams.bad_words: the tokenizer gives id {max(w)}, outside the "
                                     f"model's vocabulary")
        stop_ids = [t for t in params.stop_token_ids if t < self.vocab_size] + \
            [t for t in self._eos_ids() if t < self.vocab_size]
        so = params.structured_outputs
        matchers = [self.grammars.matcher(so) for _ in range(n)] if so is not None else [None] * n
        proto = RequestConstraint(None, bad, (ids, vals), params.min_tokens, stop_ids if params.min_tokens else ())
        out = [proto.copy(m) for m in matchers]
        if so is not None:
            for c in out:
                c.mask_vocab = self.grammars.ll.vocab_size
        return out
