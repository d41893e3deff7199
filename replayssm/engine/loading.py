"""Turning user arguments into a model: model directories or loaded models (and dtype names),
checked against the engine's settings."""

from __future__ import annotations

import os
import warnings

import torch

from ..distributed import TensorParallelModel, load_tensor_parallel
from ..models import load_model, load_tokenizer, resolve_model_dir
from .protocols import CachedModel


def is_model(obj) -> bool:
    """Whether ``obj`` is an already loaded model (implements :class:`CachedModel`)."""
    return isinstance(obj, CachedModel)


def load(model, device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1,
         mtp: bool = False, revision: str | None = None):
    """``(model, tokenizer | None)`` from a Hugging Face-layout directory, or a Hub id
    (``org/name`` at ``revision``) when no such local path exists
    (:func:`replayssm.models.resolve_model_dir`; ``mtp``: with the checkpoint's MTP head,
    ``model.mtp``).

    ``tensor_parallel_size > 1``: the model split over that many processes, each reading its
    shard (:func:`replayssm.distributed.load_tensor_parallel`, the engine's entry into the
    distributed layer below it; ``mtp``: the head sharded like the model's layers); the
    returned model owns its workers (``close()``)."""
    try:
        model = resolve_model_dir(model, revision)
    except FileNotFoundError:
        raise ValueError(f"model directory not found: {str(model)!r}") from None
    if not os.path.isdir(model):
        raise ValueError(f"model directory not found: {model!r} (it is a file)")
    if tensor_parallel_size > 1:
        return (load_tensor_parallel(str(model), tensor_parallel_size, device, dtype, mtp=mtp),
                load_tokenizer(str(model)))
    return load_model(str(model), device=device, dtype=dtype, mtp=mtp), load_tokenizer(str(model))


def load_target(model, device: torch.device, dtype: torch.dtype, config, tokenizer=None,
                revision: str | None = None):
    """``(model, tokenizer, dtype, owns_model)`` for an engine: a directory is loaded (split
    over ``config.tensor_parallel_size`` processes when > 1; with the MTP head when the
    speculative method is ``mtp``), a loaded model is checked against the settings and keeps
    its own dtype.  ``owns_model``: the engine loaded it and closes it."""
    if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                      and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer must have encode() and decode() (a tokenizers.Tokenizer or a "
                         f"transformers tokenizer), got {type(tokenizer).__name__}")
    tp, sp = config.tensor_parallel_size, config.speculative
    have = model.tensor_parallel_size if isinstance(model, TensorParallelModel) else 1
    mtp = sp is not None and sp.method == "mtp"
    if not is_model(model):
        loaded, tok = load(model, device, dtype, tp or 1, mtp=mtp, revision=revision)
        return loaded, tokenizer if tokenizer is not None else tok, dtype, True
    if revision is not None:
        raise ValueError(f"revision={revision!r} picks a Hub snapshot to load; the model given is already loaded")
    if tp is not None and tp != have:
        raise ValueError(f"tensor_parallel_size={tp} but the model given is split over {have} rank(s) "
                         f"(load it with that many, or pass a model directory)")
    own = model.dtype if isinstance(getattr(model, "dtype", None), torch.dtype) else dtype
    return model, tokenizer, own, False


def check_tokenizer_vocab(tokenizer, vocab_size: int) -> None:
    """Warn when a ``tokenizers.Tokenizer`` knows more ids than the model's vocabulary."""
    size = getattr(tokenizer, "get_vocab_size", None)
    if callable(size) and size(with_added_tokens=True) > vocab_size:
        warnings.warn(f"the tokenizer has {size(with_added_tokens=True)} tokens, more than the model's "
                      f"vocab_size {vocab_size}: text that tokenizes to the extra ids will be refused "
                      f"(is this the model's own tokenizer?)", stacklevel=3)
