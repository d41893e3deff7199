"""The server's chat templates: the engine's renderer (:mod:`replayssm.engine.chat_template`,
transformers' ``apply_chat_template`` semantics, shared with :meth:`replayssm.LLM.chat`)
over the model directory and the ``--chat-template`` override.

``--chat-template`` is a file (its contents), the name of one of the model's named
templates, or inline template text; a value that looks like a file name (no jinja syntax,
a ``.jinja`` / ``.j2`` / ``.txt`` suffix or a path separator) but names no file is refused
at startup (:func:`check_chat_template`).  The rendered text already holds the template's
special tokens, so it is tokenized without adding any.
"""

from __future__ import annotations

from ..engine.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate

__all__ = ["ChatTemplate", "ChatTemplateError", "NoChatTemplate", "check_chat_template", "load_server_template"]


def load_server_template(model_dir: str | None, override: str | None = None) -> ChatTemplate:
    """The template the server renders chats with: ``model_dir``'s, or ``override``'s."""
    if model_dir:
        return ChatTemplate.from_model_dir(model_dir, override)
    if not override:
        return ChatTemplate(None)
    return ChatTemplate(ChatTemplate(None).select(override))


def check_chat_template(model_dir: str | None, override: str | None = None) -> str | None:
    """``None`` when the server's template loads and compiles, else the startup error's text
    (a missing ``--chat-template`` file named, a template that does not compile)."""
    try:
        load_server_template(model_dir, override)
    except FileNotFoundError as e:
        return f"--chat-template: {e}"
    except ImportError as e:
        return str(e)
    except (ValueError, OSError) as e:   # ChatTemplateError, an unreadable file or config
        where = "--chat-template" if override else f"the chat template of {model_dir}"
        return f"{where}: {e}"
    return None
