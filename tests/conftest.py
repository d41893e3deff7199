"""Without a GPU, Triton kernels run on CPU tensors through the interpreter (kernel tests).

``TRITON_INTERPRET`` must be set before triton decorates the kernels (module import), and
any test module may import the models (hence the kernels) first: it is set here, for all.
"""

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False

if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
