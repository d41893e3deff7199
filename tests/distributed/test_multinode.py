"""Multi-node launch on one machine: two ``torchrun`` invocations (two "nodes", one process
each) meet at a c10d rendezvous on loopback and run one tensor-parallel engine over gloo (its
greedy tokens are one process's), or serve as two data-parallel replicas behind one API."""

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


@pytest.mark.slow
def test_data_parallel_serve_across_two_torchrun_nodes(one_thread):
    """``torchrun -m replayssm serve --data-parallel-size 2`` on two "nodes": rank 0 serves the
    API with replica 0, rank 1 is replica 1 over a TCP connection; both serve, greedy output
    is one engine's, and a SIGTERM to rank 0 drains and stops every process."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from torchrun_generate import PROMPTS

    from replayssm import LLM, SamplingParams

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"replayssm-dp-{port}",
           "-m", "replayssm", "serve", str(MODEL), "--port", "0", "--data-parallel-size", "2", "--torch-threads", "1",
           "--max-seq-len", "128", "--log-stats-interval", "0"]
    nodes = [subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    logs: list = [[], []]
    url = threading.Event()
    found: dict = {}

    def read(k):
        for line in nodes[k].stdout:
            logs[k].append(line)
            if "listening on " in line:
                found["url"] = line.split("listening on ", 1)[1].split()[0]
                url.set()

    for k in range(2):
        threading.Thread(target=read, args=(k,), daemon=True).start()
    try:
        assert url.wait(180), "".join(logs[0] + logs[1])[-3000:]
        c = openai.OpenAI(base_url=found["url"] + "/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = list(ex.map(lambda p: c.completions.create(
                model="tiny-mamba2", prompt=p, max_tokens=N_NEW, temperature=0,
                extra_body={"return_token_ids": True}).choices[0].token_ids, PROMPTS))
        with LLM(str(MODEL), max_seq_len=128, device="cpu") as llm:
            assert got == [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))]
        h = httpx.get(found["url"] + "/health", timeout=10).json()
        assert h["status"] == "ok" and [r["state"] for r in h["replicas"]] == ["up", "up"]
        assert all(r["steps"] > 0 for r in h["replicas"])   # both replicas served
        api = next(k for k in range(2) if any("listening on" in line for line in logs[k]))
        # the API process is the torchrun agent's child that printed the address
        with open(f"/proc/{nodes[api].pid}/task/{nodes[api].pid}/children") as f:
            (rank0,) = [int(x) for x in f.read().split()]
        os.kill(rank0, signal.SIGTERM)
        t0 = time.monotonic()
        for p in nodes:
            p.wait(60)
        assert time.monotonic() - t0 < 60
        assert [p.returncode for p in nodes] == [0, 0], "".join(logs[0] + logs[1])[-3000:]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
