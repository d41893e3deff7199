"""Turning user arguments into a model: model directories or loaded models (and dtype names)."""

from __future__ import annotations

import os

import torch

from ..models import load_model, load_tokenizer
from ..models.loader import parse_dtype  # noqa: F401  (the engine's dtype names)
from .protocols import CachedModel

def is_model(obj) -> bool:
    """Whether ``obj`` is an already loaded model (implements :class:`CachedModel`)."""
    return isinstance(obj, CachedModel)


def load(model, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer | None)`` from a Hugging Face-layout directory."""
    if not os.path.isdir(str(model)):
        raise ValueError(f"model directory not found: {model!r}")
    return load_model(str(model), device=device, dtype=dtype), load_tokenizer(str(model))
