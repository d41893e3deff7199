"""Helpers of the greedy-head tests (two and four ranks): a checkpoint whose LM head ties on
purpose across every vocabulary-shard boundary, and greedy runs with the switch on and off."""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402


def boundaries(V: int, N: int) -> list[int]:
    """First global row of every vocabulary shard after the first (those with real rows)."""
    Vs = -(-V // N)
    return [r * Vs for r in range(1, N) if r * Vs < V]


def tied_head_checkpoint(path: str, V: int, N: int, seed: int = 3, **over) -> str:
    """A tiny Mamba-2 whose LM head rows are zero (logits exactly 0: ties everywhere) except:
    rows ``b - 1`` and ``b`` equal at every shard boundary ``b`` (``c e_0``: the lower index
    must win), rows ``2`` and ``b + 2`` equal (``c e_1``: a tie between shards, not at the
    boundary) and row ``b + 1`` = ``-c e_0`` (a later shard wins alone).  Each logit is one
    product, so every rank and TP=1 compute it exactly alike."""
    m = H.tiny_mamba2(seed=seed, vocab_size=V, tie_word_embeddings=False, **over)
    bs = boundaries(V, N)
    with torch.no_grad():
        w = m.lm_head.weight
        w.zero_()
        c = 4.0
        for b in bs:
            w[b - 1, 0] = w[b, 0] = c
            w[b + 1, 0] = -c
            w[b + 2, 1] = c
        w[2, 1] = c
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return H.save_tiny(m, path)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9], [30, 31, 3], [11, 12]]


def generate(model, params=None, maxlen: int = 64, n_new: int = 12, **kw):
    """``(token ids per prompt, greedy decode steps run, logits decode steps run)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=maxlen, **kw) as llm:
            outs = llm.generate(PROMPTS, params or SamplingParams(max_tokens=n_new))
            calls = llm.runner.num_calls
    return [o.token_ids for o in outs], calls["greedy_decode"], calls["decode"]
