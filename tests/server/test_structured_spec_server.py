"""Structured outputs through the real server with draft-model speculation (the `openai`
client on loopback): constrained rows speculate and their greedy text is the offline plain
engine's constrained text."""

from __future__ import annotations

import json
import re

import openai

from replayssm import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def test_constrained_outputs_with_speculation_match_offline(spec_server, offline):
    c = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = spec_server.metrics()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    r = c.completions.create(model="tiny-mamba2", prompt="Person: ", max_tokens=40, temperature=0,
                             extra_body={"response_format": rf})
    ref = offline.generate(["Person: "], SamplingParams(max_tokens=40, structured_outputs={"json": SCHEMA}))[0]
    assert r.choices[0].text == ref.text
    obj = json.loads(r.choices[0].text)
    assert set(obj) == {"name", "n"} and type(obj["n"]) is int
    for body, so, ok in (({"structured_outputs": {"regex": "(ab|cd)+x?"}}, {"regex": "(ab|cd)+x?"},
                          lambda t: re.fullmatch("(ab|cd)+x?", t)),
                         ({"guided_choice": ["yes", "no", "maybe"]}, {"choice": ["yes", "no", "maybe"]},
                          lambda t: t in ("yes", "no", "maybe"))):
        r = c.completions.create(model="tiny-mamba2", prompt="abab abab ", max_tokens=12, temperature=0,
                                 extra_body=body)
        ref = offline.generate(["abab abab "], SamplingParams(max_tokens=12, structured_outputs=so))[0]
        assert r.choices[0].text == ref.text and ok(ref.text)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny-mamba2", messages=msgs, max_tokens=40, temperature=0,
                                  response_format=rf)
    ref = offline.chat(msgs, SamplingParams(max_tokens=40, structured_outputs={"json": SCHEMA}))[0]
    assert r.choices[0].message.content == ref.text
    json.loads(ref.text)
    after = spec_server.metrics()
    key = "replayssm:spec_decode_num_drafts_total"
    assert after[key] > before[key]   # the constrained requests ran verify steps
