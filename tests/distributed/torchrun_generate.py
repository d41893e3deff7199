"""Run by ``test_multinode.py`` under ``torchrun`` (each "node" one process): greedy tokens of
a tensor-parallel engine whose ranks ``torchrun`` started; rank 0 prints them as JSON."""

import json
import os
import sys

import torch

from replayssm import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9] * 12]

if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, max_seq_len=128, device="cpu")   # ranks > 0 serve here and exit
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=int(sys.argv[2])))
    print(json.dumps({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                      "tokens": [o.token_ids for o in outs]}), flush=True)
    llm.close()
