"""GPU check of the model families added in wave 3: each tiny random checkpoint (the test
suite's builders) runs through the engine on CUDA in float32 (Triton kernels, CUDA graphs) in
every decode mode; prints whether its greedy tokens equal the float64 CPU engine's.

    PYTHONPATH=.:tests/models python3 scripts/gpu_smoke_families.py
"""

from __future__ import annotations

import os
import sys
import tempfile

from replayssm import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "models"))
import test_falcon_h1 as F  # noqa: E402
import test_granite_bamba as G  # noqa: E402
import test_qwen3_5 as Q  # noqa: E402
from hf_utils import save_quiet  # noqa: E402

BUILDERS = {
    "qwen3_5": lambda: Q.tiny_qwen3_5(seed=1),
    "qwen3_5_moe": lambda: Q.tiny_qwen3_5_moe(seed=2),
    "granite": lambda: G._build("granite", 3),
    "bamba": lambda: G._build("bamba", 4),
    "falcon_h1": lambda: F.tiny_falcon_h1(seed=5),
}


def main() -> int:
    root, bad = tempfile.mkdtemp(), 0
    for name, build in BUILDERS.items():
        path = save_quiet(build(), os.path.join(root, name))
        V = LLM(path, dtype="float64", max_seq_len=128).vocab_size
        prompts = [[(7 * i + 3 * j + 1) % V for j in range(5 + 3 * i)] for i in range(3)]
        params = SamplingParams(max_tokens=8)
        ref = [o.token_ids for o in LLM(path, dtype="float64", max_seq_len=128).generate(prompts, params)]
        for mode in ("recurrent", "replay", "kv", "auto"):
            try:
                llm = LLM(path, device="cuda", dtype="float32", decode_mode=mode, max_seq_len=128, max_num_seqs=4,
                          auto_threshold=8)
                got = [o.token_ids for o in llm.generate(prompts, params)]
                same = sum(a == b for a, b in zip(got, ref))
                print(f"{name:>12} {mode:>9}: graphs={llm.runner.use_graphs} {same}/{len(ref)} prompts equal "
                      f"the float64 CPU tokens", flush=True)
            except Exception as e:   # report and go on: this is a smoke run
                bad += 1
                print(f"{name:>12} {mode:>9}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
