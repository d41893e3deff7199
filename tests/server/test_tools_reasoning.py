"""Tool calling, reasoning, template kwargs and the request-field table of the server.

The parsers and the streaming assembler are tested on scripted text; one in-process server
(uvicorn on loopback over a scripted engine whose output is fixed) is driven with the real
``openai`` client; the field table runs against the real ``plain_server``."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from server_helpers import API_KEY, MODEL
from replayssm.server.protocol import REFUSED
from replayssm.server.reasoning import ReasoningStreamer, split_reasoning
from replayssm.server.tools import ToolStreamer, held_prefix, make_tool_parser, tool_call_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        out.append(text[i:i + k])
        i += k
    return out


def _stream(parser, text: str, seed: int):
    s = ToolStreamer(parser)
    content, calls = "", {}
    pieces = _chunks(text, seed)
    for j, p in enumerate(pieces + [""]):
        c, deltas = s.feed(p, final=j == len(pieces))
        content += c
        for d in deltas:
            slot = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert slot["id"] is None and d["type"] == "function"
                slot["id"], slot["name"] = d["id"], d["function"]["name"]
            slot["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


# ---- parsers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hermes", "qwen3"])
def test_hermes_extracts_calls_and_content(name):
    p = make_tool_parser(name)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = p.extract(text)
    assert content.strip() == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # only calls: no content; not a call: kept as text; an unclosed block at the end is parsed
    assert p.extract('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n')[0] is None
    assert p.extract("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert p.extract('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1][0]["function"]["name"] == "f"
    assert p.extract("plain answer") == ("plain answer", [])


def test_nemotron_extracts_a_list_of_calls():
    p = make_tool_parser("nemotron")
    content, calls = p.extract('<TOOLCALL>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
                               '</TOOLCALL>')
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert p.extract("<TOOLCALL>{}</TOOLCALL>")[1] == []


@pytest.mark.parametrize("seed", range(20))
def test_streamed_calls_reassemble_to_the_whole_parse(seed):
    p = make_tool_parser("hermes")
    text = ('Sure <tool_c then <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool_call>bad</tool_call> <tool')
    content, calls = _stream(p, text, seed)
    whole_content, whole = p.extract(text)
    assert content == whole_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


def test_partial_tag_is_held_back_until_known():
    s = ToolStreamer(make_tool_parser("hermes"))
    assert s.feed("Hi <tool") == ("Hi ", [])
    assert s.feed("s are") == ("<tools are", [])      # not a tag after all: released
    assert s.feed(" <tool_") == (" ", [])
    c, d = s.feed('call>{"name": "f", "arguments": {"q": "x"}}</tool_call>')
    assert c == "" and d[0]["function"] == {"name": "f", "arguments": ""} and "id" in d[0]
    assert json.loads(d[1]["function"]["arguments"]) == {"q": "x"} and "id" not in d[1]
    assert held_prefix("abc<", "<think>") == 1 and held_prefix("abc", "<think>") == 0


# ---- reasoning -------------------------------------------------------------------------------
def test_reasoning_split():
    assert split_reasoning("qwen3", "<think>hmm</think>\n\nHello") == ("hmm", "Hello")
    assert split_reasoning("qwen3", "Hello") == (None, "Hello")
    assert split_reasoning("qwen3", "step 1</think>\nAnswer", "<|im_start|>assistant\n<think>\n") == \
        ("step 1", "Answer")
    assert split_reasoning("qwen3", "still thinking", "assistant\n<think>\n") == ("still thinking", None)
    assert split_reasoning("deepseek_r1", "abc</think>def") == ("abc", "def")
    assert split_reasoning("deepseek_r1", "<think>abc</think>def") == ("abc", "def")
    assert split_reasoning("deepseek_r1", "abc") == ("abc", None)


@pytest.mark.parametrize("seed", range(10))
def test_reasoning_streams_as_whole(seed):
    text = "<think>Let me think: a < b and </thi no</think>\n\nThe answer <is> 4."
    s = ReasoningStreamer("qwen3")
    r = c = ""
    pieces = _chunks(text, seed)
    for j, p in enumerate(pieces + [""]):
        a, b = s.feed(p, final=j == len(pieces))
        r, c = r + a, c + b
    assert (r, c) == split_reasoning("qwen3", text)


# ---- grammar ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hermes", "nemotron"])
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_call_grammar_compiles(name, parallel):
    llg = pytest.importorskip("llguidance")
    g = tool_call_grammar(make_tool_parser(name), [WEATHER, TIME], parallel=parallel)
    assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(g)) == ""
    assert "get_weather" in g and '"city"' in g


# ---- in-process server over a scripted engine, driven by the openai client --------------------
@dataclass
class _Out:
    request_id: str
    text: str
    token_ids: list
    finish_reason: str | None
    prompt_token_ids: list = field(default_factory=list)
    index: int = 0
    logprobs: list | None = None
    error: str | None = None


class ScriptedEngine:
    """Answers every request with :attr:`script` (a few characters per step); records the
    prompts it was given (decoded)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.vocab_size, self.num_slots = tokenizer, tokenizer.get_vocab_size(), 4
        self.script = ""
        self.prompts: list[str] = []
        self.params = []
        self.live: dict = {}

    def add_request(self, ids, params, request_id=None):
        self.prompts.append(self.tokenizer.decode(ids, skip_special_tokens=False))
        self.params.append(params)
        self.live[request_id] = [0, list(ids)]

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, st in list(self.live.items()):
            st[0] = min(st[0] + 3, len(self.script))
            done = st[0] == len(self.script)
            outs.append(_Out(rid, self.script[:st[0]], list(range(1, st[0] + 1)), "stop" if done else None, st[1]))
            if done:
                del self.live[rid]
        return outs

    def abort(self, rid):
        return self.live.pop(rid, None) is not None

    def recover(self):
        self.live.clear()

    def occupancy(self):
        return {"running": len(self.live), "waiting": 0, "total_slots": 4, "free_slots": 4 - len(self.live),
                "free_kv_blocks": 0, "total_kv_blocks": 0}


TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
                 "{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.function.name }} "
                 "{{ c.function.arguments.city }}>{% endfor %}{% endif %}"
                 "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% if enable_thinking %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    pytest.importorskip("openai")
    import shutil

    import uvicorn
    from tokenizers import Tokenizer

    from replayssm.server.app import ServerConfig, build_app

    d = tmp_path_factory.mktemp("tools") / "m"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    eng = ScriptedEngine(Tokenizer.from_file(str(d / "tokenizer.json")))
    app = build_app(eng, ServerConfig(model_name="scripted", model_dir=str(d), tool_call_parser="hermes",
                                      enable_auto_tool_choice=True, reasoning_parser="qwen3",
                                      log_stats_interval=None))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield eng, url
    server.should_exit = True
    t.join(10)


def test_tool_call_end_to_end_with_the_openai_client(scripted):
    import openai

    eng, url = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    eng.script = ('<think>The user wants weather.</think>\n\nChecking.<tool_call>\n'
                  '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    msgs = [{"role": "user", "content": [{"type": "text", "text": "weather in "}, {"type": "text", "text": "Paris?"}]}]
    r = client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER, TIME], max_tokens=100)
    assert "TOOLS:get_weather;get_time;" in eng.prompts[-1] and "user: weather in Paris?" in eng.prompts[-1]
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
    assert ch.message.model_extra["reasoning_content"] == "The user wants weather."
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # streamed: deltas reassemble to the same call; reasoning and content apart
    stream = client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER], max_tokens=100,
                                            stream=True)
    content, reasoning, calls, reasons = "", "", {}, []
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert content == "Checking." and reasoning == "The user wants weather." and reasons == ["tool_calls"]
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}

    # the call and its result go back: arguments (a JSON string) reach the template as a dict
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    eng.script = "It is sunny."
    r = client.chat.completions.create(model="scripted", messages=history, tools=[WEATHER], max_tokens=100,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert "<call get_weather Paris>" in eng.prompts[-1] and f"[{call.id}]" in eng.prompts[-1]
    assert eng.prompts[-1].endswith("assistant:<think>\n")
    # the prompt opened the reasoning: without </think> the whole output is reasoning
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.model_extra["reasoning_content"] == "It is sunny."

    # tool_choice "none": no parsing; arguments that are not JSON: 400 naming the message
    eng.script = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    r = client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER], tool_choice="none",
                                       max_tokens=100)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    bad = [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                 "function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=msgs + bad, max_tokens=5)
    assert "messages[1].tool_calls[0]" in e.value.body["message"] and e.value.body["param"] == "messages"


def test_required_and_named_tool_choice_use_a_grammar(scripted):
    from replayssm.server.protocol import engine_has

    eng, url = scripted
    eng.script = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    body = {"messages": [{"role": "user", "content": "t?"}], "tools": [WEATHER, TIME], "max_tokens": 50}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": choice})
        if not engine_has("structured_outputs"):
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            continue
        assert r.status_code == 200, r.text
        grammar = eng.params[-1].structured_outputs["grammar"]
        assert "get_time" in grammar and ("get_weather" in grammar) == (choice == "required")
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    r = httpx.post(url + "/v1/chat/completions",
                   json={**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# ---- the field table: every field honoured or refused by name ---------------------------------
#: (endpoint, field, value) that must be accepted (each changes the output or is an identifier)
HONOURED = [
    ("chat", "tools", [WEATHER]), ("chat", "tool_choice", "none"), ("chat", "parallel_tool_calls", False),
    ("chat", "chat_template_kwargs", {"enable_thinking": False}), ("chat", "documents", [{"title": "t", "text": "x"}]),
    ("both", "min_tokens", 2), ("both", "bad_words", ["zz"]), ("both", "logit_bias", {"5": 1.0}),
    ("both", "skip_special_tokens", False), ("both", "include_stop_str_in_output", True),
    ("cmpl", "echo", True), ("both", "seed", 3), ("both", "user", "u1"), ("both", "metadata", {"k": "v"}),
    ("both", "store", False), ("both", "service_tier", "auto"), ("both", "modalities", ["text"]),
    ("both", "truncate_prompt_tokens", 4), ("both", "add_special_tokens", False), ("both", "priority", 1),
    ("chat", "top_logprobs", 2), ("both", "safety_identifier", "s"), ("both", "prompt_cache_key", "k"),
    ("both", "response_format", {"type": "text"}), ("both", "structured_outputs", {"choice": ["yes", "no"]}),
    ("both", "guided_choice", ["yes", "no"]), ("both", "guided_regex", "[ab]{3}"),
    ("both", "guided_json", {"type": "object"}), ("both", "guided_grammar", 'start: "ab"'),
]
REFUSED_VALUES = {"prompt_logprobs": 1, "audio": {"voice": "x", "format": "wav"}, "modalities": ["text", "audio"],
                  "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
                  "kv_transfer_params": {"x": 1}, "store": True, "service_tier": "flex", "functions": [{"name": "f"}],
                  "function_call": "auto", "reasoning_effort": "low", "verbosity": "low", "use_beam_search": True,
                  "length_penalty": 2.0, "allowed_token_ids": [1], "logits_processors": ["x"],
                  "spaces_between_special_tokens": False, "detokenize": False, "return_tokens_as_token_ids": True,
                  "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "cache_salt": "s",
                  "mm_processor_kwargs": {}, "vllm_xargs": {}, "request_id": "r", "continue_final_message": True,
                  "chat_template": "x", "min_tokens": 1, "bad_words": ["x"], "logit_bias": {"1": 1}, "suffix": "s",
                  "echo": True}
CHAT_ONLY = {"continue_final_message", "chat_template"}
CMPL_ONLY = {"suffix"}


def _post(server, kind, extra):
    h = {"Authorization": f"Bearer {API_KEY}"}
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}
        return httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=60)
    body = {"prompt": "hello there", "max_tokens": 4, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, headers=h, timeout=60)


def test_every_refused_field_is_named(plain_server):
    from replayssm.server.protocol import engine_has

    assert set(REFUSED) <= set(REFUSED_VALUES)
    for name, value in REFUSED_VALUES.items():
        if name in ("min_tokens", "bad_words", "logit_bias") and engine_has(name):
            continue   # honoured (HONOURED)
        kinds = ["chat"] if name in CHAT_ONLY or name == "echo" else ["cmpl"] if name in CMPL_ONLY else ["chat", "cmpl"]
        for kind in kinds:
            r = _post(plain_server, kind, {name: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (kind, name, r.text)
    for kind in ("chat", "cmpl"):   # unknown fields: named, never dropped
        r = _post(plain_server, kind, {"frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate" and "unknown" in r.text
        r = _post(plain_server, kind, {"stream_options": {"include_usage": True, "x": 1}, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_every_honoured_field_is_accepted(plain_server):
    from replayssm.server.protocol import engine_has

    for kind, name, value in HONOURED:
        if name in ("min_tokens", "bad_words", "logit_bias", "structured_outputs", "guided_choice", "guided_regex",
                    "guided_json", "guided_grammar") and not engine_has(name if name in ("min_tokens", "bad_words",
                                                                                          "logit_bias")
                                                                         else "structured_outputs"):
            continue
        for k in (["chat", "cmpl"] if kind == "both" else [kind]):
            extra = {name: value}
            if name == "tools":
                extra["tool_choice"] = "none"   # the plain server has no tool parser
            if name == "top_logprobs":
                extra["logprobs"] = True
            r = _post(plain_server, k, extra)
            assert r.status_code == 200, (k, name, r.text)


def test_honoured_fields_have_their_effect(plain_server):
    from replayssm.server.protocol import engine_has

    base = _post(plain_server, "cmpl", {"temperature": 0, "max_tokens": 8}).json()["choices"][0]["text"]
    r = _post(plain_server, "cmpl", {"temperature": 0, "max_tokens": 8, "echo": True}).json()
    assert r["choices"][0]["text"] == "hello there" + base
    if len(base) >= 3:
        stop = base[1:3]
        cut = _post(plain_server, "cmpl", {"temperature": 0, "max_tokens": 8, "stop": [stop]}).json()
        kept = _post(plain_server, "cmpl", {"temperature": 0, "max_tokens": 8, "stop": [stop],
                                            "include_stop_str_in_output": True}).json()
        assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + stop
    r = _post(plain_server, "cmpl", {"max_tokens": 2, "truncate_prompt_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == 1
    if engine_has("structured_outputs"):
        r = _post(plain_server, "chat", {"max_tokens": 10, "guided_choice": ["yes", "no"]}).json()
        assert r["choices"][0]["message"]["content"] in ("yes", "no")
        r = _post(plain_server, "chat", {"max_tokens": 5, "guided_grammar": "start: foo"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar"
