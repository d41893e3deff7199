"""A model that does not fit one GPU, under tensor parallelism: replay vs recurrent, speculation vs standard.

Two random-weight presets (``--model``):

* ``nemotron-h-56b`` (default): a **Nemotron-H-56B-class** hybrid (``nemotron_h``) at the
  sizes the Nemotron-H paper gives for its 56B model — d_model 8192, 118 layers (54 Mamba-2,
  54 squared-ReLU MLP of 32768, 10 attention with 64 query / 8 KV heads of 128), Mamba-2 with
  256 heads of 64, d_state 256, 8 groups, vocab 131072 (~56 B parameters, ~105 GiB in bf16:
  more than one H100, most of one H200).  The order of the layer kinds is assumed (attention
  spread evenly; the paper's exact pattern is not available offline).
* ``qwen3-next-80b``: a **Qwen3-Next-80B-A3B-class** hybrid (``qwen3_next``, 79.7 B parameters,
  3.9 B of them used a token, 0.6 B of those the embedding and head; 148 GiB in bf16: four
  H100s or two H200s).  From the published
  config (the same values are transformers 5.17's ``Qwen3NextConfig`` defaults, documented as
  the 80B-A3B configuration): hidden 2048, 48 layers with full attention every 4th
  (``full_attention_interval`` 4: 36 Gated DeltaNet, 12 attention), attention 16 query / 2 KV
  heads of head_dim 256 with the output gate and partial rotary 0.25, GDN 16 key / 32 value
  heads of 128 with conv kernel 4, MoE in every layer (``decoder_sparse_step`` 1, no
  ``mlp_only_layers``) of 512 experts, top-10 (``norm_topk_prob``), ``moe_intermediate_size``
  512 and a shared expert of 512, vocab 151936 (untied head), RMSNorm eps 1e-6.  Assumed:
  ``rope_theta`` 1e7 and ``intermediate_size`` 5120 (no dense MLP layer uses it) as recalled
  from the model card, not read offline (neither changes the cost); no MTP head; no EOS
  (random weights).  Under TP=4 each rank holds 4 query heads and one KV head (2 KV heads
  over 4 ranks: each kept by the two ranks whose query heads read it, exact), 4 GDN key /
  8 value heads, and a 128-channel slice of every expert and of the shared expert (all 512
  experts on every rank; routing replicated).

Built shard by shard on the GPUs (``TensorParallelGroup.random_model`` with the benchmarks'
greedy-margin recipe, so the oracle's continuation is the model's own in every decode form),
nothing written to disk.

For each batch in ``--batches`` (bf16, CUDA graphs, ``bench e2e``'s measurement): decode
tokens/s of ``recurrent`` (standard decoding) and ``replay``, and of replay speculation with
the oracle drafter (``--accept``, T=4; random weights, so the greedy continuation the oracle
knows is the model's own, taken from the recurrent run), then the ratios replay ÷ recurrent
(target ≥ 1.3×) and speculation ÷ standard (target ≥ 1.8×).  Before the timings, a check:
greedy tokens of 4 prompts in replay and kv decoding (CUDA graphs) equal recurrent's
(``check: ... replay 64/64, kv 64/64``; ``MISMATCH`` otherwise); after them, how long the
group's ``close()`` took (``closed in ... s``: bounded, a few seconds at most).
``--state-dtype bfloat16`` halves the states (B=256 fits two H200s only so).  Keep NVLink multicast off.  Writes
``tp_big.json`` (``tp_big_<model>.json`` for a non-default model) to ``$OUT``.  ``--smoke``: a
tiny shape of the chosen preset's structure on CPU (``--tp`` 1, 2 or 4).

    PYTHONPATH=. python scripts/gpu_tp_big.py --batches 64 [--tp 2]
    PYTHONPATH=. python scripts/gpu_tp_big.py --model qwen3-next-80b --tp 4 --batches 64   # 4 GPUs
    PYTHONPATH=. python scripts/gpu_tp_big.py --model qwen3-next-80b --tp 2 --batches 64   # 2 H200s
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch

from replayssm import LLM, SamplingParams
from replayssm.bench import e2e
from replayssm.bench.hybrid_presets import config_parameter_count
from replayssm.distributed import TensorParallelGroup
from replayssm.engine.config import SpeculativeConfig

#: 54 Mamba-2 (M), 54 MLP (-), 10 attention (*): ten units of 5 M/- pairs + one attention,
#: then four more M/- pairs
_PATTERN = ("M-M-M-M-M-*" * 10 + "M-M-M-M-")
assert len(_PATTERN) == 118 and _PATTERN.count("M") == 54 and _PATTERN.count("*") == 10
NEMOTRON_H_56B = dict(
    model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=8192,
    hybrid_override_pattern=_PATTERN, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    intermediate_size=32768, mlp_hidden_act="relu2", mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256,
    n_groups=8, conv_kernel=4, chunk_size=256, layer_norm_epsilon=1e-5, use_conv_bias=True, use_bias=False,
    mlp_bias=False, tie_word_embeddings=False, eos_token_id=None)
SMOKE_NEMOTRON = dict(NEMOTRON_H_56B, vocab_size=256, hidden_size=32, hybrid_override_pattern="M-M*-M-",
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8,
             ssm_state_size=8, n_groups=2)
QWEN3_NEXT_80B = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    num_hidden_layers=48, full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    partial_rotary_factor=0.25, rope_theta=10_000_000.0, attention_bias=False, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=5120,
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=None)
#: the same structure at CPU size (GDN 4 key / 8 value heads, 8 query / 2 KV heads: at TP=4
#: the KV heads are replicated as in the full model)
SMOKE_QWEN3_NEXT = dict(QWEN3_NEXT_80B, vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=8,
                        head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                        shared_expert_intermediate_size=8, intermediate_size=16)
#: ``--model`` -> (the GPU config, the CPU smoke config)
PRESETS = {"nemotron-h-56b": (NEMOTRON_H_56B, SMOKE_NEMOTRON), "qwen3-next-80b": (QWEN3_NEXT_80B, SMOKE_QWEN3_NEXT)}


def check_forms(model, args, n: int = 4, tokens: int = 16) -> dict:
    """Greedy tokens of ``n`` prompts in ``recurrent`` (eager), ``replay`` and ``kv`` (CUDA
    graphs on GPUs) decoding on the split model: ``{mode: tokens equal to recurrent's, of
    all}``.  The margin recipe makes every form's greedy choice the same well above bf16
    rounding, so a mismatch is an error of the split path (the fused finish over ``tp``
    ranks, the replicated KV heads, the sharded experts), not noise."""
    vocab = int(model.config.vocab_size)
    prompts = e2e._prompts(n, args.prompt_len, vocab, seed=123)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    out = {}
    for mode, graphs in (("recurrent", False), ("replay", args.cuda_graphs), ("kv", args.cuda_graphs)):
        with LLM(model, device=args.device, dtype=args.dtype, decode_mode=mode, max_num_seqs=n, cuda_graphs=graphs,
                 max_seq_len=args.max_seq_len, ssm_state_dtype=args.ssm_state_dtype) as llm:
            out[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    want = out["recurrent"]
    return {m: (sum(a == b for x, y in zip(want, got) for a, b in zip(x, y)), n * tokens) for m, got in out.items()
            if m != "recurrent"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(PRESETS), default="nemotron-h-56b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batches", default="64")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--accept", type=float, default=0.8)
    p.add_argument("--state-dtype", default="auto")
    p.add_argument("--budget-s", type=float, default=400.0, help="start nothing new past this wall time")
    p.add_argument("--hang-s", type=float, default=240.0,
                   help="print every thread's stack if one run takes longer than this (a hang's where)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = "cuda:0" if cuda else "cpu"
    cfg = PRESETS[a.model][0 if cuda else 1]
    n = config_parameter_count(cfg)
    args = argparse.Namespace(device=dev, dtype="bfloat16" if cuda else "float32", buffer_size=16, cuda_graphs=cuda,
                              max_tokens=a.max_tokens if cuda else 6, prompt_len=a.prompt_len if cuda else 8,
                              spec_method="oracle", oracle_accept=a.accept, model=None, ssm_state_dtype=a.state_dtype)
    args.max_seq_len = -(-(args.prompt_len + args.max_tokens + 16) // 64) * 64
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model": a.model, "tp": a.tp, "params": n,
           "bf16_GiB": n * 2 / 2**30, "state_dtype": a.state_dtype, "rows": []}
    print(f"model: {a.model}{'' if cuda else ' (smoke shape)'}, {n / 1e9:.1f} B parameters "
          f"({n * 2 / 2**30:.0f} GiB bf16), TP={a.tp}", flush=True)
    if cuda:   # refuse a split whose weights alone overfill a GPU before building anything
        need, total = n * 2 / a.tp, torch.cuda.mem_get_info()[1]
        if need > 0.92 * total:
            print(f"{a.model} at TP={a.tp}: {need / 2**30:.0f} GiB of bf16 weights a GPU, more than "
                  f"{torch.cuda.get_device_name()}'s {total / 2**30:.0f} GiB; use a larger --tp", flush=True)
            return 2
    spec = SpeculativeConfig("ngram", num_tokens=4, spec_policy="fixed")
    with TensorParallelGroup(a.tp, dev) as group:
        t0 = time.perf_counter()
        model = group.random_model(cfg, dtype=args.dtype, seed=0, margin=True)
        res["build_s"] = time.perf_counter() - t0
        print(f"built in {res['build_s']:.0f} s", flush=True)
        faulthandler.dump_traceback_later(a.hang_s, exit=False)
        try:
            res["check"] = check_forms(model, args)
        finally:
            faulthandler.cancel_dump_traceback_later()
        ok = all(same == total for same, total in res["check"].values())
        print("check: greedy tokens equal to recurrent's: " + ", ".join(
            f"{m} {same}/{total}" for m, (same, total) in res["check"].items()) + ("" if ok else "  MISMATCH"),
            flush=True)
        for b in [int(x) for x in a.batches.split(",")]:
            for mode, sp in (("recurrent", None), ("replay", None), ("replay", spec)):
                if time.perf_counter() - t_start > a.budget_s:
                    print(f"budget: skipped {mode} B={b}{' spec' if sp else ''}", flush=True)
                    continue
                faulthandler.dump_traceback_later(a.hang_s, exit=False)
                try:
                    row = e2e._run(LLM, SamplingParams, model, args, b, mode, spec=sp)
                except torch.OutOfMemoryError as e:
                    print(f"{mode} B={b}: out of memory ({str(e)[:80]})", flush=True)
                    torch.cuda.empty_cache()
                    continue
                finally:
                    faulthandler.cancel_dump_traceback_later()
                res["rows"].append(row)
                print(f"[{time.perf_counter() - t_start:.0f}s] {mode}{' + spec' if sp else ''} B={b}: "
                      f"{row['decode_tokens_per_s']:.0f} tok/s, acc {row['mean_accepted_length']:.2f}, "
                      f"peak {row['peak_memory_GB']} GB", flush=True)
        model.close()
        t0 = time.perf_counter()
        group.close()       # bounded (distributed.teardown); the with-block's exit then does nothing
        res["close_s"] = time.perf_counter() - t0
        print(f"closed in {res['close_s']:.1f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = "tp_big.json" if a.model == "nemotron-h-56b" else f"tp_big_{a.model}.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"{'B':>5}{'recurrent':>11}{'replay':>9}{'spec':>9}{'replay/rec':>11}{'spec/std':>9}   (targets 1.3x, 1.8x)")
    by = {(r["batch"], r["mode"], r["speculative"]): r["decode_tokens_per_s"] for r in res["rows"]}
    for b in sorted({r["batch"] for r in res["rows"]}):
        rec, rep, sp = by.get((b, "recurrent", None)), by.get((b, "replay", None)), by.get((b, "replay", "ngram"))
        f = lambda x: f"{x:9.0f}" if x else f"{'-':>9}"  # noqa: E731
        r1 = f"{rep / rec:10.2f}x" if rec and rep else f"{'-':>11}"
        r2 = f"{sp / rec:8.2f}x" if rec and sp else f"{'-':>9}"
        print(f"{b:>5}{f(rec):>11}{f(rep)}{f(sp)}{r1}{r2}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
