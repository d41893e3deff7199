"""Real `replayssm serve` processes on 127.0.0.1 (ephemeral ports) for the server tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")

from server_helpers import API_KEY, CHAT_TEMPLATE, DRAFT, MODEL, Server  # noqa: E402


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """The shipped model with a simple chat template (the shipped one has none)."""
    d = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="session")
def _servers(chat_model_dir):
    """Both servers start together (their start-up overlaps); each is waited for on use."""
    plain = Server(chat_model_dir, "--api-key", API_KEY, "--max-num-seqs", "2", "--max-queue", "1",
                   "--served-model-name", "tiny-chat", "--enable-prefix-caching", "--enable-log-requests",
                   "--max-model-len", "2048",
                   "--log-stats-interval", "0.5")
    spec = Server(MODEL, "--speculative", "draft", "--draft-model", str(DRAFT), "--num-tokens", "3",
                  "--max-num-seqs", "16", "--max-queue", "256", "--max-seq-len", "512", "--warm-up", "on",
                  "--log-level", "warning")
    drain = Server(MODEL, "--max-num-seqs", "4", "--shutdown-timeout", "3", "--max-seq-len", "4096")
    yield {"plain": plain, "spec": spec, "drain": drain}
    plain.stop()
    spec.stop()
    drain.stop()


@pytest.fixture(scope="session")
def plain_server(_servers) -> Server:
    """No speculation, API key, 2 slots + 1 queued sequence, a chat template, prefix caching
    (its greedy output is still the offline engine's without caching)."""
    return _servers["plain"].wait()


@pytest.fixture(scope="session")
def spec_server(_servers) -> Server:
    """Draft-model speculation, 16 slots, the shipped model (no chat template), context 512,
    warmed up before listening (as on a GPU), log level warning."""
    return _servers["spec"].wait()


@pytest.fixture(scope="session")
def drain_server(_servers) -> Server:
    """4 slots, context 4096, --shutdown-timeout 3: the graceful-shutdown test stops it."""
    return _servers["drain"].wait()


@pytest.fixture(scope="session")
def offline():
    """The same model offline (greedy outputs are the reference)."""
    import torch

    from replayssm import LLM

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(MODEL), max_seq_len=512, max_num_seqs=16)
    torch.set_num_threads(n)


@pytest.fixture
def serve_logging():
    """``serve``'s main sets up the ``replayssm`` logger (its own handler, no propagation):
    put it back, so later tests' ``caplog`` still sees the records."""
    import logging

    lg = logging.getLogger("replayssm")
    saved = (list(lg.handlers), lg.level, lg.propagate)
    yield
    lg.handlers[:] = saved[0]
    lg.setLevel(saved[1])
    lg.propagate = saved[2]
