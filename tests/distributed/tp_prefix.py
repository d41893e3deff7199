"""The tensor-parallel tests' prefix-caching run: each prompt served alone (greedy) by an
engine with prefix caching, for a split model and its one-rank reference alike."""

from __future__ import annotations

import warnings


def prefix_prompts(vocab: int) -> list[list[int]]:
    """Requests sharing a 30-token base at different depths (checkpoints, inside blocks,
    past the ring), the base again last."""
    base = [(7 * i + 3) % vocab for i in range(30)]
    return [base, base[:9] + [1, 2], base[:17] + [3], base[:22] + [4, 5], base]


def cached_runs(models, prompts, max_seq_len: int, max_tokens: int = 5, **kw) -> list[tuple[list, int]]:
    """``[(token ids per prompt, prefix hit tokens)]`` for each model of ``models``: prompts
    one at a time through one engine (``kw`` over replay decoding, 4-token KV blocks, a
    6-entry ring and checkpoints every 8 tokens)."""
    from replayssm import LLM, SamplingParams

    kw = {"decode_mode": "replay", "kv_block_size": 4, "buffer_size": 6, "enable_prefix_caching": True,
          "prefix_checkpoint_interval": 8, **kw}
    runs = []
    for m in models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LLM(m, max_seq_len=max_seq_len, **kw) as llm:
                runs.append(([llm.generate([p], SamplingParams(max_tokens=max_tokens))[0].token_ids
                              for p in prompts], llm.stats["prefix_hit_tokens"]))
    return runs
