import pytest

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
def _one_thread(one_thread):
    """One intra-op thread (the tiny models; ``tests/conftest.py``)."""
