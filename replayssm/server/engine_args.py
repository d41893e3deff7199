"""The engine half of ``replayssm serve``'s flags: the engine arguments, the speculative
configuration they (or vLLM's ``--speculative-config`` JSON) describe, the ``LLM`` they build,
and its startup summary line.  The API server (:mod:`.cli`) and each data-parallel replica
process (:mod:`.dp_replica`) build their engines through here."""

from __future__ import annotations

import argparse
import json

import torch

from ..argtypes import byte_count, positive_int
from ..cache.spec import STATE_DTYPES
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
    g.add_argument("--ssm-state-dtype", "--mamba-ssm-cache-dtype", dest="ssm_state_dtype", default="auto",
                   choices=list(STATE_DTYPES),
                   help="storage dtype of the SSM checkpoint states (auto: float32; bfloat16/float16 halve the "
                        "state bytes, math stays float32; docs/MATH.md, State dtype)")
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
    g.add_argument("--spec-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="drafts per step: adaptive (0..--num-tokens, chosen per step from measured acceptance "
                        "and step cost; 0 = a plain decode step) or fixed (always --num-tokens)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form of the speculation flags, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (instead of --speculative ...)")
    g.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (by default decode and speculative steps are captured on CUDA)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="accepted for old command lines and ignored: graphs are on by default on CUDA")
    g.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() once the engine is built: Python's full garbage collections skip the "
                        "objects made at start-up (~40 ms each otherwise, mid-step)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap plain greedy decode steps' host work (outputs, stop checks, scheduling) with the "
                        "device running the previous step; other steps run as usual, outputs unchanged "
                        "(default: on for CUDA devices)")
    g.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (cache slots)")
    g.add_argument("--preemption-mode", default="swap", choices=["swap", "off"],
                   help="swap: admit when the prompt fits and swap sequences to host memory when the block "
                        "pools run dry (restored exactly); off: reserve each request's whole-life worst case")
    g.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of a model given as org/name")
    g.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=None,
                   help="context length, prompt + generated (default: the model's max_position_embeddings, "
                        "bounded by memory)")
    g.add_argument("--memory-budget", type=byte_count, default=None, help="bytes of cache the scheduler may reserve "
                   "(1e9 or 1000000000)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                   help="share of free GPU memory for caches when --memory-budget is not given")
    g.add_argument("--kv-block-size", type=int, default=16)
    g.add_argument("--auto-threshold", type=int, default=None, help="decode mode auto: KV-only below this length")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes by heads (GPUs cuda:i..i+N-1, or CPU over gloo)")
    g.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                   help="serve: N engine replicas (processes, each possibly tensor-parallel: replica i on "
                        "cuda:i*tp ..) behind one endpoint, requests routed by prefix affinity and load")
    g.add_argument("--data-parallel-max-restarts", type=int, default=3, metavar="K",
                   help="serve: times a replica (or the single engine process) that dies is restarted (0: never; "
                        "the server runs degraded, and exits 1 once no replica is left)")
    g.add_argument("--data-parallel-step-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="serve: a replica (or the engine process) holding requests that sends no step for this long "
                        "counts as hung: its "
                        "requests end with an error and it is killed and restarted (0: never)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step: decodes plus prompt chunks (chunked prefill)")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse cached prompt prefixes, resumed exactly at any token")
    g.add_argument("--prefix-checkpoint-interval", type=int, default=None,
                   help="tokens between the prefix cache's checkpoint states (a multiple of --kv-block-size)")
    g.add_argument("--prefix-cache-fraction", type=float, default=0.25,
                   help="share of the memory budget the prefix cache may hold")
    g.add_argument("--no-prefix-cache-replies", dest="prefix_cache_replies", action="store_false",
                   help="cache prompts only, not a finished request's state after its reply (chat turns)")
    g.add_argument("--seed", type=int, default=0, help="the engine's generator (unseeded requests)")
    g.add_argument("--pad-batches", action="store_true", help="pad batches to graph buckets without graphs")
    g.add_argument("--torch-threads", type=positive_int, default=None, help="torch intra-op threads (CPU)")


#: ``--speculative-config`` keys (vLLM's names) -> SpeculativeConfig fields
_VLLM_SPEC_KEYS = {"method": None, "model": "draft_model", "num_speculative_tokens": "num_tokens",
                   "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
                   "disable_by_batch_size": "disable_by_batch_size", "spec_policy": "spec_policy"}


def speculative_from_json(text: str) -> SpeculativeConfig:
    """A :class:`SpeculativeConfig` from vLLM's ``--speculative-config`` JSON: ``method``
    ``ngram``, ``draft_model`` (or a ``model`` without a method), ``mtp`` / ``*_mtp`` (the
    checkpoint's own MTP head), plus ``num_speculative_tokens`` (the most drafts per step),
    ``prompt_lookup_min/max``, ``disable_by_batch_size``, and ours, ``spec_policy``
    (``"adaptive"`` or ``"fixed"``).  Anything else is refused by name."""
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


def speculative_from_args(args) -> SpeculativeConfig | None:
    """The :class:`SpeculativeConfig` of the speculation flags (``ValueError`` when they
    contradict each other): checked before any model loads."""
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
                                 disable_by_batch_size=args.speculative_disable_by_batch_size,
                                 spec_policy=getattr(args, "spec_policy", "adaptive"))
    return spec


def build_engine(model_dir: str, args):
    """An ``LLM`` from :func:`add_engine_args` flags."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    spec = speculative_from_args(args)
    return LLM(model_dir, device=device, dtype=dtype, decode_mode=args.mode, buffer_size=args.buffer_size,
               speculative=spec, tensor_parallel_size=args.tensor_parallel_size,
               max_num_seqs=args.max_num_seqs, memory_budget=int(args.memory_budget) if args.memory_budget else None,
               max_seq_len=args.max_seq_len, kv_block_size=args.kv_block_size, auto_threshold=args.auto_threshold,
               cuda_graphs=device.startswith("cuda") and not getattr(args, "enforce_eager", False),
               seed=args.seed, pad_batches=args.pad_batches, preemption_mode=args.preemption_mode,
               max_num_batched_tokens=args.max_num_batched_tokens,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=args.enable_prefix_caching,
               prefix_checkpoint_interval=args.prefix_checkpoint_interval,
               prefix_cache_fraction=args.prefix_cache_fraction,
               prefix_cache_replies=getattr(args, "prefix_cache_replies", True), ssm_state_dtype=args.ssm_state_dtype,
               gc_freeze=getattr(args, "gc_freeze", False), async_scheduling=getattr(args, "async_scheduling", None))


def _bytes(n) -> str:
    return "none" if n is None else f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def startup_summary(engine, name: str, model_dir: str, warm_up_s: float | None = None) -> str:
    """One line: what the server built (model, dtype, device, decode mode, speculation, SSM
    state dtype, slots, context, memory plan, CUDA graphs)."""
    from .. import __version__

    cfg = getattr(engine, "config", None)
    plan = getattr(engine, "plan", None)
    spec = getattr(cfg, "speculative", None)
    if spec is None:
        speculation = "off"
    else:
        speculation = f"{spec.method} ({spec.num_tokens} tokens/step)"
    parts = [f"model {name!r} ({model_dir})", f"dtype {str(getattr(engine, 'dtype', '?')).replace('torch.', '')}",
             f"device {getattr(engine, 'device', '?')}", f"decode mode {getattr(cfg, 'decode_mode', '?')}",
             f"speculation {speculation}"]
    cache = getattr(engine, "cache", None)
    if getattr(cache, "state_dtype", None) is not None:
        parts.append(f"SSM states {str(cache.state_dtype).replace('torch.', '')}")
    if plan is not None:
        mem = plan.memory
        limit = getattr(getattr(engine, "scheduler", None), "token_limit", plan.spec.max_seq_len)
        source = getattr(cfg, "max_seq_len_source", None)
        parts += [f"slots {plan.num_slots}", f"context {limit} tokens" + (f" ({source})" if source else ""),
                  f"memory plan: budget {_bytes(plan.budget)}, {_bytes(mem.fixed)} + {mem.per_token} B/token per "
                  f"sequence, prefix store {_bytes(plan.store_bytes) if plan.prefix_store is not None else 'off'}"]
        pools = [f"{k} {v} blocks" for k, v in (("KV-only pool", plan.spec.kv_num_blocks),
                                                ("attention pool", plan.spec.attn_num_blocks)) if v]
        if pools:
            parts.append(", ".join(pools))
    runner = getattr(engine, "runner", None)
    parts.append(f"CUDA graphs {'on' if getattr(runner, 'use_graphs', False) else 'off'}")
    if warm_up_s is not None:
        parts.append(f"warmed up in {warm_up_s:.1f} s")
    return f"replayssm {__version__} serve: " + "; ".join(parts)
