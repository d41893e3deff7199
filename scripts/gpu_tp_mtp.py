"""MTP speculation under tensor parallelism on two GPUs: correctness, then cost against TP=1.

A random-weight Qwen3-Next-class model (``--preset``, its first ``--layers`` layers, bf16;
lm_head a permutation of the embedding, so greedy margins are far above rounding) with a
random MTP head in its own checkpoint layout (``bench.random_mtp.add_random_mtp``):

1. **correctness** (CUDA graphs, replay form, 8 prompts): greedy tokens with MTP chains and
   MTP trees under TP=2 against plain decoding under TP=2 and TP=1, and MTP under TP=1;
   seeded sampled MTP output under TP=2 against TP=1 (reported, not asserted: bf16 sums in
   another order may move a draw at a boundary).
2. **cost** (``bench mtp``'s measurement: every drafter does its own work each step, the
   oracle's tokens are verified with acceptance ``--oracle-accept``): decode tokens/s and the
   draft step's ms per step for each drafter at each batch size, TP=1 and TP=2 in this run.

Keep NVLink multicast off (set here for the spawned worker too).  Prints a table, writes
``tp_mtp.json`` to ``$OUT`` (or ``--out``).  ``--smoke``: the tiny preset on CPU (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

import torch  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.bench import mtp as bench_mtp  # noqa: E402
from replayssm.bench.common import free_memory, private_copy  # noqa: E402
from replayssm.bench.e2e import _prompts  # noqa: E402
from replayssm.bench.hybrid_presets import random_hybrid_dir  # noqa: E402
from replayssm.bench.random_mtp import add_random_mtp  # noqa: E402
from replayssm.engine.loading import load  # noqa: E402


#: fixed chain lengths where the engine has a draft-length policy (its default adapts T per step)
_FIXED = {"spec_policy": "fixed"} if "spec_policy" in getattr(SpeculativeConfig, "__dataclass_fields__", {}) else {}


def _tokens(model, dev, prompts, params, spec=None, graphs=True, seed=0):
    with LLM(model, device=dev, decode_mode="replay", max_num_seqs=len(prompts), max_seq_len=128,
             cuda_graphs=graphs, speculative=spec, seed=seed) as llm:
        outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.mean_accepted_length for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-next-4b")
    p.add_argument("--layers", type=int, default=12, help="keep the first layers only (0: all; the default "
                   "keeps the run under ~4 minutes)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--drafters", default="none,ngram,mtp")
    p.add_argument("--num-tokens", type=int, default=3)
    p.add_argument("--oracle-accept", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--out", default=os.environ.get("OUT", "out/gpu_tp_mtp"))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda and torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    dev = "cuda:0" if cuda else "cpu"
    preset = args.preset if cuda else "qwen3-next-tiny"
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [int(b) for b in args.batch_sizes.split(",")] if cuda else [2]
    drafters = [None if d == "none" else d for d in args.drafters.split(",") if d]
    run_args = argparse.Namespace(
        device=dev, dtype=str(dtype).split(".")[1], mode="replay", buffer_size=max(16, 2 * (args.num_tokens + 1)),
        cuda_graphs=cuda, max_tokens=args.max_tokens if cuda else 8, prompt_len=args.prompt_len if cuda else 12,
        num_tokens=args.num_tokens, oracle_accept=args.oracle_accept, max_seq_len=None)
    run_args.max_seq_len = -(-(run_args.prompt_len + run_args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "preset": preset, "layers": args.layers,
           "dtype": run_args.dtype, "num_tokens": args.num_tokens, "oracle_accept": args.oracle_accept,
           "correctness": {}, "rows": []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        src = private_copy(random_hybrid_dir(preset, tmp, num_layers=(args.layers or None) if cuda else None), os.path.join(tmp, "target"))
        add_random_mtp(src)
        vocab = json.loads(Path(src, "config.json").read_text())["vocab_size"]
        prompts = _prompts(8, 24, vocab, seed=1)
        greedy = SamplingParams(max_tokens=24, ignore_eos=True)
        sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7)
        chain = SpeculativeConfig("mtp", num_tokens=args.num_tokens, **_FIXED)
        tree = SpeculativeConfig("mtp", num_tokens=args.num_tokens, tree="topk", tree_width=2, **_FIXED)
        got = {}
        for tp in (1, 2):
            t0 = time.perf_counter()
            model = load(src, torch.device(dev), dtype, tp, mtp=True)[0]
            res[f"load_s_tp{tp}"] = time.perf_counter() - t0
            got[tp, "plain"] = _tokens(model, dev, prompts, greedy, graphs=cuda)[0]
            got[tp, "chain"], acc = _tokens(model, dev, prompts, greedy, chain, graphs=cuda)
            got[tp, "tree"] = _tokens(model, dev, prompts, greedy, tree, graphs=cuda)[0]
            got[tp, "sampled"] = _tokens(model, dev, prompts, sampled, chain, graphs=cuda, seed=3)[0]
            res["correctness"][f"mean_accepted_tp{tp}"] = sum(acc) / len(acc)
            refs: dict = {}
            for b in batches:
                for m in drafters:
                    row = bench_mtp._run(run_args, model, None, m, b, refs)
                    row["tensor_parallel_size"] = tp
                    res["rows"].append(row)
                    print(f"[tp_mtp] TP={tp} B={b} {row['drafter']}: {row['decode_tokens_per_s']:.0f} tok/s, draft "
                          f"{row.get('draft_ms_per_step', 0):.3f} ms/step", file=sys.stderr, flush=True)
                    (out / "tp_mtp.json").write_text(json.dumps(res, indent=1, default=str))
            if tp > 1:
                model.close()
            del model
            free_memory(dev)
    n = len(prompts)

    def same(a, b):
        return sum(x == y for x, y in zip(got[a], got[b]))

    c = res["correctness"]
    c.update({"tp2_chain_eq_tp2_plain": same((2, "chain"), (2, "plain")),
              "tp2_tree_eq_tp2_plain": same((2, "tree"), (2, "plain")),
              "tp2_plain_eq_tp1_plain": same((2, "plain"), (1, "plain")),
              "tp2_chain_eq_tp1_chain": same((2, "chain"), (1, "chain")),
              "tp1_chain_eq_tp1_plain": same((1, "chain"), (1, "plain")),
              "tp2_sampled_eq_tp1_sampled": same((2, "sampled"), (1, "sampled")), "prompts": n})
    res["total_s"] = time.perf_counter() - t_start
    (out / "tp_mtp.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"device {res['device']}; {preset} ({(args.layers or 'all') if cuda else 'all'} layers) {run_args.dtype}; MTP T={args.num_tokens}; "
          f"oracle acceptance {args.oracle_accept}; total {res['total_s']:.0f} s")
    print("greedy prompts equal (of %d): TP2 MTP chain = TP2 plain %d, TP2 MTP tree = TP2 plain %d, TP2 plain = TP1 "
          "plain %d, TP2 MTP = TP1 MTP %d, TP1 MTP = TP1 plain %d; seeded sampled MTP TP2 = TP1 %d" % (
              n, c["tp2_chain_eq_tp2_plain"], c["tp2_tree_eq_tp2_plain"], c["tp2_plain_eq_tp1_plain"],
              c["tp2_chain_eq_tp1_chain"], c["tp1_chain_eq_tp1_plain"], c["tp2_sampled_eq_tp1_sampled"]))
    print(f"{'batch':>6} {'drafter':<8}{'TP1 tok/s':>11}{'TP2 tok/s':>11}{'TP2/TP1':>9}{'TP1 draft ms':>14}"
          f"{'TP2 draft ms':>14}{'TP2 vs none':>13}")
    rows = {(r["batch"], r["drafter"], r["tensor_parallel_size"]): r for r in res["rows"]}
    for b in batches:
        for m in drafters:
            name = m or "none"
            r1, r2 = rows[b, name, 1], rows[b, name, 2]
            base = rows.get((b, "none", 2))
            rel = r2["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else float("nan")
            print(f"{b:>6} {name:<8}{r1['decode_tokens_per_s']:>11.0f}{r2['decode_tokens_per_s']:>11.0f}"
                  f"{r2['decode_tokens_per_s'] / r1['decode_tokens_per_s']:>8.2f}x{r1.get('draft_ms_per_step', 0):>14.3f}"
                  f"{r2.get('draft_ms_per_step', 0):>14.3f}{rel:>12.2f}x")
    ok = c["tp2_chain_eq_tp2_plain"] == n and c["tp2_tree_eq_tp2_plain"] == n
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
