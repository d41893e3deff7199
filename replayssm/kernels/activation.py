"""Triton kernel for the relu² activation of Nemotron-H's MLP, in place, one pass.

``y = relu(x)²``: the same numbers as ``torch.square(F.relu(x))`` (the square computed in
fp32 and rounded once to ``x``'s dtype), which reads and writes the tensor twice.
"""

from __future__ import annotations

from torch import Tensor

from ._triton import HAVE_TRITON, triton, tl

__all__ = ["relu2_"]

#: elements per program
BLOCK = 4096

if HAVE_TRITON:

    @triton.jit
    def _relu2_kernel(x_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        v = tl.maximum(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0)
        tl.store(x_ptr + offs, (v * v).to(x_ptr.dtype.element_ty), mask=m)


def relu2_(x: Tensor) -> Tensor:
    """``x ← relu(x)²`` in place (``x`` contiguous); returns ``x``."""
    if not x.is_contiguous():
        raise ValueError("relu2_ needs a contiguous tensor")
    N = x.numel()
    if N:
        _relu2_kernel[(triton.cdiv(N, BLOCK),)](x, N, BLOCK=BLOCK, num_warps=8)
    return x
