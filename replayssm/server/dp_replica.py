"""One data-parallel engine replica: a process that runs an engine and streams step deltas.

The API process (:mod:`replayssm.server.dp`) starts one such process per replica with
``multiprocessing``'s spawn context and talks to it over a duplex pipe.  The replica
builds its engine from the ``serve`` flags (``--tensor-parallel-size`` included: replica
``i`` puts its ranks on ``cuda:i*tp .. i*tp+tp-1``), says ``ready`` and then loops: read the
commands that arrived (``add``, ``abort``, ``stop``), run one engine step, send one message
with every request's *new* tokens of that step (never the cumulative lists: per-step cost
is proportional to the tokens produced, whatever the lengths).

Messages to the API process::

    ("ready", info)                      info: pid, device, num_slots, token_limit, vocab_size, summary
    ("step", seconds, entries, admitted, occupancy, preemptions)
        entries:  (request_id, index, new token ids, text start, text piece, new logprobs,
                   finish_reason, error, finish extras or None)  -- text = old[:start] + piece
        admitted: (request_id, seconds it waited in the engine's queue)
    ("idle", occupancy, preemptions)     nothing left to run after the commands (e.g. aborts)
    ("refused", request_id, message)     add_request raised (the request never ran)
    ("failed", message)                  a step raised; the engine recovered, its requests ended
    ("fatal", message)                   the engine cannot go on (e.g. a tensor-parallel worker
                                         died); the process exits 1 right after
    ("start_failed", message)            the engine could not be built; the process exits 1

A replica ignores SIGINT and SIGTERM (a Ctrl-C in the terminal, or a service manager,
signals every process of the group: the API process drains and then stops the replicas)
and exits when its pipe closes (the API process is gone).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

from .engine_loop import fatal_error

__all__ = ["ReplicaOutput", "ReplicaSpec", "StepAssembler", "StepDeltas", "replica_device", "replica_main"]


@dataclass
class ReplicaSpec:
    """What replica ``index`` runs: the model directory and the ``serve`` flags (an
    ``argparse.Namespace``, its ``device`` already set to the replica's), and whether to warm up."""

    index: int
    model_dir: str
    args: object
    warm_up: bool = False
    log_level: str = "info"


def replica_device(index: int, tensor_parallel_size: int, device: str | None, cuda: bool,
                   single: bool = False) -> str:
    """The first device of replica ``index``: ``cuda:index*tp`` (its tensor-parallel ranks
    take the next ``tp - 1``) on CUDA, ``cpu`` otherwise.  ``device``: the ``--device`` flag;
    ``single`` (one engine process, no data parallelism): a ``cuda:K`` it names is kept."""
    if index < 0 or tensor_parallel_size < 1:
        raise ValueError(f"replica index must be >= 0 and tensor_parallel_size >= 1, got {index}, "
                         f"{tensor_parallel_size}")
    kind = (device or ("cuda" if cuda else "cpu")).split(":")[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ValueError(f"data parallelism runs replicas on cpu or cuda, got --device {device!r}")
    if device is not None and ":" in device:
        if single:
            return device
        raise ValueError(f"--device {device!r} names one GPU; with --data-parallel-size give --device cuda "
                         f"(replica i uses cuda:i*tp .. i*tp+tp-1)")
    return f"cuda:{index * tensor_parallel_size}"


class StepDeltas:
    """The replica side of the wire format: what each request got since its last message."""

    def __init__(self):
        self._sent: dict = {}   # (request_id, index) -> [tokens sent, text sent, logprobs sent]

    def entry(self, out) -> tuple:
        k = (out.request_id, out.index)
        n_tok, text, n_lp = self._sent.get(k, (0, "", 0))
        new_ids = out.token_ids[n_tok:]
        start = len(text) if out.text.startswith(text) else 0
        piece = out.text[start:]
        lps = None
        if out.logprobs is not None:
            lps = out.logprobs[n_lp:]
            n_lp = len(out.logprobs)
        extra = None
        if out.finish_reason is not None:
            self._sent.pop(k, None)
            extra = (list(out.accepted_lengths), out.num_verify_steps, out.num_drafted, out.num_accepted)
        else:
            self._sent[k] = (len(out.token_ids), out.text, n_lp)
        return (out.request_id, out.index, list(new_ids), start, piece, lps, out.finish_reason, out.error, extra)

    def forget(self, request_id) -> None:
        for k in [k for k in self._sent if k[0] == request_id]:
            del self._sent[k]

    def clear(self) -> None:
        self._sent.clear()


@dataclass
class ReplicaOutput:
    """A request's cumulative output rebuilt from a replica's step deltas (the fields the
    server reads of a :class:`~replayssm.engine.outputs.RequestOutput`)."""

    request_id: object
    index: int
    prompt_token_ids: list
    token_ids: list
    text: str
    logprobs: list | None
    finish_reason: str | None
    error: str | None = None
    accepted_lengths: list = field(default_factory=list)
    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0


class StepAssembler:
    """The API side of the wire format: cumulative outputs from :class:`StepDeltas` entries
    (a fresh object per step: an earlier output handed to a stream never changes)."""

    def __init__(self):
        self._so_far: dict = {}   # (request_id, index) -> (token ids, text, logprobs)

    def add(self, e, prompt_ids) -> ReplicaOutput:
        rid, idx, new_ids, start, piece, lps, reason, error, extra = e
        k = (rid, idx)
        ids, text, lp = self._so_far.get(k, ((), "", None))
        ids = list(ids) + list(new_ids)
        text = text[:start] + piece
        if lps is not None:
            lp = list(lp or ()) + list(lps)
        out = ReplicaOutput(rid, idx, prompt_ids, ids, text, lp, reason, error)
        if reason is None:
            self._so_far[k] = (ids, text, lp)
        else:
            self._so_far.pop(k, None)
            if extra is not None:
                out.accepted_lengths, out.num_verify_steps, out.num_drafted, out.num_accepted = extra
        return out

    def forget(self, request_id, samples: int) -> None:
        for i in range(samples):
            self._so_far.pop((request_id, i), None)

    def clear(self) -> None:
        self._so_far.clear()

    def __len__(self) -> int:
        return len(self._so_far)


def _preemptions(engine) -> int:
    return int((getattr(engine, "stats", None) or {}).get("preemptions", 0))


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def replica_main(spec: ReplicaSpec, conn) -> None:
    """The replica process: build the engine, then serve the pipe ``conn`` until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the API process drains, then stops the replicas
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)      # under torchrun: a replica's TP group is its own
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s replica {spec.index}: %(message)s")
    log = logging.getLogger("replayssm.server.replica")
    try:
        import torch

        from .engine_args import build_engine, startup_summary

        dev = spec.args.device
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        engine = build_engine(spec.model_dir, spec.args)
        warm = engine.warm_up() if spec.warm_up else None
        info = {"pid": os.getpid(), "device": str(engine.device), "num_slots": int(engine.num_slots),
                "token_limit": int(engine.scheduler.token_limit), "vocab_size": int(engine.vocab_size),
                "summary": startup_summary(engine, os.path.basename(os.path.normpath(spec.model_dir)),
                                           spec.model_dir, warm)}
    except BaseException as e:
        try:
            conn.send(("start_failed", _describe(e)))
        except OSError:
            pass
        log.error("could not start: %s", _describe(e))
        raise SystemExit(1)
    conn.send(("ready", info))
    code = _serve(engine, conn, log)
    try:
        engine.close()
    except Exception:  # pragma: no cover - best effort after a failure
        pass
    raise SystemExit(code)


def _serve(engine, conn, log) -> int:
    """The replica's loop; returns the exit status (0: stopped or orphaned, 1: fatal)."""
    deltas = StepDeltas()
    live: dict = {}   # request id -> [its Sequence, time added, admitted yet]
    while True:
        busy = engine.has_unfinished()
        try:
            if conn.poll(0 if busy else None):
                while True:
                    cmd = conn.recv()
                    if cmd[0] == "add":
                        _, rid, ids, params = cmd
                        try:
                            live[rid] = [engine.add_request(ids, params, request_id=rid), time.perf_counter(), False]
                        except Exception as e:
                            conn.send(("refused", rid, f"{type(e).__name__}: {e}"))
                    elif cmd[0] == "abort":
                        engine.abort(cmd[1])
                        deltas.forget(cmd[1])
                        live.pop(cmd[1], None)
                    elif cmd[0] == "stop":
                        return 0
                    if not conn.poll(0):
                        break
        except (EOFError, OSError):   # the API process is gone
            return 0
        if not engine.has_unfinished():
            try:   # idle now (aborts): the occupancy the API process shows must say so
                conn.send(("idle", engine.occupancy(), _preemptions(engine)))
            except OSError:
                return 0
            continue
        t0 = time.perf_counter()
        try:
            outs = engine.step()
        except Exception as e:
            msg = _describe(e)
            try:
                if fatal_error(e):
                    raise
                engine.recover()
                for rid in live:
                    engine.abort(rid)
            except Exception:
                log.error("engine failed, replica exits: %s", msg)
                try:
                    conn.send(("fatal", msg))
                except OSError:
                    pass
                return 1
            log.error("engine step failed; its requests end with the error: %s", msg)
            deltas.clear()
            live.clear()
            conn.send(("failed", msg))
            continue
        dt = time.perf_counter() - t0
        admitted = []
        for rid, rec in list(live.items()):
            seq = rec[0]
            if not rec[2] and seq.status.name != "WAITING":
                rec[2] = True
                if seq.status.name != "REJECTED":
                    admitted.append((rid, max(t0 - rec[1], 0.0)))
            if all(m.is_finished for m in seq.group):
                del live[rid]
        entries = [deltas.entry(o) for o in outs]
        try:
            conn.send(("step", dt, entries, admitted, engine.occupancy(), _preemptions(engine)))
        except OSError:
            return 0
