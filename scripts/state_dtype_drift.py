"""How far 16-bit SSM checkpoint states drift from float32 states over long greedy generations
(CPU, float32 weights; ``docs/MATH.md``, "State dtype" reports the numbers).

For each model and decode form (replay: the state is rounded once per ring flush, every
``L = 16`` tokens; recurrent: rounded after every token) it generates ``--tokens`` greedy
tokens for ``--batch`` prompts with float32 states (the reference), then with bf16 and fp16
states:

* teacher-forced logits drift: the 16-bit run is fed the reference's tokens, so every
  position compares logits of the same context: max |Δ| over positions and vocabulary, the
  largest |Δ| / max|logits| of a position, the mean of the per-position max |Δ|, the max |Δ|
  over the first and the last 128 positions (does the error grow?), and how often the argmax
  agrees (a 16-bit run that never leaves the reference's tokens is its own teacher-forced
  run);
* free-running greedy agreement: the 16-bit run generates on its own; the share of tokens
  equal to the reference's and the first position where they differ (None: never).

Models: the shipped tiny Mamba-2 (trained) and a tiny random-weight hybrid (Nemotron-H
layout: Mamba-2, attention, MoE; its LM head replaced by a Gaussian one so the greedy
choice depends on the context, not only on the last token).

    PYTHONPATH=. python scripts/state_dtype_drift.py [--tokens 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from replayssm.bench.hybrid_presets import random_hybrid_dir
from replayssm.engine.cli import DEFAULT_MODEL
from replayssm.models import load_model

SDTS = ("bfloat16", "float16")


def _prompts(model_name: str, vocab: int, batch: int, length: int) -> list[list[int]]:
    if model_name == "shipped":
        from replayssm.models import load_tokenizer

        tok = load_tokenizer(str(DEFAULT_MODEL))
        texts = ["def fibonacci(n):\n    ", "The history of the", "import numpy as np\n\n",
                 "Once upon a time, there", "class Stack:\n    def ", "SELECT name FROM"]
        return [tok.encode(texts[i % len(texts)]).ids for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def _run(model, prompts, n: int, mode: str, sdt: str, forced: torch.Tensor | None = None):
    """Greedy generation of ``n`` tokens (or, with ``forced [B, n]``, feeding those tokens);
    returns (tokens [B, n], logits [n, B, V] float64)."""
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(B, int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    cache = model.make_cache(B + 1, mode=mode, buffer_size=16, max_seq_len=int(lens.max()) + n + 1,
                             ssm_state_dtype=sdt)
    slots = torch.arange(1, B + 1)
    lg = model.prefill(cache, slots, ids, lens)
    toks, logits = [], []
    for i in range(n):
        logits.append(lg.to(torch.float64))
        t = lg.argmax(-1) if forced is None else forced[:, i]
        toks.append(lg.argmax(-1))
        if i + 1 < n:
            lg = model.decode(cache, slots, t)
    return torch.stack(toks, 1), torch.stack(logits, 0)


def _drift(ref_logits, logits) -> dict:
    d = (logits - ref_logits).abs().amax(-1)                       # [n, B]: per position and row
    scale = ref_logits.abs().amax(-1)
    n = d.shape[0]
    head, tail = d[: min(128, n)], d[max(0, n - 128):]
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item()
    return dict(max_abs=d.max().item(), max_rel=(d / scale).max().item(), mean_abs=d.mean().item(),
                first128_max_abs=head.max().item(), last128_max_abs=tail.max().item(),
                teacher_forced_argmax_agreement=agree)


def _agreement(ref_toks, toks) -> dict:
    same = ref_toks == toks
    diverged = (~same).any(0).nonzero()
    return dict(greedy_agreement=same.double().mean().item(),
                first_divergence=None if diverged.numel() == 0 else int(diverged[0]),
                rows_identical=int(same.all(1).sum()))


def _load(name: str, tmp: str):
    if name == "shipped":
        return load_model(str(DEFAULT_MODEL), dtype="float32")
    model = load_model(random_hybrid_dir("nemotron-h-tiny", tmp, gen_device="cpu"), dtype="float32")
    head = dict(model.named_parameters())["lm_head.weight"]
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        head.copy_(torch.randn(head.shape, generator=g) / head.shape[1] ** 0.5)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--models", default="shipped,hybrid")
    p.add_argument("--modes", default="replay,recurrent")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is as fast)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = _measure(args)
    finally:   # called in-process (the smoke test): the caller's setting comes back
        torch.set_num_threads(threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _measure(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in args.models.split(","):
            model = _load(name, tmp)
            prompts = _prompts(name, int(model.config.vocab_size), args.batch, args.prompt_len)
            for mode in args.modes.split(","):
                t0 = time.perf_counter()
                ref_toks, ref_logits = _run(model, prompts, args.tokens, mode, "float32")
                for sdt in SDTS:
                    toks, logits = _run(model, prompts, args.tokens, mode, sdt)
                    # the same contexts as the reference until a row diverges: only then is a
                    # teacher-forced run needed for the logits drift
                    forced_logits = logits if torch.equal(toks, ref_toks) else \
                        _run(model, prompts, args.tokens, mode, sdt, forced=ref_toks)[1]
                    row = dict(model=name, mode=mode, state_dtype=sdt, tokens=args.tokens, batch=args.batch,
                               **_drift(ref_logits, forced_logits), **_agreement(ref_toks, toks))
                    rows.append(row)
                    print(f"{name:8s} {mode:9s} {sdt:8s} logits max|Δ| {row['max_abs']:.2e} (rel "
                          f"{row['max_rel']:.2e}; first/last 128: {row['first128_max_abs']:.2e}/"
                          f"{row['last128_max_abs']:.2e}), forced argmax {row['teacher_forced_argmax_agreement']:.4f}"
                          f", greedy agreement {row['greedy_agreement']:.4f} (first divergence "
                          f"{row['first_divergence']}, {row['rows_identical']}/{args.batch} rows identical)",
                          flush=True)
                print(f"  [{name} {mode}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
