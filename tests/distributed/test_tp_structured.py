"""Constrained rows under tensor parallelism: the grammar masks of a speculative step reach
every rank (as bytes), so TP=2 speculative constrained output equals TP=1 plain constrained
output (the shipped tiny model, which has a tokenizer; CPU, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import replayssm
from replayssm import LLM
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.models.loader import load_tokenizer

pytest.importorskip("llguidance")
MODEL = str(Path(replayssm.__file__).parent / "assets" / "tiny-mamba2")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPTS = ["Person: ", "abab abab ab", "the the the "]
PARAMS = [SamplingParams(max_tokens=24, structured_outputs={"json": SCHEMA}),
          SamplingParams(max_tokens=12, structured_outputs={"regex": r"(ab|cd)+x?"}),
          SamplingParams(max_tokens=10)]


def test_constrained_speculation_under_tp_equals_plain_constrained_decoding(group):
    want = [o.token_ids for o in LLM(MODEL, max_seq_len=128).generate(PROMPTS, PARAMS)]
    model = group.load_model(MODEL)
    sp = SpeculativeConfig("ngram", num_tokens=3, prompt_lookup_min=1, spec_policy="fixed")
    with LLM(model, max_seq_len=128, speculative=sp, tokenizer=load_tokenizer(MODEL)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == want
    json.loads(outs[0].text)
    assert outs[0].num_verify_steps + outs[1].num_verify_steps > 0     # constrained rows speculated
