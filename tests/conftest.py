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


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, restored afterwards: the reference ops on tiny models
    are dispatch-bound, and on a loaded machine more threads only add contention (tiny
    matmuls and grouped conv1d ran up to ~1000x slower with two)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
