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


# ---------------------------------------------------------------------------------------
# load_shard: the read beside the collective setup (one rank, no process group)
# ---------------------------------------------------------------------------------------
def _tiny_copy(tmp_path):
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "replayssm" / "assets" / "tiny-mamba2"
    dst = tmp_path / "tiny"
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def _setup_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "replayssm-tp-setup"]


def test_load_shard_installs_every_tensor_beside_its_setup(tmp_path):
    from replayssm.distributed.loading import load_shard
    from replayssm.distributed.startup import StartupTimes
    from replayssm.models import load_model

    path = _tiny_copy(tmp_path)
    times = StartupTimes()
    got = load_shard(str(path), 0, 1, "cpu", "float64", times=times)
    want = load_model(str(path), device="cpu", dtype=torch.float64)
    gp, wp = dict(got.named_parameters()), dict(want.named_parameters())
    assert set(gp) == set(wp) and all(torch.equal(gp[k], wp[k]) for k in wp)
    assert all(p.device.type == "cpu" for p in gp.values())          # nothing left on the meta device
    assert {"load.skeleton", "load.read", "load.setup", "load.setup_wait"} <= set(times.times)
    assert not _setup_threads()


def test_load_shard_errors_join_the_setup_first(tmp_path, monkeypatch):
    from replayssm.distributed import loading
    from replayssm.models.loader import WeightError

    path = _tiny_copy(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 64])   # truncated: a read fails mid-load
    with pytest.raises(WeightError):
        loading.load_shard(str(path), 0, 1, "cpu", "float64")
    assert not _setup_threads()
    (path / "model.safetensors").write_bytes(data)

    def broken(*a, **k):
        raise RuntimeError("setup failed on this rank")

    monkeypatch.setattr(loading, "_real_skeleton", broken)
    with pytest.raises(RuntimeError, match="setup failed"):
        loading.load_shard(str(path), 0, 1, "cpu", "float64")
    assert not _setup_threads()
