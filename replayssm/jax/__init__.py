"""Compiler-first JAX backend: the same checkpoints and decoding forms as the PyTorch engine,
with the whole decode phase compiled as one ``jax.lax.while_loop`` (prefill, replay or
recurrent decode, chain speculation with an n-gram or draft-model drafter, sampling,
acceptance and commit on the device).

Optional: needs ``pip install replayssm[jax]`` (CPU) or a JAX build for your accelerator.
The PyTorch engine never imports this package.  See docs/ARCHITECTURE.md, "JAX backend".
"""

from __future__ import annotations

_LAZY = {"JaxLLM": "replayssm.jax.generate", "load_params": "replayssm.jax.params",
         "init_cache": "replayssm.jax.model", "Cache": "replayssm.jax.model"}

__all__ = list(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'replayssm.jax' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(mod), name)
    except ModuleNotFoundError as e:
        if e.name in ("jax", "jaxlib"):
            raise ImportError("the JAX backend needs jax: pip install 'replayssm[jax]'") from e
        raise
    globals()[name] = value
    return value
