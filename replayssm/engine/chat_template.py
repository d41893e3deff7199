"""Chat templates rendered as Hugging Face transformers' ``apply_chat_template`` renders them.

Used by :meth:`replayssm.LLM.chat` and by the server (``replayssm.server.chat``), so it sits
in the engine layer.  jinja2 is imported only when a template is compiled (a clear
``ImportError`` names it when missing).

What a template sees, as in transformers:

* ``messages`` (the conversation, passed as given), ``tools`` (JSON schemas, e.g. the
  ``{"type": "function", "function": {...}}`` dicts the OpenAI API sends, or ``None``),
  ``documents`` (a list of dicts, or ``None``), ``add_generation_prompt``;
* the tokenizer's special tokens from ``tokenizer_config.json`` (``bos_token``,
  ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``,
  any other ``*_token`` string and the ``extra_special_tokens`` dict; ``special_tokens_map.json``
  fills in those the config lacks), then the caller's template kwargs
  (``chat_template_kwargs``, e.g. ``enable_thinking``), which win over the tokens;
* a sandboxed environment (``ImmutableSandboxedEnvironment``) with ``trim_blocks`` and
  ``lstrip_blocks``, the loop controls extension (``{% break %}``, ``{% continue %}``), the
  ``{% generation %}...{% endgeneration %}`` block (rendered as its body), the globals
  ``raise_exception(message)`` and ``strftime_now(format)``, and a ``tojson`` filter that does
  not escape HTML (``json.dumps`` with ``ensure_ascii=False``, ``indent``, ``separators``,
  ``sort_keys``).

Where the template comes from (transformers' order): ``chat_template.jinja`` beside the
config (and named ones in ``chat_templates/NAME.jinja``) win over ``tokenizer_config.json``'s
``chat_template``, which is a string or a list of ``{"name", "template"}``.  With several
named templates, ``"tool_use"`` is picked when tools are given and it exists, else
``"default"``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

__all__ = ["ChatTemplate", "ChatTemplateError", "NoChatTemplate", "load_chat_templates", "load_special_tokens",
           "looks_like_path", "read_template_arg", "compile_template", "render_template"]

#: names of the standard special tokens (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: variables the renderer sets itself; template kwargs may not name them
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
PATH_SUFFIXES = (".jinja", ".j2", ".txt")


class ChatTemplateError(ValueError):
    """A template that does not compile, raised (``raise_exception``) or failed to render,
    or bad arguments to the renderer."""


class NoChatTemplate(ChatTemplateError):
    """The model has no chat template and none was given."""


# -- where templates come from -------------------------------------------------------------------------
def looks_like_path(s: str) -> bool:
    """Whether a template argument is meant as a file name: one line, no jinja syntax
    (``{%`` / ``{{``), and a template-file suffix (``.jinja``, ``.j2``, ``.txt``) or a path
    separator."""
    if "{%" in s or "{{" in s or "\n" in s:
        return False
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return s.strip().lower().endswith(PATH_SUFFIXES) or any(c in s for c in seps)


def read_template_arg(value: str, names=()) -> tuple[str, bool]:
    """``(template text or name, is_name)`` for a ``--chat-template`` / ``chat_template=``
    argument: an existing file's contents; one of ``names`` (the model's named templates)
    as that name; inline template text otherwise.  A string that looks like a path
    (:func:`looks_like_path`) but names no file raises ``FileNotFoundError`` naming it."""
    if not isinstance(value, (str, os.PathLike)):
        raise ChatTemplateError(f"a chat template must be a string (template text, a file or a template name), "
                                f"got {type(value).__name__}")
    value = os.fspath(value)
    if value in names:
        return value, True
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read(), False
    if looks_like_path(value):
        if os.path.isdir(value):
            raise FileNotFoundError(f"chat template file {value!r} is a directory")
        raise FileNotFoundError(f"chat template file {value!r} does not exist (a template given inline must "
                                f"hold jinja syntax: '{{{{ ... }}}}' or '{{% ... %}}')")
    return value, False


def _read_json(fn: str) -> dict:
    if not os.path.isfile(fn):
        return {}
    with open(fn, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def load_chat_templates(model_dir: str, config: dict | None = None):
    """The model's template(s): a string, a ``{name: template}`` dict, or ``None``."""
    model_dir = str(model_dir)
    if config is None:
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    files = {}
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            files["default"] = f.read()
    tdir = os.path.join(model_dir, "chat_templates")
    if os.path.isdir(tdir):
        for fn in sorted(os.listdir(tdir)):
            if fn.endswith(".jinja") and os.path.isfile(os.path.join(tdir, fn)):
                with open(os.path.join(tdir, fn), encoding="utf-8") as f:
                    files[fn[:-len(".jinja")]] = f.read()
    if files:   # template files win over the config's entry
        return files["default"] if list(files) == ["default"] else files
    tpl = config.get("chat_template")
    if isinstance(tpl, (list, tuple)):
        tpl = {t["name"]: t["template"] for t in tpl if isinstance(t, dict) and "name" in t and "template" in t}
    return tpl if isinstance(tpl, (str, dict)) else None


def _token_str(v):
    if isinstance(v, dict):   # an AddedToken written out: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_special_tokens(model_dir: str, config: dict | None = None) -> dict:
    """``{name: token string}`` of the tokenizer's named special tokens (see the module doc)."""
    model_dir = str(model_dir)
    if config is None:
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    legacy = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    merged = {**{k: v for k, v in legacy.items() if k not in config}, **config}
    out = {}
    for k, v in merged.items():
        if k in SPECIAL_TOKENS or (k.endswith("_token") and isinstance(v, (str, dict))):
            s = _token_str(v)
            if s is not None:
                out[k] = s
    extra = merged.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({k: s for k, v in extra.items() if (s := _token_str(v)) is not None})
    return out


# -- compiling and rendering -----------------------------------------------------------------------------
def _jinja():
    try:
        import jinja2
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1' "
                          "(or the serve extra: pip install 'replayssm[serve]')") from None
    major, minor = (int(x) for x in jinja2.__version__.split(".")[:2])
    if (major, minor) < (3, 1):
        raise ImportError(f"chat templates need jinja2>=3.1, found {jinja2.__version__}")
    return jinja2


@lru_cache(maxsize=1)
def _environment():
    """The shared sandboxed environment (transformers' settings; see the module doc)."""
    jinja2 = _jinja()
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}body{% endgeneration %}``: renders ``body`` (transformers marks
        the assistant's tokens with it for training masks; inference has no use for them)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own filter: that one escapes HTML characters and knows no separators
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=64)
def compile_template(source: str):
    """The compiled template of ``source`` (cached); :class:`ChatTemplateError` if it does
    not compile."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template must be a string, got {type(source).__name__}")
    env = _environment()
    from jinja2 import TemplateError

    try:
        return env.from_string(source)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        raise ChatTemplateError(f"the chat template does not compile: {e}"
                                + (f" (line {line})" if line else "")) from None


def _tool_schemas(tools):
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError(f"tools must be a list of JSON schemas (dicts), got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ChatTemplateError(f"tools[{i}] must be a JSON schema (a dict such as {{\"type\": \"function\", "
                                    f"\"function\": {{\"name\": ..., \"parameters\": ...}}}}), got {type(t).__name__}")
    return list(tools)


def render_template(source: str, messages, tools=None, documents=None, add_generation_prompt: bool = False,
                    special_tokens: dict | None = None, template_kwargs: dict | None = None) -> str:
    """``source`` rendered for one conversation, as ``apply_chat_template(..., tokenize=False,
    **template_kwargs)`` renders it with ``special_tokens`` as the tokenizer's.  Errors (the template's ``raise_exception`` included) are
    :class:`ChatTemplateError` with the template's message."""
    tpl = compile_template(source)
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ChatTemplateError("cannot render an empty conversation: give at least one message")
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & set(RESERVED))
    if clash:
        raise ChatTemplateError(f"chat template kwargs may not set {', '.join(map(repr, clash))} "
                                f"(the renderer's own variables)")
    if documents is not None:
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("documents must be a list of dicts (e.g. with 'title' and 'text' keys)")
    variables = {**(special_tokens or {}), **kwargs}   # the caller's kwargs win over the tokens
    from jinja2 import TemplateError

    try:
        return tpl.render(messages=messages, tools=_tool_schemas(tools), documents=documents,
                          add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:   # e.g. a filter given bad data
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None


class ChatTemplate:
    """A model's chat template(s) and special tokens: :meth:`render` a conversation.

    ``templates``: a template string, a ``{name: template}`` dict, or ``None`` (no template:
    :meth:`render` raises :class:`NoChatTemplate`)."""

    def __init__(self, templates=None, special_tokens: dict | None = None, model_dir: str = ""):
        if templates is not None and not isinstance(templates, (str, dict)):
            raise ChatTemplateError(f"a chat template must be a string or a {{name: template}} dict, "
                                    f"got {type(templates).__name__}")
        self.templates, self.special_tokens, self.model_dir = templates, dict(special_tokens or {}), str(model_dir)
        # compile now: a broken template is reported at load time, not on the first request
        for src in ([templates] if isinstance(templates, str) else (templates or {}).values()):
            compile_template(src)

    @classmethod
    def from_model_dir(cls, model_dir: str, override: str | None = None) -> "ChatTemplate":
        """The template(s) of ``model_dir`` (``tokenizer_config.json``, ``chat_template.jinja``,
        ``chat_templates/``), or ``override`` (read by :func:`read_template_arg`: a file, one of
        the model's template names, or inline text; a missing file raises
        ``FileNotFoundError``)."""
        cfg = _read_json(os.path.join(str(model_dir), "tokenizer_config.json"))
        templates = load_chat_templates(model_dir, cfg)
        if override:
            text, is_name = read_template_arg(override, templates if isinstance(templates, dict) else ())
            templates = templates[text] if is_name else text
        return cls(templates, load_special_tokens(model_dir, cfg), model_dir)

    @property
    def available(self) -> bool:
        return self.templates is not None

    def _missing(self) -> NoChatTemplate:
        name = os.path.basename(os.path.normpath(self.model_dir)) if self.model_dir else ""
        return NoChatTemplate(f"the model {name + ' ' if name else ''}has no chat template (no 'chat_template' "
                              f"in tokenizer_config.json, no chat_template.jinja); give one "
                              f"(the server: --chat-template FILE; LLM.chat: chat_template=...)")

    def select(self, chat_template: str | None = None, tools=None) -> str:
        """The template source to use (transformers' ``get_chat_template``): ``chat_template``
        (template text, a file, or the name of one of the model's templates) if given; else the
        model's own, with several named ones ``"tool_use"`` when ``tools`` are given and it
        exists, else ``"default"``."""
        named = self.templates if isinstance(self.templates, dict) else {}
        if chat_template is not None:
            text, is_name = read_template_arg(chat_template, named)
            return named[text] if is_name else text
        if self.templates is None:
            raise self._missing()
        if isinstance(self.templates, str):
            return self.templates
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"the model has several chat templates and none named 'default': pick one of "
                                f"{sorted(named)} by name")

    def render(self, messages, add_generation_prompt: bool = True, tools=None, documents=None,
               chat_template: str | None = None, chat_template_kwargs: dict | None = None, **kwargs) -> str:
        """One conversation's prompt text (it holds the template's special tokens already:
        tokenize it without adding any).  ``chat_template_kwargs`` and ``kwargs``: extra
        template variables (``enable_thinking=False``, ...)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ChatTemplateError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        try:
            source = self.select(chat_template, tools)
        except FileNotFoundError as e:
            raise ChatTemplateError(str(e)) from None
        return render_template(source, messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens,
                               template_kwargs={**(chat_template_kwargs or {}), **kwargs})
