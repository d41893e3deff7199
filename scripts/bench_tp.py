"""Tensor parallelism on two GPUs: TP=2 against TP=1 decode throughput, and a model too
large for one GPU generating under TP=2.

1. The random-weight 2.7B Mamba-2 preset of ``bench e2e`` (bf16, CUDA graphs): greedy
   tokens of TP=2 checked against TP=1, then decode tokens/s at each batch size in each
   mode, TP=1 and TP=2 in the same run (``bench e2e``'s measurement, ``_run``).
2. A random-weight Nemotron-H-class model of about 80 B parameters (150 GiB in bf16; one
   H200 holds about 139 GiB), built shard by shard directly on the two GPUs
   (``TensorParallelGroup.random_model``), generating with CUDA graphs.

Keep NVLink multicast off: ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1`` (the spawned workers inherit the environment).  Writes
``tp.json`` under ``--out`` and prints a table last.  TP=1, TP=2 and the big model each run
in a process of their own (a TP group whose teardown was given up leaves its process unable
to start another).  ``--smoke``: tiny sizes on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from replayssm import LLM, SamplingParams
from replayssm.bench import e2e
from replayssm.bench.hybrid_presets import config_parameter_count
from replayssm.bench.isolated import run_isolated
from replayssm.distributed import TensorParallelGroup
from replayssm.engine.loading import load

_NEMOTRON_UNIT = "M-M-M-M*-M-M-M-M-"   # Mamba-2/MLP pairs, one attention layer per unit
BIG = dict(model_type="nemotron_h", vocab_size=131072, hidden_size=8192, hybrid_override_pattern=_NEMOTRON_UNIT * 10,
           num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=32768,
           mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
           eos_token_id=None)
BIG_SMOKE = dict(BIG, vocab_size=256, hidden_size=32, hybrid_override_pattern=_NEMOTRON_UNIT, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8,
                 ssm_state_size=8, n_groups=2)


def _throughput(tp: int, path: str, run_args, prompts, modes, batches) -> dict:
    """TP=``tp`` in this (fresh) process: greedy tokens of ``prompts``, then decode tokens/s
    per mode and batch; the group (TP > 1) is closed before returning."""
    dev = run_args.device
    t0 = time.perf_counter()
    model = load(path, torch.device(dev), getattr(torch, run_args.dtype), tp)[0]
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    with LLM(model, device=dev, max_num_seqs=8, max_seq_len=run_args.max_seq_len) as llm:
        tokens = [list(o.token_ids) for o in llm.generate(prompts, greedy)]
    rows = []
    for mode in modes:
        for b in batches:
            row = e2e._run(LLM, SamplingParams, model, run_args, b, mode)
            row.update(tensor_parallel_size=tp, load_s=load_s)
            rows.append(row)
    if tp > 1:
        model.close()
    return {"tokens": tokens, "rows": rows}


def _big(cfg: dict, run_args, cuda: bool, B: int) -> dict:
    """The ~80 B model under TP=2 (random weights built on the GPUs), in this (fresh) process."""
    dev = run_args.device
    n = config_parameter_count(cfg)
    with TensorParallelGroup(2, dev) as group:
        t0 = time.perf_counter()
        model = group.random_model(cfg, dtype=run_args.dtype, seed=0)
        build_s = time.perf_counter() - t0
        with LLM(model, device=dev, max_num_seqs=B, max_seq_len=run_args.max_seq_len, cuda_graphs=cuda) as llm:
            ps = e2e._prompts(B, run_args.prompt_len, cfg["vocab_size"], seed=2)
            llm.generate(ps[:B], SamplingParams(max_tokens=2, ignore_eos=True))
            t0 = time.perf_counter()
            outs = llm.generate(ps, SamplingParams(max_tokens=run_args.max_tokens, ignore_eos=True))
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            gen = sum(len(o.token_ids) for o in outs)
            res = {"params": n, "bf16_GiB": n * 2 / 2**30, "batch": B, "generated": gen, "wall_s": wall,
                   "tokens_per_s": gen / wall, "build_s": build_s, "capture_s": llm.capture_s,
                   "rank0_peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        model.close()
    return res


def _checked(r: dict, what: str) -> dict:
    if "error" in r:
        raise RuntimeError(f"{what} failed in its process:\n{r['error']}")
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="2.7b")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--modes", default="recurrent,replay")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--big-batch", type=int, default=16)
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--out", default="out/bench_tp")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda:0" if cuda else "cpu"
    run_args = argparse.Namespace(
        device=dev, dtype="bfloat16" if cuda else "float32", buffer_size=16, cuda_graphs=cuda,
        max_tokens=args.max_tokens if cuda else 8, prompt_len=args.prompt_len if cuda else 16, spec_method=None,
        oracle_accept=1.0, max_seq_len=None)
    run_args.max_seq_len = -(-(run_args.prompt_len + run_args.max_tokens + 16) // 64) * 64
    preset = args.preset if cuda else "tiny"
    batches = [int(b) for b in args.batch_sizes.split(",")] if cuda else [4]
    modes = args.modes.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count() if cuda else 0,
           "preset": preset, "throughput": [], "big": None}
    with tempfile.TemporaryDirectory() as tmp:
        path = e2e._random_model_dir(preset, tmp)
        prompts = e2e._prompts(8, run_args.prompt_len, e2e.PRESETS[preset]["vocab_size"], seed=1)
        tokens = {}
        for tp in (1, 2):   # each in its own process: a given-up TP teardown ends with it
            r = _checked(run_isolated(_throughput, tp, path, run_args, prompts, modes, batches), f"TP={tp}")
            tokens[tp] = r["tokens"]
            res["throughput"] += r["rows"]
        same = sum(a == b for a, b in zip(tokens[1], tokens[2]))
        res["greedy_tokens_equal"] = f"{same}/{len(prompts)}"
    if not args.skip_big:
        B = args.big_batch if cuda else 2
        res["big"] = _checked(run_isolated(_big, BIG if cuda else BIG_SMOKE, run_args, cuda, B), "the big model")
    (out / "tp.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"device {res['device']} x{res['gpus']}; preset {preset}; greedy tokens TP=2 == TP=1: "
          f"{res['greedy_tokens_equal']}")
    print(f"{'mode':<10}{'batch':>6}{'TP=1 tok/s':>12}{'TP=2 tok/s':>12}{'TP2/TP1':>9}")
    rows = {(r["mode"], r["batch"], r["tensor_parallel_size"]): r["decode_tokens_per_s"] for r in res["throughput"]}
    for mode in modes:
        for b in batches:
            a, c = rows[mode, b, 1], rows[mode, b, 2]
            print(f"{mode:<10}{b:>6}{a:>12.0f}{c:>12.0f}{c / a:>8.2f}x")
    if res["big"]:
        g = res["big"]
        print(f"big: {g['params'] / 1e9:.1f} B params ({g['bf16_GiB']:.0f} GiB bf16) under TP=2, B={g['batch']}: "
              f"{g['tokens_per_s']:.0f} tok/s, built in {g['build_s']:.0f} s, rank-0 peak "
              f"{g['rank0_peak_GiB']} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
