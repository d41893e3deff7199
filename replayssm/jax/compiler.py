"""XLA options the JAX backend compiles its programs with.

An unrolled decode step has one GEMM fusion per projection per layer; XLA:GPU autotunes
every distinct fusion (its cuBLAS algorithms and, for the Triton GEMM emitter, a search over
tile configurations each compiled to a kernel), which made the unrolled 64-layer loop compile
for minutes.  The backend therefore compiles its programs with

* ``xla_gpu_enable_triton_gemm=False``: GEMMs go to cuBLAS (no Triton tile search);
* ``xla_gpu_autotune_level=0``: cuBLAS's own heuristic picks the algorithm (as the PyTorch
  engine runs its GEMMs) instead of timing candidates.

With them the 2.7B's unrolled replay program compiled in 93 s on an H200 (2026-11-27; without
them it had not finished in 125 s).  The scan loop keeps XLA's own GEMM choices: its GPU speed
was measured with those, not with these.

Every loop also compiles with ``xla_gpu_dot_merger_threshold_mb=0``: XLA's dot merger joins
GEMMs that share an operand by concatenating the other operands, and for a decode step the
shared operand is the activation, so it concatenated the Mamba-2 ``in_proj``'s ``z`` and ``x``
weights (bf16 ``[10240, 2560]``, 52 MB) into a new array every layer of every step: a
third of the step's bytes (``scripts/gpu_jax.py --loops``, 2026-11-27: bytes per step 3.44 →
2.62× the ideal; the grouped loop 0.38 → 0.55× the PyTorch engine at B=1 and 0.58× at
B=64 on an H100, the unrolled one 0.47 → 0.74× at B=1).

They are per-program options (``jax.jit(..., compiler_options=...)``): they do not touch
other programs of the process, and need no restart.  XLA keeps one option set for every
backend, so a CPU program takes the ``xla_gpu_*`` names and ignores them (tested; TPU not
tried).  A user's own
choice wins: an option named in ``XLA_FLAGS`` is left out (XLA then uses the flag), and
``JaxLLM(compiler_options={...})`` overrides or, with the value ``None``, drops a default.

The persistent compilation cache is JAX's own: ``jax.config.update(
"jax_compilation_cache_dir", path)`` before the first call makes a later process load the
compiled loop instead of compiling it (``scripts/gpu_jax.py --cache-dir`` measures it).
"""

from __future__ import annotations

import os
import re

__all__ = ["DEFAULT_COMPILER_OPTIONS", "SCAN_COMPILER_OPTIONS", "compiler_options"]

#: options every program of the grouped and unrolled loops is compiled with (module docstring)
DEFAULT_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
                            "xla_gpu_dot_merger_threshold_mb": 0}
#: ... and of the scan loop (XLA's own GEMM choices)
SCAN_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def _flag_names(flags: str) -> set[str]:
    return set(re.findall(r"--([A-Za-z0-9_]+)", flags or ""))


def compiler_options(overrides: dict | None = None, xla_flags: str | None = None, defaults: bool = True) -> dict:
    """The defaults (``defaults=False``: the scan loop's, :data:`SCAN_COMPILER_OPTIONS`)
    without those ``xla_flags`` (default: ``$XLA_FLAGS``) names, updated with ``overrides``
    (a ``None`` value drops the option)."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"compiler_options must be a dict or None, got {overrides!r}")
    for k, v in (overrides or {}).items():
        if not isinstance(k, str) or not k.startswith("xla_"):
            raise ValueError(f"compiler option names are XLA option names (xla_...), got {k!r}")
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"compiler option {k} must be a bool, number or string, got {v!r}")
    named = _flag_names(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    base = DEFAULT_COMPILER_OPTIONS if defaults else SCAN_COMPILER_OPTIONS
    opts = {k: v for k, v in base.items() if k not in named}
    for k, v in (overrides or {}).items():
        if v is None:
            opts.pop(k, None)
        else:
            opts[k] = v
    return opts
