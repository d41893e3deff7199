"""Multi-node launch on one machine: two ``torchrun`` invocations (two "nodes", one process
each) meet at a c10d rendezvous on loopback and run one tensor-parallel engine over gloo;
its greedy tokens are one process's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.run")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "replayssm" / "assets" / "tiny-mamba2"
SCRIPT = Path(__file__).with_name("torchrun_generate.py")
N_NEW = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_on_loopback_match_one_process(one_thread):
    from torchrun_generate import PROMPTS

    from replayssm import LLM, SamplingParams

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"replayssm-{port}",
           str(SCRIPT), str(MODEL), str(N_NEW)]
    nodes = [subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    try:
        for p in nodes:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    rows = [json.loads(line) for o in outs for line in o.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["rank"] == 0 and rows[0]["world"] == 2   # rank 0 only, on one node
    with LLM(str(MODEL), max_seq_len=128, device="cpu") as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))]
    assert rows[0]["tokens"] == want
