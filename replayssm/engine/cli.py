"""``replayssm generate``: generate text with the engine, streaming it to stdout.

Defaults to the small model shipped in the package (``replayssm/assets/tiny-mamba2``; with
``--speculative draft``/``tree`` the draft is ``replayssm/assets/tiny-mamba2-draft``; with
``--speculative mtp`` the model's own MTP head drafts).
Throughput (tokens/s) and the mean accepted length go to stderr after the text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "tiny-mamba2"
DEFAULT_DRAFT = ASSETS / "tiny-mamba2-draft"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs the model's tokenizer.json)")
    p.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--model", default=None, help=f"model directory (default: {DEFAULT_MODEL})")
    p.add_argument("--mode", default="replay", choices=["recurrent", "replay", "kv", "auto"],
                   help="decode form (default: replay)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft", "tree", "mtp"])
    p.add_argument("--draft-model", default=None, help=f"draft model directory (default: {DEFAULT_DRAFT})")
    p.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step (tree: depth)")
    p.add_argument("--tree-width", type=int, default=2, help="beam width of a draft tree")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--buffer-size", type=int, default=None,
                   help="replay ring capacity L (default: 16, or 2*(drafts+1) if larger)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cuda-graphs", action="store_true", help="capture decode in CUDA graphs (CUDA only)")
    return p


def _err(msg: str) -> int:
    print(f"replayssm generate: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt is None and args.token_ids is None:
        return _err("give a PROMPT (or --token-ids 1,2,3)")
    model_dir = Path(args.model) if args.model else DEFAULT_MODEL
    if not (model_dir / "config.json").is_file():
        hint = ("the shipped model is missing from this installation (expected at "
                f"{DEFAULT_MODEL}); pass --model DIR") if args.model is None else "no config.json there"
        return _err(f"model directory {str(model_dir)!r} not found or incomplete: {hint}")
    from .config import SamplingParams, SpeculativeConfig
    from .llm import LLM

    try:
        spec = None
        if args.speculative:
            draft = None
            if args.speculative == "draft" or (args.speculative == "tree" and args.draft_model != "none"):
                draft = Path(args.draft_model) if args.draft_model else DEFAULT_DRAFT
                if not (draft / "config.json").is_file():
                    if args.speculative == "tree" and args.draft_model is None:
                        draft = None  # no shipped draft: an n-gram tree
                    else:
                        return _err(f"draft model directory {str(draft)!r} not found or incomplete; "
                                    "pass --draft-model DIR")
            spec = SpeculativeConfig(args.speculative, num_tokens=args.num_tokens,
                                     draft_model=str(draft) if draft else None, tree_width=args.tree_width)
        buffer = args.buffer_size
        if buffer is None:
            buffer = max(16, 2 * spec.verify_tokens) if spec else 16
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        tok = None
        try:
            from ..models import load_tokenizer

            tok = load_tokenizer(str(model_dir))
        except ImportError:
            pass
        if args.token_ids is not None:
            try:
                prompt = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
            except ValueError:
                return _err(f"--token-ids must be comma-separated integers, got {args.token_ids!r}")
            n_prompt = len(prompt)
        else:
            prompt = args.prompt
            if tok is None:
                return _err(f"{model_dir} has no tokenizer.json; pass --token-ids")
            n_prompt = len(tok.encode(prompt).ids)
        # size the cache for this one request (KV-only buffers and attention scale with it)
        need = n_prompt + args.max_tokens + 2 * (spec.verify_tokens if spec else 1) + 16
        max_seq_len = -(-need // 64) * 64
        llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, decode_mode=args.mode,
                  buffer_size=buffer, speculative=spec, max_num_seqs=1, cuda_graphs=args.cuda_graphs,
                  tokenizer=tok, max_seq_len=max_seq_len)
        t_load = time.perf_counter() - t0
        if isinstance(prompt, str):
            sys.stdout.write(prompt)
        shown = ""
        ids: list[int] = []
        t1 = time.perf_counter()
        for chunk in llm.stream(prompt, params):
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
        return _err(str(e))
    n = len(out.token_ids)
    line = (f"[{n} tokens in {dt:.2f}s: {n / max(dt, 1e-9):.1f} tokens/s; mode={args.mode}"
            f"{'; speculative=' + args.speculative if args.speculative else ''}; "
            f"mean accepted length {out.mean_accepted_length:.2f}; finish={out.finish_reason}; "
            f"load {t_load:.2f}s]")
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
