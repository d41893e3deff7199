"""FP8 (e4m3) weight quantization: the float64-capable reference ops (:mod:`.naive`); the
Triton GEMM with the same ``linear`` signature is :mod:`replayssm.kernels.fp8_gemm`."""
