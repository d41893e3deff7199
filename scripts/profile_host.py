"""The engine's host-side cost per step, with the model call stubbed out (CPU, no GPU needed).

Runs ``LLM`` steps on a tiny random model of ``--preset`` at batch ``--batch``, with the
runner's decode / greedy verify step replaced by stubs that return at once (random accept
counts for speculation, the bench's oracle drafter proposing), and reports the wall time of a
step split into scheduling, block reservation, drafting, the model-call phase (what ``bench
e2e`` counts as ``decode_s``: reservation, drafting, the call, the host sync and the step's
bookkeeping) and postprocessing.  On the GPU the device idles while this runs, so it adds to
every step.  Usage::

    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --spec
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

import torch

from replayssm.bench.e2e import OracleDrafter, _prompts, _random_model_dir
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.models import load_model


def _timed(obj, name: str, acc: dict, key: str) -> None:
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        acc[key] += time.perf_counter() - t
        return out

    setattr(obj, name, g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nemotron-h-tiny")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--spec", action="store_true", help="speculative steps (T=4, oracle drafter)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    B = args.batch
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(_random_model_dir(args.preset, tmp), device="cpu", dtype=torch.float32)
    V = int(model.config.vocab_size)
    prompts = _prompts(B, 8, V, seed=1)
    n_tok = 5 * (args.steps + 10)
    llm = LLM(model, device="cpu", dtype="float32", decode_mode="replay", max_num_seqs=B, max_seq_len=n_tok + 64,
              speculative=SpeculativeConfig("ngram", num_tokens=4) if args.spec else None)
    if args.spec:
        llm.drafter = OracleDrafter({tuple(p): list(range(n_tok)) for p in prompts}, 4, 0.8, V, llm.device)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=n_tok, ignore_eos=True))
    llm.step()   # prefill, on the real model
    g = torch.Generator().manual_seed(0)
    llm.runner.greedy_verify_step = lambda slots, tokens, parent, valid, tree: (
        torch.randint(1, tokens.shape[1] + 1, (tokens.shape[0],), generator=g),
        torch.randint(0, V, (tokens.shape[0],), generator=g), None)
    llm.runner.decode = lambda slots, toks: torch.randn(len(slots), V, generator=g)
    acc = defaultdict(float)
    _timed(llm.outputs, "append", acc, "append (stop criteria)")
    _timed(llm.scheduler, "schedule", acc, "schedule")
    _timed(llm.blocks, "reserve_tokens", acc, "reserve")
    if args.spec:
        _timed(llm.drafter, "propose", acc, "propose")
    _timed(llm.executor, "run", acc, "model-call phase")
    _timed(llm, "_postprocess", acc, "postprocess")
    for _ in range(5):
        llm._step()
    acc.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        llm._step()
    per = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"{'spec' if args.spec else 'plain'} B={B}: {per:.2f} ms host per step; "
          + ", ".join(f"{k} {v / args.steps * 1e3:.2f}" for k, v in acc.items()))


if __name__ == "__main__":
    main()
