"""Random-weight benchmark models: built under the caller's folder, or once per key in the
folder ``$REPLAYSSM_RANDOM_MODEL_CACHE`` names; private copies may be written."""

from __future__ import annotations

import json
import os

from replayssm.bench import common
from replayssm.bench.e2e import _random_model_dir


def test_without_a_cache_each_call_builds_under_root(tmp_path, monkeypatch):
    monkeypatch.delenv(common.RANDOM_MODEL_CACHE, raising=False)
    builds = []
    d = common.random_model_dir(tmp_path, "m", {"seed": 0}, lambda p: builds.append(p) or (p / "w").write_text("1"))
    assert d == str(tmp_path / "m") and (tmp_path / "m" / "w").read_text() == "1" and len(builds) == 1


def test_the_cache_builds_once_per_key(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(common.RANDOM_MODEL_CACHE, str(cache))
    builds = []

    def build(p):
        builds.append(p)
        (p / "config.json").write_text(json.dumps({"n": len(builds)}))

    a = common.random_model_dir(tmp_path / "r1", "m", {"seed": 0}, build)
    b = common.random_model_dir(tmp_path / "r2", "m", {"seed": 0}, build)
    c = common.random_model_dir(tmp_path / "r1", "m", {"seed": 1}, build)
    assert a == b != c and len(builds) == 2
    assert os.path.dirname(a) == str(cache) and not (tmp_path / "r1").exists()
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(a), os.path.basename(c)])   # no temporaries left


def test_e2e_presets_reuse_the_cache_and_private_copies_leave_it_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(common.RANDOM_MODEL_CACHE, str(tmp_path / "cache"))
    a = _random_model_dir("tiny", str(tmp_path / "x"))
    mtime = os.path.getmtime(os.path.join(a, "model.safetensors"))
    assert _random_model_dir("tiny", str(tmp_path / "y")) == a
    assert _random_model_dir("tiny", str(tmp_path / "y"), seed=1) != a
    own = common.private_copy(a, tmp_path / "own")
    (own / "config.json").write_text("{}")
    assert json.loads(open(os.path.join(a, "config.json")).read())["model_type"] == "mamba2"
    assert os.path.getmtime(os.path.join(a, "model.safetensors")) == mtime
