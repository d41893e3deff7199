"""The one linear layer of every model: plain weight, or FP8 weight with its scales.

``y = x Wᵀ (+ b)``.  HF parameter names: ``weight`` / ``bias``, and for FP8 weights
(``torch.float8_e4m3fn``, :mod:`replayssm.ops.fp8.naive`)

* block-scaled (``block=(bo, bi)``): ``weight_scale_inv [ceil(out/bo), ceil(in/bi)]``
  (``W ≈ q ⊙ S↑``);
* per-tensor: ``weight_scale []`` and, with a static activation scale, ``input_scale []``.

The FP8 forward goes through ``kernels.dispatch.ops_for("fp8").linear``: on CUDA the FP8
GEMM of ``kernels.fp8_gemm`` (launch by row count: weight-only GEMV for decode, FP8
activations quantized per token group on tensor cores above), the reference (dequantize,
then ``F.linear``) on the CPU and in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.dispatch import ops_for
from ..ops.fp8.naive import FP8, scale_grid

__all__ = ["Linear", "param"]


def param(*shape, dtype=None, device=None) -> nn.Parameter:
    """An empty, frozen parameter (filled by the loader)."""
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x Wᵀ (+ b)``; :meth:`to_fp8` turns it into an FP8 layer (weights loaded later)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = param(d_out, d_in)
        self.bias = param(d_out) if bias else None
        self.block: tuple[int, int] | None = None
        self.fp8 = False

    def to_fp8(self, block=None, input_scale: bool = False) -> "Linear":
        """Make the weight an (empty) e4m3 tensor with block (``block=(bo, bi)``) or
        per-tensor scales (``block=None``; ``input_scale``: also a static activation scale)."""
        dev = self.weight.device
        self.fp8, self.block = True, None if block is None else (int(block[0]), int(block[1]))
        self.weight = param(self.d_out, self.d_in, dtype=FP8, device=dev)
        if self.block is not None:
            self.weight_scale_inv = param(*scale_grid((self.d_out, self.d_in), self.block), dtype=torch.float32,
                                          device=dev)
        else:
            self.weight_scale = param(dtype=torch.float32, device=dev)
            if input_scale:
                self.input_scale = param(dtype=torch.float32, device=dev)
        return self

    @property
    def scale(self) -> Tensor | None:
        """The weight's scales (block or per-tensor), None for a float layer."""
        if not self.fp8:
            return None
        return self.weight_scale_inv if self.block is not None else self.weight_scale

    def forward(self, x: Tensor) -> Tensor:
        if not self.fp8:
            return F.linear(x, self.weight, self.bias)
        return ops_for("fp8").linear(x, self.weight, self.scale, self.bias, block=self.block,
                                     input_scale=getattr(self, "input_scale", None))

    def extra_repr(self) -> str:
        q = "" if not self.fp8 else (f", fp8 block={self.block}" if self.block else ", fp8 per-tensor")
        return f"in={self.d_in}, out={self.d_out}, bias={self.bias is not None}{q}"
