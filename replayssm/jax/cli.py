"""``replayssm generate --backend jax``: the engine's generate command on the JAX backend.

The argument parser is the engine's (:mod:`replayssm.engine.cli`); this module only runs
the request with :class:`~replayssm.jax.generate.JaxLLM`, streaming tokens to stdout in
chunks of loop iterations, and reports throughput on stderr.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..engine.cli import DEFAULT_DRAFT, DEFAULT_MODEL, _err, build_parser, conflicting_flags
from ..engine.config import SamplingParams, SpeculativeConfig


def main(argv: list[str] | None = None) -> int:
    """``replayssm generate --backend jax ...``: the engine command's arguments, run here."""
    args = build_parser().parse_args(argv)
    if args.prompt is None and args.token_ids is None:
        return _err("give a PROMPT (or --token-ids 1,2,3)")
    conflict = conflicting_flags(args)
    if conflict:
        return _err(conflict)
    model_dir = Path(args.model) if args.model else DEFAULT_MODEL
    if not (model_dir / "config.json").is_file():
        return _err(f"model directory {str(model_dir)!r} not found or incomplete; pass --model DIR")
    return generate_main(args, model_dir, DEFAULT_DRAFT, _err)


def generate_main(args, model_dir: Path, default_draft: Path, err) -> int:
    """Run one generate request from parsed CLI ``args``; ``err(msg) -> exit code``."""
    try:
        import jax
    except ImportError:
        return err("--backend jax needs jax: pip install 'replayssm[jax]'")
    if args.mode not in ("replay", "recurrent", "kv", "auto"):
        return err(f"--backend jax supports --mode replay, recurrent, kv or auto, not {args.mode!r}")
    if args.speculative not in (None, "ngram", "draft"):
        return err(f"--backend jax speculates with chains (ngram, draft), not {args.speculative!r}")
    if args.cuda_graphs:
        return err("--cuda-graphs is a torch-backend option (the JAX loop is compiled as a whole)")
    if args.device != "cpu":   # the parser's default: JAX places arrays on its default backend
        return err(f"--device is a torch-backend option; the JAX backend runs on jax's default device "
                   f"(set JAX_PLATFORMS), not {args.device!r}")
    if getattr(args, "ssm_state_dtype", "auto") not in ("auto", "float32"):
        return err(f"--ssm-state-dtype is a torch-backend option (the JAX backend keeps float32 states), "
                   f"not {args.ssm_state_dtype!r}")
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    from .generate import JaxLLM  # imports jax (an optional extra): only once it is known to be there

    try:
        spec = None
        if args.speculative:
            draft = None
            if args.speculative == "draft":
                draft = Path(args.draft_model) if args.draft_model else default_draft
                if not (draft / "config.json").is_file():
                    return err(f"draft model directory {str(draft)!r} not found or incomplete; pass --draft-model DIR")
            spec = SpeculativeConfig(args.speculative, num_tokens=args.num_tokens,
                                     draft_model=str(draft) if draft else None)
        buffer = args.buffer_size
        if buffer is None:
            buffer = max(16, 2 * spec.verify_tokens) if spec else 16
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        llm = JaxLLM(str(model_dir), dtype=args.dtype, decode_mode=args.mode, buffer_size=buffer,
                     speculative=spec, seed=args.seed or 0, max_seq_len=args.max_seq_len,
                     tensor_parallel_size=args.tensor_parallel_size)
        tok = llm.tokenizer
        if args.token_ids is not None:
            try:
                prompt = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
            except ValueError:
                return err(f"--token-ids must be comma-separated integers, got {args.token_ids!r}")
        else:
            prompt = args.prompt
            if tok is None:
                return err(f"{model_dir} has no tokenizer.json; pass --token-ids")
        t_load = time.perf_counter() - t0
        if isinstance(prompt, str):
            sys.stdout.write(prompt)
        shown, ids = "", []
        t1 = time.perf_counter()
        for chunk in llm.stream(prompt, params, chunk_steps=8):
            ids.extend(chunk)
            if tok is not None:
                text = tok.decode(ids)
                if text.startswith(shown) and not text.endswith("\ufffd"):
                    sys.stdout.write(text[len(shown):])
                    shown = text
            else:
                sys.stdout.write(" ".join(str(t) for t in chunk) + " ")
            sys.stdout.flush()
        dt = time.perf_counter() - t1
        out = llm.last_output
        if tok is not None and out.text != shown and out.text.startswith(shown):
            sys.stdout.write(out.text[len(shown):])
        sys.stdout.write("\n")
        sys.stdout.flush()
    except ValueError as e:
        return err(str(e))
    n = len(out.token_ids)
    print(f"[{n} tokens in {dt:.2f}s (first call includes compilation): {n / max(dt, 1e-9):.1f} tokens/s; "
          f"backend=jax ({jax.default_backend()}); mode={args.mode}"
          f"{'; speculative=' + args.speculative if args.speculative else ''}; tp={args.tensor_parallel_size}; "
          f"mean accepted length {out.mean_accepted_length:.2f}; finish={out.finish_reason}; "
          f"load {t_load:.2f}s]", file=sys.stderr)
    return 0
