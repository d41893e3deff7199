"""Kernel tests run the Triton kernels on CPU through the interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before triton decorates the kernels (module import).
"""

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False

if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
