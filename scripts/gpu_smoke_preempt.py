"""GPU check of preemption (swap to host and back) with the engine's CUDA defaults (graphs on):
greedy output with preemptions forced every few steps equals the output without, per decode
mode and drafter, on the shipped tiny model in float32.

    python3 scripts/gpu_smoke_preempt.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig

ASSETS = Path(__file__).resolve().parents[1] / "replayssm" / "assets"
TINY, DRAFT = str(ASSETS / "tiny-mamba2"), str(ASSETS / "tiny-mamba2-draft")
PROMPTS = [[(5 * i + 3 * j + 1) % 250 for j in range(3 + 2 * i)] for i in range(8)]


def run(llm, preempt_every=0):
    seqs = [llm.add_request(p, SamplingParams(max_tokens=24)) for p in PROMPTS]
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while llm.has_unfinished():
            llm.step()
            step += 1
            if preempt_every and step % preempt_every == 0:
                for s in [s for s in llm.scheduler.running if not s.prefilling][-2:]:
                    llm.scheduler.preempt(s)
    return [llm.output(s).token_ids for s in seqs]


def main() -> int:
    bad = 0
    specs = {None: None, "ngram": SpeculativeConfig("ngram", num_tokens=3),
             "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=DRAFT)}
    for mode in ("recurrent", "replay", "kv", "auto"):
        for name, sp in specs.items():
            kw = dict(device="cuda", dtype="float32", decode_mode=mode, max_seq_len=128, max_num_seqs=4,
                      auto_threshold=12, speculative=sp)
            want = run(LLM(TINY, **kw))
            llm = LLM(TINY, **kw)
            got = run(llm, preempt_every=3)
            ok = got == want and llm.runner.use_graphs
            bad += not ok
            print(f"{mode:>9} {str(name):>5}: graphs={llm.runner.use_graphs} preemptions={llm.stats['preemptions']} "
                  f"{'same' if got == want else 'DIFFERENT'}", flush=True)
    print("FAILED" if bad else "all equal")
    return 1 if bad else 0


if __name__ == "__main__":
    torch.set_num_threads(4)
    sys.exit(main())
