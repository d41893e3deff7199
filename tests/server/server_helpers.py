"""Helpers of the server tests: a `replayssm serve` subprocess and the test constants."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "replayssm" / "assets"
MODEL = ASSETS / "tiny-mamba2"
DRAFT = ASSETS / "tiny-mamba2-draft"
API_KEY = "test-key"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


class Server:
    """A `replayssm serve` subprocess; :attr:`url` once it listens."""

    def __init__(self, model: Path, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "replayssm", "serve", str(model), "--port", "0", "--torch-threads", "1", *args]
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.url = None
        self.log: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if "listening on " in line and self.url is None:
                self.url = line.split("listening on ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    def wait(self, timeout: float = 120.0) -> "Server":
        import httpx

        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-40:]))
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server never became healthy:\n" + "".join(self.log[-40:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def metrics(self) -> dict:
        """``{metric name: value}`` of the unlabelled-by-reason gauges and counters."""
        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, val = line.rpartition(" ")
            out[name.split("{")[0] if "finished_reason" not in name else name] = float(val)
        return out


def wait_idle(server, timeout: float = 10.0) -> dict:
    """Metrics once nothing runs or waits (slots all free)."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m["replayssm:num_requests_running"] == 0 and m["replayssm:num_requests_in_flight"] == 0
                and m["replayssm:free_slots"] == m["replayssm:total_slots"]):
            return m
        if time.time() > deadline:
            raise AssertionError(f"server not idle: {m}")
        time.sleep(0.05)


def open_stream(server, max_tokens: int = 1500):
    """A long streaming request (raw HTTP), its headers received: it is queued or running;
    returns ``(client, context manager, response)``."""
    import httpx

    cl = httpx.Client(timeout=60)
    cm = cl.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                         "stream": True})
    resp = cm.__enter__()
    assert resp.status_code == 200
    return cl, cm, resp
