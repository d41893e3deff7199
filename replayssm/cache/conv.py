"""Rollback-able window of the short causal depthwise conv (Mamba-2 and GDN layers).

A slot keeps the ``W-1`` most recent *committed* pre-conv inputs, ``window[P, C, W-1]``
(oldest first, the HF ``conv_state`` layout minus its newest column).  The conv itself and
the window updates of each step kind are ops: :mod:`replayssm.ops.conv.naive` (reference)
and :mod:`replayssm.kernels.conv` (fused kernels), routed by
:func:`replayssm.kernels.dispatch.ops_for` ``("conv")``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..runtime import want_check
from .buffers import _empty

@dataclass
class ConvWindow:
    """Committed pre-conv inputs of one conv layer: ``window [P, C, W-1]`` (oldest first)."""

    window: Tensor

    @classmethod
    def allocate(cls, num_slots: int, channels: int, width: int, dtype=torch.float32,
                 device="cpu", poison: bool = False) -> "ConvWindow":
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"conv width must be a positive int, got {width!r}")
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"conv channels must be a positive int, got {channels!r}")
        return cls(_empty((num_slots + 1, channels, width - 1), dtype, device, poison))

    @property
    def channels(self) -> int:
        return self.window.shape[1]

    @property
    def width(self) -> int:
        return self.window.shape[2] + 1

    @property
    def num_slots(self) -> int:
        return self.window.shape[0] - 1

    def write(self, slot: Tensor, window: Tensor) -> None:
        """Set ``window[slot] = window [Bt, C, W-1]`` (e.g. the final window of a prefill)."""
        slot = check_slot(self, slot, check=want_check(None, slot))
        want = (slot.shape[0], self.channels, self.width - 1)
        if tuple(window.shape) != want:
            raise ValueError(f"window has shape {tuple(window.shape)}, expected {want}")
        self.window[slot] = window.to(self.window.dtype)

    def reset(self, slot: Tensor) -> None:
        """Zero the windows of ``slot [Bt]`` (a fresh sequence)."""
        slot = check_slot(self, slot, check=want_check(None, slot))
        self.window[slot] = 0


def check_slot(win: ConvWindow, slot: Tensor, check: bool, batch: int | None = None) -> Tensor:
    """``slot [Bt]`` as int64 after checking dtype, batch, device and (``check``) range."""
    if not isinstance(slot, Tensor) or slot.dim() != 1 or slot.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot must be a 1-D int32/int64 tensor [Bt]")
    if batch is not None and slot.shape[0] != batch:
        raise ValueError(f"slot has {slot.shape[0]} rows, inputs have batch {batch}")
    if slot.device != win.window.device:
        raise ValueError(f"slot on {slot.device}, window on {win.window.device}")
    if check and slot.numel():
        lo, hi = int(slot.min()), int(slot.max())
        if lo < 0 or hi > win.num_slots:
            raise ValueError(f"slot ids must be in [0, {win.num_slots}], got [{lo}, {hi}]")
    return slot.long()
