"""Tensor parallelism of the newer families on two GPUs (Qwen3.5 dense/MoE, Granite-4.0-H,
Bamba, Falcon-H1, Zamba2, Kimi-Linear): the tiny checkpoints of
``tests/distributed/test_tp_families.py`` and ``test_tp_kimi.py`` in float32 on CUDA (Triton
kernels, CUDA graphs, NCCL all-reduces inside them).

Per family: the largest |logit| difference of TP=2 against TP=1 (full forward, one batch);
greedy tokens of TP=2 against TP=1 in replay and KV modes and with prefix caching; the
wall time of each generate call, TP=1 and TP=2 in the same run (tiny models: this measures
the per-step overhead of the collectives, not a speed-up).  Exit code 1 when a family fails
or its tokens differ.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=. python scripts/gpu_tp_families.py      # writes tp_families.json to $OUT if set

``--smoke``: two families on CPU (gloo), to check the script itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

import hf_utils as H  # noqa: E402
import test_tp_families as T  # noqa: E402
import test_tp_kimi as K  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.distributed import TensorParallelGroup  # noqa: E402
from replayssm.models import load_model  # noqa: E402

SMOKE = "--smoke" in sys.argv
DEVICE = "cpu" if SMOKE else "cuda"
#: name -> (builder, overrides): Kimi-Linear's KDA (Triton kernels, 2 heads a rank) and MLA
#: (the MLA kernel over 2 query heads a rank and the replicated latent), with MoE / low-rank q
SPECS = dict(T.SPECS, kimi_linear=(K.tiny_kimi, K.SPECS["moe"]), kimi_linear_qlora=(K.tiny_kimi, K.SPECS["qlora"]))
FAMILIES = ["qwen3_5", "qwen3_5_moe", "granite", "bamba", "falcon_h1", "falcon_h1_g1", "zamba2", "zamba2_gqa",
            "kimi_linear", "kimi_linear_qlora"]
if SMOKE:
    FAMILIES = ["granite", "zamba2", "kimi_linear"]
RUNS = {   # name -> LLM keywords
    "replay": dict(decode_mode="replay"),
    "kv": dict(decode_mode="kv"),
    "prefix": dict(decode_mode="replay", enable_prefix_caching=True, kv_block_size=16, prefix_checkpoint_interval=16),
}


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _generate(model, prompts, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=256, max_num_seqs=8, **kw) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=4))            # warm-up (graph capture)
            _sync()
            t0 = time.perf_counter()
            out = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32))]
            _sync()
            return out, time.perf_counter() - t0


def main() -> int:
    root, rows, bad = tempfile.mkdtemp(), [], 0
    with TensorParallelGroup(2, DEVICE) as group:
        for i, name in enumerate(FAMILIES):
            fn, over = SPECS[name]
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    path = H.save_tiny(fn(seed=21 + i, **over), os.path.join(root, name))
                one = load_model(path, device=DEVICE, dtype="float32")
                two = group.load_model(path, dtype="float32")
                V = one.config.vocab_size
                base = [(7 * j + 3) % V for j in range(40)]
                prompts = [base, base[:19] + [1, 2], base[:33] + [3], [5, 6, 7], base]
                ids = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(i)).to(DEVICE)
                with torch.no_grad():
                    dlogit = float((two(ids) - one(ids)).abs().max())
                row = dict(family=name, max_abs_logit_diff=dlogit)
                for run, kw in RUNS.items():
                    a, t1 = _generate(one, prompts, **kw)
                    b, t2 = _generate(two, prompts, **kw)
                    same = sum(x == y for x, y in zip(a, b))
                    bad += same != len(a)
                    row[run] = dict(equal=f"{same}/{len(a)}", tp1_s=round(t1, 4), tp2_s=round(t2, 4))
                two.close()
            except Exception as e:   # report and go on
                bad += 1
                row = dict(family=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'family':>14} {'|dlogit|':>9} " + " ".join(f"{r + ' eq / tp1 s / tp2 s':>28}" for r in RUNS))
    for r in rows:
        if "error" in r:
            print(f"{r['family']:>14} FAILED {r['error']}")
            continue
        cells = " ".join(f"{r[k]['equal']:>10} / {r[k]['tp1_s']:>6.3f} / {r[k]['tp2_s']:>6.3f}" for k in RUNS)
        print(f"{r['family']:>14} {r['max_abs_logit_diff']:>9.2e} {cells}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tp_families.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
