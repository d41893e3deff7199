"""Chat templates: our renderer (replayssm.engine.chat_template, the server's and LLM.chat's)
equals transformers' ``apply_chat_template`` on templates written for these tests; the
``--chat-template`` flag (missing file refused at startup, file and inline text used); the
shipped model answers /v1/chat/completions through the openai client."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
from server_helpers import MODEL, ROOT, Server

from replayssm import SamplingParams
from replayssm.engine.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate, looks_like_path
from replayssm.server.chat import check_chat_template, load_server_template

transformers = pytest.importorskip("transformers")

# ---- templates written for the tests ----------------------------------------------------------------
# Qwen3 / Hermes style: a <tools> block with tojson, tool calls (dict or JSON-string arguments),
# tool results grouped in one user turn, reasoning content, enable_thinking, loop controls
HERMES = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions.\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools>\\n\\nFor each call return <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- set fn = tool_call.function if tool_call.function else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# documents (RAG), special tokens, tojson's options, strftime_now (a date: the same in both renders)
DOCS = """{{ bos_token }}{% if documents %}<documents>
{% for doc in documents %}[{{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{% endfor %}</documents>
{% endif %}{% for m in messages %}{{ m.role }}> {{ m.content }}{{ eos_token }}
{% endfor %}meta: {{ {"b": "é<>&", "a": [1, 2]} | tojson(indent=2, sort_keys=True) }} {{ {"x": "é"} | tojson(ensure_ascii=True, separators=(",", ":")) }}
year {{ strftime_now("%Y") }}{% if add_generation_prompt %}
assistant> {% endif %}"""

# the {% generation %} block (transformers' assistant mask marker), custom kwargs, break
GENERATION = """{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}</a>
{% else %}<{{ m.role }}>{{ m.content }}
{% endif %}{% if max_turns is defined and loop.index >= max_turns %}{% break %}{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"""

# strict roles: raise_exception
STRICT = """{% set offset = 1 if messages[0].role == 'system' else 0 %}{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}{% if (m.role == 'user') != ((loop.index0 - offset) % 2 == 0) and m.role != 'system' %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}[{{ m.role | upper }}] {{ m.content | trim }}
{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""

TOOL_USE = """{% for t in tools %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}
{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                                       "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object",
                                                                                               "properties": {}}}},
]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather in Zürich?"}]
TOOL_CHAT = CHAT + [
    {"role": "assistant", "content": "", "reasoning_content": "need the tool",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}},
                    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]
DOCUMENTS = [{"title": "Alps", "text": "High mountains."}, {"title": "Rivers", "text": "Water <flows>."}]


def model_dir(tmp_path, name="m", chat_template=None, jinja_file=None, **extra):
    """A tokenizer directory (the shipped model's tokenizer) with the given template(s)."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(MODEL / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((MODEL / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    cfg.update(extra)
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja_file is not None:
        (d / "chat_template.jinja").write_text(jinja_file)
    return d


def both(d, messages, **kw):
    """(ours, transformers') rendering of ``messages`` with the templates of ``d``."""
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    want = hf.apply_chat_template(messages, tokenize=False, **kw)
    kw = dict(kw)
    agp = kw.pop("add_generation_prompt", False)
    got = ChatTemplate.from_model_dir(str(d)).render(messages, add_generation_prompt=agp, **kw)
    return got, want


CASES = {
    "hermes-plain": (HERMES, CHAT, {"add_generation_prompt": True}),
    "hermes-no-gen-prompt": (HERMES, CHAT, {"add_generation_prompt": False}),
    "hermes-tools": (HERMES, TOOL_CHAT, {"tools": TOOLS, "add_generation_prompt": True}),
    "hermes-thinking-off": (HERMES, TOOL_CHAT, {"tools": TOOLS, "add_generation_prompt": True,
                                                "enable_thinking": False}),
    "hermes-thinking-on": (HERMES, CHAT, {"add_generation_prompt": True, "enable_thinking": True}),
    "docs": (DOCS, CHAT, {"documents": DOCUMENTS, "add_generation_prompt": True}),
    "docs-none": (DOCS, CHAT[:2], {}),
    "docs-token-kwarg-wins": (DOCS, CHAT[:2], {"eos_token": "</END>"}),
    "generation": (GENERATION, CHAT, {"add_generation_prompt": True}),
    "generation-break": (GENERATION, CHAT, {"max_turns": 2}),
    "strict": (STRICT, CHAT, {"add_generation_prompt": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendering_equals_transformers(tmp_path, case):
    tpl, messages, kw = CASES[case]
    got, want = both(model_dir(tmp_path, chat_template=tpl, bos_token="<s>", eos_token="<eos>"), messages, **kw)
    assert got == want
    if case == "hermes-tools":   # the tools block is really there, with tojson's non-HTML-escaping output
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in got and "Zürich" in got
        assert '"arguments": {"city": "Zürich", "unit": "c"}' in got and "<tool_response>\n12:00" in got
    if case == "hermes-thinking-off":
        assert got.endswith("<think>\n\n</think>\n\n")


def test_raise_exception_for_a_bad_role_as_transformers(tmp_path):
    d = model_dir(tmp_path, chat_template=STRICT)
    bad = CHAT + [{"role": "robot", "content": "beep"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    with pytest.raises(Exception, match="bad role: robot"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="bad role: robot"):
        ChatTemplate.from_model_dir(str(d)).render(bad)
    with pytest.raises(ValueError, match="alternate"):   # ChatTemplateError is a ValueError (the server's 400)
        ChatTemplate.from_model_dir(str(d)).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_named_templates_list_picks_default_or_tool_use(tmp_path):
    named = [{"name": "default", "template": STRICT}, {"name": "tool_use", "template": TOOL_USE},
             {"name": "rag", "template": DOCS}]
    d = model_dir(tmp_path, chat_template=named)
    ours = ChatTemplate.from_model_dir(str(d))
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    for kw in ({}, {"tools": TOOLS}, {"tools": TOOLS, "add_generation_prompt": True}):
        want = hf.apply_chat_template(CHAT, tokenize=False, **kw)
        assert ours.render(CHAT, add_generation_prompt=kw.get("add_generation_prompt", False),
                           tools=kw.get("tools")) == want
    assert ours.render(CHAT, tools=TOOLS).startswith("TOOL get_weather ")
    assert ours.render(CHAT).startswith("[SYSTEM] You are terse.")
    # a template picked by name, as apply_chat_template(chat_template="rag")
    want = hf.apply_chat_template(CHAT, tokenize=False, chat_template="rag", documents=DOCUMENTS)
    assert ours.render(CHAT, add_generation_prompt=False, chat_template="rag", documents=DOCUMENTS) == want
    # no "default": a clear error naming the choices
    d2 = model_dir(tmp_path, "m2", chat_template=named[1:])
    with pytest.raises(ChatTemplateError, match="rag"):
        ChatTemplate.from_model_dir(str(d2)).render(CHAT)


def test_chat_template_jinja_file_wins_over_the_config(tmp_path):
    d = model_dir(tmp_path, chat_template=STRICT, jinja_file=GENERATION)
    got, want = both(d, CHAT, add_generation_prompt=True)
    assert got == want and got.startswith("<system>You are terse.")
    d2 = model_dir(tmp_path, "m2", jinja_file=HERMES)   # newer checkpoints: only the .jinja file
    got, want = both(d2, TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert got == want and "<tools>" in got


def test_special_tokens_as_transformers_sees_them(tmp_path):
    tpl = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ image_token }}|{{ messages[0].content }}"
    d = model_dir(tmp_path, chat_template=tpl, bos_token={"content": "<s>", "__type": "AddedToken"},
                  image_token="<img>", unk_token=None)
    got, want = both(d, CHAT[:1])
    assert got == want == "<s>|<eos>|<eos>||<img>|You are terse."


def test_bad_arguments_are_clear_errors(tmp_path):
    ours = ChatTemplate.from_model_dir(str(model_dir(tmp_path, chat_template=HERMES)))
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ours.render([])
    with pytest.raises(ChatTemplateError, match=r"tools\[0\] must be a JSON schema"):
        ours.render(CHAT, tools=[print])
    with pytest.raises(ChatTemplateError, match="may not set 'messages'"):
        ours.render(CHAT, chat_template_kwargs={"messages": []})
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(NoChatTemplate, match="no chat template"):
        ChatTemplate.from_model_dir(str(model_dir(tmp_path, "none"))).render(CHAT)


# ---- --chat-template --------------------------------------------------------------------------------
def test_looks_like_path():
    for s in ("/no/such/file", "tpl.jinja", "t.j2", "t.txt", "templates/chat", "./x"):
        assert looks_like_path(s), s
    for s in ("{{ messages[0].content }}", "{% for m in messages %}{{ m.content }}/{% endfor %}", "hello", "a\nb/c"):
        assert not looks_like_path(s), s


def test_chat_template_override_resolution(tmp_path):
    d = model_dir(tmp_path, chat_template=STRICT)
    f = tmp_path / "mine.jinja"
    f.write_text(GENERATION)
    assert load_server_template(str(d), str(f)).templates == GENERATION          # a file: its contents
    assert load_server_template(str(d), TOOL_USE).templates == TOOL_USE          # inline text
    assert load_server_template(None, str(f)).templates == GENERATION            # no model directory
    assert load_server_template(str(d)).templates == STRICT
    for missing in ("/no/such/file", str(tmp_path / "nope.jinja"), "chat.j2"):
        assert missing in check_chat_template(str(d), missing)
    assert "does not compile" in check_chat_template(str(d), "{% if %}")
    assert check_chat_template(str(d), str(f)) is None


def test_missing_chat_template_file_is_a_startup_error():
    r = subprocess.run([sys.executable, "-m", "replayssm", "serve", str(MODEL), "--port", "0",
                        "--chat-template", "/no/such/file"], cwd=str(ROOT), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--chat-template" in r.stderr and "'/no/such/file' does not exist" in r.stderr
    assert "listening" not in r.stdout


FILE_TEMPLATE = "{% for m in messages %}FILE[{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}FILE[assistant]{% endif %}"
INLINE_TEMPLATE = "{% for m in messages %}INLINE<{{ m.role }}>{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    f = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    f.write_text(FILE_TEMPLATE)
    started = {"file": Server(MODEL, "--chat-template", str(f), "--max-seq-len", "512", "--log-level", "warning"),
               "inline": Server(MODEL, "--chat-template", INLINE_TEMPLATE, "--max-seq-len", "512",
                                "--log-level", "warning"),
               "shipped": Server(MODEL, "--max-seq-len", "512", "--log-level", "warning")}
    yield started
    for s in started.values():
        s.stop()


def _tokens(server, text=None, messages=None):
    body = {"messages": messages} if messages is not None else {"prompt": text, "add_special_tokens": False}
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_template_file_and_inline_text_are_used(servers):
    msgs = [{"role": "user", "content": "hello"}]
    s = servers["file"].wait()
    assert _tokens(s, messages=msgs) == _tokens(s, "FILE[user]hello\nFILE[assistant]")
    s = servers["inline"].wait()
    assert _tokens(s, messages=msgs) == _tokens(s, "INLINE<user>hello\n")


def test_shipped_model_answers_chat_with_the_openai_client(servers, offline):
    s = servers["shipped"].wait()
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    r = c.chat.completions.create(model="tiny-mamba2", messages=msgs, max_tokens=12, temperature=0)
    ref = offline.chat(msgs, SamplingParams(max_tokens=12, temperature=0))[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert ref.prompt == ("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\ndef add(a, b):"
                          "<|im_end|>\n<|im_start|>assistant\n")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny-mamba2", messages=msgs, max_tokens=12, temperature=0, stream=True) if ch.choices)
    assert streamed == ref.text
    # the shipped template renders as transformers renders it
    hf = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ref.prompt
