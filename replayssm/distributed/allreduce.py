"""The sum of a partial tensor over the ranks: the one collective of every row-parallel layer.

A decode step of an L-layer model all-reduces ``L`` to ``2L`` small messages (``[B, T, D]``
partial outputs, a few hundred KiB), so their *latency*, not their bandwidth, sets what
tensor parallelism costs.  :class:`AllReduce` picks the path per message size:

* ``symm`` — CUDA symmetric memory (``torch.distributed._symmetric_memory``): each rank
  copies its partial into a buffer every peer can address over NVLink, and one kernel per
  rank reads all peers' buffers and sums them ("one-shot", peer-to-peer loads; no NVLink
  multicast).  One launch, one barrier: a few microseconds, and it runs inside CUDA graphs.
* ``nccl`` — ``torch.distributed.all_reduce`` on the data group (NCCL on GPUs, gloo on
  CPU): every message on CPU, and messages past ``symm_max_bytes`` on GPUs.

``method="auto"`` (default; ``REPLAYSSM_TP_ALLREDUCE`` overrides) uses ``symm`` on CUDA when
the buffer rendezvous and a probe sum succeed on every rank, ``nccl`` otherwise.  Every rank
must make the same calls in the same order (the engine guarantees it: each rank runs the
same step).  Sums are in the message dtype, ranks in rank order, so every rank holds the
bitwise-identical result.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from .startup import phase

__all__ = ["AllReduce", "METHODS"]

METHODS = ("auto", "nccl", "symm")

#: the largest message the one-shot path takes by default (a 256-row decode batch of a
#: 4096-wide model in bf16 is 2 MiB)
DEFAULT_SYMM_MAX_BYTES = 4 << 20


def _method_from_env(method: str | None) -> str:
    m = method or os.environ.get("REPLAYSSM_TP_ALLREDUCE", "auto")
    if m not in METHODS:
        raise ValueError(f"tensor-parallel all-reduce method must be one of {METHODS}, got {m!r}"
                         f"{' (from REPLAYSSM_TP_ALLREDUCE)' if method is None else ''}")
    return m


class AllReduce:
    """``__call__(x)``: ``x`` summed over the ranks of ``group`` (returns a tensor; ``x`` may be
    overwritten).  ``device``: this rank's device; ``symm_max_bytes``: one-shot messages up to
    this size (the symmetric buffer is allocated once at that size for each of ``dtypes``, the
    dtypes the model's messages come in; others take NCCL)."""

    def __init__(self, group=None, device: torch.device | str = "cpu", method: str | None = None,
                 symm_max_bytes: int = DEFAULT_SYMM_MAX_BYTES,
                 dtypes=(torch.bfloat16, torch.float16, torch.float32)):
        self.group, self.device = group, torch.device(device)
        self.dtypes = tuple(dict.fromkeys(dtypes))
        self.requested = _method_from_env(method)
        self.symm_max_bytes = int(symm_max_bytes)
        self._bufs: dict[torch.dtype, Tensor] = {}
        self._group_name = None
        self.method = "nccl"
        if self.device.type == "cuda" and self.requested in ("auto", "symm"):
            ok, why = self._setup_symm()
            if ok:
                self.method = "symm"
            elif self.requested == "symm":
                raise RuntimeError(f"REPLAYSSM_TP_ALLREDUCE=symm but symmetric memory is unusable here: {why}")
            else:
                self.why_not_symm = why

    # -- setup (collective: every rank runs it at model build) ----------------------------------
    def _setup_symm(self) -> tuple[bool, str]:
        """Allocate and rendezvous the bf16/fp16/fp32 buffers, probe one sum; agree on the
        outcome across ranks (all use ``symm`` or none does)."""
        ok, why = True, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem
            grp = self.group or dist.group.WORLD
            self._group_name = grp.group_name
            for dt in self.dtypes:
                n = self.symm_max_bytes // (torch.finfo(dt).bits // 8)
                with phase("symm.alloc"):
                    buf = symm_mem.empty(n, dtype=dt, device=self.device)
                with phase("symm.rendezvous"):
                    symm_mem.rendezvous(buf, grp)
                self._bufs[dt] = buf
            with phase("symm.probe"):
                probe = torch.full((7, 3), float(dist.get_rank(self.group) + 1), dtype=self.dtypes[-1],
                                   device=self.device)
                got = self._symm(probe)
                size = dist.get_world_size(self.group)
                want = size * (size + 1) / 2
                if not bool(torch.all(got == want)):
                    ok, why = False, f"probe sum gave {got.flatten()[0].item()}, want {want}"
        except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
            ok, why = False, f"{type(e).__name__}: {e}"
        with phase("symm.agree"):
            flag = torch.tensor([1 if ok else 0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if ok and not int(flag.item()):
            ok, why = False, "another rank could not use symmetric memory"
        if not ok:
            self._bufs.clear()
        return ok, why

    # -- the collective -------------------------------------------------------------------------
    def _symm(self, x: Tensor) -> Tensor:
        buf = self._bufs[x.dtype]
        flat = x.reshape(-1)
        n = flat.numel()
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:n], flat.contiguous(), "sum", self._group_name)
        return out.view(x.shape)

    def takes(self, x: Tensor) -> bool:
        """Whether ``x`` goes the one-shot path."""
        return (self.method == "symm" and x.dtype in self._bufs
                and x.numel() * x.element_size() <= self.symm_max_bytes)

    def __call__(self, x: Tensor) -> Tensor:
        if self.takes(x):
            return self._symm(x)
        dist.all_reduce(x, group=self.group)
        return x

    def __repr__(self) -> str:
        return f"AllReduce(method={self.method!r}, symm_max_bytes={self.symm_max_bytes})"
