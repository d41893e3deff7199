"""Structured outputs (llguidance), min_tokens, bad_words and logit_bias on the shipped tiny
byte-level model (``replayssm/assets/tiny-mamba2``, vocabulary = 256 bytes + ``<eos>``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import replayssm
from replayssm.engine import LLM
from replayssm.engine.config import SamplingParams, SpeculativeConfig

pytest.importorskip("llguidance")

MODEL = str(Path(replayssm.__file__).parent / "assets" / "tiny-mamba2")
EOS = 256

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"},
                   "tag": {"enum": ["a", "b"]}},
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
_TYPES = {"name": str, "age": int, "ok": bool, "tag": str}
PROMPTS = ["Person: ", "def f(x):\n", "Data "]

_engines: dict = {}


def engine(key: str = "replay") -> LLM:
    """One engine per configuration for the module (loading costs a second)."""
    if key not in _engines:
        kw = {"decode_mode": key} if key in ("recurrent", "replay", "kv", "auto") else {}
        if key == "ngram":
            kw = dict(speculative=SpeculativeConfig(method="ngram", num_tokens=3, prompt_lookup_min=1))
        elif key == "draft":
            kw = dict(speculative=SpeculativeConfig(method="draft", num_tokens=3, draft_model=MODEL))
        _engines[key] = LLM(MODEL, max_seq_len=256, **kw)
    return _engines[key]


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == set(SCHEMA["required"]), text
    for k, t in _TYPES.items():
        assert type(obj[k]) is t, (k, text)
    assert len(obj["name"]) <= 6 and 0 <= obj["age"] <= 99 and obj["tag"] in ("a", "b")


def test_json_schema_greedy_and_sampled_outputs_validate():
    llm = engine()
    ps = [SamplingParams(max_tokens=80, structured_outputs={"json": SCHEMA})] * 2 + \
         [SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured_outputs={"json": json.dumps(SCHEMA)})
          for i in range(3)]
    outs = llm.generate(PROMPTS[:2] + PROMPTS, ps)
    for o in outs:
        assert o.finish_reason == "stop", o
        assert EOS not in o.token_ids
        check_schema(o.text)
    anyobj = llm.generate(PROMPTS, SamplingParams(max_tokens=120, temperature=0.8, seed=3,
                                                  structured_outputs={"json_object": True}))
    for o in anyobj:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:   # cut by max_tokens: still a prefix of an object
            assert o.text.startswith("{")


def test_regex_choice_and_grammar_match():
    llm = engine()
    rx = r"[a-z]{2,5}-[0-9]{2}"
    choices = ["yes", "no", "maybe so"]
    lark = 'start: "n=" num ";"\nnum: %json {"type": "integer", "minimum": 1, "maximum": 500}'
    ps = [SamplingParams(max_tokens=20, structured_outputs={"regex": rx}),
          SamplingParams(max_tokens=20, temperature=1.0, seed=7, structured_outputs={"regex": rx}),
          SamplingParams(max_tokens=20, structured_outputs={"choice": choices}),
          SamplingParams(max_tokens=20, temperature=1.0, seed=1, n=3, structured_outputs={"choice": choices}),
          SamplingParams(max_tokens=20, structured_outputs={"grammar": lark})]
    outs = llm.generate(["Code: ", "Code: ", "Answer: ", "Answer: ", "Value "], ps)
    assert all(o.finish_reason == "stop" for o in outs)
    assert re.fullmatch(rx, outs[0].text) and re.fullmatch(rx, outs[1].text)
    assert outs[2].text in choices
    assert len(outs[3].samples) == 3 and all(s.text in choices for s in outs[3].samples)
    m = re.fullmatch(r"n=(\d+);", outs[4].text)
    assert m and 1 <= int(m.group(1)) <= 500
    g = llm.constraints.grammars
    assert g.hits >= 3   # compiled once per constraint (the samples and repeats reuse it)


def test_mixed_batch_free_rows_get_their_own_tokens():
    llm = engine()
    free = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.9, seed=5)]
    alone = [o.token_ids for o in llm.generate(["Once upon a time", "x = 1\n"], free)]
    cons = SamplingParams(max_tokens=80, structured_outputs={"json": SCHEMA})
    mixed = llm.generate(["Once upon a time", "Person: ", "x = 1\n", "Data "], [free[0], cons, free[1], cons])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    check_schema(mixed[1].text)


CONSTRAINED = [SamplingParams(max_tokens=60, structured_outputs={"json": SCHEMA}),
               SamplingParams(max_tokens=16, structured_outputs={"regex": r"(ab|cd)+x?"}),
               SamplingParams(max_tokens=12, min_tokens=4, bad_words=("e",), logit_bias={ord("t"): 2.0})]
FREE = SamplingParams(max_tokens=24)


@pytest.mark.parametrize("key", ["recurrent", "kv", "auto", "ngram", "draft"])
def test_constrained_greedy_identical_in_every_mode_and_with_speculation(key):
    prompts = ["Person: ", "the the the ", "Once upon a time", "abab abab abab"]
    params = CONSTRAINED + [FREE]
    want = [o.token_ids for o in engine("replay").generate(prompts, params)]
    got = engine(key).generate(prompts, params)
    assert [o.token_ids for o in got] == want
    if key in ("ngram", "draft"):   # grammar rows speculate too; the logit_bias row decodes plainly
        assert got[3].num_verify_steps > 0 and got[0].num_verify_steps > 0
        assert got[2].num_verify_steps == 0


def test_min_tokens_masks_eos_and_stop_tokens():
    llm = engine()
    eos_now = SamplingParams(max_tokens=20, logit_bias={EOS: 100.0})
    assert llm.generate(["Hi"], eos_now)[0].token_ids == [EOS]
    o = llm.generate(["Hi"], SamplingParams(max_tokens=20, min_tokens=5, logit_bias={EOS: 100.0}))[0]
    assert o.token_ids[-1] == EOS and len(o.token_ids) == 6 and o.finish_reason == "stop"
    stop_tok = ord("a")
    o = llm.generate(["Hi"], SamplingParams(max_tokens=20, min_tokens=3, stop_token_ids=[stop_tok],
                                            logit_bias={stop_tok: 100.0}))[0]
    assert o.token_ids == [o.token_ids[0], o.token_ids[1], o.token_ids[2], stop_tok]
    assert stop_tok not in o.token_ids[:3]
    # stop strings count only past min_tokens (vLLM)
    base = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12))[0].text
    s = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, stop=[base[:2]]))[0]
    assert s.text == ""
    s = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, min_tokens=4, stop=[base[:2]]))[0]
    assert s.text.startswith(base[:4])


def test_bad_words_never_generated():
    llm = engine()
    prompt = "the the the "
    base = llm.generate([prompt], SamplingParams(max_tokens=30))[0].text
    assert "th" in base and "e" in base
    out = llm.generate([prompt], SamplingParams(max_tokens=30, bad_words=["th", "e"]))[0]
    assert "th" not in out.text and "e" not in out.text
    assert len(out.token_ids) == 30


def test_logit_bias_shifts_greedy_choice():
    llm = engine()
    o = llm.generate(["Hi"], SamplingParams(max_tokens=8, logit_bias={ord("z"): 100.0}))[0]
    assert o.text == "z" * 8
    o = llm.generate(["Hi"], SamplingParams(max_tokens=8, logit_bias={"122": 100.0}))[0]   # JSON-style keys
    assert o.text == "z" * 8


@pytest.mark.parametrize("params, field", [
    (dict(structured_outputs={"regex": "(("}), "structured_outputs['regex']"),
    (dict(structured_outputs={"grammar": "start: foo"}), "structured_outputs['grammar']"),
    (dict(structured_outputs={"json": {"type": "nosuchtype"}}), "structured_outputs['json']"),
    (dict(logit_bias={300: 1.0}), "logit_bias"),
])
def test_bad_constraints_raise_in_add_request_and_queue_nothing(params, field):
    llm = engine()
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.add_request("Hi", SamplingParams(**params))
    assert not llm.has_unfinished() and not llm._requests


@pytest.mark.parametrize("params, field", [
    (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs"),
    (dict(structured_outputs={"yaml": "a"}), "structured_outputs"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs['json']"),
    (dict(structured_outputs={"json_object": False}), "structured_outputs['json_object']"),
    (dict(structured_outputs={"choice": []}), "structured_outputs['choice']"),
    (dict(structured_outputs={"regex": ""}), "structured_outputs['regex']"),
    (dict(structured_outputs="json"), "structured_outputs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=100, max_tokens=10), "min_tokens"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=3), "bad_words"),
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
])
def test_sampling_params_validation(params, field):
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field}")):
        SamplingParams(**params)


def test_missing_llguidance_names_the_extra(monkeypatch):
    from replayssm.engine.structured import ConstraintFactory, StructuredOutputsUnavailable
    llm = engine()
    monkeypatch.setitem(sys.modules, "llguidance", None)
    f = ConstraintFactory(llm.tokenizer, llm.vocab_size, EOS)
    with pytest.raises(StructuredOutputsUnavailable, match=r"replayssm\[structured\]"):
        f.build(SamplingParams(structured_outputs={"regex": "a+"}))
    # the other constraints need no llguidance
    assert f.build(SamplingParams(min_tokens=2, bad_words=["x"]))[0] is not None
