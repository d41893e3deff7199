"""The tensor-parallel sub-block finish with the partials *pushed* to the ranks that sum them
(remote stores) instead of pulled from the peers (remote loads, :mod:`.tp_reduce`).  Same
math and rounding as :mod:`.tp_reduce` (reference: :func:`replayssm.ops.tp_reduce.reduce_add_norm`),
so every rank writes bitwise what the pull kernel writes::

    o = round_act(Σ_g c_g Σ_{r∈g} p_r);   s = round_sum(h + o);   y = RMSNorm(s)

Two schedules, one row per program (``programs`` caps the grid; a program then strides over
rows), both in one launch:

* **push** (one-shot): each program stores its rows of this rank's partial ``p [R, N]`` (and
  its sums of squares ``q [R]``) into every peer's receive slot ``recv[e % 2][rank]``, raises
  its flag on every peer, waits for the peers' flags of the same program, then sums the W
  slots (its own partial read in place) locally.  NVLink bytes a rank sends:
  ``(W-1)·R·N·es``.
* **two-shot**: the columns split into W slices of ``SW = ceil(N / W)``.  Phase 1 stores
  slice ``p`` of the partial into rank ``p``'s ``recv[0][rank]`` (the sums go to everyone);
  flags; phase 2 sums this rank's slice over the ranks (scale, rounding) and stores the
  reduced slice into every rank's ``gather`` rows; flags; phase 3 reads full rows of ``o``
  from the local ``gather`` and adds the residual and the norm.  Bytes sent:
  ``2·(W-1)/W·R·N·es`` (half the one-shot's at W = 4, the same at W = 2).  The norm's sum
  of squares is not exchanged per slice: every rank holds the same full rows of ``o`` and
  the same residual, so each computes the same norm locally (one read of a local row).

Synchronisation: each program raises ``flags[phase][rank][pid]`` on every peer to ``e + 1``
(release, system scope, after a block barrier: the program's stores before it) and spins
until the peers' ``flags[phase][peer][pid]`` of its own pad reach ``e + 1`` (acquire; int32
difference, so counters may wrap).  ``e`` is this rank's call count (``ctl[0]``, local): every
program reads it on entry, and the last program to finish (``ctl[1]`` counts them) moves it
on, so a call sees one epoch, whatever its grid.  A program waits only on the programs of
the same index on the peers, never on its own rank's, so there is no co-residency
assumption beyond index-ordered scheduling.  Reuse of a slot: a rank writes slot ``s`` for
call ``k + 1`` (two-shot) or ``k + 2`` (push, parity) only after its own call ``k``
(``k + 1``) finished, which needed every peer's flag of the phase that follows the peer's
last read of that slot, so no peer still reads it (two-shot: the recv slots are read in
phase 2, before the phase-2 flags; ``gather`` is written in phase 2 of call ``k + 1``, after
the peers' phase-1 flags of call ``k + 1``, i.e. after they left call ``k``).  Every rank must
make the same sequence of calls with the same row counts; the kernel replays in CUDA graphs
(nothing on the host changes between calls).

Memory (every rank the same layout, :func:`push_layout`): ``recv [2, W, max_rows, N]``
(activation dtype), ``qrecv [2, W, max_rows]`` fp32, ``gather [max_rows, N]``, ``flags [2, W,
max_programs]`` int32 (zeroed once), all in one symmetric allocation; ``ctl [2]`` int32 is
local.  Peer regions are addressed as this rank's partial pointer plus an element offset
(16-byte aligned offsets are declared when ``aligned``, so rows move as 16-byte vectors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, next_pow2, triton, tl

if HAVE_TRITON:
    from .tp_reduce import _finish_row

__all__ = ["PushBuffers", "push_layout", "tp_push"]

DEFAULT_PROGRAMS = 256


def push_layout(W: int, max_rows: int, N: int, elem_bytes: int, max_programs: int) -> dict[str, tuple[int, int]]:
    """Byte ``(offset, size)`` of each region in one rank's allocation (256-byte aligned)."""
    out, at = {}, 0
    for name, n in (("recv", 2 * W * max_rows * N * elem_bytes), ("qrecv", 2 * W * max_rows * 4),
                    ("gather", max_rows * N * elem_bytes), ("flags", 2 * W * max_programs * 4)):
        out[name] = (at, n)
        at += -(-n // 256) * 256
    out["total"] = (0, at)
    return out


@dataclass(frozen=True)
class PushBuffers:
    """Every rank's region addresses (``[W]`` int64 on this rank's device) and this rank's
    ``ctl [2]`` int32, for a partial of ``N`` channels, up to ``max_rows`` rows and
    ``max_programs`` programs a call; ``aligned``: every region 16-byte aligned and ``N``
    rows a multiple of 16 bytes."""

    recv: Tensor
    qrecv: Tensor
    gather: Tensor
    flags: Tensor
    ctl: Tensor
    N: int
    max_rows: int
    max_programs: int
    aligned: bool

    @staticmethod
    def from_bases(bases: list[int], ctl: Tensor, N: int, elem_bytes: int, max_rows: int,
                   max_programs: int = DEFAULT_PROGRAMS) -> PushBuffers:
        """The regions of :func:`push_layout` in allocations starting at ``bases [W]``."""
        lay = push_layout(len(bases), max_rows, N, elem_bytes, max_programs)
        kw = {"dtype": torch.int64, "device": ctl.device}
        reg = {k: torch.tensor([b + lay[k][0] for b in bases], **kw) for k in ("recv", "qrecv", "gather", "flags")}
        aligned = all(b % 16 == 0 for b in bases) and (N * elem_bytes) % 16 == 0
        return PushBuffers(ctl=ctl, N=int(N), max_rows=int(max_rows), max_programs=int(max_programs),
                           aligned=aligned, **reg)


if HAVE_TRITON:

    @triton.jit
    def _at(ptrs, k, like_ptr, like_addr, ES: tl.constexpr, ALIGNED: tl.constexpr):
        """Rank ``k``'s region (address ``ptrs[k]``) as ``like_ptr`` plus an element offset."""
        d = (tl.load(ptrs + k) - like_addr) // ES
        if ALIGNED:
            d = tl.multiple_of(d, 16 // ES)
        return like_ptr + d

    @triton.jit
    def _flag_and_wait(flag_ptrs, base, e, rank, pid, MAXP, W: tl.constexpr):
        """Raise this program's flag on every peer to ``e + 1``; wait for the peers' flags."""
        tl.debug_barrier()
        for p in tl.static_range(W):
            if p != rank:
                fl = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(fl + base + rank * MAXP + pid, e + 1, sem="release", scope="sys")
        own = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        for p in tl.static_range(W):
            if p != rank:
                while tl.atomic_add(own + base + p * MAXP + pid, 0, sem="acquire", scope="sys") - (e + 1) < 0:
                    pass
        tl.debug_barrier()

    @triton.jit
    def _epoch_done(ctl):
        """The last program of the call resets the count and moves the epoch on."""
        tl.debug_barrier()
        if tl.atomic_add(ctl + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(ctl + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(ctl, 1, sem="release", scope="gpu")

    @triton.jit
    def _reduce_cols(part_ptr, me, q_ptr, qme, recv_ptrs, qrecv_ptrs, slot0, r64, cols, mc, rank, N, MAXR,
                     inv_gsize, gate_eps, W: tl.constexpr, RPG: tl.constexpr, SCALED: tl.constexpr,
                     ES: tl.constexpr, ALIGNED: tl.constexpr, BL: tl.constexpr):
        """``Σ_g c_g Σ_{r∈g} p_r`` (fp32, ranks in order) over columns ``cols`` of row ``r64``:
        rank ``k``'s values from the local receive slot ``slot0 + k`` (its own partial in place)."""
        dr = (tl.load(recv_ptrs + rank) - me) // ES        # the local slots, from part_ptr
        dq = (tl.load(qrecv_ptrs + rank) - qme) // 4
        acc = tl.zeros([BL], dtype=tl.float32)
        for g in tl.static_range(W // RPG):
            part = tl.zeros([BL], dtype=tl.float32)
            tot = 0.0
            for kk in tl.static_range(RPG):
                k = g * RPG + kk
                b = tl.where(k == rank, r64 * N, dr + ((slot0 + k) * MAXR + r64) * N)
                if ALIGNED:
                    b = tl.multiple_of(b, 16 // ES)
                # past L1 (.cg): the peers wrote these lines over NVLink since this SM last read them
                part += tl.load(part_ptr + b + cols, mask=mc, other=0.0, cache_modifier=".cg").to(tl.float32)
                if SCALED:
                    tot += tl.load(q_ptr + tl.where(k == rank, r64, dq + (slot0 + k) * MAXR + r64),
                                   cache_modifier=".cg")
            if SCALED:
                acc += part * tl.rsqrt(tot * inv_gsize + gate_eps)
            else:
                acc += part
        return acc

    @triton.jit(do_not_specialize=["R", "rank"])
    def _tp_push_kernel(
        part_ptr, q_ptr, recv_ptrs, qrecv_ptrs, gather_ptrs, flag_ptrs, ctl_ptr, h_ptr, w_ptr, y_ptr, s_ptr, o_ptr,
        R, N, SW, MAXR, MAXP, h_stride, rank, eps, gate_eps, inv_gsize,
        W: tl.constexpr, RPG: tl.constexpr, SCALED: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
        ZERO_CENTERED: tl.constexpr, OUT: tl.constexpr, TWO_SHOT: tl.constexpr, ES: tl.constexpr,
        ALIGNED: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        e = tl.atomic_add(ctl_ptr, 0, sem="acquire", scope="gpu")
        me = part_ptr.to(tl.int64)
        qme = q_ptr.to(tl.int64)
        act = part_ptr.dtype.element_ty
        j = tl.arange(0, BN)
        m = j < N
        if TWO_SHOT:
            js = tl.arange(0, BS)
            # phase 1: slice p of each row to rank p's slot [rank]; the sums to every peer
            for row in range(pid, R, G):
                r64 = tl.cast(row, tl.int64)
                for p in tl.static_range(W):
                    if p != rank:
                        c = p * SW + js
                        mc = (js < SW) & (c < N)
                        x = tl.load(part_ptr + r64 * N + c, mask=mc)
                        dst = _at(recv_ptrs, p, part_ptr, me, ES, ALIGNED)
                        tl.store(dst + (rank * MAXR + r64) * N + c, x, mask=mc)
                        if SCALED:
                            qd = _at(qrecv_ptrs, p, q_ptr, qme, 4, False)
                            tl.store(qd + rank * MAXR + r64, tl.load(q_ptr + r64))
            _flag_and_wait(flag_ptrs, 0, e, rank, pid, MAXP, W)
            # phase 2: this rank's slice summed over the ranks, to every rank's gather rows
            c = rank * SW + js
            mc = (js < SW) & (c < N)
            for row in range(pid, R, G):
                r64 = tl.cast(row, tl.int64)
                acc = _reduce_cols(part_ptr, me, q_ptr, qme, recv_ptrs, qrecv_ptrs, 0, r64, c, mc, rank, N, MAXR,
                                   inv_gsize, gate_eps, W, RPG, SCALED, ES, ALIGNED, BS)
                o = acc.to(act)
                for p in tl.static_range(W):
                    dst = _at(gather_ptrs, p, part_ptr, me, ES, ALIGNED)
                    tl.store(dst + r64 * N + c, o, mask=mc)
            _flag_and_wait(flag_ptrs, W * MAXP, e, rank, pid, MAXP, W)
            # phase 3: full rows of the sum, locally
            gv = _at(gather_ptrs, rank, part_ptr, me, ES, ALIGNED)
            for row in range(pid, R, G):
                r64 = tl.cast(row, tl.int64)
                x = tl.load(gv + r64 * N + j, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
                _finish_row(x, h_ptr, w_ptr, y_ptr, s_ptr, o_ptr, r64, j, m, N, h_stride, eps,
                            ADD, NORM, ZERO_CENTERED, OUT)
        else:
            par = (e & 1).to(tl.int64)
            for row in range(pid, R, G):
                r64 = tl.cast(row, tl.int64)
                x = tl.load(part_ptr + r64 * N + j, mask=m)
                for p in tl.static_range(W):
                    if p != rank:
                        dst = _at(recv_ptrs, p, part_ptr, me, ES, ALIGNED)
                        tl.store(dst + ((par * W + rank) * MAXR + r64) * N + j, x, mask=m)
                        if SCALED:
                            qd = _at(qrecv_ptrs, p, q_ptr, qme, 4, False)
                            tl.store(qd + (par * W + rank) * MAXR + r64, tl.load(q_ptr + r64))
            _flag_and_wait(flag_ptrs, 0, e, rank, pid, MAXP, W)
            for row in range(pid, R, G):
                r64 = tl.cast(row, tl.int64)
                acc = _reduce_cols(part_ptr, me, q_ptr, qme, recv_ptrs, qrecv_ptrs, par * W, r64, j, m, rank, N,
                                   MAXR, inv_gsize, gate_eps, W, RPG, SCALED, ES, ALIGNED, BN)
                x = acc.to(act).to(tl.float32)
                _finish_row(x, h_ptr, w_ptr, y_ptr, s_ptr, o_ptr, r64, j, m, N, h_stride, eps,
                            ADD, NORM, ZERO_CENTERED, OUT)
        _epoch_done(ctl_ptr)


def tp_push(part: Tensor, bufs: PushBuffers, rows: int, *, rank: int = 0, two_shot: bool = False,
            sums: Tensor | None = None, ranks_per_group: int | None = None, group_size: int = 1,
            gate_eps: float = 0.0, residual: Tensor | None = None, sum_dtype: torch.dtype | None = None,
            weight: Tensor | None = None, eps: float = 0.0, zero_centered: bool = False, want_sum: bool = False,
            programs: int | None = None, num_warps: int | None = None):
    """Launch the push (or ``two_shot``) finish over ``rows`` rows of this rank's partial
    ``part [>= rows, N]`` (contiguous; local memory); ``sums [>= rows]`` fp32: its sums of
    squares (the deferred gated-norm scale, groups of ``ranks_per_group`` ranks, ``group_size``
    channels); ``bufs``: the ranks' regions; ``programs``: the grid cap (default and maximum
    ``bufs.max_programs``).  The other arguments and the returned ``(y, s, o)`` are
    :func:`~replayssm.kernels.tp_reduce.tp_reduce`'s."""
    W = int(bufs.recv.numel())
    N = bufs.N
    rpg = W if ranks_per_group is None else int(ranks_per_group)
    if W < 1 or rpg < 1 or W % rpg:
        raise ValueError(f"{W} ranks do not split into norm groups of {rpg}")
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} outside 0..{W - 1}")
    if part.dim() != 2 or part.shape[-1] != N or not part.is_contiguous() or part.shape[0] < rows:
        raise ValueError(f"part must be a contiguous [>= {rows}, {N}] tensor, got {tuple(part.shape)}")
    if not 0 <= rows <= bufs.max_rows:
        raise ValueError(f"{rows} rows outside 0..{bufs.max_rows} (the receive slots' size)")
    if sums is not None and (sums.dtype != torch.float32 or sums.numel() < rows or group_size < 1):
        raise ValueError("sums must be >= rows fp32 values, with a positive group_size")
    if residual is not None and (residual.dim() != 2 or tuple(residual.shape) != (rows, N) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [{rows}, {N}] with unit stride along N, got {tuple(residual.shape)}")
    if weight is not None and tuple(weight.shape) != (N,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match {N} channels")
    G = bufs.max_programs if programs is None else int(programs)
    if not 1 <= G <= bufs.max_programs:
        raise ValueError(f"programs must be in 1..{bufs.max_programs}, got {G}")
    dev = part.device
    want_sum = want_sum or (residual is None and weight is None)
    y = torch.empty(rows, N, dtype=weight.dtype, device=dev) if weight is not None else None
    s = torch.empty(rows, N, dtype=sum_dtype or residual.dtype, device=dev) if residual is not None else None
    o = torch.empty(rows, N, dtype=part.dtype, device=dev) if want_sum else None
    if rows == 0:
        return y, s, o
    BN = next_pow2(N)
    SW = -(-N // W)
    like = part
    q = sums if sums is not None else torch.zeros(1, dtype=torch.float32, device=dev)
    _tp_push_kernel[(min(rows, G),)](
        part, q, bufs.recv, bufs.qrecv, bufs.gather, bufs.flags, bufs.ctl,
        residual if residual is not None else like, weight if weight is not None else like,
        y if y is not None else like, s if s is not None else like, o if o is not None else like,
        rows, N, SW, bufs.max_rows, bufs.max_programs, residual.stride(0) if residual is not None else 0, int(rank),
        float(eps), float(gate_eps), 1.0 / float(group_size),
        W=W, RPG=rpg, SCALED=sums is not None, ADD=residual is not None, NORM=weight is not None,
        ZERO_CENTERED=bool(zero_centered), OUT=o is not None, TWO_SHOT=bool(two_shot), ES=part.element_size(),
        ALIGNED=bufs.aligned and part.data_ptr() % 16 == 0, BN=BN, BS=next_pow2(SW),
        num_warps=num_warps or min(8, max(1, BN // 512)))
    return y, s, o
