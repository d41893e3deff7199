"""Incremental detokenization: text grows token by token without re-decoding the output.

Decoding token ``i`` alone is wrong for most tokenizers: byte-level BPE splits one UTF-8
character over several tokens, and SentencePiece-style decoders drop or add a leading space
depending on what precedes a token.  Decoding the whole output every step is right but costs
``O(len)`` per token.  :class:`Detokenizer` keeps a short *context* of tokens already turned
into text and decodes ``context + pending`` each time: the new text is what that decode adds
after ``decode(context)``.  Text is released only when it does not end in an incomplete
character (U+FFFD, the decoder's stand-in for a partial UTF-8 sequence), so a character is
never split between two pieces; once released, the pending tokens become the new context.

Each push decodes at most ``context + pending`` tokens (a few), whatever the output length.
:func:`find_stop` checks stop strings on the released text incrementally as well: only the
new piece and the ``max(len(stop)) - 1`` characters before it are searched.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns a stream of token ids into text, piece by piece.

    ``tokenizer`` needs ``decode(ids: list[int]) -> str`` (``tokenizers.Tokenizer`` or a
    transformers tokenizer).  ``prompt_ids``: the tokens before the output; the last few seed
    the context so that the first output token decodes as it would after the prompt.
    ``context``: how many released tokens to decode again before the pending ones.
    ``max_pending``: after this many tokens without a complete character the text is
    released anyway (a genuine U+FFFD in the output must not stall the stream).
    """

    def __init__(self, tokenizer, prompt_ids=(), context: int = 4, max_pending: int = 8):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.tokenizer = tokenizer
        self.context_size, self.max_pending = context, max_pending
        self._ctx: list[int] = list(prompt_ids)[-context:]   # tokens whose text is released
        self._ctx_text = self._decode(self._ctx)
        self._pending: list[int] = []
        self.text = ""                  # everything released so far
        self.num_tokens = 0             # tokens pushed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it releases (possibly ``""``)."""
        self.num_tokens += 1
        self._pending.append(int(token_id))
        full = self._decode(self._ctx + self._pending)
        # the new text is what follows the context's own text (taken by length: a decoder
        # that rewrites a boundary character still yields the whole-text decode's share)
        piece = full[len(self._ctx_text):]
        if piece.endswith(REPLACEMENT) and len(self._pending) < self.max_pending:
            return ""               # an incomplete character: wait for its other bytes
        self.text += piece
        self._ctx = (self._ctx + self._pending)[-self.context_size:]
        self._ctx_text = self._decode(self._ctx)
        self._pending = []
        return piece

    def flush(self) -> str:
        """Release whatever is pending (end of the stream), incomplete characters included."""
        if not self._pending:
            return ""
        full = self._decode(self._ctx + self._pending)
        piece = full[len(self._ctx_text):]
        self.text += piece
        self._ctx = (self._ctx + self._pending)[-self.context_size:]
        self._ctx_text = self._decode(self._ctx)
        self._pending = []
        return piece


def find_stop(text: str, new_len: int, stops) -> int | None:
    """Earliest index in ``text`` where a stop string starts, looking only at matches that end
    inside the last ``new_len`` characters (the rest was searched before); ``None`` if none."""
    if not stops or new_len <= 0:
        return None
    longest = max(len(s) for s in stops)
    lo = max(0, len(text) - new_len - longest + 1)
    best = None
    for s in stops:
        i = text.find(s, lo)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
