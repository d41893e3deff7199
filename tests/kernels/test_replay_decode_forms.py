"""Replay-decode launch forms beyond the defaults: the ``fma`` fold (rank-1 updates of the tile
in registers, any tile width), tiles narrower than 16 (more programs at small batches), the
per-batch launch-config table (``DECODE_TABLE``) and 16-bit checkpoint states.

Every case runs several decode steps against the reference op on a float64 copy of the
buffers and inputs: outputs, states and every ring entry, with odd shapes (tiles partly
masked), two rows flushing in one batch whose entries wrap around the ring end, a padding row
on slot 0, ring entries past each row's fill poisoned with NaN, and every ``torch.empty``
poisoned (outputs and scratch must be written in full).  CPU: the Triton interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402
from test_kernels import (fill_m2, gdn_inputs, m2_inputs, make_ring, packed_views, prep_gdn, prep_m2,  # noqa: E402
                          valid_ring)

from replayssm.cache.buffers import GDNBuffers  # noqa: E402

from replayssm.kernels import gdn as KG  # noqa: E402
from replayssm.kernels import mamba2 as K2  # noqa: E402
from replayssm.ops.gdn import naive as NG  # noqa: E402
from replayssm.ops.mamba2 import naive as N2  # noqa: E402

DEVICE = kernel_device()
F64 = torch.float64

#: Mamba-2 forms: d = 7 in 1-, 4- and 8-wide blocks (the last block partly masked)
M2_FORMS = {
    "fma_d1": dict(fold_form="fma", block_d=1, num_warps=1, pre_scores=False),
    "fma_d4": dict(fold_form="fma", block_d=4, num_warps=2, pre_scores=False),
    "fma_d4_scores": dict(fold_form="fma", block_d=4, num_warps=1, pre_scores=True),
    "fma_d8": dict(fold_form="fma", block_d=8, num_warps=4, pre_scores=False),
    "dot_d16": dict(fold_form="dot", block_d=16, num_warps=2, pre_scores=True),
    "hold_d16": dict(fold_form="hold", block_d=16, num_warps=1, pre_scores=False),
    "hold_d16_early": dict(fold_form="hold", block_d=16, num_warps=2, pre_scores=False, prefetch=True),
    "hold_d16_scores_early": dict(fold_form="hold", block_d=16, num_warps=2, pre_scores=True, prefetch=True),
    "fma_d4_early": dict(fold_form="fma", block_d=4, num_warps=1, pre_scores=False, prefetch=True),
    "unroll_d2": dict(fold_form="unroll", block_d=2, num_warps=1, pre_scores=False),
    "unroll_d8_scores_early": dict(fold_form="unroll", block_d=8, num_warps=2, pre_scores=True, prefetch=True),
    "dot_d16_early": dict(fold_form="dot", block_d=16, num_warps=2, pre_scores=True, prefetch=True),
}
#: GDN forms: V = 9 in 1-, 4- and 16-wide blocks
GDN_FORMS = {
    "fused_fma_v1": dict(flush_mode="fused", fold_form="fma", block_v=1, num_warps=1, pre_scores=False),
    "fused_fma_v4": dict(flush_mode="fused", fold_form="fma", block_v=4, num_warps=2, pre_scores=False),
    "fused_fma_v4_scores": dict(flush_mode="fused", fold_form="fma", block_v=4, num_warps=1, pre_scores=True),
    "fused_fma_v16_scores": dict(flush_mode="fused", fold_form="fma", block_v=16, num_warps=2, pre_scores=True),
    "apart_fma_v4_scores": dict(flush_mode="apart", fold_form="fma", block_v=4, pre_scores=True, fold_warps=1),
    "fused_hold_v16": dict(flush_mode="fused", fold_form="hold", block_v=16, num_warps=1, pre_scores=False),
    "fused_hold_v16_early": dict(flush_mode="fused", fold_form="hold", block_v=16, num_warps=2, pre_scores=False,
                                 prefetch=True),
    "fused_hold_v16_scores_early": dict(flush_mode="fused", fold_form="hold", block_v=16, num_warps=2,
                                        pre_scores=True, prefetch=True),
    "fused_fma_v4_early": dict(flush_mode="fused", fold_form="fma", block_v=4, num_warps=1, pre_scores=False,
                               prefetch=True),
    "fused_unroll_v2": dict(flush_mode="fused", fold_form="unroll", block_v=2, num_warps=1, pre_scores=False),
    "fused_unroll_v8_scores_early": dict(flush_mode="fused", fold_form="unroll", block_v=8, num_warps=2,
                                         pre_scores=True, prefetch=True),
    "gated_unroll_v4_early": dict(flush_mode="gated", fold_form="unroll", block_v=4, pre_scores=False, fold_warps=1,
                                  prefetch=True),
    "apart_dot_v16_scores_early": dict(flush_mode="apart", fold_form="dot", block_v=16, pre_scores=True,
                                       prefetch=True),
    "gated_hold_v16_scores_early": dict(flush_mode="gated", fold_form="hold", block_v=16, pre_scores=True,
                                        fold_warps=4, prefetch=True),
    "gated_dot_v16": dict(flush_mode="gated", fold_form="dot", block_v=16, pre_scores=False, fold_warps=2),
    "gated_fma_v4_scores": dict(flush_mode="gated", fold_form="fma", block_v=4, pre_scores=True, fold_warps=1),
    "apart_hold_v16_scores_early": dict(flush_mode="apart", fold_form="hold", block_v=16, pre_scores=True,
                                        fold_warps=2, prefetch=True),
}


def _shapes(state_dtype=torch.float32):
    s = dict(Bt=6, H=4, d=7, G=2, n=19, HK=2, HV=4, K=7, V=9, P=9, L=8, dtype=torch.float32)
    if DEVICE == "cuda":
        s = dict(Bt=40, H=16, d=64, G=2, n=128, HK=4, HV=8, K=128, V=128, P=48, L=16, dtype=torch.float32)
    return dict(s, state_dtype=state_dtype)


def _two_flushes(ring, slots, L):
    """Rows 0 and 4 flush on the first step with entries wrapping past the ring end; row 1
    starts empty; row 2 pads (slot 0)."""
    for r in (0, 4):
        ring.start[slots[r]] = L - 3
        ring.length[slots[r]] = L - 1
    ring.length[slots[1]] = 0


def _prep_m2(s, seed):
    ring, slots = make_ring(s, DEVICE, 1, seed)
    _two_flushes(ring, slots, s["L"])
    buf = fill_m2(s, DEVICE, seed)
    valid_ring(ring, slots, [buf.x, buf.B, buf.dt],
               [lambda t: torch.randn_like(t), lambda t: torch.randn_like(t),
                lambda t: torch.rand_like(t) * 0.5 + 0.05])
    return ring, slots, buf


def _prep_gdn(s, seed):
    ring, slots = make_ring(s, DEVICE, 1, seed)
    _two_flushes(ring, slots, s["L"])
    torch.manual_seed(seed)
    buf = GDNBuffers.allocate(s["P"] - 1, s["L"], s["HK"], s["HV"], s["K"], s["V"], dtype=s["dtype"],
                              device=DEVICE, poison=True)
    buf.state.normal_()
    valid_ring(ring, slots, [buf.u, buf.k, buf.g],
               [lambda t: torch.randn_like(t), lambda t: torch.nn.functional.normalize(torch.randn_like(t), dim=-1),
                lambda t: -torch.rand_like(t) * 0.7])
    return ring, slots, buf


def _with_state(buf, sdt):
    f = {x.name: getattr(buf, x.name) for x in dataclasses.fields(buf)}
    f["state"] = f["state"].to(sdt)
    return type(buf)(**f)


def _as64(buf):
    return type(buf)(**{x.name: getattr(buf, x.name).to(F64) for x in dataclasses.fields(buf)})


def _c64(ts):
    return [t.to(F64) if t.is_floating_point() else t for t in ts]


def _compare(ref, buf, names, before, flush, slots, what):
    """Ring tensors and fp32 states at fp32 accuracy (NaN exactly where the reference has
    NaN); a 16-bit state: flushed slots within one rounding of the float64 state, every
    other slot bit for bit unchanged."""
    for name in names:
        a, b = getattr(ref, name)[1:], getattr(buf, name)[1:]
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: buf.{name} NaN pattern differs"
        if name == "state" and b.dtype != torch.float32:
            written = torch.zeros(b.shape[0] + 1, dtype=torch.bool, device=b.device)
            written[slots[flush]] = True
            written = written[1:]
            assert torch.equal(b[~written], before[1:][~written]), f"{what}: a slot not flushed changed"
            if not written.any():
                continue
            want, got = a[written], b[written].to(F64)
            ulp = 2.0 ** -7 if b.dtype == torch.bfloat16 else 2.0 ** -10
            bound = ulp * want.abs() + 1e-5 * (1 + want.abs().max())
            assert ((got - want).abs() <= bound).all(), f"{what}: flushed state off by more than one rounding"
            continue
        torch.testing.assert_close(torch.nan_to_num(b.to(F64)), torch.nan_to_num(a), atol=2e-5, rtol=2e-4,
                                   msg=lambda m: f"{what}: buf.{name}: {m}")


def _run_m2(form, sdt, steps=3, **shape):
    s = dict(_shapes(sdt), **shape)
    ring, slots, buf = _prep_m2(s, seed=11)
    buf = _with_state(buf, sdt)
    ref = _as64(buf)
    real = slots != 0
    flushed = []
    for step in range(steps):
        ins = m2_inputs(s, DEVICE)
        plan = ring.plan_decode(slots)
        before = buf.state.clone()
        y_ref = N2.replay_decode(ref, plan, *_c64(ins))
        y = K2.replay_decode(buf, plan, *ins, **form)
        assert not torch.isnan(y[real]).any(), f"step {step}: NaN in y"
        torch.testing.assert_close(y[real].to(F64), y_ref[real], atol=2e-5, rtol=2e-4,
                                   msg=lambda m: f"step {step}: y: {m}")
        _compare(ref, buf, ("state", "x", "B", "dt"), before, plan.flush & real, slots, f"step {step}")
        flushed.append(int((plan.flush & real).sum()))
        ref.state.copy_(buf.state.to(F64))  # the next step reads the state as stored (rounded once)
        ring.commit(plan)
    assert flushed[0] >= 2, f"want two rows flushing in one step, got {flushed}"


def _run_gdn(form, sdt, steps=3, packed=False, **shape):
    s = dict(_shapes(sdt), **shape)
    ring, slots, buf = _prep_gdn(s, seed=12)
    buf = _with_state(buf, sdt)
    ref = _as64(buf)
    real = slots != 0
    flushed = []
    for step in range(steps):
        ins = gdn_inputs(s, DEVICE)
        if packed:  # q, k, v as views of one projection output (read in place, NaN between them)
            ins = [t[:, 0] for t in packed_views(*(t[:, None] for t in ins[:3]))] + list(ins[3:])
        plan = ring.plan_decode(slots)
        before = buf.state.clone()
        y_ref = NG.replay_decode(ref, plan, *_c64(ins))
        y = KG.replay_decode(buf, plan, *ins, **form)
        assert not torch.isnan(y[real]).any(), f"step {step}: NaN in y"
        torch.testing.assert_close(y[real].to(F64), y_ref[real], atol=2e-5, rtol=2e-4,
                                   msg=lambda m: f"step {step}: y: {m}")
        _compare(ref, buf, ("state", "u", "k", "g"), before, plan.flush & real, slots, f"step {step}")
        flushed.append(int((plan.flush & real).sum()))
        ref.state.copy_(buf.state.to(F64))  # the next step reads the state as stored (rounded once)
        ring.commit(plan)
    assert flushed[0] >= 2, f"want two rows flushing in one step, got {flushed}"


@pytest.mark.parametrize("name", sorted(M2_FORMS))
def test_mamba2_decode_forms(name, nan_empty):
    _run_m2(M2_FORMS[name], torch.float32, steps=1 if name.endswith("d1") else 3)


@pytest.mark.parametrize("name", sorted(GDN_FORMS))
def test_gdn_decode_forms(name, nan_empty):
    _run_gdn(GDN_FORMS[name], torch.float32, steps=1 if name.endswith("v1") else 2, packed="scores" in name)


@pytest.mark.parametrize("prefetch", [False, True])
def test_gdn_persistent_ranges_cross_rows(prefetch, monkeypatch, nan_empty):
    """The ``apart`` persistent kernel on 3 programs for 2 flush rows × 4 tiles: with
    ``prefetch`` each program takes 3 contiguous tiles, so the second one's range starts on
    one flush row and ends on the next (the row search redone at the boundary); without it
    the tiles are strided by the grid."""
    monkeypatch.setattr(KG, "persistent_programs", lambda device, work, per_sm: 3)
    _run_gdn(dict(flush_mode="apart", fold_form="hold", block_v=16, pre_scores=True, prefetch=prefetch,
                  fold_warps=2), torch.float32, steps=2)


@pytest.mark.parametrize("form", [dict(flush_mode="fused", block_v=16), dict(flush_mode="split", block_v=16),
                                  dict(route="state")])
def test_gdn_decode_reads_qkv_in_place(form, nan_empty):
    """``q``, ``k``, ``v`` as strided views of one tensor (the layer's split of the projection):
    read in place, no copies, for the default forms too."""
    _run_gdn(form, torch.float32, steps=1, packed=True)


@pytest.mark.parametrize("name", ["fma_d4", "dot_d16", "hold_d16_scores_early"])
def test_mamba2_decode_forms_bf16_state(name, nan_empty):
    _run_m2(M2_FORMS[name], torch.bfloat16, steps=2)


@pytest.mark.parametrize("name", ["fused_fma_v4", "apart_fma_v4_scores", "gated_hold_v16_scores_early"])
def test_gdn_decode_forms_bf16_state(name, nan_empty):
    _run_gdn(GDN_FORMS[name], torch.bfloat16, steps=2)


def test_gdn_default_forms_bf16_state(nan_empty):
    """The defaults' forms (``dot`` fold, fused and apart) with a bf16 state, as a baseline
    for the ``fma`` cases above."""
    for form in (dict(flush_mode="fused", block_v=16), dict(flush_mode="apart", pre_scores=True, block_v=16)):
        _run_gdn(form, torch.bfloat16, steps=1)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU shapes; the GPU shapes have several chunks already")
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_fma_fold_over_several_chunks(sdt, nan_empty):
    """The ``fma`` fold's run-time loop over state chunks (``FMA_CHUNK`` values each): two chunks,
    the second partly masked (Mamba-2 ``n`` = 40 in 32-column chunks of a 32-row tile; GDN
    ``K`` = 40 in 32-row chunks of a 32-column tile)."""
    assert K2.FMA_CHUNK // 32 == 32
    _run_m2(dict(fold_form="fma", block_d=32, num_warps=2, pre_scores=True), sdt, steps=1, d=33, n=40)
    _run_gdn(dict(flush_mode="fused", fold_form="fma", block_v=32, pre_scores=False), sdt, steps=1, K=40, V=33)


def test_decode_table_rows(monkeypatch):
    """A row of ``DECODE_TABLE`` is taken for batches up to its bound and its state dtype;
    other batches keep the measured defaults."""
    monkeypatch.setattr(K2, "DECODE_TABLE", [(8, 2, dict(block_d=8, fold_form="fma", num_warps=1))])
    got = K2.decode_defaults(4, 128, 64, None, 2)
    assert (got["block_d"], got["fold_form"], got["num_warps"]) == (8, "fma", 1)
    assert K2.decode_defaults(4, 128, 64, None, 4)["fold_form"] == "dot"
    assert K2.decode_defaults(16, 128, 64, None, 2)["block_d"] == 32
    monkeypatch.setattr(KG, "DECODE_TABLE", [(1, None, dict(block_v=8, fold_form="fma"))])
    got = KG.decode_defaults(1, 32, 128, 4)
    assert (got["block_v"], got["fold_form"], got["flush_mode"]) == (8, "fma", "fused")
    assert KG.decode_defaults(2, 32, 128, 4)["block_v"] == 32
    # a pasted row with an unknown key raises, naming it
    monkeypatch.setattr(K2, "DECODE_TABLE", [(8, None, dict(block_dd=8))])
    with pytest.raises(ValueError, match="block_dd"):
        K2.decode_defaults(4, 128, 64, None, 4)
    monkeypatch.setattr(KG, "DECODE_TABLE", [(8, None, dict(prefetch=True, warps=2))])
    with pytest.raises(ValueError, match="warps"):
        KG.decode_defaults(4, 32, 128, 4)
    # the table's form runs (and is exact) through the wrapper's defaults
    monkeypatch.setattr(K2, "DECODE_TABLE", [(1 << 20, None, dict(block_d=4, fold_form="fma", num_warps=1))])
    _run_m2({}, torch.float32, steps=1)


def test_decode_block_widths():
    assert K2.decode_block(7, 4, "fma") == 4
    assert K2.decode_block(7, 32, "fma") == 8          # at most next_pow2(size)
    assert K2.decode_block(64, 4, "dot") == 16         # tl.dot needs 16 rows
    assert K2.decode_block(64, 3, "fma") == 4
    assert K2.decode_block(64, 4, "hold") == 16        # tl.dot needs 16 rows
    with pytest.raises(ValueError, match="fold_form"):
        K2.decode_block(64, 4, "rank1")
    with pytest.raises(ValueError, match="positive"):
        K2.decode_block(64, 0, "fma")


def test_bad_forms_raise_before_touching_memory():
    s = _shapes()
    ring, slots, buf = prep_m2(s, DEVICE, seed=3)
    snap = [t.clone() for t in (buf.state, buf.x, buf.B, buf.dt)]
    with pytest.raises(ValueError, match="fold_form"):
        K2.replay_decode(buf, ring.plan_decode(slots), *m2_inputs(s, DEVICE), fold_form="rank1")
    for a, b in zip(snap, (buf.state, buf.x, buf.B, buf.dt)):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan())
    ring, slots, gbuf = prep_gdn(s, DEVICE, seed=4)
    gsnap = [t.clone() for t in (gbuf.state, gbuf.u, gbuf.k, gbuf.g)]
    ins = gdn_inputs(s, DEVICE)
    with pytest.raises(ValueError, match="fold_form='fma'"):
        KG.replay_decode(gbuf, ring.plan_decode(slots), *ins, flush_mode="split", fold_form="fma")
    with pytest.raises(ValueError, match="fold_form='unroll'"):
        KG.replay_decode(gbuf, ring.plan_decode(slots), *ins, flush_mode="split", fold_form="unroll")
    with pytest.raises(ValueError, match="fold_form='hold'"):
        KG.replay_decode(gbuf, ring.plan_decode(slots), *ins, flush_mode="split", fold_form="hold")
    with pytest.raises(ValueError, match="fold_form"):
        KG.replay_decode(gbuf, ring.plan_decode(slots), *ins, fold_form="rank1")
    for a, b in zip(gsnap, (gbuf.state, gbuf.u, gbuf.k, gbuf.g)):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan())
