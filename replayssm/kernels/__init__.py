"""Triton kernels with the same signatures as the naive ops (``replayssm.ops.*.naive``).

``kernels.mamba2`` / ``kernels.gdn`` hold the kernels and their wrappers; use
:mod:`replayssm.kernels.dispatch` to pick the kernel (CUDA tensors) or the naive op
(otherwise).  Importing this package does not import triton.
"""
