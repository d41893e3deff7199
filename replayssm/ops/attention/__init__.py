"""Softmax attention over a paged KV cache: reference ops (:mod:`.naive`, with the absorbed MLA
op of :mod:`.mla`); the Triton kernels with the same signatures are in
:mod:`replayssm.kernels.attention` and :mod:`replayssm.kernels.mla`."""

from . import naive  # noqa: F401  (first: it imports .mla, which uses its helpers)
