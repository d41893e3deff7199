"""The split GDN verify (``impl="split"``: per key-head prep kernel + state-streaming readout)
against the float64-capable naive op: verify cycles with all-reject / all-accept / random
accept counts (ring wrap, flush rows mixed with non-flush rows and padding rows in one batch),
group sizes above 2, a second partly masked V-block, ``T`` past 8 (a 32-row readout operand),
trees, the KV-only form, and NaN-poisoned outputs and scratch."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402
from test_kernels import (GDN_BUF, _paged, clone_gdn, close, close_buffers, gdn_inputs, prep_gdn,  # noqa: E402
                          random_parents)

from replayssm.kernels import gdn as KG  # noqa: E402
from replayssm.ops.gdn import naive as NG  # noqa: E402

DEVICE = kernel_device()


def _shape(**kw):
    if DEVICE == "cpu":  # odd sizes; 3 value heads per key head; V = 20 on 16-wide tiles: 2 blocks
        s = dict(Bt=6, HK=2, HV=6, K=9, V=20, P=9, L=12, dtype=torch.float32)
    else:
        s = dict(Bt=24, HK=4, HV=8, K=128, V=128, P=40, L=16, dtype=torch.bfloat16)
    return dict(s, **kw)


def _bv():
    return 16 if DEVICE == "cpu" else None


@pytest.mark.parametrize("pattern", ["reject", "accept", "random"])
def test_split_verify_cycle(pattern, nan_empty):
    """Verify steps in a row, each committed with the pattern's accept counts."""
    s, T = _shape(), 5
    ring, slots, buf = prep_gdn(s, DEVICE, seed=21, T=T, kind="verify")
    ref = clone_gdn(buf)
    gen = torch.Generator().manual_seed(22)
    kinds = set()
    for step in range(2):
        plan = ring.plan_verify(slots, T, "verify")
        q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
        y_ref = NG.replay_verify(ref, plan, q, k, v, g, beta)
        y = KG.replay_verify(buf, plan, q, k, v, g, beta, impl="split", block_v=_bv())
        real = slots != 0
        close(y_ref[real], y[real], s["dtype"], f"y step {step}")
        close_buffers(ref, buf, s["dtype"], GDN_BUF)
        kinds.update(bool(f) for f in plan.flush[real].tolist())
        acc = {"reject": torch.zeros(s["Bt"], dtype=torch.long), "accept": torch.full((s["Bt"],), T),
               "random": torch.randint(0, T + 1, (s["Bt"],), generator=gen)}[pattern]
        ring.commit(plan, acc.to(slots.device))
    assert kinds == {True, False}, "want flush and non-flush rows"
    starts = ring.start[slots[slots != 0]]
    assert pattern == "reject" or bool((starts != 0).any())


@pytest.mark.parametrize("T,fused", [(3, True), (9, False), (9, True)])
def test_split_verify_shapes(T, fused, nan_empty):
    """Small and long drafts (``2T > 16``), the fold in the pass or after."""
    s = _shape(L=2 * T + 3)
    ring, slots, buf = prep_gdn(s, DEVICE, seed=30 + T, T=T, kind="verify")
    ref = clone_gdn(buf)
    plan = ring.plan_verify(slots, T, "verify")
    assert bool(plan.flush.any()) and not bool(plan.flush[slots != 0].all())
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    y_ref = NG.replay_verify(ref, plan, q, k, v, g, beta)
    y = KG.replay_verify(buf, plan, q, k, v, g, beta, impl="split", fused_fold=fused, block_v=_bv())
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    close_buffers(ref, buf, s["dtype"], GDN_BUF)


def test_split_tree_verify(nan_empty):
    s, T = _shape(), 5
    ring, slots, buf = prep_gdn(s, DEVICE, seed=40, T=T, kind="tree")
    ref = clone_gdn(buf)
    plan = ring.plan_verify(slots, T, "tree")
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    parent = random_parents(s["Bt"], T, seed=41, device=DEVICE)
    y_ref = NG.tree_verify(ref, plan, parent, q, k, v, g, beta)
    y = KG.tree_verify(buf, plan, parent, q, k, v, g, beta, impl="split", block_v=_bv())
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    close_buffers(ref, buf, s["dtype"], GDN_BUF)


def test_split_kv_verify(nan_empty):
    s, T = _shape(), 3
    pidx, kv, slots = _paged(DEVICE, s, "gdn", T, seed=42)
    kv_ref = copy.deepcopy(kv)
    pplan = pidx.plan(slots, T)
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    y_ref = NG.kv_verify(kv_ref, pplan, q, k, v, g, beta)
    y = KG.kv_verify(kv, pplan, q, k, v, g, beta, impl="split", block_v=_bv())
    real = slots != 0
    close(y_ref[real], y[real], s["dtype"], "y")
    for name in ("u", "k", "g"):
        a, b = getattr(kv_ref, name)[pplan.block_size:], getattr(kv, name)[pplan.block_size:]
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        close(torch.nan_to_num(a), torch.nan_to_num(b), s["dtype"], f"kv.{name}")


def test_split_matches_dot_form_and_rejects_bad_input():
    """The split and dot forms agree on one call; bad impl / head counts raise before any write."""
    s, T = _shape(), 4
    ring, slots, buf = prep_gdn(s, DEVICE, seed=50, T=T, kind="verify")
    other = clone_gdn(buf)
    plan = ring.plan_verify(slots, T, "verify")
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    y0 = KG.replay_verify(other, plan, q, k, v, g, beta, impl="dot", block_v=_bv())
    y1 = KG.replay_verify(buf, plan, q, k, v, g, beta, impl="split", block_v=_bv())
    real = slots != 0
    close(y0[real], y1[real], s["dtype"], "y split vs dot")
    close_buffers(other, buf, s["dtype"], GDN_BUF)
    before = clone_gdn(buf)
    with pytest.raises(ValueError, match="verify impl"):
        KG.replay_verify(buf, plan, q, k, v, g, beta, impl="splitt")
    with pytest.raises(ValueError, match="num_v_heads"):
        KG.replay_verify(buf, plan, q, k, v[:, :, :-1], g[:, :, :-1], beta[:, :, :-1], impl="split")
    for name in GDN_BUF:
        assert torch.equal(torch.nan_to_num(getattr(before, name)), torch.nan_to_num(getattr(buf, name))), name


def test_split_defaults_table():
    assert KG.split_defaults(256, 32) == (64, 2)
    assert KG.split_defaults(1, 32) == (32, 4)
    assert "split" in KG.VERIFY_IMPLS
    assert KG.verify_form(torch.bfloat16, 5, None, None)[0] == "dot"  # the default is unchanged until measured


def test_verify_table_selects_split(monkeypatch):
    """A ``VERIFY_TABLE`` row routes default calls (16-bit activations) to the split form from its
    bounds on; other calls keep the rule; the split call gives the explicit call's numbers."""
    monkeypatch.setattr(KG, "VERIFY_TABLE", [(5, 20, "split")])
    assert KG.verify_form(torch.bfloat16, 5, None, None, pairs=24) == ("split", "tf32")
    assert KG.verify_form(torch.bfloat16, 5, None, None, pairs=12)[0] == "dot"
    assert KG.verify_form(torch.bfloat16, 4, None, None, pairs=24)[0] == "rows"
    assert KG.verify_form(torch.float32, 5, None, None, pairs=24)[0] == "rows"
    assert KG.verify_form(torch.bfloat16, 5, "dot", None, pairs=24)[0] == "dot"
    seen = []
    real = KG._verify_split
    monkeypatch.setattr(KG, "_verify_split", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    s, T = _shape(dtype=torch.bfloat16), 5
    ring, slots, buf = prep_gdn(s, DEVICE, seed=60, T=T, kind="verify")
    other = clone_gdn(buf)
    plan = ring.plan_verify(slots, T, "verify")
    q, k, v, g, beta = gdn_inputs(s, DEVICE, T)
    y0 = KG.replay_verify(other, plan, q, k, v, g, beta, impl="split", block_v=_bv())
    y1 = KG.replay_verify(buf, plan, q, k, v, g, beta, block_v=_bv())  # Bt × HV = 36 pairs: the table's row
    assert len(seen) == 2
    assert torch.equal(y0, y1)
    for name in GDN_BUF:
        assert torch.equal(getattr(other, name).nan_to_num(), getattr(buf, name).nan_to_num()), name
