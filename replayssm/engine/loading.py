"""Turning user arguments into a model: dtype names, model directories or loaded models."""

from __future__ import annotations

import os

import torch

from ..models import load_model, load_tokenizer
from .protocols import CachedModel

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))} or a torch.dtype, got {dtype!r}")


def is_model(obj) -> bool:
    """Whether ``obj`` is an already loaded model (implements :class:`CachedModel`)."""
    return isinstance(obj, CachedModel)


def load(model, device: torch.device, dtype: torch.dtype, mtp: bool = False):
    """``(model, tokenizer | None)`` from a Hugging Face-layout directory (``mtp``: with the
    checkpoint's MTP head, ``model.mtp``)."""
    if not os.path.isdir(str(model)):
        raise ValueError(f"model directory not found: {model!r}")
    return load_model(str(model), device=device, dtype=dtype, mtp=mtp), load_tokenizer(str(model))
