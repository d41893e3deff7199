"""Prompt validation and encoding (pure functions, no model or cache touched).

A prompt is either text (a ``str``; needs a tokenizer) or a sequence of token ids.  Token
ids must be real integers: Python ``int`` (not ``bool``), NumPy integer scalars, integer
0-d tensors, or a 1-D integer NumPy array / tensor.  Floats (``97.0`` included), strings,
bools and NumPy floats are rejected rather than coerced.  Text must be valid Unicode: a
lone surrogate (from Python code, or an invalid UTF-8 byte on the command line, which
Python decodes to ``\\udc80``..``\\udcff``) is rejected with its position.  Every error is
a :class:`ValueError` naming the offending element and its position.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_text", "token_ids", "encode_prompt", "is_token_id", "prompt_list"]


def _numpy():
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return numpy


def _torch():
    import sys

    return sys.modules.get("torch")  # only if already imported: a tensor cannot exist otherwise


def check_text(text: str, what: str = "prompt") -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8), else a ``ValueError`` naming
    the first bad character's position.

    Characters ``\\udc80``..``\\udcff`` are how Python's ``surrogateescape`` carries an
    invalid UTF-8 byte from the command line; they are reported as that byte.
    """
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            raise ValueError(f"{what} is not valid UTF-8: byte 0x{code - 0xDC00:02x} at character "
                             f"{e.start} cannot be decoded (near {text[max(0, e.start - 10):e.start]!r})") from None
        raise ValueError(f"{what} is not valid Unicode: lone surrogate U+{code:04X} at character {e.start}"
                         f" (near {text[max(0, e.start - 10):e.start]!r})") from None
    return text


def is_token_id(x: Any) -> bool:
    """Whether ``x`` is one integer token id: an ``int`` that is not a ``bool``, a NumPy
    integer scalar, or a 0-d integer tensor."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    np = _numpy()
    if np is not None and isinstance(x, np.generic):
        return isinstance(x, np.integer)
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool
    return False


def _scalar(x: Any) -> bool:
    """A number-like element (a token id, or a float / bool / NumPy scalar posing as one)."""
    if isinstance(x, (int, float, complex)):
        return True
    np, torch = _numpy(), _torch()
    if np is not None and isinstance(x, np.generic):
        return True
    return torch is not None and isinstance(x, torch.Tensor) and x.dim() == 0


def _describe(x: Any) -> str:
    return f"{x!r} ({type(x).__module__ + '.' if type(x).__module__ not in ('builtins',) else ''}" \
           f"{type(x).__name__})"


def token_ids(prompt: Any, vocab_size: int | None = None, what: str = "prompt") -> list[int]:
    """Validate a token-id prompt; returns it as a list of Python ints.

    Accepts a list / tuple of token ids (see :func:`is_token_id`) or a 1-D integer NumPy
    array / tensor.  With ``vocab_size``, every id must be in ``[0, vocab_size)``.
    """
    np, torch = _numpy(), _torch()
    if torch is not None and isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"{what} as a tensor must be 1-D token ids, got shape {tuple(prompt.shape)}")
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"{what} token ids must be integers, got a tensor of dtype {prompt.dtype}")
        ids = [int(t) for t in prompt.tolist()]
    elif np is not None and isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise ValueError(f"{what} as an array must be 1-D token ids, got shape {prompt.shape}")
        if prompt.dtype.kind not in "iu":
            raise ValueError(f"{what} token ids must be integers, got an array of dtype {prompt.dtype}")
        ids = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (list, tuple)):
        ids = []
        for i, t in enumerate(prompt):
            if not is_token_id(t):
                raise ValueError(f"{what} token ids must be ints: element {i} is {_describe(t)}")
            ids.append(int(t))
    else:
        raise ValueError(f"{what} must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"empty {what}: it needs at least one token")
    if vocab_size is not None:
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise ValueError(f"{what} token id {t} at position {i} is out of range: the vocabulary "
                                 f"is [0, {vocab_size})")
    return ids


def encode_prompt(prompt: Any, tokenizer, vocab_size: int | None) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt.

    Text (``str``) is checked for valid Unicode and encoded with ``tokenizer`` (an object
    with ``encode(text).ids``, as ``tokenizers.Tokenizer``); token-id prompts are validated
    by :func:`token_ids`.  Bytes are rejected (decode them to ``str`` first: which encoding
    they hold is the caller's knowledge).  Raises ``ValueError``.
    """
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__} "
                         "(decode it to str first)")
    if isinstance(prompt, str):
        check_text(prompt)
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer (tokenizer.json in the model directory); "
                             "pass token id lists instead")
        ids = list(tokenizer.encode(prompt).ids)
        if not ids:
            raise ValueError("empty prompt: the text encodes to no tokens")
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"the tokenizer produced ids {bad[:5]} outside the model's vocabulary "
                                 f"[0, {vocab_size})")
        return prompt, ids
    return None, token_ids(prompt, vocab_size)


def prompt_list(prompts: Any) -> list:
    """``generate``'s ``prompts`` argument as a list of prompts: one text or one token-id
    sequence (a list whose first element is a number, or a 1-D array / tensor) becomes a list
    of one; anything else iterable is a list of prompts."""
    if isinstance(prompts, (str, bytes, bytearray)):
        return [prompts]
    np, torch = _numpy(), _torch()
    if torch is not None and isinstance(prompts, torch.Tensor):
        return [prompts] if prompts.dim() <= 1 else list(prompts)
    if np is not None and isinstance(prompts, np.ndarray):
        return [prompts] if prompts.ndim <= 1 else list(prompts)
    if isinstance(prompts, (list, tuple)):
        return [prompts] if prompts and _scalar(prompts[0]) else list(prompts)
    try:
        return list(prompts)
    except TypeError:
        raise ValueError(f"prompts must be a str, a list of token ids, or a list of those; got "
                         f"{type(prompts).__name__}") from None
