"""Hub ids (``org/name``) for LLM / load_model / generate: resolved through a fake
``snapshot_download`` (never the network); offline, a clear error that says it is a hub id."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import huggingface_hub

from replayssm.engine import cli
from replayssm.models import HubError, is_hub_id, load_model, resolve_model_dir

TINY = cli.DEFAULT_MODEL
needs_tiny = pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="shipped model not present")


@pytest.fixture
def fake_hub(monkeypatch):
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, tuple(allow_patterns or ())))
        return str(TINY)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_hub_id_shape():
    assert is_hub_id("org/name") and is_hub_id("state-spaces/mamba2-130m")
    for s in ("name", "/abs/path", "./org/name", "a/b/c", "org/..", "../x", "", None):
        assert not is_hub_id(s)


@needs_tiny
def test_hub_id_resolves_through_snapshot_download(fake_hub):
    assert resolve_model_dir("org/tiny", revision="v1") == str(TINY)
    repo, rev, patterns = fake_hub[0]
    assert (repo, rev) == ("org/tiny", "v1")
    assert "*.safetensors" in patterns and "*.json" in patterns and "*.bin" not in patterns
    model = load_model("org/tiny")
    assert model.config.vocab_size > 0

    from replayssm import LLM, SamplingParams

    llm = LLM("org/tiny", revision="main", max_num_seqs=1, max_seq_len=64)
    assert fake_hub[-1][:2] == ("org/tiny", "main") and llm.tokenizer is not None
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


@needs_tiny
def test_a_local_path_always_wins(fake_hub, tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    os.symlink(TINY, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/tiny") == "org/tiny" and resolve_model_dir(str(TINY)) == str(TINY)
    assert load_model("org/tiny").config.vocab_size > 0
    assert fake_hub == []   # never asked the hub


def test_missing_paths_and_hub_failures_are_named(monkeypatch, tmp_path):
    from replayssm import LLM

    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model directory not found"):
        LLM(str(tmp_path / "nope"))

    def failing(kind):
        def snapshot_download(repo_id, **kw):
            raise type(kind, (Exception,), {})("boom")
        return snapshot_download

    for kind, why in (("RepositoryNotFoundError", "no such repository on the Hub"),
                      ("RevisionNotFoundError", "revision 'v9' not found"),
                      ("GatedRepoError", "gated"),
                      ("SomethingElse", "SomethingElse: boom")):
        monkeypatch.setattr(huggingface_hub, "snapshot_download", failing(kind))
        with pytest.raises(HubError, match=rf"'org/x' is not a local directory, so it was taken as a Hugging Face "
                                           rf"Hub id, and it could not be fetched at revision 'v9': .*{why}"):
            LLM("org/x", revision="v9")


def test_offline_hub_id_is_a_clear_error(tmp_path):
    """HF_HUB_OFFLINE=1 and an empty cache: LLM and generate say it is a hub id that could not
    be fetched and why — never "model directory not found"."""
    code = (
        "from replayssm import LLM\n"
        "from replayssm.engine import cli\n"
        "try:\n"
        "    LLM('no-such-org/no-such-model')\n"
        "except ValueError as e:\n"
        "    print('LLM:', e)\n"
        "print('rc', cli.main(['hi', '--model', 'no-such-org/no-such-model']))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert "rc 2" in text, text
    for line in ("LLM:", "replayssm generate: error:"):
        msg = next(ln for ln in text.splitlines() if ln.startswith(line))
        assert "taken as a Hugging Face Hub id" in msg and "HF_HUB_OFFLINE=1" in msg, msg
        assert "model directory not found" not in msg
