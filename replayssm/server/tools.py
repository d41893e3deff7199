"""Tool calls in generated text: parsers, a streaming assembler and the grammar that forces one.

``--tool-call-parser`` picks the format the model writes its calls in:

* ``hermes`` / ``qwen3``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
  block per call (several allowed);
* ``nemotron``: ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``.

:meth:`ToolParser.extract` splits a whole output into content (the text outside the calls,
``None`` when only whitespace) and OpenAI tool calls (``{"id": "call_...", "type":
"function", "function": {"name", "arguments": JSON string}}``).  A block whose body is not
a call (bad JSON, no name) stays in the content, as the model wrote it.

:class:`ToolStreamer` does the same on text arriving piece by piece: text outside the calls
is released as content at once, except a tail that may be the start of an opening tag
(held until it is known not to be one); a call is released when its closing tag arrives
(or at the end of the output) as two deltas, as OpenAI streams them: the first with
``index``, ``id``, ``type`` and the name (``arguments: ""``), the next with the arguments.

:func:`tool_call_grammar` builds the llguidance Lark grammar that makes a model emit one
call (or several) of the given tools in the parser's format, each call's arguments
constrained by its function's parameter schema (``tool_choice="required"`` or a named
function).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

TOOL_PARSERS = ("hermes", "qwen3", "nemotron")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag`` (text that
    may still become the tag once more arrives)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _call(obj) -> dict | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments"}`` object (``parameters`` is
    accepted for ``arguments``, as some models write it), or ``None`` if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):   # some models write the arguments as a JSON string already
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": text}}


@dataclass(frozen=True)
class ToolParser:
    """One call format: an opening and a closing tag around a JSON object (``many=False``)
    or a JSON list of objects (``many=True``)."""

    name: str
    start: str
    end: str
    many: bool

    def calls_of(self, body: str) -> list[dict] | None:
        """The calls of one block's body, or ``None`` if the body is not a (list of) call(s)."""
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        objs = obj if self.many and isinstance(obj, list) else [obj] if not self.many else None
        if not objs:
            return None
        calls = [_call(o) for o in objs]
        return None if any(c is None for c in calls) else calls

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a whole output."""
        streamer = ToolStreamer(self)
        content, deltas = streamer.feed(text, final=True)
        return (content if content.strip() else None), streamer.calls


def make_tool_parser(name: str) -> ToolParser:
    if name in ("hermes", "qwen3"):
        return ToolParser(name, "<tool_call>", "</tool_call>", many=False)
    if name == "nemotron":
        return ToolParser(name, "<TOOLCALL>", "</TOOLCALL>", many=True)
    raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(TOOL_PARSERS)})")


class ToolStreamer:
    """Splits text arriving in pieces into content and tool-call deltas (see the module)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buf = ""            # text not released yet
        self.inside = False      # within an opening tag's block
        self.calls: list[dict] = []

    def _close(self, body: str, raw: str) -> tuple[str, list[dict]]:
        calls = self.parser.calls_of(body)
        if calls is None:   # not a call: the model's text, as written
            return raw, []
        deltas = []
        for c in calls:
            i = len(self.calls)
            self.calls.append(c)
            fn = c["function"]
            deltas.append({"index": i, "id": c["id"], "type": "function",
                           "function": {"name": fn["name"], "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": fn["arguments"]}})
        return "", deltas

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        """``(content, tool-call deltas)`` released by ``piece``; ``final``: the output ended
        (everything held is released, an unclosed block parsed as a call if it is one)."""
        p = self.parser
        self.buf += piece
        content, deltas = [], []
        while True:
            if not self.inside:
                at = self.buf.find(p.start)
                if at < 0:
                    keep = 0 if final else held_prefix(self.buf, p.start)
                    content.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.buf[:at])
                self.buf = self.buf[at:]
                self.inside = True
            at = self.buf.find(p.end, len(p.start))
            if at < 0:
                if final:
                    text, d = self._close(self.buf[len(p.start):], self.buf)
                    content.append(text)
                    deltas += d
                    self.buf, self.inside = "", False
                break
            raw = self.buf[:at + len(p.end)]
            text, d = self._close(self.buf[len(p.start):at], raw)
            content.append(text)
            deltas += d
            self.buf, self.inside = self.buf[at + len(p.end):], False
        return "".join(content), deltas


# ---- grammar (tool_choice "required" or a named function) -------------------------------------
def _lark_str(s: str) -> str:
    return json.dumps(s)


def tool_call_grammar(parser: ToolParser, tools: list[dict], parallel: bool = True) -> str:
    """An llguidance Lark grammar whose sentences are calls of ``tools`` (OpenAI function
    tools) in ``parser``'s format: one call, or with ``parallel`` one or more; each call's
    ``arguments`` follow its function's ``parameters`` schema (``{}``: any object)."""
    if not tools:
        raise ValueError("a tool call grammar needs at least one tool")
    objs = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object"}
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
        objs.append(schema)
    lines = []
    names = []
    for i, schema in enumerate(objs):
        lines.append(f"call_{i}: %json {json.dumps(schema)}")
        names.append(f"call_{i}")
    lines.append("call: " + " | ".join(names))
    if parser.many:
        body = 'call ("," ws call)*' if parallel else "call"
        lines.insert(0, f"start: {_lark_str(parser.start)} \"[\" {body} \"]\" {_lark_str(parser.end)}")
    else:
        block = f"{_lark_str(parser.start + chr(10))} call {_lark_str(chr(10) + parser.end)}"
        lines.insert(0, f"start: block ({_lark_str(chr(10))} block)*" if parallel else "start: block")
        lines.insert(1, f"block: {block}")
    lines.append('ws: /[ \\t\\n]*/')
    return "\n".join(lines) + "\n"
