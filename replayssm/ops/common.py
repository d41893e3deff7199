"""Helpers shared by the naive reference ops (:mod:`replayssm.ops.mamba2.naive`,
:mod:`replayssm.ops.gdn.naive`).

Only helpers whose logic is the same for both op families live here; family-specific
checks stay beside their ops.  Every ``check_*`` helper raises ``ValueError`` and writes
nothing, so an op can validate everything before its first cache write.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.ring import StepPlan
from ..cache.tree import check_parents
from ..runtime import want_check as _want_check

#: checkpoint-state storage dtypes; math always runs in :func:`compute_dtype` of the state
#: (fp32 for fp32/bf16/fp16 states, fp64 for fp64): a bf16/fp16 state is upcast when read and
#: rounded once when written (per flush / per recurrent step), never accumulated in 16 bits
STATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def want_check(check: bool | None, *tensors: Tensor) -> bool:
    """Host-side value checks: ``check`` if given, else on iff every tensor is on the CPU;
    always off while a CUDA graph is being captured (:func:`replayssm.runtime.want_check`)."""
    return _want_check(check, *tensors)


def shape_str(t) -> str:
    """``t``'s shape as a tuple string, or its type name if it is not a tensor."""
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


# ---------------------------------------------------------------------------- checks
def check_state_dtype(state: Tensor, what: str) -> None:
    """States are stored as fp32, fp64, bf16 or fp16 (:data:`STATE_DTYPES`)."""
    if state.dtype not in STATE_DTYPES:
        raise ValueError(f"{what} must be float32, float64, bfloat16 or float16, got {state.dtype}")


def check_route(route, routes: tuple[str, ...]) -> None:
    """``route`` is one of ``routes``."""
    if route not in routes:
        raise ValueError(f"bad route {route!r}: expected one of {routes}")


def check_tensors(prefix: str, want: dict, device, detail: str = "") -> None:
    """Each ``want[name] = (t, shape)`` is a floating-point tensor of that shape on ``device``.

    Errors name ``{prefix}.{name}``; ``detail`` (e.g. ``" (P=.., L=..)"``) follows the
    expected shape.
    """
    for name, (t, shape) in want.items():
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{prefix}.{name} has shape {shape_str(t)}, expected {shape}{detail}")
        if t.device != device:
            raise ValueError(f"{prefix}.{name} is on {t.device}, inputs on {device}")
        if not t.is_floating_point():
            raise ValueError(f"{prefix}.{name} must be floating point, got {t.dtype}")


def check_plan(plan, kind: str, Bt: int, T: int) -> None:
    """``plan`` is a :class:`StepPlan` of ``kind`` for ``Bt`` rows appending ``T`` entries."""
    if not isinstance(plan, StepPlan):
        raise ValueError(f"plan must be a StepPlan, got {type(plan).__name__}")
    if plan.kind != kind:
        raise ValueError(f"wrong plan kind: this op needs a {kind!r} plan, got {plan.kind!r}")
    if plan.batch != Bt:
        raise ValueError(f"plan has {plan.batch} rows, inputs have batch {Bt}")
    if plan.num_new != T:
        raise ValueError(f"plan appends {plan.num_new} entries per row, inputs have {T} tokens")


def check_plan_rows(plan: StepPlan, Bt: int, device) -> None:
    """The plan's per-row tensors are ``[Bt]`` on ``device``."""
    for name in ("slot", "start", "hist", "flush"):
        t = getattr(plan, name)
        if not isinstance(t, Tensor) or tuple(t.shape) != (Bt,) or t.device != device:
            raise ValueError(f"plan.{name} must be a [{Bt}] tensor on {device}")


def check_plan_fit(plan: StepPlan, T: int, L: int) -> None:
    """Committed lengths plus ``T`` new entries fit capacity ``L`` (host check).

    A flushing row may overwrite committed entries (they are summarised into the
    checkpoint before any write); any other row needs ``h + T <= L``.
    """
    bad = (plan.hist < 0) | (plan.hist > L) | (~plan.flush & (plan.hist + T > L))
    if bool(bad.any()):
        raise ValueError(f"inconsistent plan: committed lengths {plan.hist.tolist()} with {T} "
                         f"new entries do not fit capacity {L} without a flush")


def check_kv_lengths(pplan, T: int) -> None:
    """Each row's KV length plus ``T`` new entries fits its block table (host check)."""
    cap = pplan.block_table.shape[1] * pplan.block_size
    if bool(((pplan.length < 0) | (pplan.length + T > cap)).any()):
        raise ValueError(f"KV lengths {pplan.length.tolist()} + {T} new entries exceed the "
                         f"{cap} entries a row's block table holds")


def check_tree(parent, Bt: int, N: int, device, check: bool) -> Tensor:
    """Validate ``parent [N]`` / ``[Bt, N]``; return it as ``[Bt, N]`` int64.

    With ``check`` the tree must be topological (:func:`~replayssm.cache.tree.check_parents`).
    """
    if not isinstance(parent, Tensor) or parent.dim() not in (1, 2):
        raise ValueError("bad tree: parent must be an integer tensor [N] or [Bt, N], "
                         f"got {shape_str(parent)}")
    if parent.dtype not in _INDEX_DTYPES:
        raise ValueError(f"bad tree: parent must be int32/int64, got {parent.dtype}")
    if parent.device != device:
        raise ValueError(f"bad tree: parent is on {parent.device}, inputs on {device}")
    if parent.shape[-1] != N or (parent.dim() == 2 and parent.shape[0] != Bt):
        raise ValueError(f"bad tree: parent has shape {tuple(parent.shape)}, expected [{Bt}, {N}] or [{N}]")
    if check:
        return check_parents(parent, Bt)  # raises ValueError on a non-topological tree
    p = parent.long()
    return (p[None].expand(Bt, N) if p.dim() == 1 else p).contiguous()


def check_slot(slot, P: int, Bt: int, device, check: bool) -> Tensor:
    """``slot [Bt]`` int32/int64 on ``device``, ids in ``[0, P)`` (host check); returns int64."""
    if not isinstance(slot, Tensor) or tuple(slot.shape) != (Bt,):
        raise ValueError(f"slot must be an integer tensor of shape [{Bt}], got {shape_str(slot)}")
    if slot.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot must be int32/int64, got {slot.dtype}")
    if slot.device != device:
        raise ValueError(f"slot is on {slot.device}, inputs on {device}")
    s = slot.long()
    if check and Bt and bool(((s < 0) | (s >= P)).any()):
        raise ValueError(f"slot ids must be in [0, {P - 1}], got {s.tolist()}")
    return s


def check_accepted(accepted, Bt: int, T: int, device, check: bool) -> Tensor:
    """``accepted [Bt]`` int32/int64 on ``device``, counts in ``[0, T]`` (host check); returns int64."""
    if not isinstance(accepted, Tensor) or tuple(accepted.shape) != (Bt,):
        raise ValueError(f"accepted must be an integer tensor of shape [{Bt}], got {shape_str(accepted)}")
    if accepted.dtype not in _INDEX_DTYPES:
        raise ValueError(f"accepted must be int32/int64, got {accepted.dtype}")
    if accepted.device != device:
        raise ValueError(f"accepted is on {accepted.device}, state on {device}")
    a = accepted.long()
    if check and Bt and bool(((a < 0) | (a > T)).any()):
        raise ValueError(f"accepted counts must be in [0, {T}], got {a.tolist()}")
    return a


# ---------------------------------------------------------------------------- writes
def write_state_where(state: Tensor, slot: Tensor, flag: Tensor, new: Tensor) -> None:
    """``state[slot] = new`` on rows with ``flag`` (other rows rewrite their old value; no sync)."""
    old = state[slot]
    state[slot] = torch.where(flag[:, None, None, None], new.to(state.dtype), old)
