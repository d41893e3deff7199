"""Chat replies in the prefix cache on the GPU: a finished request's state after its prompt and
reply is cached (a state point), so the next chat turn resumes at the end of the reply.  One
run, a few minutes on one H100:

1. correctness: the tiny random presets of the three families (Mamba-2 ``tiny``,
   ``nemotron-h-tiny``, ``qwen3-next-tiny``; float32, CUDA graphs), every decode mode, plus
   n-gram speculation and 16-bit states in replay mode: 2 conversations x 4 chat turns (each
   prompt the previous prompt, its reply and 24 new tokens) with caching off and with
   replies cached.  Greedy tokens must be identical, every token's logprob within 1e-3 of
   caching off's, and every later turn must resume at the end of the previous reply (the
   prefix cache's ``prefix_state_hit_tokens``; with speculation a reply a verify step ran
   past is not cached and its turn checks only the output);
2. timing: ``bench e2e``'s chat workload on the random-weight 2.7B Mamba-2 preset (``--presets
   2.7b,nemotron-h-4b`` adds the hybrid; bf16, CUDA graphs, replay mode, 16 conversations x 4
   turns of 128 new tokens and 64 generated), three runs each in one process: caching off,
   prompts only (``prefix_cache_replies=False``, the state before this change) and replies
   cached:
   mean TTFT, TTFT and prompt tokens prefilled per turn, output tokens/s, and the share of
   outputs equal to caching off's.

Prints a short table and writes ``$OUT/gpu_chat_replies.json`` when ``$OUT`` is set.

    PYTHONPATH=. python scripts/gpu_chat_replies.py                 # GPU
    PYTHONPATH=. python scripts/gpu_chat_replies.py --cpu-check     # CPU dry run: part 1, eager
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.bench import e2e
from replayssm.models.loader import load_model

TURNS, CONVS, NEW, GEN = 4, 2, 24, 12


def _chat(llm, firsts, new_msgs) -> tuple[list, list]:
    """All conversations' turns (turn t of every conversation submitted together): per turn
    the outputs and the prompt tokens resumed at a reply's end."""
    hist, outs, state_hits = [list(f) for f in firsts], [], []
    params = SamplingParams(max_tokens=GEN, logprobs=1, ignore_eos=True)
    for t in range(TURNS):
        prompts = [h + m[t] for h, m in zip(hist, new_msgs)] if t else hist
        before = llm.stats.get("prefix_state_hit_tokens", 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = llm.generate(prompts, params)
        outs.append([(o.token_ids, [lp[0] for lp in o.logprobs]) for o in res])
        state_hits.append(llm.stats.get("prefix_state_hit_tokens", 0) - before)
        hist = [p + o.token_ids for p, o in zip(prompts, res)]
    return outs, state_hits


def correctness(device: str, graphs: bool) -> list[dict]:
    rows = []
    rng = random.Random(0)
    cases = [(p, m, {}) for p in ("tiny", "nemotron-h-tiny", "qwen3-next-tiny")
             for m in ("recurrent", "replay", "kv", "auto")]
    cases += [(p, "replay", {"speculative": SpeculativeConfig("ngram", num_tokens=3)}) for p in ("tiny",
                                                                                              "nemotron-h-tiny")]
    cases += [(p, "replay", {"ssm_state_dtype": "bfloat16"}) for p in ("tiny", "qwen3-next-tiny")]
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for preset, mode, extra in cases:
            if preset not in models:
                models[preset] = load_model(e2e._random_model_dir(preset, tmp, seed=1), device=device,
                                            dtype="float32")
            model = models[preset]
            V = int(model.config.vocab_size)
            firsts = [[rng.randrange(V) for _ in range(37 + 5 * c)] for c in range(CONVS)]
            msgs = [[[rng.randrange(V) for _ in range(NEW)] for _ in range(TURNS)] for _ in range(CONVS)]
            kw = dict(device=device, dtype="float32", decode_mode=mode, max_seq_len=512, kv_block_size=16,
                      max_num_seqs=4, cuda_graphs=graphs, **extra)
            got = {}
            for name, on in (("off", False), ("on", True)):
                with LLM(model, enable_prefix_caching=on, **kw) as llm:
                    got[name] = _chat(llm, firsts, msgs)
                    if on:
                        saved = llm.stats["prefix_states_saved"]
                        skipped = llm.stats["prefix_replies_skipped"]
            (off, _), (on, hits) = got["off"], got["on"]
            same = all(a[0] == b[0] for ta, tb in zip(off, on) for a, b in zip(ta, tb))
            dlp = max((abs(x - y) for ta, tb in zip(off, on) for a, b in zip(ta, tb) for x, y in zip(a[1], b[1])),
                      default=0.0)
            want_hits = [0] + [sum(len(firsts[c]) + t * (GEN + NEW) + GEN - 1 for c in range(CONVS))
                               for t in range(TURNS - 1)]
            spec = "speculative" in extra
            ok = same and dlp < 1e-3 and (hits == want_hits if not spec else saved > 0 and saved + skipped ==
                                          TURNS * CONVS)
            rows.append(dict(preset=preset, mode=mode, extra=",".join(extra) or "-", same_tokens=same,
                             max_logprob_diff=dlp, state_hit_tokens=hits, want=want_hits, ok=ok))
            print(f"  {preset:<16}{mode:<10}{rows[-1]['extra']:<16} tokens equal {same}, |dlogprob| {dlp:.1e}, "
                  f"reply hits {hits} (want {want_hits}): {'ok' if ok else 'FAIL'}", flush=True)
    return rows


def timing(out: Path, presets: list[str]) -> list[dict]:
    rows = []
    for preset in presets:
        d = out / preset
        t0 = time.perf_counter()
        rc = e2e.main(["--preset", preset, "--cuda-graphs", "--workload", "chat", "--workload-mode", "replay",
                       "--conversations", "16", "--turns", "4", "--turn-len", "128", "--max-tokens", "64",
                       "--max-num-seqs", "16", "--no-plots", "--out", str(d)])
        res = json.loads((d / "prefix.json").read_text())
        for r in res["runs"]:
            r.pop("output_ids", None)
        rows.append(dict(preset=preset, rc=rc, seconds=time.perf_counter() - t0, runs=res["runs"],
                         summary=res["summary"]))
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-check", action="store_true", help="part 1 only, on the CPU, without CUDA graphs")
    ap.add_argument("--presets", default="2.7b", help="part 2's presets (bench e2e names), comma-separated")
    args = ap.parse_args()
    device = "cpu" if args.cpu_check else "cuda"
    print("1. correctness: caching off vs replies cached (greedy tokens, logprobs, reply hits)")
    corr = correctness(device, graphs=not args.cpu_check)
    result = {"correctness": corr}
    if not args.cpu_check:
        out = Path(os.environ.get("OUT") or tempfile.mkdtemp())
        print("2. timing: bench e2e chat workload (off / prompts only / replies cached)")
        result["timing"] = timing(out, [p for p in args.presets.split(",") if p])
        print(f"{'preset':<15}{'cache':<9}{'TTFT ms':>9}{'tok/s':>8}{'hit':>6}  per turn TTFT ms / prefilled")
        for t in result["timing"]:
            for r in t["runs"]:
                per = " ".join(f"{a:.0f}/{b}" for a, b in zip(r["ttft_per_turn_ms"], r["prefilled_per_turn"]))
                print(f"{t['preset']:<15}{r['cache']:<9}{r['ttft_mean_ms']:>9.1f}{r['output_tokens_per_s']:>8.0f}"
                      f"{r['hit_rate']:>6.2f}  {per}")
            s = t["summary"]
            print(f"{t['preset']:<15}TTFT prompts-only / replies {s['chat_ttft_prompts_only_over_replies']:.2f}x, "
                  f"off / replies {s['chat_ttft_off_over_on']:.2f}x, same output {s['chat_same_output_frac']:.2f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_chat_replies.json").write_text(json.dumps(result, indent=1, default=str))
    bad = [r for r in corr if not r["ok"]]
    print("correctness: " + ("all ok" if not bad else f"{len(bad)} FAILED"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
