"""replayssm: exact replay-buffer decoding for Mamba-2 and Gated DeltaNet models."""


def _version() -> str:
    """The installed package's version (pyproject.toml's, the one source of truth); a
    source tree run without installing reports ``0+unknown``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("replayssm")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

# The engine's public names load on first use, so `import replayssm` stays cheap and works
# even where the engine's dependencies are missing.
_LAZY = {"LLM": "replayssm.engine.llm", "RequestOutput": "replayssm.engine.llm",
         "SamplingParams": "replayssm.engine.config", "SpeculativeConfig": "replayssm.engine.config"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'replayssm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
