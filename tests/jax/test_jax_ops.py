"""JAX forms vs the PyTorch reference ops (float64): chunked prefill against the recurrence,
and the replay machinery (ring gather, output-only decode, chain verify, the writes of
``apply_updates`` (ring entries, flushing rows' checkpoints), commit) over a run of steps with per-row accepted counts, a NaN-poisoned ring and
wrap-around, against a per-row recurrent reference; final checkpoints rebuilt from S0 and
the ring against the reference states."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from replayssm.jax import ops  # noqa: E402
from replayssm.jax.layers import Ctx, _gdn_ssm, _mamba_ssm, apply_updates  # noqa: E402
from replayssm.jax.model import ring_commit, ring_flush  # noqa: E402
from replayssm.jax.params import MixerSpec  # noqa: E402
from replayssm.ops.gdn import naive as gdn_ref  # noqa: E402
from replayssm.ops.mamba2 import naive as m2_ref  # noqa: E402

F64 = jnp.float64
TOL_F64 = dict(rtol=1e-9, atol=1e-10)     # every form vs the recurrence, float64


def _t(a):
    return torch.from_numpy(np.asarray(a))


def _m2_inputs(rng, Bt, T, H, d, G, n):
    x = rng.standard_normal((Bt, T, H, d))
    dt = rng.uniform(0.01, 0.5, (Bt, T, H))
    A = -rng.uniform(0.5, 2.0, H)
    B = rng.standard_normal((Bt, T, G, n))
    C = rng.standard_normal((Bt, T, G, n))
    return x, dt, A, B, C


def _gdn_inputs(rng, Bt, T, H, HV, K, V):
    q = rng.standard_normal((Bt, T, H, K))
    k = rng.standard_normal((Bt, T, H, K))
    v = rng.standard_normal((Bt, T, HV, V))
    g = -rng.uniform(0.01, 0.6, (Bt, T, HV))
    beta = rng.uniform(0.1, 0.9, (Bt, T, HV))
    return q, k, v, g, beta


def test_mamba2_chunked_matches_recurrence():
    rng = np.random.default_rng(0)
    Bt, T, H, d, G, n = 2, 13, 4, 3, 2, 5
    x, dt, A, B, C = _m2_inputs(rng, Bt, T, H, d, G, n)
    S0 = rng.standard_normal((Bt, H, d, n))
    y, S = ops.m2_chunked(*(jnp.asarray(a) for a in (x, dt, A, B, C, S0)), Q=4)
    y_ref, S_ref = m2_ref.recurrent_scan(*(_t(a) for a in (x, dt, A, B, C)), initial_state=_t(S0))
    np.testing.assert_allclose(np.asarray(y), y_ref.numpy(), **TOL_F64)
    np.testing.assert_allclose(np.asarray(S), S_ref.numpy(), **TOL_F64)


def test_gdn_chunked_matches_recurrence():
    rng = np.random.default_rng(1)
    Bt, T, H, HV, K, V = 2, 11, 2, 4, 3, 5
    q, k, v, g, beta = _gdn_inputs(rng, Bt, T, H, HV, K, V)
    S0 = rng.standard_normal((Bt, HV, K, V)) * 0.3
    qn, kn = ops.gdn_prep_qk(jnp.asarray(q), jnp.asarray(k), F64)
    y, S = ops.gdn_chunked(qn, kn, *(jnp.asarray(a) for a in (v, g, beta, S0)), Q=4)
    y_ref, S_ref = gdn_ref.recurrent_scan(*(_t(a) for a in (q, k, v, g, beta)), initial_state=_t(S0))
    np.testing.assert_allclose(np.asarray(y), y_ref.numpy(), **TOL_F64)
    np.testing.assert_allclose(np.asarray(S), S_ref.numpy(), **TOL_F64)


class _Runner:
    """Drives one SSM mixer's cache through prefill / decode / verify+commit steps (layer 0 of
    a one-layer stage) and a per-row recurrent reference beside it."""

    def __init__(self, kind, Bt, L, dims, rng):
        self.kind, self.Bt, self.L, self.rng = kind, Bt, L, rng
        nan = np.nan
        if kind == "mamba":
            H, d, G, n = dims
            self.sp = MixerSpec("mamba", (("chunk", 4), ("n", n)))
            self.A = -rng.uniform(0.5, 2.0, H)
            self.c = {"state": jnp.full((1, Bt, H, d, n), nan, F64), "rx": jnp.full((1, Bt, L, H, d), nan, F64),
                      "rB": jnp.full((1, Bt, L, G, n), nan, F64), "rdt": jnp.full((1, Bt, L, H), nan, F64)}
            self.S_ref = torch.zeros(Bt, H, d, n, dtype=torch.float64)
        else:
            H, HV, K, V = dims
            self.sp = MixerSpec("gdn", (("H", H), ("HV", HV), ("K", K), ("V", V), ("chunk", 4)))
            self.c = {"state": jnp.full((1, Bt, HV, K, V), nan, F64), "ru": jnp.full((1, Bt, L, HV, V), nan, F64),
                      "rk": jnp.full((1, Bt, L, H, K), nan, F64), "rg": jnp.full((1, Bt, L, HV), nan, F64)}
            self.S_ref = torch.zeros(Bt, HV, K, V, dtype=torch.float64)
        self.dims = dims
        self._jit = {}
        self.start = jnp.zeros(Bt, jnp.int32)
        self.hist = jnp.zeros(Bt, jnp.int32)

    def inputs(self, T):
        if self.kind == "mamba":
            return _m2_inputs(self.rng, self.Bt, T, *self.dims)[:2] + _m2_inputs(self.rng, self.Bt, T, *self.dims)[3:]
        return _gdn_inputs(self.rng, self.Bt, T, *self.dims)

    def _ssm(self, args, ctx):
        """One mixer call, compiled once per step kind (eager dispatch is slower here)."""
        key = (ctx.kind, ctx.T)
        if key not in self._jit:
            def run(c, a, arrays):
                cx = Ctx(kind=ctx.kind, mode="replay", T=ctx.T, L=self.L, **arrays)
                upd = {}
                if self.kind == "mamba":
                    x, dt, B, C = a
                    y, c, _ = _mamba_ssm(self.sp, x, dt, jnp.asarray(self.A), B, C, cx, c, 0, F64, upd)
                else:
                    y, c, _ = _gdn_ssm(self.sp, *a, cx, c, 0, F64, upd)
                return y, apply_updates(c, {k: v[None] for k, v in upd.items()}, cx)

            self._jit[key] = jax.jit(run)
        arrays = {k: getattr(ctx, k) for k in ("positions", "valid", "lengths", "start", "hist", "flush")}
        y, self.c = self._jit[key](self.c, [jnp.asarray(v) for v in args], arrays)
        return y, self.c, {}

    def _ref_scan(self, args, S):
        t = [_t(v) for v in args]
        if self.kind == "mamba":
            x, dt, B, C = t
            return m2_ref.recurrent_scan(x, dt, _t(self.A), B, C, initial_state=S)
        return gdn_ref.recurrent_scan(*t, initial_state=S)

    def prefill(self, T, lengths):
        args = self.inputs(T)
        t = jnp.arange(T)
        valid = t[None, :] < jnp.asarray(lengths)[:, None]
        ctx = Ctx(kind="prefill", mode="replay", T=T, positions=jnp.broadcast_to(t, (self.Bt, T)),
                  valid=valid, lengths=jnp.asarray(lengths), L=self.L)
        _, self.c, _ = self._ssm(args, ctx)
        for b, m in enumerate(lengths):
            row = [a[b:b + 1, :m] for a in args]
            self.S_ref[b] = self._ref_scan(row, self.S_ref[b:b + 1])[1][0]

    def step(self, T, accepted=None):
        kind = "decode" if accepted is None else "verify"
        args = self.inputs(T)
        flush = ring_flush(self.hist, kind, T, self.L)
        ctx = Ctx(kind=kind, mode="replay", T=T, positions=jnp.zeros((self.Bt, T), jnp.int32),
                  start=self.start, hist=self.hist, flush=flush, L=self.L)
        y, self.c, _ = self._ssm(args, ctx)
        y_ref, _ = self._ref_scan(args, self.S_ref)
        np.testing.assert_allclose(np.asarray(y), y_ref.numpy(), **TOL_F64)
        acc = [T] * self.Bt if accepted is None else accepted
        for b, a in enumerate(acc):
            if a:
                self.S_ref[b] = self._ref_scan([v[b:b + 1, :a] for v in args], self.S_ref[b:b + 1])[1][0]
        self.start, self.hist = ring_commit(self.start, self.hist, flush, self.L,
                                            None if accepted is None else jnp.asarray(accepted, jnp.int32))
        return flush

    def rebuilt_state(self):
        """``S0`` plus the committed ring, folded (what a flush would store)."""
        ctx = Ctx(kind="verify", mode="replay", T=1, positions=None, start=self.start, hist=self.hist, L=self.L)
        from replayssm.jax.layers import _history

        S0 = self.c["state"][0]
        if self.kind == "mamba":
            (hx, hB, hdt), valid = _history(self.c, ("rx", "rB", "rdt"), 0, ctx, F64)
            return ops.m2_build_state(S0, hx, hB, hdt, jnp.asarray(self.A) * hdt, valid)
        (hu, hk, hg), valid = _history(self.c, ("ru", "rk", "rg"), 0, ctx, F64)
        w, tot = ops.gdn_hist_weights(hg, valid)
        return ops.gdn_build_state(S0, hu, hk, w, tot)


@pytest.mark.parametrize("kind,dims,readout", [("mamba", (4, 3, 2, 5), "dot"), ("gdn", (2, 4, 3, 5), "dot"),
                                               ("mamba", (4, 3, 2, 5), "reduce")])
def test_replay_steps_match_recurrence(kind, dims, readout):
    """Rows diverge: different prompt lengths, accepted counts and flush steps; the ring
    wraps around and starts NaN-poisoned.  (``reduce``: decode's ``S0 C`` as a reduction.)"""
    ops.set_step_readout(readout)
    try:
        _replay_run(kind, dims)
    finally:
        ops.set_step_readout("dot")


def _replay_run(kind, dims):
    rng = np.random.default_rng(2)
    Bt, L, T = 3, 8, 3
    r = _Runner(kind, Bt, L, dims, rng)
    r.prefill(7, [7, 3, 5])
    flushes, mixed = np.zeros(Bt, int), 0
    plan = [None, (3, 0, 2), None, (1, 3, 3), (2, 2, 0), None, None, (3, 1, 2), (0, 3, 1), None, (2, 3, 3), (3, 3, 1)]
    for acc in plan:
        f = np.asarray(r.step(1 if acc is None else T, None if acc is None else list(acc)))
        flushes += f
        mixed += 0 < f.sum() < Bt
    assert flushes.min() >= 1 and mixed >= 2, (flushes, mixed)   # every row flushed, rows out of step
    assert int(jnp.max(r.start)) > 0                                          # the ring wrapped
    np.testing.assert_allclose(np.asarray(r.rebuilt_state()), r.S_ref.numpy(), **TOL_F64)


@pytest.mark.parametrize("kind,readout", [("mamba", "dot"), ("gdn", "dot"), ("mamba", "reduce"), ("gdn", "reduce")])
def test_recurrent_steps_match_reference(kind, readout):
    """``m2_step`` / ``gdn_step`` in both readouts (``dot``: from the new state; ``reduce``:
    from the old one, ``y = a (S C) + Δ (B·C) x``, ``y = e^g Sᵀq + (k·q) u``) token by token
    against the reference recurrence: every output and the final state (odd sizes, grouped
    B/C and key heads)."""
    rng = np.random.default_rng(3)
    Bt, T = 3, 5
    ops.set_step_readout(readout)
    try:
        _check_steps(kind, rng, Bt, T)
    finally:
        ops.set_step_readout("dot")
    with pytest.raises(ValueError, match="step readout"):
        ops.set_step_readout("fused")


def _check_steps(kind, rng, Bt, T):
    if kind == "mamba":
        H, d, G, n = 6, 3, 2, 5
        x, dt, A, B, C = _m2_inputs(rng, Bt, T, H, d, G, n)
        S = S0 = rng.standard_normal((Bt, H, d, n))
        ys = []
        for t in range(T):
            y, S = ops.m2_step(jnp.asarray(S), *(jnp.asarray(a[:, t]) for a in (x, dt)), jnp.asarray(A),
                               jnp.asarray(B[:, t]), jnp.asarray(C[:, t]))
            ys.append(np.asarray(y))
        y_ref, S_ref = m2_ref.recurrent_scan(*(_t(a) for a in (x, dt, A, B, C)), initial_state=_t(S0))
    else:
        H, HV, K, V = 2, 6, 3, 5
        q, k, v, g, beta = _gdn_inputs(rng, Bt, T, H, HV, K, V)
        S = S0 = rng.standard_normal((Bt, HV, K, V)) * 0.3
        qn, kn = ops.gdn_prep_qk(jnp.asarray(q), jnp.asarray(k), F64)
        ys = []
        for t in range(T):
            y, S = ops.gdn_step(jnp.asarray(S), qn[:, t], kn[:, t], *(jnp.asarray(a[:, t]) for a in (v, g, beta)))
            ys.append(np.asarray(y))
        y_ref, S_ref = gdn_ref.recurrent_scan(*(_t(a) for a in (q, k, v, g, beta)), initial_state=_t(S0))
    np.testing.assert_allclose(np.stack(ys, 1), y_ref.numpy(), **TOL_F64)
    np.testing.assert_allclose(np.asarray(S), S_ref.numpy(), **TOL_F64)
