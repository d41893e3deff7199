"""``replayssm serve MODEL_DIR``: the OpenAI-compatible server (uvicorn, loopback by default).

Every option of the ``LLM`` constructor is a flag (decode mode, buffer size, speculation,
dtype, device, CUDA graphs, context length, memory budget, ...).  The server prints
``replayssm serve: listening on http://HOST:PORT`` once it accepts connections (``--port 0``
picks a free port and prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch

from ..argtypes import byte_count, port, positive_int
from ..engine.config import SpeculativeConfig
from ..engine.llm import LLM

DECODE_MODES = ("recurrent", "replay", "kv", "auto")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The ``LLM`` constructor's options as flags (shared with ``bench serve``)."""
    g = p.add_argument_group("engine")
    g.add_argument("--mode", "--decode-mode", dest="mode", default="replay", choices=DECODE_MODES,
                   help="decode form (default: replay)")
    g.add_argument("--buffer-size", type=int, default=None,
                   help="replay ring capacity L (default: 16, or 2*(verify tokens) if larger)")
    g.add_argument("--speculative", default=None, choices=["ngram", "draft", "tree", "mtp"],
                   help="speculative method (mtp: the checkpoint's own MTP head)")
    g.add_argument("--draft-model", default=None, help="draft model directory (draft / tree)")
    g.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step (tree: depth)")
    g.add_argument("--tree-width", type=int, default=2, help="beam width of a draft tree")
    g.add_argument("--tree-depth", type=int, default=None, help="depth of a draft tree (default: --num-tokens)")
    g.add_argument("--prompt-lookup-min", type=int, default=1)
    g.add_argument("--prompt-lookup-max", type=int, default=3)
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="steps with more than N running sequences decode without speculation")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form of the speculation flags, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (instead of --speculative ...)")
    g.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--cuda-graphs", action="store_true", help="capture decode and speculative steps (CUDA)")
    g.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (cache slots)")
    g.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=2048,
                   help="context length (prompt + generated)")
    g.add_argument("--memory-budget", type=byte_count, default=None, help="bytes of cache the scheduler may reserve "
                   "(1e9 or 1000000000)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                   help="share of free GPU memory for caches when --memory-budget is not given")
    g.add_argument("--kv-block-size", type=int, default=16)
    g.add_argument("--auto-threshold", type=int, default=None, help="decode mode auto: KV-only below this length")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes by heads (GPUs cuda:i..i+N-1, or CPU over gloo)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step: decodes plus prompt chunks (chunked prefill)")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse cached prompt prefixes, resumed exactly at any token")
    g.add_argument("--prefix-checkpoint-interval", type=int, default=None,
                   help="tokens between the prefix cache's checkpoint states (a multiple of --kv-block-size)")
    g.add_argument("--prefix-cache-fraction", type=float, default=0.25,
                   help="share of the memory budget the prefix cache may hold")
    g.add_argument("--seed", type=int, default=0, help="the engine's generator (unseeded requests)")
    g.add_argument("--pad-batches", action="store_true", help="pad batches to graph buckets without graphs")
    g.add_argument("--torch-threads", type=positive_int, default=None, help="torch intra-op threads (CPU)")


#: ``--speculative-config`` keys (vLLM's names) -> SpeculativeConfig fields
_VLLM_SPEC_KEYS = {"method": None, "model": "draft_model", "num_speculative_tokens": "num_tokens",
                   "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
                   "disable_by_batch_size": "disable_by_batch_size"}


def speculative_from_json(text: str) -> SpeculativeConfig:
    """A :class:`SpeculativeConfig` from vLLM's ``--speculative-config`` JSON: ``method``
    ``ngram``, ``draft_model`` (or a ``model`` without a method), ``mtp`` / ``*_mtp`` (the
    checkpoint's own MTP head), plus ``num_speculative_tokens``, ``prompt_lookup_min/max``,
    ``disable_by_batch_size``.  Anything else is refused by name."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(_VLLM_SPEC_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {unknown}; supported: {sorted(_VLLM_SPEC_KEYS)}")
    method = cfg.get("method")
    if method is None or method == "draft_model":
        if cfg.get("model") is None:
            raise ValueError("--speculative-config needs a 'method' (ngram, draft_model, mtp) or a draft 'model'")
        ours = "draft"
    elif method == "ngram":
        ours = "ngram"
    elif method == "mtp" or (isinstance(method, str) and method.endswith("_mtp")):
        ours = "mtp"
    else:
        raise ValueError(f"--speculative-config: method {method!r} is not supported here; use ngram, "
                         f"draft_model (with 'model') or mtp")
    kw = {_VLLM_SPEC_KEYS[k]: v for k, v in cfg.items() if k != "method"}
    if ours != "draft" and kw.get("draft_model") is not None:
        raise ValueError(f"--speculative-config: method {method!r} takes no 'model'")
    return SpeculativeConfig(ours, **kw)


def build_engine(model_dir: str, args):
    """An ``LLM`` from :func:`add_engine_args` flags."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    spec = None
    if getattr(args, "speculative_config", None):
        if args.speculative:
            raise ValueError("give either --speculative or --speculative-config, not both")
        if args.draft_model is not None:
            raise ValueError("--draft-model is ignored with --speculative-config: give the draft as its 'model'")
        spec = speculative_from_json(args.speculative_config)
    elif args.speculative:
        draft = args.draft_model
        if args.speculative == "draft" and draft is None:
            raise ValueError("--speculative draft needs --draft-model DIR")
        spec = SpeculativeConfig(args.speculative, num_tokens=args.num_tokens, draft_model=draft,
                                 tree_width=args.tree_width, tree_depth=args.tree_depth,
                                 prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                                 disable_by_batch_size=args.speculative_disable_by_batch_size)
    return LLM(model_dir, device=device, dtype=dtype, decode_mode=args.mode, buffer_size=args.buffer_size,
               speculative=spec, tensor_parallel_size=args.tensor_parallel_size,
               max_num_seqs=args.max_num_seqs, memory_budget=int(args.memory_budget) if args.memory_budget else None,
               max_seq_len=args.max_seq_len, kv_block_size=args.kv_block_size, auto_threshold=args.auto_threshold,
               cuda_graphs=args.cuda_graphs, seed=args.seed, pad_batches=args.pad_batches,
               max_num_batched_tokens=args.max_num_batched_tokens,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=args.enable_prefix_caching,
               prefix_checkpoint_interval=args.prefix_checkpoint_interval,
               prefix_cache_fraction=args.prefix_cache_fraction)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory (Hugging Face layout)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=port, default=8000, help="port (0: any free port, printed at start)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the directory name)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="sequences that may wait beyond --max-num-seqs; more get 503 (default: 256)")
    p.add_argument("--chat-template", default=None, help="a chat template (string or file) overriding the model's")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--warm-up", default="auto", choices=["auto", "on", "off"],
                   help="run every kind of step once before listening, so no request waits for a kernel "
                        "compile (auto: on for CUDA)")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
        engine = build_engine(args.model, args)
    except ValueError as e:
        sock.close()
        print(f"replayssm serve: error: {e}", file=sys.stderr)
        return 2
    if args.warm_up == "on" or (args.warm_up == "auto" and engine.device.type == "cuda"):
        secs = engine.warm_up()
        print(f"replayssm serve: warmed up in {secs:.1f} s", file=sys.stderr, flush=True)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = build_app(engine, ServerConfig(model_name=name, model_dir=args.model, api_key=args.api_key,
                                         max_queue=args.max_queue, chat_template=args.chat_template))
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=2))

    startup = server.startup

    async def announce(sockets=None):   # after the app started and the socket listens
        await startup(sockets=sockets)
        url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
        print(f"replayssm serve: listening on {url} (model {name!r})", flush=True)

    server.startup = announce
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
