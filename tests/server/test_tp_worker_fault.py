"""``serve --tensor-parallel-size 2`` on CPU (gloo) whose worker is killed mid-stream: the
stream ends with an error naming the rank within seconds, new requests are refused, and the
server shuts down with status 1 (for a supervisor to restart it) -- never a hang."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
from server_helpers import MODEL, Server


def _workers(pid: int) -> list[int]:
    """Child processes of ``pid`` started by multiprocessing's spawn (not its resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(x) for x in f.read().split()]
    out = []
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(k)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads children from /proc")
def test_killed_tp_worker_ends_the_stream_with_an_error_and_the_server_exits():
    server = Server(MODEL, "--tensor-parallel-size", "2", "--max-seq-len", "512", "--log-stats-interval", "0")
    try:
        server.wait(180)
        (worker,) = _workers(server.proc.pid)
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = iter(c.completions.create(model="tiny-mamba2", prompt=[1, 2, 3, 4], max_tokens=400, temperature=0,
                                           stream=True))
        for _ in range(3):
            next(stream)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match=r"engine failed: .*WorkerFailed: rank 1 \(pid \d+\) exited with "
                                                  r"code -9"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        try:   # refused while it shuts down (or already gone)
            c.completions.create(model="tiny-mamba2", prompt=[1, 2], max_tokens=2)
            raise AssertionError("a request was accepted after the engine failed")
        except openai.APIStatusError as e:
            assert e.status_code == 503 and "engine failed" in str(e)
        except openai.APIConnectionError:
            pass
        assert server.proc.wait(30) == 1
        assert "replayssm serve: error: engine failed: " in "".join(server.log)
    finally:
        server.stop()
