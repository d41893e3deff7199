import pytest
import torch

from recompute_model import tiny_pair


@pytest.fixture(scope="session")
def pair():
    return tiny_pair(vocab_size=32)


@pytest.fixture(scope="session")
def target(pair):
    return pair[0]


@pytest.fixture(scope="session")
def draft(pair):
    return pair[1]




@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models are dispatch-bound: intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
