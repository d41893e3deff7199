"""Decode forms as objects: how an SSM layer keeps a sequence and runs each step kind.

``get_form(name)`` returns the registered form (``"recurrent"``, ``"replay"``, ``"kv"``,
``"mixed"``); :data:`CACHE_FORMS` says which forms a model cache of each mode allocates
(a KV-only cache also holds the replay form its slots switch to).  What each form decides per
step kind (the op that runs, the stores it reads / writes / flushes, what its commit does) is
one table, :mod:`replayssm.forms.table` (``STEPS``, ``KINDS``, ``step``), which the forms and
the JAX backend both read.  A new form is one module defining a
:class:`~replayssm.forms.base.DecodeForm` subclass, its rows in the table and one
:func:`register_form` call (and, for a new cache mode, an entry in :data:`CACHE_FORMS`).

The table is torch-free and imported eagerly; the forms themselves (PyTorch) load on first
use of a name below, so ``replayssm.forms.table`` imports no torch.
"""

from __future__ import annotations

from .table import KINDS, STEP_KINDS, STEPS, Kind, Step, step

_LAZY = {"CACHE_FORMS": "registry", "get_form": "registry", "register_form": "registry",
         "DecodeForm": "base", "FormLayer": "base", "KVForm": "kv", "MixedForm": "mixed",
         "RecurrentForm": "recurrent", "ReplayForm": "replay"}

__all__ = ["STEP_KINDS", "KINDS", "STEPS", "Kind", "Step", "step", *_LAZY]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'replayssm.forms' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
