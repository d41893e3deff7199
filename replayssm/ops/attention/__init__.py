"""Softmax attention over a paged KV cache: reference ops (:mod:`.naive`); the Triton kernels
with the same signatures are in :mod:`replayssm.kernels.attention`."""
