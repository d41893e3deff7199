"""Run one benchmark configuration in a fresh process and get its result back.

A tensor-parallel group whose teardown blocked (NCCL with symmetric-memory buffers) is
given up by ``close()``, and ``torch.distributed`` then stays initialised in that process:
no second group can start there.  A script that measures several TP configurations runs
each one through :func:`run_isolated`: a ``spawn`` child runs ``fn(*args)``, sends the
result back over a pipe as soon as it has it, and ends with ``os._exit`` — a teardown
still blocked in the child cannot hold it up, nor the parent.

``fn`` must be importable by name (a module-level function; a script's functions are, as
``spawn`` re-imports the script as ``__mp_main__``) and its result picklable.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

__all__ = ["run_isolated"]


def _child(fn, args, env, conn) -> None:  # pragma: no cover - runs in the spawned process
    os.environ.update(env)
    try:
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))
        conn.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_isolated(fn, *args, env: dict | None = None, timeout_s: float = 600.0):
    """``fn(*args)`` in a fresh ``spawn`` process with ``env`` added to its environment
    (before ``fn`` runs; children it spawns inherit it).  Returns ``fn``'s result, or
    ``{"error": ...}`` (its traceback; or that it died, or ran past ``timeout_s`` and was
    killed).  The child's stdout and stderr are this process's."""
    import multiprocessing as mp

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    env = {str(k): str(v) for k, v in (env or {}).items()}
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(fn, args, env, send), daemon=False, name="replayssm-isolated")
    p.start()
    send.close()
    t_end = time.monotonic() + timeout_s
    got = None
    try:
        while got is None:
            left = t_end - time.monotonic()
            if left <= 0:
                got = ("error", f"timed out after {timeout_s:.0f} s")
            elif recv.poll(min(left, 0.5)):
                try:
                    got = recv.recv()
                except EOFError:
                    got = ("error", f"the child exited with code {p.exitcode} before sending a result")
            elif not p.is_alive() and not recv.poll(0):
                got = ("error", f"the child exited with code {p.exitcode} before sending a result")
    finally:
        p.join(10.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
        recv.close()
    status, value = got
    return value if status == "ok" else {"error": value}
