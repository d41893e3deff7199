"""The forms' table (``replayssm.forms.table``): torch-free, consistent with itself, with the
PyTorch forms and ops that read it, and with the JAX backend's dispatch built from it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from replayssm.cache.ring import RingIndex
from replayssm.forms import CACHE_FORMS, get_form, table
from replayssm.forms.base import ring_plan
from replayssm.kernels.dispatch import ops_for


def test_table_imports_no_torch():
    """The table, and the JAX layers that dispatch through it, load without torch."""
    code = ("import sys, replayssm.forms.table as t; assert t.STEPS; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)
    try:
        importlib.import_module("jax")
    except ImportError:
        return
    subprocess.run([sys.executable, "-c", "import sys, replayssm.jax.layers; assert 'torch' not in sys.modules"],
                   check=True)


def test_every_form_has_every_kind_and_the_ops_exist():
    assert table.STEP_KINDS == ("prefill", "decode", "verify", "tree")
    assert set(table.FORMS) == {"recurrent", "replay", "kv"}
    for fam in ("mamba2", "gdn"):
        ops = ops_for(fam, backend="naive")
        for (form, kind), st in table.STEPS.items():
            assert hasattr(ops, st.op), (fam, form, kind, st.op)
            if not table.KINDS[kind].tentative:   # a step that commits itself keeps nothing
                assert not st.pending and not st.commit and not st.state.at_commit, (form, kind)
            if st.pending:                        # what a step keeps, its commit reads
                assert st.commit, (form, kind)
    conv = ops_for("conv", backend="naive")
    for kd in table.KINDS.values():
        assert hasattr(conv, kd.conv)
        assert bool(kd.conv_commit) == kd.tentative
        if kd.conv_commit:
            assert hasattr(conv, kd.conv_commit)


def test_table_cells():
    s = table.step("replay", "decode")
    assert s.op == "replay_decode" and s.state.read and s.state.flush and s.state.with_new and not s.state.write
    assert s.ring.read and s.ring.write and not s.pages.used
    v = table.step("replay", "verify")
    assert v.state.flush and not v.state.with_new and v.commit == ""
    r = table.step("recurrent", "verify")
    assert r.state.at_commit and r.pending == "snap" and r.commit == "snapshot_commit"
    assert table.step("recurrent", "decode").state.write
    assert table.step("replay", "prefill").ring.reset
    assert not any(getattr(table.step(f, "full"), n).used for f in table.FORMS for n in ("state", "ring", "pages"))
    with pytest.raises(ValueError, match="no step"):
        table.step("mixed", "decode")
    with pytest.raises(ValueError, match="bad store cell"):
        table.Store.parse("rx")


def test_pytorch_forms_read_the_table():
    for name in table.FORMS:
        f = get_form(name)
        stores = table.form_stores(name)
        assert f.uses_ring == ("ring" in stores) and f.uses_pages == ("pages" in stores)
        for kind in table.STEP_KINDS:
            assert callable(getattr(f, kind))
            commit = table.step(name, kind).commit
            if commit:
                assert callable(getattr(f, commit)), (name, commit)
    assert (get_form("recurrent").uses_ring, get_form("replay").uses_ring, get_form("kv").uses_pages) == \
        (False, True, True)
    m = get_form("mixed")
    assert m.uses_ring and m.uses_pages
    assert all(f in table.FORMS for forms in CACHE_FORMS.values() for f in forms)


@pytest.mark.parametrize("kind,T", [("prefill", 1), ("decode", 1), ("verify", 3), ("tree", 4)])
def test_ring_flush_rule_matches_the_ring_plan(kind, T):
    L = 8
    ring = RingIndex(L + 1, L)
    hist = torch.arange(L + 1)
    ring.length[1:] = hist
    slots = torch.arange(1, L + 2)
    plan = ring_plan(ring, kind, slots, T)
    assert torch.equal(plan.flush, table.ring_flush(hist, kind, T, L))
    assert (np.asarray(table.ring_flush(hist.numpy(), kind, T, L)) == plan.flush.numpy()).all()


def test_jax_dispatch_is_built_from_the_table():
    pytest.importorskip("jax")
    from replayssm.jax import layers, model

    assert model.MODES == layers.FORMS == ("recurrent", "replay", "kv")
    for steps in (layers.M2_STEPS, layers.GDN_STEPS):
        for form in layers.FORMS:
            for kind in layers.KINDS_RUN:
                assert steps[(form, kind)].args[0] is table.step(form, kind)
    # kv keeps every entry and never flushes (no ring rule); auto is a composition, not a form
    assert model.uses_ring("replay") and not model.uses_ring("recurrent") and not model.uses_ring("kv")
    assert "auto" not in layers.FORMS and model.uses_ring("auto")
