"""One launch per tensor-parallel sub-block: the sum over ranks fused with the residual add
and the next block's norm (``REPLAYSSM_TP_FUSED``, default on; ``0``, or
``REPLAYSSM_TP_ALLREDUCE=nccl``: the hooks of :mod:`.layers` all-reduce every mixer output
as before).

A mixer of a plain :class:`~replayssm.models.base.Block` returns its partial output as a
:class:`DeferredSum`; the block hands it the residual stream and the next norm
(``Block.add_norm`` / ``Block.finish``), and it finishes the sub-block:

* on GPUs (:class:`FusedFinish`, message up to the one-shot size): each rank's partial lies
  in its symmetric-memory buffer (Mamba-2's ``out_proj`` writes it there; other mixers'
  outputs are copied in), and one kernel (:func:`~replayssm.kernels.tp_reduce.tp_reduce`)
  waits for every rank, sums the partials over NVLink in rank order, adds the residual and
  applies the next RMSNorm;
* on CPUs, float64 and anything the kernel does not take: the reference, the all-reduce of
  ``[partial ; sums]`` then the same scale, add and norm in PyTorch
  (:func:`reference_sum`);
* ``REPLAYSSM_TP_FUSED_METHOD`` picks how the kernel moves the partials: ``pull`` (default:
  each rank reads the peers' buffers as 16-byte vectors), ``pull-b16`` (the kernel's
  former addressing, which compiles to 2-byte loads: kept to measure against), ``push``  (each rank stores its partial into the
  peers' receive slots, then sums locally) or ``twoshot`` (each rank sums one column slice
  and stores it into every rank: half the bytes at 4 ranks); see
  :mod:`~replayssm.kernels.tp_push` (``REPLAYSSM_TP_FUSED_PROGRAMS`` caps its grid);
* on GPUs past the one-shot size (long prefills) or past ``REPLAYSSM_TP_FUSED_MAX_ROWS``
  rows (default 16: the kernel wins at one row and loses from 64, measured): today's path
  (all-reduce, then the block's fused add + norm).

Mamba-2's gated norm, where a norm group spans ranks (``n_groups`` < ranks), is deferred
past ``out_proj``: its row scale ``c = rsqrt(mean (x·silu(z))² + eps)`` factors out of the
projection, ``out = Σ_g c_g Σ_{r∈g} (u_r W_rᵀ)`` with ``u = w · x · silu(z)``, so each rank
sends ``u``'s projection and its sums of squares, and no separate all-reduce of the sums
remains (:class:`~.layers.DeferredGatedNorm`; the projection must be bias-free).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..kernels import _triton
from ..kernels.dispatch import env_backend
from ..layers.linear import Linear
from ..layers.norms import RMSNorm
from ..models.base import Deferred
from ..runtime import compute_dtype

__all__ = ["DeferredSum", "GroupScale", "FusedFinish", "SymmOutProj", "fused_enabled", "fused_max_rows",
           "fused_method", "fused_programs", "reference_sum"]

ENV = "REPLAYSSM_TP_FUSED"
ROWS_ENV = "REPLAYSSM_TP_FUSED_MAX_ROWS"
METHOD_ENV = "REPLAYSSM_TP_FUSED_METHOD"
PROGRAMS_ENV = "REPLAYSSM_TP_FUSED_PROGRAMS"
METHODS = ("pull", "pull-b16", "push", "twoshot")
#: the fused finish takes calls of at most this many rows (``REPLAYSSM_TP_FUSED_MAX_ROWS``
#: overrides; the buffers' own ``max_rows`` caps it too: 819 rows of d = 2560 in 4 MiB).
#: Measured on two H200s (2026-11-27 night, `scripts/gpu_tp_fused.py`, both paths in one
#: run), µs per call at 1 / 64 / 256 rows: the fused pull with 16-byte loads 6.8 / 8.4 / 13.4
#: (d = 2560) and 8.5 / 12.7 / 25.8 (d = 8192) against the all-reduce + add/norm it replaces
#: 8.4 / 11.6 / 19.3 and 9.7 / 17.9 / 41.7; the Mamba-2 tail 15.1 / 17.3 / 23.3 against
#: 23.5 / 28.0 / 38.2.  End to end (2.7B, replay, TP=2 ÷ TP=1): 1.10x / 1.29x / 1.49x at
#: B = 1 / 64 / 256 with every decode call fused, against 0.99x / 1.10x / 1.32x with the
#: former cap of 16 rows (and the former 2-byte loads, which made 64 and 256 rows slower than
#: the unfused path).  So the fused path takes every call its buffer holds.
DEFAULT_MAX_ROWS = 4096


def _positive_env(name: str, default: int, value: str | None) -> int:
    """``value`` (or environment variable ``name``, else ``default``) as a positive integer."""
    v = os.environ.get(name, str(default)) if value is None else value
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return n


def fused_max_rows(value: str | None = None) -> int:
    """``REPLAYSSM_TP_FUSED_MAX_ROWS`` (or ``value``): a positive row count (default
    :data:`DEFAULT_MAX_ROWS`)."""
    return _positive_env(ROWS_ENV, DEFAULT_MAX_ROWS, value)


def fused_method(value: str | None = None) -> str:
    """``REPLAYSSM_TP_FUSED_METHOD`` (or ``value``): one of :data:`METHODS` (default ``pull``)."""
    v = os.environ.get(METHOD_ENV, "pull") if value is None else value
    if v not in METHODS:
        raise ValueError(f"{METHOD_ENV} must be one of {', '.join(METHODS)}, got {v!r}")
    return v


def fused_programs(value: str | None = None) -> int:
    """``REPLAYSSM_TP_FUSED_PROGRAMS`` (or ``value``): the push kernels' grid cap, a positive
    integer (default :data:`~replayssm.kernels.tp_push.DEFAULT_PROGRAMS`)."""
    from ..kernels.tp_push import DEFAULT_PROGRAMS

    return _positive_env(PROGRAMS_ENV, DEFAULT_PROGRAMS, value)


def fused_enabled(value: str | None = None) -> bool:
    """``REPLAYSSM_TP_FUSED`` (or ``value``): ``1`` (default) or ``0``."""
    v = os.environ.get(ENV, "1") if value is None else value
    if v not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {v!r}")
    return v == "1"


@dataclass(frozen=True)
class GroupScale:
    """A deferred gated norm's row scale: ``sums [rows]`` (this rank's fp32 sums of squares),
    the rank's norm group ``index`` of ``groups`` (``ranks_per_group = ranks / groups``),
    ``size`` channels a group, ``eps``."""

    sums: Tensor
    index: int
    groups: int
    size: int
    eps: float


class FusedFinish:
    """One model's fused sub-block finish (every rank builds it together: a collective).

    ``mode(rows, x)``: ``"fused"`` (CUDA, symmetric memory, ``rows <= fused_rows``: the
    buffers' ``max_rows`` and :func:`fused_max_rows`, the
    model's dtype), ``"reference"`` (not CUDA, float64, or ``REPLAYSSM_KERNELS=naive``),
    else None (today's path).

    Buffers: two parities of ``[max_rows, D]`` partials and ``[max_rows]`` fp32 sums in one
    symmetric allocation (its signal pad holds the barrier slots).  Why two, and why the
    last call of a forward (:meth:`DeferredSum.add`) ends with a second barrier: a rank that
    leaves call ``k`` (parity ``p``) writes its next partial into parity ``1-p`` while a
    slower peer may still read its parity-``p`` buffer; it writes parity ``p`` again only
    for call ``k+2``, after passing call ``k+1``'s barrier, which that peer reaches only
    once it has finished call ``k``.  This needs calls to alternate parity, which a host
    counter gives within one forward (graphs capture it as constants); a forward's last
    call (:meth:`DeferredSum.add`, or the last before blocks that defer nothing) waits for
    every peer to finish reading (the trailing barrier), so the next forward (or graph
    replay) starts again at parity 0 whatever the count before it.

    ``method`` (default ``REPLAYSSM_TP_FUSED_METHOD``): ``push`` / ``twoshot`` add a second
    symmetric allocation (:func:`~replayssm.kernels.tp_push.push_layout`: receive slots,
    gather rows, flags) and a local epoch counter; their kernel orders its own reuse of
    the slots, so the parities and the trailing barrier do not matter to them (the partial
    is only read locally)."""

    method = "pull"
    push = None

    def __init__(self, group, device, dtype: torch.dtype, hidden: int, max_bytes: int, rank: int, size: int,
                 allreduce, method: str | None = None, programs: int | None = None):
        self.group, self.device, self.dtype, self.D = group, torch.device(device), dtype, int(hidden)
        self.rank, self.size, self.allreduce = rank, size, allreduce
        self.method = fused_method(method)
        self.programs = fused_programs() if programs is None else fused_programs(str(programs))
        self.parity = 0
        self.max_rows = max(1, int(max_bytes) // (self.D * torch.finfo(dtype).bits // 8))
        self.fused_rows = min(self.max_rows, fused_max_rows())   # calls the kernel takes
        self.ok, self.why_not = False, "not CUDA"
        self.parts: list[Tensor] = []
        self.sums: list[Tensor] = []
        if self.device.type == "cuda" and dtype != torch.float64:
            self.ok, self.why_not = self._setup()

    def _setup(self) -> tuple[bool, str]:
        ok, why = True, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if not _triton.HAVE_TRITON:
                raise RuntimeError("no Triton")
            grp = self.group or dist.group.WORLD
            es = torch.finfo(self.dtype).bits // 8
            pbytes = _align(self.max_rows * self.D * es)
            sbytes = _align(self.max_rows * 4)
            buf = symm_mem.empty(2 * (pbytes + sbytes), dtype=torch.uint8, device=self.device)
            hdl = symm_mem.rendezvous(buf, grp.group_name)
            i64 = dict(dtype=torch.int64, device=self.device)
            self._buf = buf
            self.part_ptrs, self.ss_ptrs = [], []
            for p in range(2):
                po, so = p * pbytes, 2 * pbytes + p * sbytes
                self.parts.append(buf[po: po + self.max_rows * self.D * es].view(self.dtype).view(self.max_rows, self.D))
                self.sums.append(buf[so: so + self.max_rows * 4].view(torch.float32))
                self.part_ptrs.append(torch.tensor([a + po for a in hdl.buffer_ptrs], **i64))
                self.ss_ptrs.append(torch.tensor([a + so for a in hdl.buffer_ptrs], **i64))
            if any(a % 16 for a in hdl.buffer_ptrs):   # the kernel reads partials 16 bytes at a time
                raise RuntimeError(f"symmetric buffers not 16-byte aligned: {list(hdl.buffer_ptrs)}")
            self.pad_ptrs = torch.tensor(list(hdl.signal_pad_ptrs), **i64)
            if int(hdl.signal_pad_size) < 4 * (2 * self.size + 4):
                raise RuntimeError(f"signal pad of {hdl.signal_pad_size} bytes is too small for the barrier counters")
            if self.method in ("push", "twoshot"):
                from ..kernels.tp_push import PushBuffers, push_layout

                total = push_layout(self.size, self.max_rows, self.D, es, self.programs)["total"][1]
                pbuf = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
                phdl = symm_mem.rendezvous(pbuf, grp.group_name)
                pbuf.zero_()                      # the flags start at 0 (epoch 0)
                torch.cuda.synchronize(self.device)
                self._pbuf = pbuf
                ctl = torch.zeros(2, dtype=torch.int32, device=self.device)      # this rank's epoch, count
                self.push = PushBuffers.from_bases(list(phdl.buffer_ptrs), ctl, self.D, es, self.max_rows,
                                                   self.programs)
        except Exception as e:  # noqa: BLE001 - any failure: the reference / today's path
            ok, why = False, f"{type(e).__name__}: {e}"
        ok, why = self._agree(ok, why)
        if ok:   # probe (every rank, or none: it waits for its peers): rank r sends r + 1, plus a residual of 1
            try:
                n = min(3, self.max_rows)
                self.parts[0][:n].fill_(self.rank + 1)
                ones = torch.ones(n, self.D, dtype=self.dtype, device=self.device)
                _, s, _ = self.run(self.parts[0][:n], None, ones, torch.float32, trailing=True)   # parity 0 -> 0
                want = self.size * (self.size + 1) / 2 + 1
                if not bool(torch.all(s == want)):
                    ok, why = False, f"probe gave {s.flatten()[0].item()}, want {want}"
            except Exception as e:  # noqa: BLE001
                ok, why = False, f"{type(e).__name__}: {e}"
            ok, why = self._agree(ok, why)
        if not ok:
            self.parts, self.sums = [], []
        return ok, why

    def _agree(self, ok: bool, why: str) -> tuple[bool, str]:
        """All ranks ok, or none."""
        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if ok and not int(flag.item()):
            return False, "another rank could not set up the fused finish"
        return ok, why

    # -- which path a call takes (every rank decides the same: same rows, dtype, device) ---------
    def mode(self, rows: int, x: Tensor) -> str | None:
        if x.device.type != "cuda" or x.dtype == torch.float64 or env_backend() == "naive":
            return "reference"
        if self.ok and rows and rows <= self.fused_rows and x.dtype == self.dtype:
            return "fused"
        return None

    def part_out(self, rows: int) -> Tensor:
        """This call's partial buffer ``[rows, D]`` (write the partial here: no copy)."""
        return self.parts[self.parity][:rows]

    def sums_out(self, rows: int) -> Tensor:
        return self.sums[self.parity][:rows]

    def run(self, partial: Tensor, scale: GroupScale | None, residual: Tensor | None = None,
            sum_dtype=None, norm: RMSNorm | None = None, want_sum: bool = False, trailing: bool = False):
        """The kernel on this call's buffers (``partial [..., D]`` copied in unless it is
        already there); ``(y, s, o)`` as :func:`~replayssm.kernels.tp_reduce.tp_reduce`."""
        from ..kernels.tp_reduce import tp_reduce

        rows = partial.numel() // self.D
        buf = self.part_out(rows)
        if partial.data_ptr() != buf.data_ptr():
            buf.copy_(partial.reshape(rows, self.D))
        kw = {}
        if scale is not None:
            sb = self.sums_out(rows)
            if scale.sums.data_ptr() != sb.data_ptr():
                sb.copy_(scale.sums.reshape(rows))
            kw = dict(ranks_per_group=self.size // scale.groups, group_size=scale.size, gate_eps=scale.eps)
            if self.method in ("pull", "pull-b16"):
                kw["ss_ptrs"] = self.ss_ptrs[self.parity]
            else:
                kw["sums"] = sb
        if self.method in ("push", "twoshot"):
            from ..kernels.tp_push import tp_push

            out = tp_push(buf, self.push, rows, rank=self.rank, two_shot=self.method == "twoshot",
                          residual=None if residual is None else residual.reshape(rows, self.D),
                          sum_dtype=sum_dtype, weight=None if norm is None else norm.weight,
                          eps=0.0 if norm is None else norm.eps,
                          zero_centered=bool(norm is not None and norm.zero_centered), want_sum=want_sum,
                          programs=min(self.programs, self.push.max_programs), **kw)
            self.parity = 0 if trailing else 1 - self.parity
            return out
        out = tp_reduce(self.part_ptrs[self.parity], buf, rows, rank=self.rank,
                        residual=None if residual is None else residual.reshape(rows, self.D),
                        sum_dtype=sum_dtype, weight=None if norm is None else norm.weight,
                        eps=0.0 if norm is None else norm.eps, zero_centered=bool(norm is not None and norm.zero_centered),
                        want_sum=want_sum, pad_ptrs=self.pad_ptrs, trailing=trailing,
                        aligned=self.method == "pull", **kw)
        self.parity = 0 if trailing else 1 - self.parity
        return out


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a


def reference_sum(allreduce, partial: Tensor, scale: GroupScale | None) -> Tensor:
    """The sum over ranks in PyTorch: ``allreduce(partial)``; with a deferred norm scale,
    one all-reduce of ``[partial ; sums]`` per norm group (``[..., G, D + 1]``, this rank's
    in its group's row), then ``Σ_g c_g · part_g`` (at least fp32), in the partial's dtype."""
    if scale is None:
        return allreduce(partial)
    cdt = compute_dtype(partial.dtype)
    D = partial.shape[-1]
    msg = partial.new_zeros(*partial.shape[:-1], scale.groups, D + 1, dtype=cdt)
    msg[..., scale.index, :D] = partial.to(cdt)
    msg[..., scale.index, D] = scale.sums.reshape(partial.shape[:-1]).to(cdt)
    tot = allreduce(msg)
    c = torch.rsqrt(tot[..., D] / scale.size + scale.eps)                 # [..., G]
    return (tot[..., :D] * c[..., None]).sum(-2).to(partial.dtype)


class DeferredSum(Deferred):
    """A mixer's partial output (this rank's ``partial [..., D]``, with its norm ``scale``
    when deferred) whose sum over ranks is still to do: see the module docstring."""

    def __init__(self, fin: FusedFinish, partial: Tensor, scale: GroupScale | None, mode: str):
        self.fin, self.partial, self.scale, self.mode = fin, partial, scale, mode
        self.dtype = partial.dtype

    def _fuses(self, h: Tensor, sum_dtype) -> bool:
        return (self.mode == "fused" and h.shape == self.partial.shape and h.dtype != torch.float64
                and sum_dtype != torch.float64)

    def add_norm(self, h: Tensor, norm: nn.Module, dtype: torch.dtype, sum_dtype: torch.dtype, last: bool = False):
        if self._fuses(h, sum_dtype) and type(norm) is RMSNorm and norm.weight.dtype == dtype:
            y, s, _ = self.fin.run(self.partial, self.scale, h, sum_dtype, norm, trailing=last)
            return y.view(h.shape), s.view(h.shape)
        return norm.add_forward(h, self.value(), dtype, sum_dtype)

    def add(self, h: Tensor, sum_dtype: torch.dtype) -> Tensor:
        if self._fuses(h, sum_dtype):
            _, s, _ = self.fin.run(self.partial, self.scale, h, sum_dtype, trailing=True)
            return s.view(h.shape)
        return h.to(sum_dtype) + self.value()

    def value(self) -> Tensor:
        """The sum itself (a consumer that needs the tensor)."""
        if self.mode == "fused":
            return self.fin.run(self.partial, self.scale, want_sum=True, trailing=True)[2].view(self.partial.shape)
        return reference_sum(self.fin.allreduce, self.partial, self.scale)


class SymmOutProj(Linear):
    """A mixer's last (row-parallel) projection under the fused finish: a float projection
    of a decode-sized batch writes straight into this call's symmetric buffer (no copy);
    FP8 weights and other calls run as :class:`Linear`."""

    fin: FusedFinish | None = None

    def forward(self, x: Tensor) -> Tensor:
        fin = self.fin
        rows = x.numel() // x.shape[-1]
        if fin is None or self.fp8 or fin.mode(rows, x) != "fused" or x.dtype != self.weight.dtype:
            return super().forward(x)
        out = fin.part_out(rows)
        x2 = x.reshape(rows, self.d_in)
        if self.bias is None:
            torch.mm(x2, self.weight.t(), out=out)
        else:
            torch.addmm(self.bias, x2, self.weight.t(), out=out)
        return out.view(*x.shape[:-1], self.d_out)


def deferring_hook(fin: FusedFinish, allreduce, norm=None):
    """The forward hook of a mixer whose output only becomes a block's ``pending``: a
    :class:`DeferredSum` (or, where the fused finish does not apply, the all-reduced tensor);
    ``norm``: the mixer's :class:`~.layers.DeferredGatedNorm`, whose sums it takes."""

    def hook(module, args, output: Tensor):
        scale = norm.take() if norm is not None else None
        rows = output.numel() // output.shape[-1]
        mode = fin.mode(rows, output)
        if mode is None:
            return allreduce(output)
        return DeferredSum(fin, output, scale, mode)

    return hook
