"""One Triton kernel finishing a tensor-parallel sub-block: the sum over ranks of the
row-parallel partial outputs, the deferred gated-norm scale, the residual add and the next
block's RMSNorm (the reference: :func:`replayssm.ops.tp_reduce.reduce_add_norm`).

Per row, with rank ``r``'s partial ``p_r [N]`` (read from its buffer: peers' buffers are
device addresses over NVLink, ``part_ptrs [W]``) and, when ``SCALED``, its sum of squares
``q_r`` of the gated norm's input (``ss_ptrs [W]``; ranks ``g·RPG .. g·RPG+RPG-1`` share
norm group ``g``)::

    c_g = rsqrt((Σ_{r∈g} q_r) / group_size + gate_eps)             (1 when not SCALED)
    o   = round_act(Σ_g c_g Σ_{r∈g} p_r)        fp32 sums, ranks in rank order
    s   = round_sum(h + o)                                         (ADD)
    y   = w · rms(round_norm(s))  or  (1 + w) · rms(...)            (NORM)

Every rank reads the same partials in the same order, so every rank writes bitwise the
same ``o``, ``s`` and ``y``.  Peers' rows are read past L1 (``.cg``: the owner's L2 holds
them coherently); one program per row.

``BARRIER`` (the sums' CPU interpreter tests compile it out, their "ranks" being separate
host tensors; another test runs it with the peers' signals pre-set) uses counters on each
rank's signal pad (``pad_ptrs [W]``, int32): ``[0, W)`` entry signals from each rank,
``[W, 2W)`` trailing signals, then this rank's own ``epoch`` (calls so far),
``trail_epoch`` (trailing calls so far), ``arrived`` and ``done`` (programs of the current
call).  Each program reads ``e = epoch``; the first program to arrive adds 1 to every
peer's entry slot for this rank (release, system scope: this rank's partial, written by
the kernels before this one, is then visible); every program spins until this rank's
entry slot of each peer reaches ``e + 1`` (acquire).  So one signal crosses NVLink per
rank and call whatever the grid (a handshake per program made the wait grow with the
rows: 42 µs at 256 rows against 6 µs at one).  The last program to finish resets
``arrived``/``done``; with ``TRAIL`` it first signals the peers' trailing slots and waits
for theirs (no rank leaves before every peer has read its buffer); then it moves ``epoch``
on.  Every program read ``e`` before the last one counted in, so a call sees one epoch;
the counters only grow, so the kernel replays inside CUDA graphs; no program waits on
another program of its own rank, so any grid size is safe.  Every rank must make the same
sequence of calls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import HAVE_TRITON, next_pow2, triton, tl

if HAVE_TRITON:
    from .norm import rmsnorm_row

__all__ = ["tp_reduce"]

if HAVE_TRITON:

    @triton.jit
    def _wait_for(own, base, target, rank, W: tl.constexpr):
        """Spin until slot ``base + p`` of this rank's pad ``own`` reaches ``target`` for every
        peer ``p`` (compared through the int32 difference, so counters may wrap around)."""
        for p in tl.static_range(W):
            if p != rank:
                while tl.atomic_add(own + base + p, 0, sem="acquire", scope="sys") - target < 0:
                    pass

    @triton.jit
    def _signal(pad_ptrs, base, rank, W: tl.constexpr):
        """Add 1 to slot ``base + rank`` of every peer's pad."""
        for p in tl.static_range(W):
            if p != rank:
                peer = tl.load(pad_ptrs + p).to(tl.pointer_type(tl.int32))
                tl.atomic_add(peer + base + rank, 1, sem="release", scope="sys")

    @triton.jit
    def _finish_row(x, h_ptr, w_ptr, y_ptr, s_ptr, o_ptr, r64, j, m, N, h_stride, eps,
                    ADD: tl.constexpr, NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, OUT: tl.constexpr):
        """The reduced row ``x`` (fp32 of activation-dtype values): store it, add the
        residual, store the sum, apply the norm (the pull kernel's and :mod:`.tp_push`'s kernels' row end)."""
        if OUT:
            tl.store(o_ptr + r64 * N + j, x.to(o_ptr.dtype.element_ty), mask=m)
        if ADD:
            x += tl.load(h_ptr + r64 * h_stride + j, mask=m, other=0.0).to(tl.float32)
            s = x.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + r64 * N + j, s, mask=m)
            x = s.to(tl.float32)
        if NORM:
            rmsnorm_row(x, w_ptr, y_ptr + r64 * N, j, m, N, eps, ZERO_CENTERED)

    # one binary for every row count (a new batch size compiles nothing) and every rank
    @triton.jit(do_not_specialize=["R", "rank"])
    def _tp_reduce_kernel(
        part_ptrs, ss_ptrs, pad_ptrs, like_ptr, h_ptr, w_ptr, y_ptr, s_ptr, o_ptr,
        R, N, h_stride, rank, eps, gate_eps, inv_gsize,
        W: tl.constexpr, RPG: tl.constexpr, SCALED: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
        ZERO_CENTERED: tl.constexpr, OUT: tl.constexpr, BARRIER: tl.constexpr, TRAIL: tl.constexpr,
        BN: tl.constexpr, ALIGNED: tl.constexpr = False, ES: tl.constexpr = 2,
    ):
        pid = tl.program_id(0)
        npr = tl.num_programs(0)
        if BARRIER:
            own = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
            e = tl.atomic_add(own + 2 * W, 0, sem="acquire", scope="gpu")
            if tl.atomic_add(own + 2 * W + 2, 1, sem="acq_rel", scope="gpu") == 0:
                _signal(pad_ptrs, 0, rank, W)
            _wait_for(own, 0, e + 1, rank, W)
            tl.debug_barrier()
        act = like_ptr.dtype.element_ty
        j = tl.arange(0, BN)
        m = j < N
        if pid < R:
            r64 = tl.cast(pid, tl.int64)
            acc = tl.zeros([BN], dtype=tl.float32)
            for g in tl.static_range(W // RPG):
                part = tl.zeros([BN], dtype=tl.float32)
                tot = 0.0
                for k in tl.static_range(RPG):
                    if ALIGNED:
                        # like_ptr plus an element offset declared a multiple of 16 bytes: the
                        # compiler then reads 16-byte vectors (an address cast to a pointer loses
                        # its divisibility, so the other form reads 2-byte elements over NVLink)
                        d = (tl.load(part_ptrs + g * RPG + k) - like_ptr.to(tl.int64)) // ES
                        src = like_ptr + tl.multiple_of(d, 16 // ES)
                    else:
                        src = tl.multiple_of(tl.load(part_ptrs + g * RPG + k), 16).to(tl.pointer_type(act))
                    part += tl.load(src + r64 * N + j, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
                    if SCALED:
                        sq = tl.load(ss_ptrs + g * RPG + k).to(tl.pointer_type(tl.float32))
                        tot += tl.load(sq + r64, cache_modifier=".cg")
                if SCALED:
                    acc += part * tl.rsqrt(tot * inv_gsize + gate_eps)
                else:
                    acc += part
            _finish_row(acc.to(act).to(tl.float32), h_ptr, w_ptr, y_ptr, s_ptr, o_ptr, r64, j, m, N, h_stride, eps,
                        ADD, NORM, ZERO_CENTERED, OUT)
        if BARRIER:
            tl.debug_barrier()
            if tl.atomic_add(own + 2 * W + 3, 1, sem="acq_rel", scope="gpu") == npr - 1:
                # the last program of this call: every program has read `e` and its rows
                tl.atomic_xchg(own + 2 * W + 2, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(own + 2 * W + 3, 0, sem="relaxed", scope="gpu")
                if TRAIL:
                    te = tl.atomic_add(own + 2 * W + 1, 1, sem="acq_rel", scope="gpu")
                    _signal(pad_ptrs, W, rank, W)
                    _wait_for(own, W, te + 1, rank, W)
                tl.atomic_add(own + 2 * W, 1, sem="release", scope="gpu")


def tp_reduce(part_ptrs: Tensor, like: Tensor, rows: int, *, rank: int = 0, ss_ptrs: Tensor | None = None,
              ranks_per_group: int | None = None, group_size: int = 1, gate_eps: float = 0.0,
              residual: Tensor | None = None, sum_dtype: torch.dtype | None = None, weight: Tensor | None = None,
              eps: float = 0.0, zero_centered: bool = False, want_sum: bool = False,
              pad_ptrs: Tensor | None = None, trailing: bool = False, num_warps: int | None = None,
              aligned: bool = False):
    """Launch the kernel over ``rows`` rows of ``N = like.shape[-1]`` channels.

    ``part_ptrs [W]`` int64: each rank's partial ``[rows, N]`` (contiguous, ``like``'s dtype)
    as a device address; ``ss_ptrs [W]`` int64 (optional): each rank's fp32 sums of squares
    ``[rows]``, normalising by its group of ``ranks_per_group`` ranks (default all) and
    ``group_size`` channels; ``residual [rows, N]`` (rows may be strided): add it, the sum
    stored in ``sum_dtype``; ``weight [N]``: the next RMSNorm (output in its dtype).
    ``pad_ptrs [W]`` int64: the signal pads (None: no barrier, the ranks' buffers are
    already complete); ``trailing``: a second barrier after the reads; ``num_warps``: a
    launch override (default: by the row width); ``aligned``: the caller vouches that every
    ``part_ptrs`` address is 16-byte aligned (``like`` must be too), and the partials are
    addressed from ``like`` so that they load as 16-byte vectors.  Returns
    ``(y, s, o)``: the normed rows (or None), the new residual stream (or None), the
    reduced rows (when ``want_sum`` or neither of the others is asked for, else None)."""
    W = int(part_ptrs.numel())
    N = like.shape[-1]
    rpg = W if ranks_per_group is None else int(ranks_per_group)
    if W < 1 or part_ptrs.dtype != torch.int64 or rpg < 1 or W % rpg:
        raise ValueError(f"part_ptrs must be int64 addresses of W >= 1 ranks in groups of a divisor of W; "
                         f"got {W} ({part_ptrs.dtype}), ranks_per_group={rpg}")
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} outside 0..{W - 1}")
    if ss_ptrs is not None and (ss_ptrs.numel() != W or ss_ptrs.dtype != torch.int64 or group_size < 1):
        raise ValueError("ss_ptrs must be W int64 addresses, with a positive group_size")
    if residual is not None and (residual.dim() != 2 or tuple(residual.shape) != (rows, N) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [{rows}, {N}] with unit stride along N, got {tuple(residual.shape)}")
    if weight is not None and tuple(weight.shape) != (N,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match {N} channels")
    if pad_ptrs is not None and (pad_ptrs.numel() != W or pad_ptrs.dtype != torch.int64):
        raise ValueError("pad_ptrs must be W int64 addresses")
    if aligned and like.data_ptr() % 16:
        raise ValueError("aligned: like must be 16-byte aligned")
    dev = like.device
    want_sum = want_sum or (residual is None and weight is None)
    y = torch.empty(rows, N, dtype=weight.dtype, device=dev) if weight is not None else None
    s = torch.empty(rows, N, dtype=sum_dtype or residual.dtype, device=dev) if residual is not None else None
    o = torch.empty(rows, N, dtype=like.dtype, device=dev) if want_sum else None
    if rows == 0 and not trailing:
        return y, s, o
    BN = next_pow2(N)
    grid = max(1, rows)
    dummy = part_ptrs
    _tp_reduce_kernel[(grid,)](
        part_ptrs, ss_ptrs if ss_ptrs is not None else dummy, pad_ptrs if pad_ptrs is not None else dummy, like,
        residual if residual is not None else like, weight if weight is not None else like,
        y if y is not None else like, s if s is not None else like, o if o is not None else like,
        rows, N, residual.stride(0) if residual is not None else 0, int(rank), float(eps), float(gate_eps),
        1.0 / float(group_size), W=W, RPG=rpg, SCALED=ss_ptrs is not None, ADD=residual is not None,
        NORM=weight is not None, ZERO_CENTERED=bool(zero_centered), OUT=o is not None,
        BARRIER=pad_ptrs is not None, TRAIL=bool(trailing) and pad_ptrs is not None, BN=BN,
        ALIGNED=bool(aligned), ES=like.element_size(), num_warps=num_warps or min(8, max(1, BN // 512)))
    return y, s, o
