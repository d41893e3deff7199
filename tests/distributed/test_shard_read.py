"""A rank's slice of one checkpoint tensor: ranges assembled in place, padding zeroed."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from replayssm.distributed.loading import _read


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    fn = tmp_path_factory.mktemp("shard") / "w.safetensors"
    save_file({"a": torch.randn(7, 5, generator=g, dtype=torch.float64),
               "b": torch.randn(3, 11, generator=g).to(torch.bfloat16)}, str(fn))
    with safe_open(str(fn), framework="pt", device="cpu") as f:
        yield f


@pytest.mark.parametrize("key,dim,ranges,pad_to", [
    ("a", 0, [(1, 4)], None),                   # one range: the slice itself
    ("a", 0, [(0, 2), (3, 4), (6, 7)], None),   # packed segments, rows
    ("a", 0, [(5, 7)], 3),                      # a padded vocabulary shard
    ("a", 1, [(0, 1), (2, 5)], 6),              # columns, several ranges and padding
    ("b", 1, [(1, 4), (7, 11)], None),
    ("b", 1, [(10, 11)], None),
])
def test_ranges_match_concatenation(handle, key, dim, ranges, pad_to):
    full = handle.get_tensor(key).clone()
    want = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
    if pad_to is not None and pad_to > want.shape[dim]:
        shape = list(want.shape)
        shape[dim] = pad_to - want.shape[dim]
        want = torch.cat([want, torch.zeros(shape, dtype=want.dtype)], dim)
    got = _read(handle, key, dim, ranges, torch.device("cpu"), pad_to)
    assert got.dtype == full.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(handle.get_tensor(key), full)              # the file's tensor is untouched
