"""Pick the Triton kernel or the naive reference op for each decoding form.

Every function takes the same arguments as the op of the same name in
:mod:`replayssm.ops.mamba2.naive` / :mod:`replayssm.ops.gdn.naive` plus ``backend``:

* ``"auto"`` (default): Triton for CUDA tensors when Triton is importable, else naive;
* ``"triton"``: force the kernel (CPU tensors need ``TRITON_INTERPRET=1``, set before
  triton is imported);
* ``"naive"``: force the reference op.

The environment variable ``REPLAYSSM_KERNELS`` (``triton`` / ``naive``) overrides
``"auto"``.  Kernel-only tuning keywords (``block_d``, ``block_v``, ``num_warps``,
``pre_scores``, ``bits``, ``precision``, ``snapshots``) are dropped when the naive op runs.

:func:`ops_for` returns the object the layers call (``layer._ops()``): it has every
attribute of the naive module, and the ops that have a kernel (:data:`ROUTED`) choose the
kernel or the naive op per call, from the call's tensors.

Commit helpers are plain tensor ops (a pointer move, no host sync) and are the same for
both backends: :func:`ring_commit`, :func:`tree_commit`, :func:`snapshot_commit`.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
from torch import Tensor

from . import _triton

_BACKENDS = ("auto", "triton", "naive")
_KERNEL_ONLY = ("block_d", "block_v", "num_warps", "pre_scores", "bits", "precision", "snapshots", "impl", "fused_fold")
#: ops of both families that have a Triton kernel with the naive op's signature
ROUTED = ("recurrent_step", "recurrent_update", "replay_decode", "replay_verify", "tree_verify", "kv_verify",
          "snapshot_verify")


def _env_backend() -> str | None:
    env = os.environ.get("REPLAYSSM_KERNELS", "").strip().lower()
    return env if env in ("triton", "naive") else None


def _fp64_naive(backend: str, tensors) -> str:
    """``"auto"`` keeps float64 calls on the naive ops (the kernels compute in fp32; fp64 is
    the exactness reference) unless ``REPLAYSSM_KERNELS`` overrides."""
    if backend == "auto" and _env_backend() is None and \
            any(isinstance(t, Tensor) and t.dtype == torch.float64 for t in tensors):
        return "naive"
    return backend


def use_triton(*tensors: Tensor | None, backend: str = "auto") -> bool:
    """Whether the Triton kernel runs for these tensors under ``backend``."""
    if backend not in _BACKENDS:
        raise ValueError(f"bad backend {backend!r}: expected one of {_BACKENDS}")
    if backend == "auto":
        backend = _env_backend() or backend
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


def _naive(family: str):
    if family == "mamba2":
        from ..ops.mamba2 import naive
    else:
        from ..ops.gdn import naive
    return naive


def _kern(family: str):
    if family == "mamba2":
        from . import mamba2 as k
    else:
        from . import gdn as k
    return k


def _call(family: str, name: str, probe, backend: str, args, kwargs):
    if use_triton(*probe, backend=backend):
        f = getattr(_kern(family), name)
        if "check" in kwargs and not _accepts(f, "check"):
            kwargs = {k: v for k, v in kwargs.items() if k != "check"}  # validation toggle only
        return f(*args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in _KERNEL_ONLY}
    return getattr(_naive(family), name)(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _accepts(f, kw: str) -> bool:
    return kw in inspect.signature(f).parameters


def _probe(args) -> list[Tensor]:
    """The tensors that decide the backend of one call: tensor arguments, plus the state
    (or first pool tensor) of buffer objects (``Mamba2Buffers`` / ``GDNBuffers`` /
    paged pools)."""
    out = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(getattr(a, "state", None), Tensor):
            out.append(a.state)
        elif hasattr(a, "tensors") and callable(a.tensors):
            ts = [t for t in a.tensors() if isinstance(t, Tensor)]
            out += ts[:1]
    return out


class KernelOps:
    """What a layer's ``_ops()`` returns: the naive module of ``family``, with the ops in
    :data:`ROUTED` dispatched per call.

    ``ops.<name>(...)`` for a routed op runs the Triton kernel when :func:`use_triton`
    says so for the call's tensors (``backend="auto"``: CUDA tensors and Triton
    importable; ``REPLAYSSM_KERNELS`` overrides), else the naive op with kernel-only
    keywords dropped.  In ``"auto"`` mode without the environment override, float64
    calls stay on the naive ops: the kernels compute in fp32, and fp64 is the exactness
    reference.  Every other attribute (``chunked_prefill``, ``rebuild_state``,
    ``kv_to_state``, ``snapshot_commit``, ...) is the naive module's.
    """

    def __init__(self, family: str, backend: str = "auto"):
        if family not in ("mamba2", "gdn"):
            raise ValueError(f"unknown op family {family!r}: expected 'mamba2' or 'gdn'")
        if backend not in _BACKENDS:
            raise ValueError(f"bad backend {backend!r}: expected one of {_BACKENDS}")
        self.family, self.backend = family, backend
        self.naive = _naive(family)
        for name in ROUTED:
            setattr(self, name, self._router(name))

    def _router(self, name: str):
        naive_f = getattr(self.naive, name)

        @functools.wraps(naive_f)
        def op(*args, **kwargs):
            probe = _probe(args)
            return _call(self.family, name, probe, _fp64_naive(self.backend, probe), args, kwargs)

        return op

    def __getattr__(self, name):  # everything not routed: the naive module
        if name in ("naive", "family", "backend"):
            raise AttributeError(name)
        return getattr(self.naive, name)

    def __repr__(self) -> str:
        return f"KernelOps({self.family!r}, backend={self.backend!r})"


@functools.lru_cache(maxsize=None)
def ops_for(family: str, backend: str = "auto") -> KernelOps:
    """The (cached) :class:`KernelOps` of ``family`` (``"mamba2"`` or ``"gdn"``)."""
    return KernelOps(family, backend)


# ------------------------------------------------------------------------------ Mamba-2
def mamba2_recurrent_step(state, x, dt, A, B, C, D=None, backend: str = "auto", **kw):
    return _call("mamba2", "recurrent_step", (state, x), backend, (state, x, dt, A, B, C, D), kw)


def mamba2_replay_decode(buf, plan, x, dt, A, B, C, D=None, backend: str = "auto", **kw):
    return _call("mamba2", "replay_decode", (buf.state, x), backend, (buf, plan, x, dt, A, B, C, D), kw)


def mamba2_replay_verify(buf, plan, x, dt, A, B, C, D=None, backend: str = "auto", **kw):
    return _call("mamba2", "replay_verify", (buf.state, x), backend, (buf, plan, x, dt, A, B, C, D), kw)


def mamba2_tree_verify(buf, plan, parent, x, dt, A, B, C, D=None, backend: str = "auto", **kw):
    return _call("mamba2", "tree_verify", (buf.state, x), backend,
                 (buf, plan, parent, x, dt, A, B, C, D), kw)


def mamba2_kv_verify(kv, pplan, x, dt, A, B, C, D=None, backend: str = "auto", **kw):
    return _call("mamba2", "kv_verify", (kv.x, x), backend, (kv, pplan, x, dt, A, B, C, D), kw)


def mamba2_snapshot_verify(state, slot, x, dt, A, B, C, D=None, backend: str = "auto", **kw):
    return _call("mamba2", "snapshot_verify", (state, x), backend, (state, slot, x, dt, A, B, C, D), kw)


# ------------------------------------------------------------------------------ GDN
def gdn_recurrent_step(state, q, k, v, g, beta, backend: str = "auto", **kw):
    return _call("gdn", "recurrent_step", (state, q), backend, (state, q, k, v, g, beta), kw)


def gdn_replay_decode(buf, plan, q, k, v, g, beta, backend: str = "auto", **kw):
    return _call("gdn", "replay_decode", (buf.state, q), backend, (buf, plan, q, k, v, g, beta), kw)


def gdn_replay_verify(buf, plan, q, k, v, g, beta, backend: str = "auto", **kw):
    return _call("gdn", "replay_verify", (buf.state, q), backend, (buf, plan, q, k, v, g, beta), kw)


def gdn_tree_verify(buf, plan, parent, q, k, v, g, beta, backend: str = "auto", **kw):
    return _call("gdn", "tree_verify", (buf.state, q), backend, (buf, plan, parent, q, k, v, g, beta), kw)


def gdn_kv_verify(kv, pplan, q, k, v, g, beta, backend: str = "auto", **kw):
    return _call("gdn", "kv_verify", (kv.u, q), backend, (kv, pplan, q, k, v, g, beta), kw)


def gdn_snapshot_verify(state, slot, q, k, v, g, beta, backend: str = "auto", **kw):
    return _call("gdn", "snapshot_verify", (state, q), backend, (state, slot, q, k, v, g, beta), kw)


# ------------------------------------------------------------------------------ conv
def conv_decode(win, slot, x, weight, bias=None, activation=None, backend: str = "auto", check=None):
    """Decode step of the short conv (:func:`replayssm.cache.conv.conv_decode`): the fused
    kernel for CUDA tensors below fp64, the reference otherwise."""
    probe = (win.window, x)
    if use_triton(*probe, backend=_fp64_naive(backend, (x,))):
        from . import conv as kconv

        return kconv.conv_decode(win, slot, x, weight, bias, activation)
    from ..cache import conv as rconv

    return rconv.conv_decode(win, slot, x, weight, bias, activation, check=check)


def conv_verify(win, slot, x, weight, bias=None, activation=None, backend: str = "auto", check=None):
    """Short conv of ``T`` tentative tokens (:func:`replayssm.cache.conv.conv_verify`): one
    kernel for CUDA tensors below fp64, the reference otherwise."""
    if use_triton(win.window, x, backend=_fp64_naive(backend, (x,))):
        from . import conv as kconv

        return kconv.conv_verify(win, slot, x, weight, bias, activation)
    from ..cache import conv as rconv

    return rconv.conv_verify(win, slot, x, weight, bias, activation, check=check)


def conv_commit(win, slot, x, accepted, backend: str = "auto", check=None) -> None:
    """Keep the accepted tokens in the conv window (:func:`replayssm.cache.conv.conv_commit`):
    one kernel for CUDA tensors below fp64, the reference otherwise."""
    if use_triton(win.window, x, backend=_fp64_naive(backend, (x,))):
        from . import conv as kconv

        return kconv.conv_commit(win, slot, x, accepted)
    from ..cache import conv as rconv

    return rconv.conv_commit(win, slot, x, accepted, check=check)


# ------------------------------------------------------------------------------ commit
def ring_commit(ring, plan, accepted: Tensor | None = None, check: bool | None = None) -> None:
    """Advance each row by its accepted count (pointer move on the device, no host sync)."""
    ring.commit(plan, accepted, check=check)


def tree_commit(buffers: list[Tensor], plan, path: Tensor, accepted: Tensor) -> None:
    """Gather each row's accepted root-to-leaf path to the front of its new ring entries
    (call for every layer's ``ring_tensors()``, then :func:`ring_commit`)."""
    from ..cache.tree import gather_path

    gather_path(buffers, plan, path, accepted)


def snapshot_commit(state: Tensor, slot: Tensor, snapshots: Tensor, accepted: Tensor,
                    check: bool | None = None) -> None:
    """Baseline commit: ``state[slot] = snapshots[:, a-1]`` where ``a > 0`` (tensor ops)."""
    from ..ops.mamba2.naive import snapshot_commit as _sc

    _sc(state, slot, snapshots, accepted, check=check)


# ------------------------------------------------------------------------------ attention



def write_kv(k_cache, v_cache, k, v, slot_mapping, backend: str = "auto", check=None) -> None:
    """Write each token's key and value to its flat cache slot
    (:func:`replayssm.ops.attention.naive.write_kv`; negative slots are skipped): one kernel
    launch for CUDA tensors below fp64, the reference otherwise."""
    if use_triton(k_cache, k, backend=_fp64_naive(backend, (k, k_cache))):
        from . import attention as katt

        return katt.write_kv(k_cache, v_cache, k, v, slot_mapping, check=check)
    from ..ops.attention import naive

    return naive.write_kv(k_cache, v_cache, k, v, slot_mapping, check=check)


def paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, *, scale, tree_bits=None, out=None,
                    backend: str = "auto", check=None, **kw):
    """Softmax attention over a paged KV cache
    (:func:`replayssm.ops.attention.naive.paged_attention`): the Triton kernel for CUDA
    tensors below fp64, the reference otherwise (kernel-only keywords ``num_splits``,
    ``block_m``, ``block_n``, ``num_warps`` are then dropped)."""
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens)
    if use_triton(q, k_cache, backend=_fp64_naive(backend, (q, k_cache))):
        from . import attention as katt

        return katt.paged_attention(*args, scale=scale, tree_bits=tree_bits, out=out, check=check, **kw)
    from ..ops.attention import naive

    return naive.paged_attention(*args, scale=scale, tree_bits=tree_bits, out=out, check=check)


# ------------------------------------------------------------------------------ mixture of experts
def moe_experts(x, idx, w, w1, w2, *, act: str = "silu", gated: bool = True, backend: str = "auto", **kw):
    """Routed experts of a MoE block (:func:`replayssm.ops.moe.naive.experts`): the fused
    grouped-GEMM kernels for CUDA tensors below fp64 with a supported activation, the
    gather-based reference otherwise (kernel-only keywords ``block_m``, ``block_n``,
    ``block_k``, ``num_warps`` are then dropped)."""
    from . import moe as kmoe

    if act in kmoe.SUPPORTED_ACTS and use_triton(x, w1, backend=_fp64_naive(backend, (x, w1))):
        return kmoe.experts(x, idx, w, w1, w2, act=act, gated=gated, **kw)
    from ..ops.moe import naive

    return naive.experts(x, idx, w, w1, w2, act=act, gated=gated)
