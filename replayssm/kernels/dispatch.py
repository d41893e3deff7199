"""One routing API from the layers to the ops: the Triton kernel or the reference op.

``ops_for(family)`` (``"mamba2"``, ``"gdn"``, ``"kda"``, ``"conv"``, ``"attention"``, ``"moe"``,
``"fp8"``, ``"gates"``) returns a :class:`KernelOps`: an object with one attribute per op of the family's reference module
(``replayssm.ops.<family>.naive``).  Each op is declared in exactly one of two lists:

* :data:`ROUTED` — it has a Triton kernel with the reference op's signature
  (``replayssm.kernels.<family>``); the backend is picked from the call's lead tensor (see
  below): the kernel for CUDA tensors below float64 when Triton is importable, the
  reference op otherwise (float64 is the exactness reference, so ``"auto"`` keeps it on the
  reference);
* :data:`REFERENCE_ONLY` — no kernel yet: the attribute *is* the reference function, on
  every device.  ``tests/kernels/test_layer_dispatch.py`` lists these, so an op that runs
  the reference on CUDA is a decision someone wrote down, never a silent fallback: an op
  routed to the kernels whose kernel module lacks it raises, naming it.

Resolved once, not per call: a routed op keeps a table ``(device, dtype) -> function`` of
its lead tensor (the first tensor argument, positional then keyword, or a cache object's
``state`` / ``window`` / first pool tensor), filled on the first call with that key; a call
is then that dict lookup plus the call of the kernel (with ``check=`` dropped when it does
not take it) or of the reference op (with :data:`KERNEL_ONLY` keywords dropped).

A kernel module may restrict which calls its kernel takes (``SUPPORTS[name](*args, **kw)``,
e.g. the MoE kernel's activations); other calls run the reference (checked per call).

Any other name raises ``AttributeError``.  ``backend`` (``"auto"`` | ``"triton"`` |
``"naive"``) forces a backend; the environment variable ``REPLAYSSM_KERNELS``
(``triton`` / ``naive``) overrides ``"auto"`` (``triton`` on CPU tensors needs
``TRITON_INTERPRET=1`` set before triton is imported).  The environment is read when a
choice is first resolved; :func:`reset` forgets every resolved choice (tests that change
``REPLAYSSM_KERNELS`` or patch a kernel module call it).
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref

import torch
from torch import Tensor

from ..ops.attention import naive as attention_naive
from ..ops.conv import naive as conv_naive
from ..ops.fp8 import naive as fp8_naive
from ..ops.gates import naive as gates_naive
from ..ops.gdn import naive as gdn_naive
from ..ops.kda import naive as kda_naive
from ..ops.mamba2 import naive as mamba2_naive
from ..ops.moe import naive as moe_naive
from . import _triton
from . import attention as attention_kernels
from . import conv as conv_kernels
from . import fp8_gemm
from . import gates as gates_kernels
from . import gdn as gdn_kernels
from . import gdn_prefill
from . import kda as kda_kernels
from . import mla as mla_kernels
from . import mamba2 as mamba2_kernels
from . import mamba2_prefill
from . import moe as moe_kernels

BACKENDS = ("auto", "triton", "naive")
KERNEL_ONLY = ("block_d", "block_v", "num_warps", "pre_scores", "bits", "precision", "snapshots", "impl",
               "fused_fold", "flush_mode", "fold_warps", "block_n", "block_t", "block_c", "num_stages", "wu_warps",
               "inv_precision", "inv", "num_splits", "block_m", "block_k", "act_quant", "split_k", "fold_form",
               "prefetch")
_KERNEL_ONLY = frozenset(KERNEL_ONLY)

_REFERENCE = {"mamba2": mamba2_naive, "gdn": gdn_naive, "kda": kda_naive, "conv": conv_naive,
              "attention": attention_naive, "moe": moe_naive, "fp8": fp8_naive, "gates": gates_naive}
#: where each family's kernels live (the first module defining an op's name has it)
_KERNELS = {"mamba2": (mamba2_kernels, mamba2_prefill), "gdn": (gdn_kernels, gdn_prefill), "kda": (kda_kernels,),
            "conv": (conv_kernels,), "attention": (attention_kernels, mla_kernels), "moe": (moe_kernels,), "fp8": (fp8_gemm,),
            "gates": (gates_kernels,)}

#: ops with a Triton kernel of the reference op's signature, per family
ROUTED = {
    "mamba2": ("recurrent_step", "recurrent_update", "replay_decode", "replay_verify", "tree_verify",
               "kv_verify", "snapshot_verify", "chunked_prefill_varlen", "kv_fold", "rebuild_state", "conv_fold"),
    "gdn": ("recurrent_step", "recurrent_update", "replay_decode", "replay_verify", "tree_verify",
            "kv_verify", "snapshot_verify", "chunked_prefill_varlen", "kv_fold", "rebuild_state"),
    "kda": ("replay_decode", "replay_verify", "tree_verify", "kv_verify", "kv_tree_verify"),
    "conv": ("conv_decode", "conv_verify", "conv_commit", "conv_prefill_varlen"),
    "attention": ("write_kv", "paged_attention", "mla_attention"),
    "moe": ("experts",),
    "fp8": ("linear",),
    "gates": ("gates",),
}
#: ops (and helpers) that run the reference on every device, per family
REFERENCE_ONLY = {
    "mamba2": ("segsum", "recurrent_scan", "chunked_prefill", "snapshot_commit", "kv_to_state",
               "kv_tree_verify"),
    "gdn": ("l2norm", "recurrent_scan", "chunked_prefill", "snapshot_commit", "kv_to_state",
            "kv_tree_verify"),
    # KDA (Kimi-Linear): kernels for the replay and KV-only decode forms; prefill, the
    # recurrent and snapshot baselines and the folds run the reference on every device
    "kda": ("l2norm", "recurrent_step", "recurrent_update", "recurrent_scan", "chunked_prefill",
            "chunked_prefill_varlen", "rebuild_state", "snapshot_verify", "snapshot_commit", "kv_fold",
            "kv_to_state"),
    "conv": ("conv_prefill", "conv_tree", "conv_commit_tree", "conv_window_out"),
    "attention": ("token_positions", "new_slots", "check_paged", "check_write", "check_mla"),
    "moe": ("activation", "check_experts"),
    "fp8": ("quantize_block", "dequantize_block", "quantize_tensor", "dequantize_tensor", "quantize_groups",
            "dequantize_groups", "expand_scale", "scale_grid", "quantize_experts", "dequantize_experts",
            "expert_scale_shape", "linear_act_quant", "check_block"),
    "gates": ("check_gates", "clamps"),
}


_UNREAD = object()
_env = _UNREAD                      # REPLAYSSM_KERNELS as read by env_backend (until reset)
_live: weakref.WeakSet = weakref.WeakSet()   # every KernelOps (their tables are cleared by reset)


def env_backend() -> str | None:
    """``REPLAYSSM_KERNELS`` when it names a backend (``"triton"`` / ``"naive"``), else None;
    read once (until :func:`reset`)."""
    global _env
    if _env is _UNREAD:
        env = os.environ.get("REPLAYSSM_KERNELS", "").strip().lower()
        _env = env if env in ("triton", "naive") else None
    return _env


def reset() -> None:
    """Forget every resolved choice: the next call of each op (and :func:`env_backend`)
    reads ``REPLAYSSM_KERNELS`` / ``TRITON_INTERPRET`` and looks its kernel up again."""
    global _env
    _env = _UNREAD
    for ops in list(_live):
        ops.clear()


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


def _accepts(f, kw: str) -> bool:
    return kw in inspect.signature(f).parameters


def _lead(args, kwargs) -> Tensor | None:
    """The tensor that decides the backend of one call: the first tensor argument
    (positional, then keyword), where a cache object stands for its state (ring buffers),
    window (conv) or first pool tensor (paged pools); None when the call has none."""
    for a in args:
        t = a if isinstance(a, Tensor) else _held(a)
        if t is not None:
            return t
    for a in kwargs.values():
        t = a if isinstance(a, Tensor) else _held(a)
        if t is not None:
            return t
    return None


def _held(a) -> Tensor | None:
    """The tensor standing for cache object ``a`` in :func:`_lead` (None if ``a`` is none)."""
    t = getattr(a, "state", None)
    if isinstance(t, Tensor):
        return t
    t = getattr(a, "window", None)
    if isinstance(t, Tensor):
        return t
    if hasattr(a, "tensors") and callable(a.tensors):
        for t in a.tensors():
            if isinstance(t, Tensor):
                return t
    return None


def kernel_module(family: str, name: str):
    """The module of ``family``'s kernels that defines routed op ``name`` (the first of
    ``_KERNELS[family]`` that does); raises ``NotImplementedError`` naming the op if none does."""
    for m in _KERNELS[family]:
        if hasattr(m, name):
            return m
    raise NotImplementedError(
        f"{family}.{name} is routed to the Triton kernels but none of "
        f"{[m.__name__ for m in _KERNELS[family]]} defines it: write the kernel, or move "
        f"{name!r} to REFERENCE_ONLY[{family!r}] (no silent fallback to the reference)")


def kernel_for(family: str, name: str):
    """The Triton wrapper of ``family``'s routed op ``name``."""
    return getattr(kernel_module(family, name), name)


class KernelOps:
    """The ops of one family (see the module docstring).

    ``ops.<name>(...)`` for a name in ``ROUTED[family]`` runs the function its table holds
    for the call's lead tensor's ``(device, dtype)``; a missing entry is resolved first
    (:meth:`resolve`).  A name in ``REFERENCE_ONLY[family]`` is the reference function itself.
    """

    def __init__(self, family: str, backend: str = "auto"):
        if family not in _REFERENCE:
            raise ValueError(f"unknown op family {family!r}: expected one of {sorted(_REFERENCE)}")
        if backend not in BACKENDS:
            raise ValueError(f"bad backend {backend!r}: expected one of {BACKENDS}")
        self.family, self.backend = family, backend
        self.naive = _REFERENCE[family]
        self.tables: dict[str, dict] = {}
        for name in ROUTED[family]:
            setattr(self, name, self._router(name))
        for name in REFERENCE_ONLY[family]:
            setattr(self, name, getattr(self.naive, name))
        _live.add(self)

    def _router(self, name: str):
        table = self.tables[name] = {}
        resolve = self.resolve

        @functools.wraps(getattr(self.naive, name))
        def op(*args, **kwargs):
            t = args[0] if args and isinstance(args[0], Tensor) else _lead(args, kwargs)
            key = None if t is None else (t.device, t.dtype)
            f = table.get(key)
            if f is None:
                f = table[key] = resolve(name, t)
            return f(*args, **kwargs)

        return op

    def resolve(self, name: str, lead: Tensor | None):
        """The function routed op ``name`` runs for calls led by a tensor of ``lead``'s
        device and dtype (``lead`` None: calls without tensors): the kernel when
        :func:`use_triton` says so for ``lead`` (and, where its module declares
        ``SUPPORTS[name]``, for the calls that predicate accepts, checked per call), else
        the reference op dropping :data:`KERNEL_ONLY` keywords."""
        probe = [] if lead is None else [lead]
        if not use_triton(*probe, backend=_fp64_naive(self.backend, probe)):
            return self._reference(name)
        module = kernel_module(self.family, name)
        f = getattr(module, name)
        supports = getattr(module, "SUPPORTS", {}).get(name)
        kernel = f if _accepts(f, "check") else functools.partial(_without_check, f)
        if supports is None:
            return kernel
        reference = self._reference(name)

        def supported(*args, **kwargs):
            return (kernel if supports(*args, **kwargs) else reference)(*args, **kwargs)

        return supported

    def _reference(self, name: str):
        f = getattr(self.naive, name)

        def reference(*args, **kwargs):
            if kwargs and not _KERNEL_ONLY.isdisjoint(kwargs):
                kwargs = {k: v for k, v in kwargs.items() if k not in _KERNEL_ONLY}
            return f(*args, **kwargs)

        return reference

    def clear(self) -> None:
        """Forget the resolved functions (:func:`reset` does it for every ``KernelOps``)."""
        for table in self.tables.values():
            table.clear()

    def __repr__(self) -> str:
        return f"KernelOps({self.family!r}, backend={self.backend!r})"


def _without_check(f, *args, **kwargs):
    """``f(*args, **kwargs)`` without ``check=`` (a kernel that does not take it)."""
    kwargs.pop("check", None)
    return f(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def ops_for(family: str, backend: str = "auto") -> KernelOps:
    """The (cached) :class:`KernelOps` of ``family`` (one of :data:`ROUTED`'s keys)."""
    return KernelOps(family, backend)
