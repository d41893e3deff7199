"""One routing API from the layers to the ops: the Triton kernel or the reference op.

``ops_for(family)`` (``"mamba2"``, ``"gdn"``, ``"conv"``, ``"attention"``, ``"moe"``) returns a
:class:`KernelOps`: an
object with one attribute per op of the family's reference module
(``replayssm.ops.<family>.naive``).  Each op is declared in exactly one of two lists:

* :data:`ROUTED` — it has a Triton kernel with the reference op's signature
  (``replayssm.kernels.<family>``); the backend is picked per call from the call's tensors:
  the kernel for CUDA tensors below float64 when Triton is importable, the reference op
  otherwise (float64 is the exactness reference, so ``"auto"`` keeps it on the reference);
* :data:`REFERENCE_ONLY` — no kernel yet: the attribute *is* the reference function, on
  every device.  ``tests/kernels/test_layer_dispatch.py`` lists these, so an op that runs
  the reference on CUDA is a decision someone wrote down, never a silent fallback.

A kernel module may restrict which calls its kernel takes (``SUPPORTS[name](*args, **kw)``,
e.g. the MoE kernel's activations); other calls run the reference.

Any other name raises ``AttributeError``.  ``backend`` (``"auto"`` | ``"triton"`` |
``"naive"``) forces a backend; the environment variable ``REPLAYSSM_KERNELS``
(``triton`` / ``naive``) overrides ``"auto"`` (``triton`` on CPU tensors needs
``TRITON_INTERPRET=1`` set before triton is imported).  Kernel-only tuning keywords
(:data:`KERNEL_ONLY`) are dropped when the reference op runs.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
from torch import Tensor

from ..ops.attention import naive as attention_naive
from ..ops.conv import naive as conv_naive
from ..ops.gdn import naive as gdn_naive
from ..ops.mamba2 import naive as mamba2_naive
from ..ops.moe import naive as moe_naive
from . import _triton
from . import attention as attention_kernels
from . import conv as conv_kernels
from . import gdn as gdn_kernels
from . import gdn_prefill
from . import mamba2 as mamba2_kernels
from . import mamba2_prefill
from . import moe as moe_kernels

BACKENDS = ("auto", "triton", "naive")
KERNEL_ONLY = ("block_d", "block_v", "num_warps", "pre_scores", "bits", "precision", "snapshots", "impl",
               "fused_fold", "flush_mode", "fold_warps", "block_n", "block_t", "block_c", "num_stages", "wu_warps",
               "inv_precision", "inv", "num_splits", "block_m", "block_k")

_REFERENCE = {"mamba2": mamba2_naive, "gdn": gdn_naive, "conv": conv_naive, "attention": attention_naive,
              "moe": moe_naive}
#: where each family's kernels live (the first module defining an op's name has it)
_KERNELS = {"mamba2": (mamba2_kernels, mamba2_prefill), "gdn": (gdn_kernels, gdn_prefill), "conv": (conv_kernels,),
            "attention": (attention_kernels,), "moe": (moe_kernels,)}

#: ops with a Triton kernel of the reference op's signature, per family
ROUTED = {
    "mamba2": ("recurrent_step", "recurrent_update", "replay_decode", "replay_verify", "tree_verify",
               "kv_verify", "snapshot_verify", "chunked_prefill_varlen", "kv_fold", "rebuild_state", "conv_fold"),
    "gdn": ("recurrent_step", "recurrent_update", "replay_decode", "replay_verify", "tree_verify",
            "kv_verify", "snapshot_verify", "chunked_prefill_varlen", "kv_fold", "rebuild_state"),
    "conv": ("conv_decode", "conv_verify", "conv_commit", "conv_prefill_varlen"),
    "attention": ("write_kv", "paged_attention"),
    "moe": ("experts",),
}
#: ops (and helpers) that run the reference on every device, per family
REFERENCE_ONLY = {
    "mamba2": ("segsum", "recurrent_scan", "chunked_prefill", "snapshot_commit", "kv_to_state",
               "kv_tree_verify"),
    "gdn": ("l2norm", "recurrent_scan", "chunked_prefill", "snapshot_commit", "kv_to_state",
            "kv_tree_verify"),
    "conv": ("conv_prefill", "conv_tree", "conv_commit_tree", "conv_window_out"),
    "attention": ("token_positions", "new_slots", "check_paged", "check_write"),
    "moe": ("activation", "check_experts"),
}


def env_backend() -> str | None:
    """``REPLAYSSM_KERNELS`` when it names a backend (``"triton"`` / ``"naive"``), else None."""
    env = os.environ.get("REPLAYSSM_KERNELS", "").strip().lower()
    return env if env in ("triton", "naive") else None


def _fp64_naive(backend: str, tensors) -> str:
    """``"auto"`` keeps float64 calls on the reference ops (the kernels compute in fp32;
    fp64 is the exactness reference) unless ``REPLAYSSM_KERNELS`` overrides."""
    if backend == "auto" and env_backend() is None and \
            any(isinstance(t, Tensor) and t.dtype == torch.float64 for t in tensors):
        return "naive"
    return backend


def fused_ok(x: Tensor, *others: Tensor) -> bool:
    """Whether a layer's fused Triton kernel (norms, activations) runs: ``x`` on CUDA below
    fp64, ``others`` of ``x``'s dtype, unless ``REPLAYSSM_KERNELS=naive``."""
    if x.device.type != "cuda" or x.dtype == torch.float64 or any(t.dtype != x.dtype for t in others):
        return False
    return _triton.HAVE_TRITON and env_backend() != "naive"


def use_triton(*tensors: Tensor | None, backend: str = "auto") -> bool:
    """Whether the Triton kernel runs for these tensors under ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"bad backend {backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        backend = env_backend() or backend
    if backend == "naive":
        return False
    ts = [t for t in tensors if isinstance(t, Tensor)]
    if backend == "triton":
        if not _triton.HAVE_TRITON:
            raise RuntimeError("backend='triton' but triton is not installed")
        if not _triton.usable(*ts):
            raise RuntimeError("backend='triton' needs CUDA tensors, or CPU tensors with "
                               "TRITON_INTERPRET=1 set before triton is imported")
        return True
    return _triton.HAVE_TRITON and bool(ts) and all(t.device.type == "cuda" for t in ts)


@functools.lru_cache(maxsize=None)
def _accepts(f, kw: str) -> bool:
    return kw in inspect.signature(f).parameters


def _probe(args, kwargs=None) -> list[Tensor]:
    """The tensors that decide the backend of one call: tensor arguments (positional or
    keyword), plus the state (ring buffers), window (conv) or first pool tensor (paged pools)
    of cache objects."""
    out = []
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(getattr(a, "state", None), Tensor):
            out.append(a.state)
        elif isinstance(getattr(a, "window", None), Tensor):
            out.append(a.window)
        elif hasattr(a, "tensors") and callable(a.tensors):
            ts = [t for t in a.tensors() if isinstance(t, Tensor)]
            out += ts[:1]
    return out


def kernel_for(family: str, name: str):
    """The Triton wrapper of ``family``'s routed op ``name``."""
    return next(getattr(m, name) for m in _KERNELS[family] if hasattr(m, name))


class KernelOps:
    """The ops of one family, each routed per call (see the module docstring).

    ``ops.<name>(...)`` for a name in ``ROUTED[family]`` runs the Triton kernel when
    :func:`use_triton` says so for the call's tensors (``check=`` is dropped for kernels
    that do not take it), else the reference op with :data:`KERNEL_ONLY` keywords dropped.
    A name in ``REFERENCE_ONLY[family]`` is the reference function itself.
    """

    def __init__(self, family: str, backend: str = "auto"):
        if family not in _REFERENCE:
            raise ValueError(f"unknown op family {family!r}: expected one of {sorted(_REFERENCE)}")
        if backend not in BACKENDS:
            raise ValueError(f"bad backend {backend!r}: expected one of {BACKENDS}")
        self.family, self.backend = family, backend
        self.naive = _REFERENCE[family]
        for name in ROUTED[family]:
            setattr(self, name, self._router(name))
        for name in REFERENCE_ONLY[family]:
            setattr(self, name, getattr(self.naive, name))

    def _router(self, name: str):
        naive_f = getattr(self.naive, name)
        @functools.wraps(naive_f)
        def op(*args, **kwargs):
            probe = _probe(args, kwargs)
            f = kernel_for(self.family, name)
            supports = getattr(sys.modules[f.__module__], "SUPPORTS", {}).get(name)
            if use_triton(*probe, backend=_fp64_naive(self.backend, probe)) and \
                    (supports is None or supports(*args, **kwargs)):
                if "check" in kwargs and not _accepts(f, "check"):
                    kwargs = {k: v for k, v in kwargs.items() if k != "check"}
                return f(*args, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k not in KERNEL_ONLY}
            return naive_f(*args, **kwargs)

        return op

    def __repr__(self) -> str:
        return f"KernelOps({self.family!r}, backend={self.backend!r})"


@functools.lru_cache(maxsize=None)
def ops_for(family: str, backend: str = "auto") -> KernelOps:
    """The (cached) :class:`KernelOps` of ``family`` (``"mamba2"``, ``"gdn"`` or ``"conv"``)."""
    return KernelOps(family, backend)
