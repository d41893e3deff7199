"""Softmax attention over a paged KV cache: reference ops (:mod:`.naive`, with the absorbed MLA
op of :mod:`.mla`); the Triton kernels with the same signatures are in
:mod:`replayssm.kernels.attention` and :mod:`replayssm.kernels.mla`."""
