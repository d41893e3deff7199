"""``replayssm generate``: generate text with the engine, streaming it to stdout.

Defaults to the small model shipped in the package (``replayssm/assets/tiny-mamba2``; with
``--speculative draft``/``tree`` the draft is ``replayssm/assets/tiny-mamba2-draft``; with
``--speculative mtp`` the model's own MTP head drafts).
Throughput (tokens/s) and the mean accepted length go to stderr after the text.  The cache
is sized for the request, within a context limit (``--max-seq-len``; default: the model's
``max_position_embeddings``, else ``replayssm.engine.cache_plan.DEFAULT_CONTEXT`` = 8192 tokens):
``--max-tokens`` beyond what the limit leaves after the prompt is clipped, with a note on
stderr.  A prompt of ``PROGRESS_MIN_TOKENS`` (512) tokens or more shows a prefill progress
bar on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
import time
from pathlib import Path

from ..argtypes import positive_int
from ..cache.spec import STATE_DTYPES
from ..models import is_hub_id, load_tokenizer, read_config, resolve_model_dir
from ..runtime import check_device
from .config import SamplingParams, SpeculativeConfig
from .detokenizer import Detokenizer
from .inputs import check_text, encode_prompt, token_ids
from .cache_plan import DEFAULT_CONTEXT, context_limit
from .llm import LLM

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "tiny-mamba2"
DEFAULT_DRAFT = ASSETS / "tiny-mamba2-draft"
#: prompts at least this long show a prefill progress bar on stderr
PROGRESS_MIN_TOKENS = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs the model's tokenizer.json)")
    p.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--model", default=None,
                   help=f"model directory, or a Hugging Face Hub id org/name (downloaded when no such local path "
                        f"exists; HF_TOKEN, HF_HOME, HF_HUB_OFFLINE apply) (default: {DEFAULT_MODEL})")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of a --model hub id")
    p.add_argument("--mode", default="replay", choices=["recurrent", "replay", "kv", "auto"],
                   help="decode form (default: replay)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft", "tree", "mtp"])
    p.add_argument("--draft-model", default=None, help=f"draft model directory (default: {DEFAULT_DRAFT})")
    p.add_argument("--num-tokens", type=positive_int, default=4, help="draft tokens per step (tree: depth)")
    p.add_argument("--tree-width", type=positive_int, default=2, help="beam width of a draft tree")
    p.add_argument("--spec-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="drafts per step: adaptive (0..--num-tokens by measured acceptance and step cost) or fixed")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="tokens to generate (clipped to what the context limit leaves after the prompt)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="context limit in tokens (default: the model's max_position_embeddings, else "
                        f"{DEFAULT_CONTEXT})")
    p.add_argument("--ssm-state-dtype", "--mamba-ssm-cache-dtype", dest="ssm_state_dtype", default="auto",
                   choices=list(STATE_DTYPES),
                   help="storage dtype of the SSM checkpoint states (auto: float32; bfloat16/float16 halve the "
                        "state bytes, math stays float32; docs/MATH.md, State dtype)")
    p.add_argument("--buffer-size", type=positive_int, default=None,
                   help="replay ring capacity L (default: 16, or 2*(drafts+1) if larger)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture decode in CUDA graphs (default: on for a CUDA device, off elsewhere)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap plain greedy decode steps' host work (outputs, stop checks, scheduling) with the "
                        "device running the previous step; other steps run as usual, outputs unchanged "
                        "(default: on for CUDA devices)")
    p.add_argument("--torch-threads", type=positive_int, default=None,
                   help="torch intra-op threads (CPU work); default: min(physical cores, cores not busy), from "
                        "this process's CPU affinity and the 1-minute load average, at least 1 (so a busy "
                        "machine is not oversubscribed)")
    p.add_argument("--backend", default="torch", choices=["torch", "jax"],
                   help="torch: this engine; jax: the compiled JAX loop (replayssm.jax, needs jax)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes by heads (GPUs cuda:i..i+N-1, or CPU over gloo); "
                        "under torchrun, the number of processes it started")
    return p


def default_torch_threads() -> int:
    """Threads that do not oversubscribe the machine: the physical cores among the CPUs this
    process may run on (``os.sched_getaffinity``; hyper-threads of one core count once),
    less the cores already busy (the 1-minute load average, rounded up), at least 1."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(c))
    try:
        busy = math.ceil(os.getloadavg()[0])
    except (AttributeError, OSError):   # pragma: no cover - no load average
        busy = 0
    return max(1, min(len(cores), len(cpus) - busy))


def _err(msg: str) -> int:
    print(f"replayssm generate: error: {msg}", file=sys.stderr)
    return 2


def _note(msg: str) -> None:
    print(f"replayssm generate: {msg}", file=sys.stderr)


@contextlib.contextmanager
def prefill_progress(models, n_tokens: int):
    """A progress bar on stderr for one long prefill: it advances as each layer of each
    model (target, then draft) finishes its prefill call, and is removed afterwards."""
    from tqdm import tqdm

    blocks = [b for m in models if m is not None for b in getattr(m, "blocks", [])]
    if not blocks:
        yield
        return
    bar = tqdm(total=len(blocks), desc=f"prefill {n_tokens} tokens", unit="layer", file=sys.stderr, leave=False)

    def done(module, args, output):
        ctx = args[1] if len(args) > 1 else None
        if getattr(ctx, "kind", None) == "prefill" and bar.n < bar.total:
            bar.update(1)

    hooks = [b.register_forward_hook(done) for b in blocks]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        bar.close()


def _read_prompt(args, tok, vocab_size: int):
    """``(text or None, ids)`` from PROMPT or --token-ids, validated."""
    if args.token_ids is not None:
        parts = [t for t in args.token_ids.replace(" ", "").split(",") if t]
        try:
            ids = [int(t) for t in parts]
        except ValueError:
            raise ValueError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}") from None
        return None, token_ids(ids, vocab_size, "--token-ids")
    if tok is None:
        raise ValueError(f"{args.model or DEFAULT_MODEL} has no tokenizer.json; pass --token-ids")
    return encode_prompt(args.prompt, tok, vocab_size)


def conflicting_flags(args) -> str | None:
    """A message for flags that would be silently ignored together, else None."""
    if args.prompt is not None and args.token_ids is not None:
        return "give a PROMPT or --token-ids, not both"
    if args.draft_model is not None and args.speculative not in ("draft", "tree"):
        return "--draft-model is used by --speculative draft or tree only"
    return None


def _check_args(args):
    """``(device, model directory)`` once the flags make sense; raises ``ValueError``."""
    if args.prompt is None and args.token_ids is None:
        raise ValueError("give a PROMPT (or --token-ids 1,2,3)")
    conflict = conflicting_flags(args)
    if conflict:
        raise ValueError(conflict)
    if args.prompt is not None:
        check_text(args.prompt, "PROMPT")
    device = check_device(args.device)
    if args.cuda_graphs and device.type != "cuda":   # None: the engine decides (on for CUDA)
        _note(f"warning: --cuda-graphs needs a CUDA device; ignored on {device}")
        args.cuda_graphs = False
    if args.revision is not None and args.model is None:
        raise ValueError("--revision picks a Hub snapshot of --model org/name; give --model")
    if args.model is None:
        model_dir = DEFAULT_MODEL
    elif is_hub_id(args.model) and not Path(args.model).exists():   # a local path always wins
        model_dir = Path(resolve_model_dir(args.model, args.revision))   # HubError (a ValueError) says why
    else:
        model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        hint = ("the shipped model is missing from this installation (expected at "
                f"{DEFAULT_MODEL}); pass --model DIR") if args.model is None else "no config.json there"
        raise ValueError(f"model directory {str(model_dir)!r} not found or incomplete: {hint}")
    if args.backend == "jax":   # replayssm.cli routes --backend jax to replayssm.jax.cli
        raise ValueError("--backend jax runs through the `replayssm generate` command (replayssm.jax.cli)")
    return device, model_dir


def _speculative(args) -> SpeculativeConfig | None:
    """The ``--speculative`` config (the shipped draft model unless ``--draft-model``; a tree
    with no shipped draft is an n-gram tree)."""
    if not args.speculative:
        return None
    draft = None
    if args.speculative == "draft" or (args.speculative == "tree" and args.draft_model != "none"):
        draft = Path(args.draft_model) if args.draft_model else DEFAULT_DRAFT
        if not (draft / "config.json").is_file():
            if args.speculative == "tree" and args.draft_model is None:
                draft = None  # no shipped draft: an n-gram tree
            else:
                raise ValueError(f"draft model directory {str(draft)!r} not found or incomplete; "
                                 "pass --draft-model DIR")
    return SpeculativeConfig(args.speculative, num_tokens=args.num_tokens,
                             draft_model=str(draft) if draft else None, tree_width=args.tree_width,
                             spec_policy=args.spec_policy)


def _context(args, cfg, n_prompt: int) -> int | None:
    """``max_seq_len`` to build the engine with: the request sized (prompt + ``--max-tokens``,
    rounded up to 64; KV-only buffers and attention scale with it) when that is below the
    context limit, else ``None`` or ``--max-seq-len``: the engine's one rule (the model's
    context, lowered to what memory holds; :func:`replayssm.engine.cache_plan.plan_caches`).
    The limit counts prompt + generated tokens, with or without speculation.  Refuses a
    prompt that cannot fit a limit it knows here (the engine refuses the others)."""
    limit, source = (args.max_seq_len, "--max-seq-len") if args.max_seq_len else context_limit(cfg)
    if n_prompt + 1 > limit:
        raise ValueError(f"the prompt has {n_prompt} tokens; it does not fit the context limit of {limit} tokens "
                         f"({source}: prompt + generated tokens); pass a larger --max-seq-len")
    want = -(-(n_prompt + args.max_tokens) // 64) * 64
    if want < limit:
        return want
    return args.max_seq_len   # None: the engine resolves the model's context within memory


def _clip_note(args, llm, n_prompt: int) -> None:
    """A note on stderr when ``--max-tokens`` is more than the engine's context leaves."""
    limit, room = llm.config.max_seq_len, llm.config.max_seq_len - n_prompt
    if args.max_tokens > room:
        _note(f"note: --max-tokens {args.max_tokens} clipped to {room}: the context limit is {limit} tokens "
              f"({llm.config.max_seq_len_source}) and the prompt has {n_prompt}; --max-seq-len changes the limit")


def _stream(llm, prompt: list[int], text: str | None, params, tok) -> float:
    """Generate, writing the text (or token ids) to stdout as it comes; returns seconds."""
    n_prompt = len(prompt)
    progress = (prefill_progress([llm.model, llm.draft_model], n_prompt) if n_prompt >= PROGRESS_MIN_TOKENS
                else contextlib.nullcontext())
    detok = Detokenizer(tok, prompt) if tok is not None else None
    t1 = time.perf_counter()
    stream = llm.stream(prompt, params)
    with progress:
        first = next(stream, None)
    if text is not None and first is not None:
        sys.stdout.write(text)
    for chunk in itertools.chain([first] if first is not None else [], stream):
        if detok is not None:   # incremental: whole characters only, no re-decoding
            sys.stdout.write("".join(detok.push(t) for t in chunk))
        else:
            sys.stdout.write(" ".join(str(t) for t in chunk) + " ")
        sys.stdout.flush()
    dt = time.perf_counter() - t1
    if llm.last_output.error:
        raise ValueError(llm.last_output.error)
    if detok is not None:
        sys.stdout.write(detok.flush())
    sys.stdout.write("\n")
    sys.stdout.flush()
    return dt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads or default_torch_threads())
    try:
        return _generate(args)
    finally:   # called in-process (tests, scripts): the caller's setting comes back
        torch.set_num_threads(threads)


def _generate(args) -> int:
    try:
        device, model_dir = _check_args(args)
        spec = _speculative(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        cfg = read_config(str(model_dir))
        tok = load_tokenizer(str(model_dir))
        text, prompt = _read_prompt(args, tok, int(cfg.vocab_size))
        max_seq_len = _context(args, cfg, len(prompt))
        llm = LLM(str(model_dir), device=device, dtype=args.dtype, decode_mode=args.mode,
                  buffer_size=args.buffer_size, speculative=spec, max_num_seqs=1, cuda_graphs=args.cuda_graphs,
                  tokenizer=tok, max_seq_len=max_seq_len, tensor_parallel_size=args.tensor_parallel_size,
                  ssm_state_dtype=args.ssm_state_dtype, async_scheduling=args.async_scheduling)
        _clip_note(args, llm, len(prompt))
        t_load = time.perf_counter() - t0
        dt = _stream(llm, prompt, text, params, tok)
        llm.close()
    except ValueError as e:
        return _err(str(e))
    out = llm.last_output
    n = len(out.token_ids)
    line = (f"[{n} tokens in {dt:.2f}s: {n / max(dt, 1e-9):.1f} tokens/s; mode={args.mode}"
            f"{'; speculative=' + args.speculative if args.speculative else ''}; "
            f"mean accepted length {out.mean_accepted_length:.2f}; finish={out.finish_reason}; "
            f"load {t_load:.2f}s]")
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
