"""Turning user arguments into a model: model directories or loaded models (and dtype names)."""

from __future__ import annotations

import os

import torch

from ..distributed import load_tensor_parallel
from ..models import load_model, load_tokenizer
from ..models.loader import parse_dtype  # noqa: F401  (the engine's dtype names)
from .protocols import CachedModel


def is_model(obj) -> bool:
    """Whether ``obj`` is an already loaded model (implements :class:`CachedModel`)."""
    return isinstance(obj, CachedModel)


def load(model, device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1,
         mtp: bool = False):
    """``(model, tokenizer | None)`` from a Hugging Face-layout directory (``mtp``: with the
    checkpoint's MTP head, ``model.mtp``).

    ``tensor_parallel_size > 1``: the model split over that many processes, each reading its
    shard (:func:`replayssm.distributed.load_tensor_parallel`, the engine's entry into the
    distributed layer below it); the returned model owns its workers (``close()``).  The MTP
    head is not sharded: ``mtp`` with ``tensor_parallel_size > 1`` is refused."""
    if not os.path.isdir(str(model)):
        raise ValueError(f"model directory not found: {model!r}")
    if tensor_parallel_size > 1:
        if mtp:
            raise ValueError("speculative method 'mtp' is not supported with tensor_parallel_size > 1 "
                             "(the MTP head is not sharded over the workers); use tensor_parallel_size=1 "
                             "or method='ngram'/'draft'")
        return load_tensor_parallel(str(model), tensor_parallel_size, device, dtype), load_tokenizer(str(model))
    return load_model(str(model), device=device, dtype=dtype, mtp=mtp), load_tokenizer(str(model))
