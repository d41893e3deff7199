"""Chat templates: ``tokenizer_config.json``'s ``chat_template`` rendered with jinja2.

The template sees what Hugging Face's ``apply_chat_template`` gives it — ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and the other special tokens of the
config, ``raise_exception(msg)``, ``strftime_now(fmt)`` — in a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``.  A config may hold one template or a list of named
ones (``"default"`` is used).  The rendered text already holds the template's special
tokens, so it is tokenized without adding any.
"""

from __future__ import annotations

import json
import os
from datetime import datetime


class NoChatTemplate(ValueError):
    """The model directory has no chat template."""


def _token_str(v):
    if isinstance(v, dict):   # {"content": "<s>", ...} in older configs
        return v.get("content")
    return v


def load_chat_template(model_dir: str, override: str | None = None):
    """``(template source | None, special tokens dict)`` from ``model_dir``.  ``override``:
    a template string or a path to a file holding one."""
    cfg = {}
    fn = os.path.join(str(model_dir), "tokenizer_config.json")
    if os.path.isfile(fn):
        with open(fn) as f:
            cfg = json.load(f)
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    jinja = os.path.join(str(model_dir), "chat_template.jinja")
    if tpl is None and os.path.isfile(jinja):
        with open(jinja) as f:
            tpl = f.read()
    if override:
        if os.path.isfile(override):
            with open(override) as f:
                override = f.read()
        tpl = override
    special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return tpl, special


class ChatTemplate:
    """A compiled chat template: :meth:`render` messages to the prompt text."""

    def __init__(self, source: str | None, special: dict | None = None, model_dir: str = ""):
        self.source, self.special, self.model_dir = source, dict(special or {}), model_dir
        self._tpl = None
        if source is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            try:
                self._tpl = env.from_string(source)
            except TemplateError as e:
                raise ValueError(f"chat template of {model_dir or 'the model'} does not compile: {e}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str, override: str | None = None) -> "ChatTemplate":
        src, special = load_chat_template(model_dir, override)
        return cls(src, special, model_dir)

    @property
    def available(self) -> bool:
        return self._tpl is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._tpl is None:
            raise NoChatTemplate(
                f"the model {os.path.basename(os.path.normpath(self.model_dir)) or ''} has no chat template "
                f"(no 'chat_template' in tokenizer_config.json); use /v1/completions, or start the server "
                f"with --chat-template FILE")
        from jinja2 import TemplateError

        try:
            return self._tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except TemplateError as e:
            raise ValueError(f"chat template: {e}") from None


def _raise(message):
    from jinja2 import TemplateError

    raise TemplateError(message)
