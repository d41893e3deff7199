"""Reasoning text (``<think>...</think>``) apart from the answer.

``--reasoning-parser`` picks how a model marks its reasoning:

* ``qwen3``: ``<think>...</think>`` in the output; the opening tag may be the prompt's last
  text instead (Qwen3's template with ``enable_thinking`` writes it there), and then the
  output starts inside the reasoning.  Without any opening tag the output is all content
  (thinking disabled).
* ``deepseek_r1``: the output starts inside the reasoning (DeepSeek-R1's template opens it;
  an opening tag in the output is skipped); text after ``</think>`` is content, and an
  output without one is all reasoning (it ran out of tokens while thinking).

:class:`ReasoningStreamer` splits text arriving piece by piece, holding back a tail that may
be the start of a tag; :func:`split_reasoning` does it for a whole output.
"""

from __future__ import annotations

from .tools import held_prefix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


class ReasoningStreamer:
    """``feed(piece) -> (reasoning, content)`` of the text released so far."""

    def __init__(self, parser: str, prompt_text: str = ""):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(REASONING_PARSERS)})")
        self.parser = parser
        opened = prompt_text.rstrip().endswith(START)
        # "start": an opening tag may come first; "think": inside; "answer": after it
        self.state = "think" if parser == "deepseek_r1" or opened else "start"
        self.skip_open = parser == "deepseek_r1" and not opened   # R1 may repeat the tag itself
        self.buf = ""
        self.strip_nl = False

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.buf += piece
        reasoning, content = [], []
        while self.buf:
            if self.state == "answer":
                if self.strip_nl:   # the newlines after </think> separate, they are not the answer
                    self.buf = self.buf.lstrip("\n")
                    self.strip_nl = not self.buf
                content.append(self.buf)
                self.buf = ""
            elif self.state == "start" or self.skip_open:
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf = head[len(START):]
                    self.state, self.skip_open = "think", False
                    continue
                if not final and START.startswith(head):   # maybe the tag, still arriving
                    break
                if self.skip_open:
                    self.skip_open = False
                else:
                    self.state = "answer"
            else:   # think
                at = self.buf.find(END)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf = self.buf[at + len(END):]
                    self.state, self.strip_nl = "answer", True
                    continue
                keep = 0 if final else held_prefix(self.buf, END)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
        return "".join(reasoning), "".join(content)


def split_reasoning(parser: str, text: str, prompt_text: str = "") -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a whole output (``None`` for an empty part; the
    newlines right after ``</think>`` are dropped)."""
    s = ReasoningStreamer(parser, prompt_text)
    reasoning, content = s.feed(text, final=True)
    return (reasoning or None), (content or None)
