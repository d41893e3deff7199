"""The registered decode forms (``get_form``) and the forms each cache mode allocates."""

from __future__ import annotations

from .base import DecodeForm
from .kv import KVForm
from .mixed import MixedForm
from .recurrent import RecurrentForm
from .replay import ReplayForm

_FORMS: dict[str, DecodeForm] = {}

#: forms whose memory a model cache of each mode allocates (first: the mode's own form)
CACHE_FORMS: dict[str, tuple[str, ...]] = {
    "recurrent": ("recurrent",),
    "replay": ("replay",),
    "kv": ("kv", "replay"),
}


def register_form(form: DecodeForm) -> DecodeForm:
    """Make ``form`` available as ``get_form(form.name)``."""
    if not isinstance(form, DecodeForm) or not form.name:
        raise ValueError(f"a form must be a named DecodeForm, got {form!r}")
    _FORMS[form.name] = form
    return form


def get_form(name: str) -> DecodeForm:
    try:
        return _FORMS[name]
    except KeyError:
        raise ValueError(f"unknown decode form {name!r}: registered {sorted(_FORMS)}") from None


for _f in (RecurrentForm(), ReplayForm(), KVForm(), MixedForm()):
    register_form(_f)
