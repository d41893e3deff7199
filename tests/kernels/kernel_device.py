"""Where the kernel tests run: on CPU through the Triton interpreter (``TRITON_INTERPRET=1``,
set by ``conftest.py`` when no GPU is present), else on the GPU with the compiled kernels."""

from __future__ import annotations

import pytest
import torch


def kernel_device() -> str:
    """``"cpu"`` (interpreter) or ``"cuda"``; skips the calling test module when neither works."""
    from replayssm.kernels import _triton

    if _triton.interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("neither the Triton interpreter nor a GPU is available", allow_module_level=True)
