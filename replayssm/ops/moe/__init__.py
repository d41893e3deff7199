"""Mixture-of-experts expert compute: the reference op (:mod:`.naive`); the fused Triton form
with the same signature is :mod:`replayssm.kernels.moe`."""
