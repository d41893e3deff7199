"""ShardedCache forwards exactly the model-cache protocol: every change runs on every rank
with plain host arguments, reads and attributes come from rank 0's shard (no processes)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from replayssm.cache.spec import CacheSpec
from replayssm.distributed.model import ShardedCache
from replayssm.models.cache import ModelCache
from replayssm.models.protocols import ModelCacheLike, changes, reads


class _Group:
    """Records what would be sent to the workers, runs rank 0's share."""

    def __init__(self):
        self.sent = []

    def call(self, target, method, local, args=(), kwargs=None, result=None):
        self.sent.append((method, args, kwargs or {}))
        return local(*args, **(kwargs or {}))

    def release(self, handle):
        pass


class _Local:
    """Stands for rank 0's ModelCache: records the changes it runs."""

    spec = CacheSpec(mode="auto")

    def __init__(self):
        self.ran = []

    def mode_of(self, slot):
        return "kv"

    def ssm_form(self):
        return "kv"

    def nbytes(self):
        return 7

    def tensors(self):
        return []

    def __getattr__(self, name):
        if name in changes(ModelCacheLike):
            return lambda *a, **k: self.ran.append((name, a, k)) or name
        raise AttributeError(name)


def test_model_cache_implements_the_protocol():
    for name in changes(ModelCacheLike) | reads(ModelCacheLike):
        want = list(inspect.signature(getattr(ModelCacheLike, name)).parameters)
        assert list(inspect.signature(getattr(ModelCache, name)).parameters) == want, name
    assert {"reserve", "release", "switch_to_state", "fork", "load_prefixes"} <= changes(ModelCacheLike)
    assert reads(ModelCacheLike) == {"mode_of", "ssm_form", "nbytes"}


def test_changes_run_on_every_rank_with_plain_arguments():
    group, local = _Group(), _Local()
    cache = ShardedCache(group, 3, local)
    assert cache.reserve(torch.tensor(2), np.int64(9), defer=True) == "reserve"
    cache.release(torch.tensor([1, 2]))
    cache.load_prefixes([(1, 5, (1, 2), [], None)])
    cache.prefix_checkpoints([{"row": np.int32(1), "chain": torch.tensor([4, 5]), "base": None}])
    want = [("reserve", (2, 9), {"defer": True}), ("release", ([1, 2],), {}),
            ("load_prefixes", ([(1, 5, (1, 2), [], None)],), {}),
            ("prefix_checkpoints", ([{"row": 1, "chain": [4, 5], "base": None}],), {})]
    assert group.sent == want and local.ran == want
    assert type(group.sent[0][1][1]) is int
    for name in changes(ModelCacheLike):   # every change is forwarded
        assert getattr(ShardedCache, name).__wrapped__ is getattr(ModelCacheLike, name)


def test_reads_and_attributes_stay_on_rank_0():
    group, local = _Group(), _Local()
    cache = ShardedCache(group, 3, local)
    assert cache.mode_of(1) == "kv" and cache.ssm_form() == "kv" and cache.nbytes() == 7
    assert cache.spec.mode == "auto"
    assert group.sent == []
    with pytest.raises(AttributeError, match="not forwarded"):
        cache.tensors()
