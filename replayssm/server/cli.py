"""``replayssm serve MODEL_DIR``: the OpenAI-compatible server (uvicorn, loopback by default).

Every option of the ``LLM`` constructor is a flag (decode mode, buffer size, speculation,
dtype, device, context length, memory budget, ...); on CUDA, graphs and the warm-up are on
unless ``--enforce-eager`` / ``--warm-up off``.  ``--config FILE.yaml`` gives any flag from a
file (keys are flag names; the command line wins).  The server logs a one-line summary of
what it built, prints ``replayssm serve: listening on http://HOST:PORT`` once it accepts
connections (``--port 0`` picks a free port and prints it), logs throughput every
``--log-stats-interval`` seconds of traffic, and on SIGTERM / SIGINT stops admitting (503),
lets the requests in flight finish for up to ``--shutdown-timeout`` seconds, ends the rest
with ``finish_reason: "abort"`` and exits 0.

On CUDA the engine runs in a process of its own (``--engine-process``, the data-parallel
replica machinery with one replica); ``--engine-in-process`` keeps it on a thread of the API
process, as on CPU (docs/SERVING.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

import torch

from ..argtypes import port
from ..models import is_hub_id, resolve_model_dir

from .engine_args import add_engine_args, build_engine, speculative_from_args, startup_summary


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="replayssm serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (Hugging Face layout; may come from --config as 'model')")
    p.add_argument("--version", action="version", version=f"replayssm {__version__}")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="flags from a YAML file: {flag name ('-' or '_'): value}; command-line flags override it")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    from .reasoning import REASONING_PARSERS
    from .tools import TOOL_PARSERS

    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the format the model writes tool calls in (hermes/qwen3: <tool_call>{...}</tool_call>, "
                        "nemotron: <TOOLCALL>[...]</TOOLCALL>)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="with tool_choice 'auto', parse the model's tool calls out of its text (needs "
                        "--tool-call-parser)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> into reasoning_content (qwen3, deepseek_r1)")
    p.add_argument("--port", type=port, default=8000, help="port (0: any free port, printed at start)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the directory name)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="sequences that may wait beyond --max-num-seqs; more get 503 (default: 256)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template instead of the model's: a file, the name of one of the model's "
                        "templates, or inline jinja text (a missing file is an error at startup)")
    levels = ["critical", "error", "warning", "info", "debug"]
    p.add_argument("--log-level", default="info", choices=levels,
                   help="level of the server's own log (startup summary, stats, requests, slow steps)")
    p.add_argument("--uvicorn-log-level", default="warning", choices=levels,
                   help="level of uvicorn's log (info: one access line per HTTP request)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats lines (throughput, queue, cache), logged when there was traffic")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="an info line per request at arrival (sizes, sampling, a short prompt prefix) and finish")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, how long requests in flight may run on before they are aborted")
    p.add_argument("--warm-up", default="auto", choices=["auto", "on", "off"],
                   help="run every kind of step once before listening, so no request waits for a kernel "
                        "compile (auto: on for CUDA)")
    p.add_argument("--engine-process", default="auto", choices=["auto", "on", "off"],
                   help="run the engine in a process of its own, fed over a pipe by the API process (the "
                        "data-parallel replica machinery with one replica), so that HTTP, tokenizing and "
                        "streaming never hold the engine's GIL (auto: on for CUDA, off on CPU and under torchrun)")
    p.add_argument("--engine-in-process", dest="engine_process", action="store_const", const="off",
                   help="the engine on a thread of the API process (same as --engine-process off)")
    add_engine_args(p)
    return p


def config_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags of a ``--config`` YAML file as command-line words (put before the real ones,
    which then win).  Keys are flag names with '-' or '_' (``max-num-seqs``, ``max_num_seqs``);
    ``model`` is the model directory; unknown keys are refused by name."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config needs pyyaml: pip install pyyaml (in the serve extra)") from None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if cfg is None:
        return []
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {path} must be a mapping of flag names to values, got {type(cfg).__name__}")
    flags = {}
    for a in parser._actions:
        for o in a.option_strings:
            if o.startswith("--"):
                flags[o[2:]] = a
    out, unknown = [], []
    for key, value in cfg.items():
        name = str(key).replace("_", "-")
        if name == "model":
            out = [str(value)] + out if value is not None else out
            continue
        a = flags.get(name)
        if a is None or name in ("config", "help", "version"):
            unknown.append(str(key))
            continue
        if value is None:   # the default
            continue
        flag = "--" + name
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key!r} is a switch: give true or false, got {value!r}")
            if value == (not isinstance(a, argparse._StoreFalseAction)):
                out.append(flag)
            continue
        if isinstance(value, bool):   # YAML reads on/off/yes/no as booleans
            word = ("on" if value else "off") if a.choices and "on" in a.choices else str(value).lower()
            out += [flag, word]
        elif isinstance(value, (dict, list)):
            if a.dest != "speculative_config":
                raise ValueError(f"--config {path}: {key!r} takes one value, got {type(value).__name__}")
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {sorted(unknown)} (not flags of replayssm serve; "
                         f"see replayssm serve --help)")
    return out


def parse_args(argv: list[str] | None):
    """Command-line flags over ``--config``'s; exits 2 (argparse) on bad ones."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            from_file = config_argv(parser, known.config)
        except ValueError as e:
            parser.error(str(e))
        # a model positional only from the file when the command line names none
        file_model = from_file[:1] if from_file and not from_file[0].startswith("--") else []
        args = parser.parse_args(from_file[len(file_model):] + argv)
        if args.model is None and file_model:
            args.model = file_model[0]
    else:
        args = parser.parse_args(argv)
    if args.model is None:
        parser.error("the following arguments are required: model (or 'model' in --config)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)")
    for name in ("log_stats_interval", "shutdown_timeout"):
        v = getattr(args, name)
        if not v >= 0 or v == float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a finite number of seconds >= 0, got {v}")
    return args


def _setup_logging(level: str) -> logging.Logger:
    """The ``replayssm`` logger to stderr at ``level`` (uvicorn configures only its own)."""
    root = logging.getLogger("replayssm")
    root.setLevel(level.upper())
    if not any(getattr(h, "_replayssm_serve", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        h._replayssm_serve = True
        root.addHandler(h)
        root.propagate = False
    return logging.getLogger("replayssm.server")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = _setup_logging(args.log_level)
    if args.served_model_name is None and is_hub_id(args.model) and not os.path.exists(args.model):
        args.served_model_name = args.model   # the API names a Hub model by its id, as vLLM does
    try:   # a local directory, or a Hub id org/name (downloaded; a clear error offline)
        args.model = resolve_model_dir(args.model, args.revision)
    except (ValueError, FileNotFoundError) as e:
        print(f"replayssm serve: error: {e}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"replayssm serve: error: {args.model!r} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if args.max_queue < 0:
        print("replayssm serve: error: --max-queue must be >= 0", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from .app import ServerConfig, build_app  # fastapi (the serve extra): reported below if missing
    except ImportError as e:
        print(f"replayssm serve: error: {e}; install the serve extra: pip install 'replayssm[serve]'", file=sys.stderr)
        return 2
    from .chat import check_chat_template

    problem = check_chat_template(args.model, args.chat_template)   # before the model loads
    if problem:
        print(f"replayssm serve: error: {problem}", file=sys.stderr)
        return 2
    # the port first: a taken one is reported before the model loads and the caches fill memory
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        print(f"replayssm serve: error: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        own_process = engine_process(args)
    except ValueError as e:
        sock.close()
        print(f"replayssm serve: error: {e}", file=sys.stderr)
        return 2
    if args.data_parallel_size > 1 or own_process:
        return _serve_data_parallel(args, sock, family, log)
    try:
        engine = build_engine(args.model, args)
    except ValueError as e:
        sock.close()
        print(f"replayssm serve: error: {e}", file=sys.stderr)
        return 2
    warm = None
    if args.warm_up == "on" or (args.warm_up == "auto" and engine.device.type == "cuda"):
        warm = engine.warm_up()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    summary = startup_summary(engine, name, args.model, warm)
    if log.isEnabledFor(logging.INFO):
        log.info(summary)
    else:   # shown once whatever the level
        print(summary, file=sys.stderr, flush=True)
    stats_every = None if args.disable_log_stats or not args.log_stats_interval else args.log_stats_interval
    app = build_app(engine, ServerConfig(model_name=name, model_dir=args.model, api_key=args.api_key,
                                         max_queue=args.max_queue, chat_template=args.chat_template,
                                         log_requests=args.enable_log_requests, log_stats_interval=stats_every,
                                         tool_call_parser=args.tool_call_parser,
                                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                                         reasoning_parser=args.reasoning_parser))
    host, port = sock.getsockname()[:2]
    server = draining_server_class()(uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=3,
                                           access_log=args.uvicorn_log_level in ("info", "debug")),
                            app.state.engine_loop, args.shutdown_timeout)

    startup = server.startup

    async def announce(sockets=None):   # after the app started and the socket listens
        await startup(sockets=sockets)
        server.loop = asyncio.get_running_loop()
        url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
        print(f"replayssm serve: listening on {url} (model {name!r})", flush=True)

    server.startup = announce
    loop = app.state.engine_loop
    loop.on_failed = lambda: setattr(server, "should_exit", True)   # the engine is gone: exit, not hang
    server.run(sockets=[sock])
    if loop.failed is not None:
        print(f"replayssm serve: error: engine failed: {loop.failed}", file=sys.stderr, flush=True)
        return 1
    return 0


def engine_process(args) -> bool:
    """Whether the engine runs in a process of its own (``--engine-process``): ``auto`` is on
    when the device is CUDA, except under ``torchrun`` (multi-node tensor parallelism keeps
    rank 0's engine in the API process).  ``ValueError`` for contradicting flags."""
    from ..distributed import launched_by_torchrun

    mode = getattr(args, "engine_process", "auto")
    if mode == "off":
        if args.data_parallel_size > 1:
            raise ValueError(f"--engine-in-process runs one engine in the API process; --data-parallel-size "
                             f"{args.data_parallel_size} runs every replica in a process of its own")
        return False
    torchrun = launched_by_torchrun() and args.data_parallel_size == 1
    if mode == "on":
        if torchrun:
            raise ValueError("--engine-process on is not supported under torchrun with --data-parallel-size 1 "
                             "(tensor parallelism over hosts keeps rank 0's engine in the API process)")
        return True
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device.startswith("cuda") and not torchrun


def _server_config(args, name: str):
    from .app import ServerConfig

    stats_every = None if args.disable_log_stats or not args.log_stats_interval else args.log_stats_interval
    return ServerConfig(model_name=name, model_dir=args.model, api_key=args.api_key, max_queue=args.max_queue,
                        chat_template=args.chat_template, log_requests=args.enable_log_requests,
                        log_stats_interval=stats_every, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser)


def _serve_data_parallel(args, sock, family, log) -> int:
    """``--data-parallel-size N``: N replica processes (:mod:`replayssm.server.dp`) behind one
    app; N = 1 is the engine in a process of its own (``--engine-process``)."""
    import uvicorn

    from ..models.loader import load_tokenizer
    from .app import build_app
    from .dp import DataParallelConfig, DataParallelPool, ReplicaDied
    from .dp_router import RouterConfig

    from ..distributed import launched_by_torchrun

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    connected, local_rank = None, 0
    try:
        speculative_from_args(args)   # the flags' contradictions before any replica starts
        cfg = DataParallelConfig(args.data_parallel_size, max_restarts=args.data_parallel_max_restarts,
                                 step_timeout_s=args.data_parallel_step_timeout,
                                 router=RouterConfig(block_tokens=args.kv_block_size))
        warm = args.warm_up == "on" or (args.warm_up == "auto" and (args.device or (
            "cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"))
        if launched_by_torchrun():   # one torchrun rank per replica, maybe on several hosts
            from .dp_torchrun import meet, serve_rank

            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if world != cfg.size:
                raise ValueError(f"--data-parallel-size {cfg.size} under torchrun needs one process per replica, "
                                 f"but torchrun started WORLD_SIZE={world}")
            conns = meet(rank, world)
            if rank != 0:   # a replica of rank 0's server
                sock.close()
                return serve_rank(rank, local_rank, args, conns, warm)
            connected = conns
        pool = DataParallelPool(args.model, args, cfg, name, args.max_queue, warm_up=warm, log_level=args.log_level,
                                connected=connected, local_rank=local_rank)
        infos = pool.launch(load_tokenizer(args.model))
    except (ValueError, ReplicaDied) as e:
        sock.close()
        msg = str(e)
        if args.data_parallel_size == 1:   # one engine process: no replicas to speak of
            msg = msg.replace("replica 0 ", "the engine process ", 1)
        print(f"replayssm serve: error: {msg}", file=sys.stderr)
        return 2
    for i, info in enumerate(infos):
        who = f"replica {i}" if cfg.size > 1 else "engine process"
        line = f"{who} (pid {info['pid']}, {info['device']}): {info['summary']}"
        if log.isEnabledFor(logging.INFO):
            log.info(line)
        else:
            print(line, file=sys.stderr, flush=True)
    try:
        app = build_app(pool.view, _server_config(args, name), engine_loop=pool)
    except BaseException:
        pool.shutdown()
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    server = draining_server_class()(uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=3,
                                                    access_log=args.uvicorn_log_level in ("info", "debug")),
                                     pool, args.shutdown_timeout)
    startup = server.startup

    async def announce(sockets=None):
        await startup(sockets=sockets)
        server.loop = asyncio.get_running_loop()
        url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
        where = (f"{cfg.size} data-parallel replicas" if cfg.size > 1 else
                 f"engine process pid {infos[0]['pid']}")
        print(f"replayssm serve: listening on {url} (model {name!r}, {where})", flush=True)

    server.startup = announce
    pool.on_failed = lambda: setattr(server, "should_exit", True)   # nothing left to serve: exit, not hang
    try:
        server.run(sockets=[sock])
    finally:
        pool.shutdown()
    if pool.failed is not None:
        print(f"replayssm serve: error: engine failed: {pool.failed}", file=sys.stderr, flush=True)
        return 1
    return 0


def draining_server_class():
    """:class:`uvicorn.Server` with a graceful stop (built here: uvicorn is the serve extra's)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with a graceful stop: the first SIGTERM / SIGINT starts
        :meth:`AsyncEngine.drain` (new requests 503, those in flight finish for up to
        ``timeout`` seconds, the rest abort) and the server exits once it is done; a second
        signal aborts at once, a third exits without waiting.  The signal is not raised
        again afterwards (uvicorn's habit), so the process exits 0."""

        def __init__(self, config, engine_loop, timeout: float):
            super().__init__(config)
            self.engine_loop, self.timeout = engine_loop, timeout
            self.loop = None
            self._signals = 0
            self._task = None

        def handle_exit(self, sig, frame) -> None:
            self._signals += 1
            log = logging.getLogger("replayssm.server")
            if self.loop is None:   # not serving yet: nothing to drain
                self.should_exit = True
                return
            if self._signals == 1:
                log.warning("%s: draining (no new requests; up to %g s for the %d sequences in flight)",
                            signal.Signals(sig).name, self.timeout, self.engine_loop.in_flight)
                self.loop.call_soon_threadsafe(self._start_drain)
            elif self._signals == 2:
                log.warning("%s again: aborting the requests in flight now", signal.Signals(sig).name)
                self.loop.call_soon_threadsafe(self._start_drain, 0.0)
            else:
                self.should_exit = self.force_exit = True

        def _start_drain(self, timeout: float | None = None) -> None:
            if self._task is not None and timeout is None:
                return
            if self._task is not None:
                self._task.cancel()
            self._task = asyncio.ensure_future(self._drain(self.timeout if timeout is None else timeout))

        async def _drain(self, timeout: float) -> None:
            log = logging.getLogger("replayssm.server")
            try:
                left = await self.engine_loop.drain(timeout)
                if left:
                    log.warning("shutdown: aborted %d sequences still running after %g s", left, timeout)
                await asyncio.sleep(0.1)   # the last chunks leave before the connections close
            except asyncio.CancelledError:   # superseded by a second signal's immediate drain
                raise
            except Exception as e:  # pragma: no cover - still exit
                log.error("shutdown drain failed: %s: %s", type(e).__name__, e)
            self.should_exit = True

    return DrainingServer


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
