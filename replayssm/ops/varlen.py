"""Packed variable-length prefill: validation and state plumbing shared by the reference
ops and the Triton kernels of both families.

A packed batch is one flat token stream ``[Nt, ...]`` holding ``N`` sequences back to back;
``cu_seqlens [N+1]`` (int32/int64, ``cu[0] = 0``, non-decreasing, ``cu[N] = Nt``) marks
where each starts.  Sequences may be empty.  Each sequence starts from its own state, taken
from one of two sources:

* ``initial_state [N, ...]`` (or ``None`` = zeros); the final states are returned;
* a state pool, in place: ``state_pool [P, ...]``, ``slots [N]``, ``fresh [N]`` (bool, default
  all False): sequence ``i`` starts from zeros if ``fresh[i]`` else from
  ``state_pool[slots[i]]``, and its final state is written to ``state_pool[slots[i]]``.
  Fresh rows are never read (they may hold NaN); rows not in ``slots`` are never touched.
  Slots must be distinct, except the null slot 0, which padding sequences may share.

Every check raises ``ValueError`` before anything is written.  Value checks (ranges,
monotonicity, distinct slots) are host syncs and run only when ``check`` says so
(:func:`replayssm.runtime.want_check`: on for CPU tensors by default).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import STATE_DTYPES, shape_str

_INDEX = (torch.int32, torch.int64)
NULL_SLOT = 0


def check_cu_seqlens(cu_seqlens, Nt: int, device, check: bool) -> int:
    """Validate ``cu_seqlens [N+1]``; returns ``N``."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], got {shape_str(cu_seqlens)}")
    if cu_seqlens.dtype not in _INDEX:
        raise ValueError(f"cu_seqlens must be int32/int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, inputs on {device}")
    if check:
        cu = cu_seqlens.long()
        if int(cu[0]) != 0 or int(cu[-1]) != Nt:
            raise ValueError(f"cu_seqlens must start at 0 and end at the token count {Nt}, got "
                             f"{int(cu[0])} .. {int(cu[-1])}")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    return cu_seqlens.numel() - 1


def check_state_source(initial_state, state_pool, slots, fresh, N: int, shape: tuple, device,
                       check: bool):
    """Validate the state source of ``N`` sequences with per-sequence state ``shape``.

    Returns ``(slots int64 | None, fresh bool | None)``.  ``initial_state`` and the pool
    are exclusive; ``slots`` / ``fresh`` need ``state_pool``.
    """
    if state_pool is None:
        if slots is not None or fresh is not None:
            raise ValueError("slots / fresh are given without state_pool")
        if initial_state is not None:
            if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (N,) + shape:
                raise ValueError(f"initial_state must have shape {(N,) + shape}, got {shape_str(initial_state)}")
            if initial_state.dtype not in STATE_DTYPES:
                raise ValueError(f"initial_state dtype must be float32, float64, bfloat16 or float16, got "
                                 f"{initial_state.dtype}")
            if initial_state.device != device:
                raise ValueError(f"initial_state is on {initial_state.device}, inputs on {device}")
        return None, None
    if initial_state is not None:
        raise ValueError("give either initial_state or state_pool (with slots), not both")
    if not isinstance(state_pool, Tensor) or state_pool.dim() != len(shape) + 1 or \
            tuple(state_pool.shape[1:]) != shape:
        raise ValueError(f"state_pool must have shape [P, {', '.join(map(str, shape))}], got {shape_str(state_pool)}")
    if state_pool.dtype not in STATE_DTYPES:
        raise ValueError(f"state_pool dtype must be float32, float64, bfloat16 or float16, got {state_pool.dtype}")
    if state_pool.device != device:
        raise ValueError(f"state_pool is on {state_pool.device}, inputs on {device}")
    return check_slots(state_pool, slots, fresh, N, device, check)


def check_slots(pool: Tensor, slots, fresh, N: int, device, check: bool):
    """``slots [N]`` (int, in ``[0, P)``, distinct but for the null slot) and ``fresh [N]``
    (bool or None) for a pool with ``P = pool.shape[0]`` rows.  Returns ``(slots int64, fresh)``."""
    if not isinstance(slots, Tensor) or tuple(slots.shape) != (N,) or slots.dtype not in _INDEX:
        raise ValueError(f"slots must be an int32/int64 tensor of shape [{N}], got {shape_str(slots)}")
    if slots.device != device:
        raise ValueError(f"slots is on {slots.device}, inputs on {device}")
    if fresh is not None:
        if not isinstance(fresh, Tensor) or tuple(fresh.shape) != (N,) or fresh.dtype != torch.bool:
            raise ValueError(f"fresh must be a bool tensor of shape [{N}], got {shape_str(fresh)}")
        if fresh.device != device:
            raise ValueError(f"fresh is on {fresh.device}, inputs on {device}")
    s = slots.long()
    if check and N:
        P = pool.shape[0]
        if bool(((s < 0) | (s >= P)).any()):
            raise ValueError(f"slots must be in [0, {P - 1}], got {s.tolist()}")
        real = s[s != NULL_SLOT]
        if real.numel() != torch.unique(real).numel():
            raise ValueError(f"a slot appears for several sequences: {s.tolist()} (only the null "
                             f"slot {NULL_SLOT} may repeat)")
    return s, fresh


def gather_initial(initial_state, state_pool, slots, fresh, N: int, shape: tuple, cdt, device) -> Tensor:
    """Each sequence's starting state ``[N, *shape]`` in ``cdt`` (zeros for fresh rows and
    without a source; fresh pool rows are selected away, never multiplied)."""
    if state_pool is not None:
        S = state_pool[slots].to(cdt)
        if fresh is not None:
            S = torch.where(fresh.view((N,) + (1,) * len(shape)), torch.zeros((), dtype=cdt, device=device), S)
        return S
    if initial_state is not None:
        return initial_state.to(cdt)
    return torch.zeros((N,) + shape, dtype=cdt, device=device)


def seq_bounds(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` per sequence (host copy: for the reference ops)."""
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))
