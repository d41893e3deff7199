"""LLM.chat: conversations rendered with the chat template (replayssm.engine.chat_template)
and generated; greedy output equals LLM.generate on the rendered prompt."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from replayssm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "replayssm" / "assets" / "tiny-mamba2"
GREEDY = SamplingParams(max_tokens=10, temperature=0)
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(MODEL), max_seq_len=512, max_num_seqs=4)


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    out = llm.chat(CHAT, GREEDY)
    assert len(out) == 1
    text = out[0].prompt
    assert text == ("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\ndef add(a, b):<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(text, add_special_tokens=False).ids
    ref = llm.generate([ids], GREEDY)[0]
    assert out[0].prompt_token_ids == ids
    assert out[0].token_ids == ref.token_ids and out[0].text == ref.text and len(ref.token_ids) > 0
    assert llm.generate(text, GREEDY)[0].text == out[0].text   # this tokenizer adds no special tokens


def test_chat_batch_of_conversations_and_per_conversation_params(llm):
    convs = [CHAT, [{"role": "user", "content": "import os\n"}], CHAT[1:]]
    params = [GREEDY, SamplingParams(max_tokens=4, temperature=0), GREEDY]
    outs = llm.chat(convs, params)
    assert len(outs) == 3
    for conv, sp, out in zip(convs, params, outs):
        one = llm.chat(conv, sp)[0]
        assert out.prompt == one.prompt and out.token_ids == one.token_ids
    assert len(outs[1].token_ids) <= 4


def test_chat_template_override_kwargs_tools_and_documents(llm, tmp_path):
    tpl = ("{% for t in tools or [] %}<tool>{{ t.function.name }}</tool>{% endfor %}"
           "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}"
           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}{% if enable_thinking is false %}[no-think]{% endif %}assistant:{% endif %}")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    out = llm.chat(CHAT[1:], GREEDY, chat_template=tpl, chat_template_kwargs={"enable_thinking": False},
                   tools=tools, documents=[{"title": "t", "text": "body"}])[0]
    assert out.prompt == "<tool>lookup</tool><doc>body</doc>user: def add(a, b):\n[no-think]assistant:"
    assert out.text == llm.generate([llm.tokenizer.encode(out.prompt, add_special_tokens=False).ids], GREEDY)[0].text
    out = llm.chat(CHAT[1:], GREEDY, chat_template=tpl, add_generation_prompt=False)[0]
    assert out.prompt == "user: def add(a, b):\n"
    f = tmp_path / "t.jinja"   # a file works too
    f.write_text(tpl)
    assert llm.chat(CHAT[1:], GREEDY, chat_template=str(f))[0].prompt == "user: def add(a, b):\nassistant:"
    # matches transformers' apply_chat_template with the same arguments
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    want = hf.apply_chat_template(CHAT[1:], tools=tools, documents=[{"title": "t", "text": "body"}], chat_template=tpl,
                                  tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert want == "<tool>lookup</tool><doc>body</doc>user: def add(a, b):\n[no-think]assistant:"


def test_chat_errors(llm):
    bad = "{% if messages[-1].role != 'user' %}{{ raise_exception('last must be user') }}{% endif %}x"
    with pytest.raises(ValueError, match="last must be user"):
        llm.chat([{"role": "assistant", "content": "a"}], GREEDY, chat_template=bad)
    with pytest.raises(ValueError, match="conversation 1: chat template: last must be user"):
        llm.chat([CHAT, [{"role": "assistant", "content": "a"}]], GREEDY, chat_template=bad)
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([], GREEDY)
    with pytest.raises(ValueError, match="/no/such/template.jinja"):
        llm.chat(CHAT, GREEDY, chat_template="/no/such/template.jinja")
    assert not llm.has_unfinished()   # nothing was queued


def test_engine_does_not_import_the_server():
    """Layering: the engine is below the server (the renderer lives in engine/)."""
    for fn in (ROOT / "replayssm" / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(fn.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert "server" not in mod.split("."), f"{fn}: imports {mod}"
            elif isinstance(node, ast.Import):
                assert not any("replayssm.server" in a.name for a in node.names), f"{fn}"
