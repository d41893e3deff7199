"""One float64-capable reference of the gated delta rule, for every form, serving Gated DeltaNet
(a log-decay per value head) and KDA (a log-decay per value head and key channel).

Per value head, in the HF/fla state layout ``St = Sᵀ ∈ [.., HV, K, V]`` (``S x = Stᵀ x``,
``u kᵀ`` is ``k ⊗ u``), ``docs/MATH.md``::

    St ← e^{g_t} ⊙ St                 (GDN: one scalar; KDA: row c of St scaled by e^{g_t[c]})
    u_t = β_t (v_t − Stᵀ k_t)
    St ← St + k_t ⊗ u_t               y_t = Stᵀ q_t

A scalar decay is a per-channel decay constant over K, so one set of formulas serves both:
:meth:`DeltaFamily.chan` views GDN's ``g [.., HV]`` as ``[.., HV, 1]`` and every decay below is
applied by broadcasting over that channel axis (``K' = 1`` for GDN, ``K`` for KDA).  The
family modules (:mod:`replayssm.ops.gdn.naive`, :mod:`replayssm.ops.kda.naive`) bind the ops
of a :class:`DeltaRuleRef` to their public names.

Decays are ``exp`` of sums of log-decays over a segment, formed by adding terms (suffix sums,
path sums), never ratios of cumulative products.  Math runs in the state's compute dtype (fp32;
fp64 for fp64 states: a bf16 / fp16 state is upcast when read and rounded once when written);
``y`` is returned in ``v``'s dtype.  Ring entries past a row's valid length may be NaN: they are
masked with ``torch.where``.  Bad input raises ``ValueError`` before any cache tensor is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import paged
from ..cache.ring import StepPlan, gather_history, write_new
from ..cache.tree import ancestor_mask
from ..runtime import compute_dtype
from . import kv_blocks  # a module reference: tests spy on kv_blocks.runs
from .common import (check_accepted, check_kv_lengths, check_plan, check_plan_fit, check_plan_rows,
                     check_route, check_slot, check_state_dtype, check_tensors, check_tree, shape_str,
                     want_check, write_state_where)
from .varlen import check_cu_seqlens, check_state_source, gather_initial, seq_bounds

_ROUTES = ("state", "output")
#: up to this many new tokens the KV-only ops solve them in one block; more run the chunked scan
KV_CHUNK = 64


# ---------------------------------------------------------------------------- family-free helpers
def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last axis (HF/fla ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep_qk(q: Tensor, k: Tensor, cdt, scale, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """Upcast, optionally l2-normalise, and scale q: returns ``(q·scale, k)`` in ``cdt``."""
    q, k = q.to(cdt), k.to(cdt)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return q * s, k


def _heads(x: Tensor, HV: int) -> Tensor:
    """Expand key heads to value heads along axis -2: ``[.., H, K] -> [.., HV, K]``."""
    H = x.shape[-2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=-2)


def _chain_mask(Bt: int, T: int, device) -> Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(Bt, T, T)


def _decay(a: Tensor) -> Tensor:
    """Channel decays ``a [.., HV, K']`` shaped to scale states ``[.., HV, K, V]`` row by row."""
    return a[..., None]


def _state_readout(St: Tensor, x: Tensor) -> Tensor:
    """``S x = Stᵀ x`` for states ``St [Bt,HV,K,V]`` and key- or value-head vectors ``x [Bt,M,H|HV,K]``."""
    return torch.einsum("bhkv,bmhk->bmhv", St, _heads(x, St.shape[1]))


def _sum_history_state(u: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """``Σ_j (w_j ⊙ k_j) ⊗ u_j`` in state layout ``[Bt,HV,K,V]``; ``w [Bt,J,HV,K']``."""
    return torch.einsum("bjhk,bjhk,bjhv->bhkv", w, _heads(k, u.shape[-2]), u)


def _history_readout(u: Tensor, k: Tensor, w: Tensor, x: Tensor) -> Tensor:
    """``Σ_j ((w_j ⊙ k_j)·x_m) u_j`` for value-head vectors ``x [Bt,M,HV,K]`` -> ``[Bt,M,HV,V]``."""
    scores = torch.einsum("bjhk,bjhk,bmhk->bjmh", w, _heads(k, u.shape[-2]), x)
    return torch.einsum("bjmh,bjhv->bmhv", scores, u)


def _masked(t: Tensor, valid: Tensor, cdt) -> Tensor:
    """``t`` upcast with entries where not ``valid [Bt,J]`` replaced by 0 (NaN-safe)."""
    shape = valid.shape + (1,) * (t.dim() - 2)
    return torch.where(valid.view(shape), t.to(cdt), torch.zeros((), dtype=cdt, device=t.device))


def _run_weights(g: Tensor, valid: Tensor, later: Tensor | None = None) -> Tensor:
    """``w_j = e^{Σ_{v>j} g_v (+ later)}`` per channel ``[Bt,J,HV,K']``, 0 where not valid."""
    s = kv_blocks.suffix_after(g)
    if later is not None:
        s = s + later[:, None]
    return torch.where(valid[:, :, None, None], torch.exp(s), torch.zeros((), dtype=g.dtype, device=g.device))


def _path_decays(mask: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Log-decays along a chain/tree of T new tokens (sums of terms, no differences).

    mask ``[Bt,T,T]`` (ancestor-or-self), g ``[Bt,T,HV,K']``.  Returns ``E [Bt,HV,T,T,K']``,
    ``E[s,s'] = Σ_{v on the path (s', s]} g_v`` (``-inf`` where s' is not s or an ancestor),
    and ``G [Bt,T,HV,K']``, the log-decay from ``S_h`` through token s."""
    Bt, T, HV, Kc = g.shape
    E, G = kv_blocks.path_logs(mask, g.reshape(Bt, T, HV * Kc))
    E = E.reshape(Bt, T, T, HV, Kc).permute(0, 3, 1, 2, 4)
    neg_inf = torch.full((), float("-inf"), dtype=g.dtype, device=g.device)
    return torch.where(mask[:, None, :, :, None], E, neg_inf), G.reshape(Bt, T, HV, Kc)


def _delta_block(hk, hq, q, k, v, E, beta, mask):
    """Corrections and outputs of a block of T tokens under a causal/ancestor mask.

    hk, hq: ``[Bt,T,HV,V]`` decayed history readouts ``S_h (e^{G_s} ⊙ k_s)``, ``S_h (e^{G_s} ⊙ q_s)``;
    q, k ``[Bt,T,H,K]`` (normalised, q scaled); v ``[Bt,T,HV,V]``; E ``[Bt,HV,T,T,K']`` pairwise
    log-decays ``G_s − G_{s'}`` (``-inf`` off the mask); beta ``[Bt,T,HV]``; mask ``[Bt,T,T]``.

    Solves ``(I + A) U = R``, ``A_{s,s'} = β_s ((k_s ⊙ e^{G_s−G_{s'}})·k_{s'})`` (s' a strict
    predecessor), ``R_s = β_s (v_s − hk_s)``; ``y_s = hq_s + Σ_{s'≤s} ((q_s ⊙ e^{G_s−G_{s'}})·k_{s'}) U_{s'}``.
    Returns ``U, y`` as ``[Bt,T,HV,V]``."""
    T, HV = v.shape[1], v.shape[2]
    cdt = v.dtype
    D = torch.exp(E)  # exactly 0 off the mask
    ke, qe = _heads(k, HV), _heads(q, HV)
    kk = torch.einsum("bshk,bhstk,bthk->bhst", ke, D, ke)
    qk = torch.einsum("bshk,bhstk,bthk->bhst", qe, D, ke)
    eye = torch.eye(T, dtype=torch.bool, device=v.device)
    zero = torch.zeros((), dtype=cdt, device=v.device)
    A = torch.where(~eye, beta.transpose(1, 2)[..., None] * kk, zero)
    R = (beta[..., None] * (v - hk)).transpose(1, 2)  # [Bt,HV,T,V]
    I = torch.eye(T, dtype=cdt, device=v.device)
    U = torch.linalg.solve_triangular(I + A, R, upper=False, unitriangular=True)
    y = hq + torch.einsum("bhst,bhtv->bshv", qk, U)
    return U.transpose(1, 2), y


def _decayed(G: Tensor, x: Tensor, HV: int) -> Tensor:
    """``e^{G} ⊙ x`` for log-decays ``G [..,HV,K']`` and key-head vectors ``x [..,H,K]`` -> ``[..,HV,K]``."""
    return torch.exp(G) * _heads(x, HV)


def _scan_chunks(St, qn, kn, vc, gc, bc, chunk: int):
    """Chunked WY/UT scan of prepared tokens (``gc [Bt,T,HV,K']``) from state ``St``.

    Per chunk: ``G_s`` = in-chunk cumulative log-decay; readouts of the decayed vectors
    ``e^{G_s} ⊙ k_s`` / ``e^{G_s} ⊙ q_s``; one triangular solve; then
    ``St ← e^{G_C} ⊙ St + Σ_s (e^{Σ_{v>s} g_v} ⊙ k_s) ⊗ U_s``.  Returns ``(y, St, U)``."""
    Bt, T = qn.shape[:2]
    HV = vc.shape[2]
    ys, us = [], []
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        qc, kc, vv, gg, bb = qn[:, sl], kn[:, sl], vc[:, sl], gc[:, sl], bc[:, sl]
        mask = _chain_mask(Bt, qc.shape[1], qn.device)
        E, _ = _path_decays(mask, gg)
        G = gg.cumsum(1)
        hk, hq = _state_readout(St, _decayed(G, kc, HV)), _state_readout(St, _decayed(G, qc, HV))
        U, y = _delta_block(hk, hq, qc, kc, vv, E, bb, mask)
        ys.append(y)
        us.append(U)
        w = torch.exp(kv_blocks.suffix_after(gg))
        St = _decay(torch.exp(gg.sum(1))) * St + _sum_history_state(U, kc, w)
    if not ys:
        return vc.new_zeros(vc.shape), St, vc.new_zeros(vc.shape)
    return torch.cat(ys, 1), St, torch.cat(us, 1)


def _step(St, q, k, v, g, beta):
    """One step on prepared inputs: St ``[Bt,HV,K,V]``, q/k ``[Bt,H,K]``, g ``[Bt,HV,K']``."""
    HV = St.shape[1]
    ke, qe = _heads(k, HV), _heads(q, HV)
    St = _decay(torch.exp(g)) * St
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", St, ke))
    St = St + ke[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", St, qe), St


def _draft_mask(par: Tensor | None, Bt: int, T: int, device) -> Tensor:
    return _chain_mask(Bt, T, device) if par is None else ancestor_mask(par)


def snapshot_commit(state: Tensor, slot: Tensor, snapshots: Tensor, accepted: Tensor,
                    check: bool | None = None) -> None:
    """Baseline commit: ``state[slot] = snapshots[:, a-1]`` for rows with ``a = accepted > 0``.

    snapshots ``[Bt,T,HV,K,V]``, accepted ``[Bt]`` in ``[0, T]``.  No host sync without check.
    """
    if not isinstance(snapshots, Tensor) or snapshots.dim() != 5:
        raise ValueError("snapshots must be a tensor [Bt, T, HV, K, V]")
    Bt, T = snapshots.shape[:2]
    if not isinstance(state, Tensor) or state.dim() != 4 or state.shape[1:] != snapshots.shape[2:]:
        raise ValueError(f"state must be [P, {', '.join(map(str, snapshots.shape[2:]))}], "
                         f"got {shape_str(state)}")
    if snapshots.device != state.device:
        raise ValueError(f"snapshots on {snapshots.device}, state on {state.device}")
    check = want_check(check, state)
    sl = check_slot(slot, state.shape[0], Bt, state.device, check)
    a = check_accepted(accepted, Bt, T, state.device, check)
    rows = torch.arange(Bt, device=state.device)
    chosen = snapshots[rows, (a - 1).clamp(min=0)]
    write_state_where(state, sl, a > 0, chosen)


# ---------------------------------------------------------------------------- the family
@dataclass(frozen=True)
class DeltaFamily:
    """A delta-rule variant: its name, decay layout and cache classes.

    ``per_channel``: ``g`` is ``[.., HV, K]`` (KDA) rather than ``[.., HV]`` (GDN)."""

    name: str
    per_channel: bool
    buffers: type
    paged_buffers: type

    def chan(self, g: Tensor) -> Tensor:
        """Log-decays in channel form ``[.., HV, K']``: GDN's scalar per head gets ``K' = 1``."""
        return g if self.per_channel else g[..., None]

    def g_tail(self, HV: int, K: int) -> tuple:
        return (HV, K) if self.per_channel else (HV,)


class DeltaRuleRef:
    """The reference ops of one :class:`DeltaFamily` (bound to module names by the family modules)."""

    def __init__(self, fam: DeltaFamily):
        self.fam = fam

    # ------------------------------------------------------------------------ checks
    def _check_inputs(self, q, k, v, g, beta, has_time: bool, scale):
        """Validate raw projections; return ``(Bt, T, H, HV, K, V)`` (``T = 1`` if no time axis)."""
        for name, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
        nd = 4 if has_time else 3
        if q.dim() != nd:
            raise ValueError(f"q must be {'[Bt, T, H, K]' if has_time else '[Bt, H, K]'}, got shape {tuple(q.shape)}")
        if k.shape != q.shape:
            raise ValueError(f"k has shape {tuple(k.shape)}, q has {tuple(q.shape)}: they must match")
        if k.dtype != q.dtype:
            raise ValueError(f"dtype mismatch: q is {q.dtype}, k is {k.dtype}")
        lead = tuple(q.shape[:-2])
        if v.dim() != nd or tuple(v.shape[:-2]) != lead:
            exp = "[Bt, T, HV, V]" if has_time else "[Bt, HV, V]"
            raise ValueError(f"v must be {exp} with leading dims {lead}, got shape {tuple(v.shape)}")
        H, K = q.shape[-2:]
        HV, V = v.shape[-2:]
        if tuple(g.shape) != lead + self.fam.g_tail(HV, K):
            what = " (a log-decay per value head and key channel)" if self.fam.per_channel else ""
            raise ValueError(f"g must have shape {lead + self.fam.g_tail(HV, K)}{what}, got {tuple(g.shape)}")
        if tuple(beta.shape) != lead + (HV,):
            raise ValueError(f"beta must have shape {lead + (HV,)}, got {tuple(beta.shape)}")
        if H < 1 or HV < 1 or K < 1 or V < 1:
            raise ValueError(f"empty head dims: H={H}, HV={HV}, K={K}, V={V}")
        if HV % H:
            raise ValueError(f"value heads HV={HV} is not a multiple of key heads H={H}")
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        return q.shape[0], (q.shape[1] if has_time else 1), H, HV, K, V

    def _check_buffers(self, buf, plan, kind: str, dims, device, check: bool) -> None:
        """Validate a layer's buffers and the step plan against the inputs' dims."""
        Bt, T, H, HV, K, V = dims
        cls = self.fam.buffers
        if not isinstance(buf, cls):
            raise ValueError(f"buf must be {cls.__name__}, got {type(buf).__name__}")
        check_plan(plan, kind, Bt, T)
        check_state_dtype(buf.state, "buf.state dtype")
        P, L = buf.state.shape[0], plan.capacity
        want = {"state": (buf.state, (P, HV, K, V)), "u": (buf.u, (P, L, HV, V)),
                "k": (buf.k, (P, L, H, K)), "g": (buf.g, (P, L) + self.fam.g_tail(HV, K))}
        check_tensors("buf", want, device, f" (P={P}, L={L}, H={H}, HV={HV}, K={K}, V={V})")
        check_plan_rows(plan, Bt, device)
        if check and Bt:
            if bool(((plan.slot < 0) | (plan.slot >= P)).any()):
                raise ValueError(f"plan slots must be in [0, {P - 1}]")
            if bool(((plan.start < 0) | (plan.start >= L)).any()):
                raise ValueError(f"plan starts must be in [0, {L - 1}]")
            if T > L:
                raise ValueError(f"{T} new entries do not fit a ring of capacity {L}")
            check_plan_fit(plan, T, L)

    def _check_paged(self, kv, pplan) -> None:
        cls = self.fam.paged_buffers
        if not isinstance(kv, cls):
            raise ValueError(f"kv must be {cls.__name__}, got {type(kv).__name__}")
        if not isinstance(pplan, paged.PagedPlan):
            raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")

    def _check_kv(self, kv, pplan, dims, device, check: bool) -> None:
        Bt, T, H, HV, K, V = dims
        self._check_paged(kv, pplan)
        if pplan.slot.shape != (Bt,):
            raise ValueError(f"paged plan has {pplan.slot.shape[0]} rows, inputs have batch {Bt}")
        if pplan.num_new != T:
            raise ValueError(f"paged plan appends {pplan.num_new} entries per row, inputs have {T} tokens")
        for name in ("slot", "length", "block_table"):
            t = getattr(pplan, name)
            if t.shape[0] != Bt or t.device != device:
                raise ValueError(f"pplan.{name} must have {Bt} rows on {device}")
        if not isinstance(kv.u, Tensor) or kv.u.dim() != 3:
            raise ValueError(f"kv.u must be [NB*bs, HV, V], got {shape_str(kv.u)}")
        NBbs = kv.u.shape[0]
        if NBbs % pplan.block_size:
            raise ValueError(f"KV pools have {NBbs} entries, not a multiple of block_size {pplan.block_size}")
        want = {"u": (kv.u, (NBbs, HV, V)), "k": (kv.k, (NBbs, H, K)), "g": (kv.g, (NBbs,) + self.fam.g_tail(HV, K))}
        check_tensors("kv", want, device)
        if check and Bt:
            nb = NBbs // pplan.block_size
            if bool(((pplan.block_table < 0) | (pplan.block_table >= nb)).any()):
                raise ValueError(f"block table entries must be in [0, {nb - 1}]")
            check_kv_lengths(pplan, T)

    def _kv_dims(self, kv, pplan) -> tuple[int, int, int, int, int, int]:
        """``(Bt, T, H, HV, K, V)`` of a paged call from the pools and the plan."""
        self._check_paged(kv, pplan)
        for name in ("u", "k"):
            t = getattr(kv, name)
            if not isinstance(t, Tensor) or t.dim() != 3:
                raise ValueError(f"kv.{name} must be a pool [NB*bs, heads, dim], got {shape_str(t)}")
        HV, V = kv.u.shape[1:]
        H, K = kv.k.shape[1:]
        if H < 1 or HV % H:
            raise ValueError(f"value heads HV={HV} is not a multiple of the KV pool's key heads {H}")
        Bt = pplan.slot.shape[0] if isinstance(pplan.slot, Tensor) else -1
        return Bt, pplan.num_new, H, HV, K, V

    def _initial(self, initial_state, dims, cdt, device):
        Bt, T, H, HV, K, V = dims
        if initial_state is None:
            return torch.zeros(Bt, HV, K, V, dtype=cdt, device=device)
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (Bt, HV, K, V):
            raise ValueError(f"initial_state must have shape {(Bt, HV, K, V)}, got {shape_str(initial_state)}")
        check_state_dtype(initial_state, "initial_state dtype")
        if initial_state.device != device:
            raise ValueError(f"initial_state is on {initial_state.device}, inputs on {device}")
        return initial_state.to(cdt)

    # ------------------------------------------------------------------------ recurrence
    def recurrent_step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       scale: float | None = None, use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
        """One delta-rule step (the recurrent form).

        state ``[Bt,HV,K,V]``, q/k ``[Bt,H,K]``, v ``[Bt,HV,V]``, g ``[Bt,HV]`` (GDN) or
        ``[Bt,HV,K]`` (KDA), beta ``[Bt,HV]``.  ``St ← e^g ⊙ St``; ``u = β (v − Stᵀ k)``;
        ``St ← St + k ⊗ u``; ``y = Stᵀ q``.  Returns ``(y [Bt,HV,V] in v.dtype, new_state)``
        (a new tensor, state dtype)."""
        Bt, _, H, HV, K, V = self._check_inputs(q, k, v, g, beta, False, scale)
        if not isinstance(state, Tensor) or tuple(state.shape) != (Bt, HV, K, V):
            raise ValueError(f"state must have shape {(Bt, HV, K, V)}, got {shape_str(state)}")
        check_state_dtype(state, "state dtype")
        cdt = compute_dtype(state.dtype)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        y, St = _step(state.to(cdt), qn, kn, v.to(cdt), self.fam.chan(g.to(cdt)), beta.to(cdt))
        return y.to(v.dtype), St.to(state.dtype)

    def recurrent_update(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         scale: float | None = None, use_qk_l2norm: bool = True,
                         slot: Tensor | None = None) -> Tensor:
        """One step on a state pool, in place: ``state[slot] ← step(state[slot])``.

        state ``[P,HV,K,V]``, slot ``[Bt]`` (default: rows ``0..Bt-1``); other shapes as in
        :func:`recurrent_step`.  Returns ``y [Bt,HV,V]``."""
        if not isinstance(state, Tensor) or state.dim() != 4:
            raise ValueError(f"state must be a pool [P, HV, K, V], got {shape_str(state)}")
        Bt = v.shape[0] if isinstance(v, Tensor) and v.dim() else 0
        idx = torch.arange(Bt, device=state.device) if slot is None else \
            check_slot(slot, state.shape[0], Bt, state.device, want_check(None, state))
        y, S = self.recurrent_step(state[idx], q, k, v, g, beta, scale, use_qk_l2norm)
        state[idx] = S.to(state.dtype)
        return y

    def _scan_setup(self, q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
        dims = self._check_inputs(q, k, v, g, beta, True, scale)
        cdt = compute_dtype(initial_state.dtype) if isinstance(initial_state, Tensor) else compute_dtype(
            q.dtype, v.dtype, g.dtype, beta.dtype)
        St = self._initial(initial_state, dims, cdt, q.device)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        return dims, St, qn, kn, v.to(cdt), self.fam.chan(g.to(cdt)), beta.to(cdt)

    def recurrent_scan(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       scale: float | None = None, initial_state: Tensor | None = None,
                       use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
        """Ground truth: a loop of :func:`recurrent_step` over T tokens.

        q/k ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g ``[Bt,T,HV]`` (GDN) or ``[Bt,T,HV,K]`` (KDA),
        beta ``[Bt,T,HV]``, initial_state ``[Bt,HV,K,V]`` (zeros if None).  Returns
        ``(y [Bt,T,HV,V], final_state)``; math in the initial state's compute dtype (fp64 if any
        input is fp64 when there is none)."""
        dims, St, qn, kn, vc, gc, bc = self._scan_setup(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
        ys = []
        for t in range(dims[1]):
            y, St = _step(St, qn[:, t], kn[:, t], vc[:, t], gc[:, t], bc[:, t])
            ys.append(y)
        y = torch.stack(ys, 1) if ys else vc.new_zeros(vc.shape)
        return y.to(v.dtype), St

    def chunked_prefill(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        scale: float | None = None, initial_state: Tensor | None = None,
                        use_qk_l2norm: bool = True, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
        """Chunked WY/UT form of :func:`recurrent_scan` (same arguments and returns).

        Per chunk of C tokens from state St, with ``G_s`` the in-chunk cumulative log-decay:
        ``(I + A) U = R``, ``A_{s,s'} = β_s ((k_s ⊙ e^{G_s−G_{s'}})·k_{s'})`` (s' < s),
        ``R_s = β_s (v_s − Stᵀ(e^{G_s} ⊙ k_s))``;
        ``y_s = Stᵀ(e^{G_s} ⊙ q_s) + Σ_{s'≤s} ((q_s ⊙ e^{G_s−G_{s'}})·k_{s'}) U_{s'}``;
        ``St ← e^{G_C} ⊙ St + Σ_s (e^{G_C−G_s} ⊙ k_s) ⊗ U_s``.  The last chunk may be shorter."""
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        _, St, qn, kn, vc, gc, bc = self._scan_setup(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
        y, St, _ = _scan_chunks(St, qn, kn, vc, gc, bc, chunk_size)
        return y.to(v.dtype), St

    # ------------------------------------------------------------------------ replay
    def _history(self, buf, plan: StepPlan, cdt):
        """Committed ring entries, masked: ``u [Bt,L,HV,V]``, ``k [Bt,L,H,K]``, weights
        ``w_j = e^{pre_h − pre_j}`` (0 past ``h``) ``[Bt,L,HV,K']`` and ``pre_h [Bt,HV,K']``."""
        valid = plan.hist_mask()
        u = _masked(gather_history(buf.u, plan), valid, cdt)
        k = _masked(gather_history(buf.k, plan), valid, cdt)
        g = self.fam.chan(_masked(gather_history(buf.g, plan), valid, cdt))
        return u, k, _run_weights(g, valid), g.sum(1)

    def _readouts(self, buf, plan, cdt, x: Tensor | None, route: str):
        """History readouts ``S_h x_m`` for value-head vectors ``x [Bt,M,HV,K]`` and ``S_h``.

        route "state": materialise ``S_h`` and read it.  route "output": one read of ``S0``
        (``S0 (e^{pre_h} ⊙ x)``) plus the ring terms; ``S_h`` is still returned (flush rows)."""
        u, k, w, tot = self._history(buf, plan, cdt)
        S0 = buf.state[plan.slot].to(cdt)
        Sh = _decay(torch.exp(tot)) * S0 + _sum_history_state(u, k, w)
        if x is None:
            return None, Sh
        if route == "state":
            return _state_readout(Sh, x), Sh
        return _state_readout(S0, torch.exp(tot)[:, None] * x) + _history_readout(u, k, w, x), Sh

    def check_rebuild_state(self, buf, plan) -> None:
        """Validate a :func:`rebuild_state` call (shared with its kernel)."""
        if not isinstance(buf, self.fam.buffers) or not isinstance(plan, StepPlan):
            raise ValueError(f"rebuild_state needs {self.fam.buffers.__name__} and a StepPlan")
        check_state_dtype(buf.state, "buf.state dtype")

    def rebuild_state(self, buf, plan: StepPlan) -> Tensor:
        """``S_h = e^{pre_h} ⊙ S0 + Σ_{j<h} (e^{pre_h−pre_j} ⊙ k_j) ⊗ u_j`` per row ``[Bt,HV,K,V]``
        (the first step of replay), in the compute dtype (a 16-bit checkpoint is not rounded
        here).  Reads only; any plan kind."""
        self.check_rebuild_state(buf, plan)
        return self._readouts(buf, plan, compute_dtype(buf.state.dtype), None, "state")[1]

    def replay_decode(self, buf, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                      beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                      route: str = "state", check: bool | None = None) -> Tensor:
        """Replay decode of one token per row (``docs/MATH.md``); ``plan.kind == "decode"``.

        q/k ``[Bt,H,K]``, v ``[Bt,HV,V]``, g ``[Bt,HV]`` / ``[Bt,HV,K]``, beta ``[Bt,HV]``.  With
        ``S_h`` rebuilt from the checkpoint and ring and ``α = e^g``: ``u = β (v − S_h (α ⊙ k))``,
        ``y = S_h (α ⊙ q) + u (k·q)``; appends ``(u, k, g)`` at ring position ``h``; rows with
        ``plan.flush`` write ``state[slot] = α ⊙ S_h + k ⊗ u`` (= ``S_{h+1}``) from the entry as
        the ring stores it (rounded to its dtype), so a checkpoint is always the fold of stored
        entries.  Returns ``y [Bt,HV,V]``."""
        check_route(route, _ROUTES)
        dims = self._check_inputs(q, k, v, g, beta, False, scale)
        check = want_check(check, q)
        self._check_buffers(buf, plan, "decode", dims, q.device, check)
        Bt, _, H, HV, K, V = dims
        cdt = compute_dtype(buf.state.dtype)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
        a = torch.exp(self.fam.chan(gc))  # [Bt,HV,K']
        ke, qe = _heads(kn, HV), _heads(qn, HV)
        r, Sh = self._readouts(buf, plan, cdt, torch.stack([a * ke, a * qe], 1), route)
        u = bc[..., None] * (vc - r[:, 0])
        y = r[:, 1] + u * (ke * qe).sum(-1, keepdim=True)
        u_s, k_s = u.to(buf.u.dtype).to(cdt), _heads(kn.to(buf.k.dtype).to(cdt), HV)  # as stored
        a_s = torch.exp(self.fam.chan(gc.to(buf.g.dtype).to(cdt)))
        S_next = _decay(a_s) * Sh + k_s[..., :, None] * u_s[..., None, :]
        # ---- writes (all validation done above)
        write_new(buf.u, plan, u[:, None])
        write_new(buf.k, plan, kn[:, None])
        write_new(buf.g, plan, gc[:, None])
        write_state_where(buf.state, plan.slot, plan.flush, S_next)
        return y.to(v.dtype)

    def _draft_verify(self, buf, plan, par, q, k, v, g, beta, scale, use_qk_l2norm, route, dims):
        """Shared body of :func:`replay_verify` / :func:`tree_verify` (inputs validated;
        ``par`` None for a chain of drafts)."""
        Bt, T, H, HV = dims[:4]
        cdt = compute_dtype(buf.state.dtype)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
        M = _draft_mask(par, Bt, T, q.device)
        E, G = _path_decays(M, self.fam.chan(gc))
        r, Sh = self._readouts(buf, plan, cdt, torch.cat([_decayed(G, kn, HV), _decayed(G, qn, HV)], 1), route)
        U, y = _delta_block(r[:, :T], r[:, T:], qn, kn, vc, E, bc, M)
        # ---- writes (all validation done above)
        write_new(buf.u, plan, U)
        write_new(buf.k, plan, kn)
        write_new(buf.g, plan, gc)
        write_state_where(buf.state, plan.slot, plan.flush, Sh)
        return y.to(v.dtype)

    def replay_verify(self, buf, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                      beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                      route: str = "state", check: bool | None = None) -> Tensor:
        """Replay verify of T drafts per row in one triangular solve (``docs/MATH.md``,
        "Speculative verify"); ``plan.kind == "verify"``.

        q/k ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g ``[Bt,T,HV]`` / ``[Bt,T,HV,K]``, beta ``[Bt,T,HV]``.
        ``G_s = Σ_{i≤s} g_i``; ``(I + A) U = R``,
        ``A_{s,s'} = β_s ((k_s ⊙ e^{G_s−G_{s'}})·k_{s'})`` (s' < s), ``R_s = β_s (v_s − S_h(e^{G_s} ⊙ k_s))``;
        ``y_s = S_h(e^{G_s} ⊙ q_s) + Σ_{s'≤s} ((q_s ⊙ e^{G_s−G_{s'}})·k_{s'}) U_{s'}``.
        Appends ``(U, k, g)`` at positions ``h..h+T-1``; flush rows write ``state[slot] = S_h``
        (committed entries only).  Returns ``y [Bt,T,HV,V]``; commit with ``ring.commit``."""
        check_route(route, _ROUTES)
        dims = self._check_inputs(q, k, v, g, beta, True, scale)
        check = want_check(check, q)
        self._check_buffers(buf, plan, "verify", dims, q.device, check)
        return self._draft_verify(buf, plan, None, q, k, v, g, beta, scale, use_qk_l2norm, route, dims)

    def tree_verify(self, buf, plan: StepPlan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor,
                    g: Tensor, beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                    route: str = "state", check: bool | None = None) -> Tensor:
        """Replay verify of a draft tree of N nodes per row; ``plan.kind == "tree"``.

        parent ``[Bt,N]`` or ``[N]`` (topological, ``-1`` = child of the last committed entry).
        The system of :func:`replay_verify` under the ancestor-or-self mask ``M``, with
        ``G_i = Σ_{j∈M_i} g_j`` and each pairwise decay the sum along the path ``(j, i]``; each
        node's output equals the recurrence along its root path.  Appends ``(U, k, g)`` at
        ``h..h+N-1``; flush rows write ``S_h``.  Commit:
        ``cache.tree.gather_path(buf.ring_tensors(), plan, path, accepted)`` then ``ring.commit``."""
        check_route(route, _ROUTES)
        dims = self._check_inputs(q, k, v, g, beta, True, scale)
        check = want_check(check, q, parent) if isinstance(parent, Tensor) else True
        self._check_buffers(buf, plan, "tree", dims, q.device, check)
        par = check_tree(parent, dims[0], dims[1], q.device, check)
        return self._draft_verify(buf, plan, par, q, k, v, g, beta, scale, use_qk_l2norm, route, dims)

    # ------------------------------------------------------------------------ snapshot baseline
    def snapshot_verify(self, state: Tensor, slot: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                        beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                        check: bool | None = None) -> tuple[Tensor, Tensor]:
        """Baseline speculative verify: serial scan from ``state[slot]``, one state per draft.

        state ``[P,HV,K,V]`` (read only), slot ``[Bt]``.  Returns ``(y [Bt,T,HV,V],
        snapshots [Bt,T,HV,K,V])`` with ``snapshots[:, s]`` the state after draft s (state
        dtype); commit with :func:`snapshot_commit`."""
        Bt, T, H, HV, K, V = self._check_inputs(q, k, v, g, beta, True, scale)
        if not isinstance(state, Tensor) or state.dim() != 4 or tuple(state.shape[1:]) != (HV, K, V):
            raise ValueError(f"state must be [P, {HV}, {K}, {V}], got {shape_str(state)}")
        check_state_dtype(state, "state dtype")
        if state.device != q.device:
            raise ValueError(f"state is on {state.device}, inputs on {q.device}")
        sl = check_slot(slot, state.shape[0], Bt, q.device, want_check(check, q))
        cdt = compute_dtype(state.dtype)
        St = state[sl].to(cdt)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        vc, gc, bc = v.to(cdt), self.fam.chan(g.to(cdt)), beta.to(cdt)
        ys, snaps = [], []
        for t in range(T):
            y, St = _step(St, qn[:, t], kn[:, t], vc[:, t], gc[:, t], bc[:, t])
            ys.append(y)
            snaps.append(St)
        return torch.stack(ys, 1).to(v.dtype), torch.stack(snaps, 1).to(state.dtype)

    # ------------------------------------------------------------------------ KV-only (paged)
    # The KV-only form keeps every entry since the start in paged blocks (``S0 = 0``).  The ops
    # walk the blocks a batch holds, a run of whole blocks at a time (:mod:`..kv_blocks`):
    # up to ``KV_CHUNK`` new tokens the history readouts are sums over the held entries, run by
    # run, and the new tokens one triangular solve under their chain / tree mask; more (a
    # prefill), the history is folded into a state and the new tokens run the chunked scan.
    def _kv_run(self, kv, pos: Tensor, valid: Tensor, cdt):
        """One run of held entries, masked: ``u [Bt,E,HV,V]``, ``k [Bt,E,H,K]``, ``g [Bt,E,HV,K']``."""
        return (_masked(kv.u[pos], valid, cdt), _masked(kv.k[pos], valid, cdt),
                self.fam.chan(_masked(kv.g[pos], valid, cdt)))

    def _kv_fold(self, kv, pplan, cdt, S0: Tensor | None = None, budget: int = kv_blocks.RUN_BUDGET) -> Tensor:
        """``S_n = e^{pre_n} ⊙ S0 + Σ_{j<n} (e^{pre_n−pre_j} ⊙ k_j) ⊗ u_j`` per row, run by run."""
        HV, V = kv.u.shape[1:]
        H, K = kv.k.shape[1:]
        S = torch.zeros(pplan.batch, HV, K, V, dtype=cdt, device=kv.u.device) if S0 is None else S0.to(cdt)
        gw = 4 * HV * K if self.fam.per_channel else HV * K + 4 * HV  # per-entry work of the decays
        for pos, valid in kv_blocks.runs(pplan, pplan.batch * (2 * HV * V + 2 * H * K + gw), budget=budget):
            u, k, g = self._kv_run(kv, pos, valid, cdt)
            S = _decay(torch.exp(g.sum(1))) * S + _sum_history_state(u, k, _run_weights(g, valid))
        return S

    def _kv_readout(self, kv, pplan, x: Tensor, cdt) -> Tensor:
        """``S_n x_m`` for value-head vectors ``x [Bt,M,HV,K]``, run by run (newest first,
        carrying the log-decay of the runs already seen), without forming ``S_n``."""
        Bt, M, HV, K = x.shape
        V = kv.u.shape[2]
        H = kv.k.shape[1]
        Kc = K if self.fam.per_channel else 1
        r = torch.zeros(Bt, M, HV, V, dtype=cdt, device=x.device)
        later = torch.zeros(Bt, HV, Kc, dtype=cdt, device=x.device)
        gw = 4 * HV * K + M * 2 * HV if self.fam.per_channel else 3 * HV + M * (H + 2 * HV)
        for pos, valid in kv_blocks.runs(pplan, Bt * (2 * HV * V + 2 * H * K + gw), reverse=True):
            u, k, g = self._kv_run(kv, pos, valid, cdt)
            r = r + _history_readout(u, k, _run_weights(g, valid, later), x)
            later = later + g.sum(1)
        return r

    def _kv_new(self, kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims):
        """Shared body of :func:`kv_verify` / :func:`kv_tree_verify` (inputs validated;
        ``par`` None for a chain).  Writes the new ``(u, k, g)``; returns ``y`` in ``v.dtype``."""
        Bt, T, H, HV = dims[:4]
        cdt = compute_dtype(kv.g.dtype, kv.u.dtype, q.dtype, v.dtype)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
        if par is None and T > KV_CHUNK:
            y, _, U = _scan_chunks(self._kv_fold(kv, pplan, cdt), qn, kn, vc, self.fam.chan(gc), bc, KV_CHUNK)
        else:
            M = _draft_mask(par, Bt, T, q.device)
            E, G = _path_decays(M, self.fam.chan(gc))
            r = self._kv_readout(kv, pplan, torch.cat([_decayed(G, kn, HV), _decayed(G, qn, HV)], 1), cdt)
            U, y = _delta_block(r[:, :T], r[:, T:], qn, kn, vc, E, bc, M)
        # ---- writes (all validation done above)
        paged.write_kv_new(kv.u, pplan, U)
        paged.write_kv_new(kv.k, pplan, kn)
        paged.write_kv_new(kv.g, pplan, gc)
        return y.to(v.dtype)

    def kv_verify(self, kv, pplan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  scale: float | None = None, use_qk_l2norm: bool = True,
                  check: bool | None = None, parent: Tensor | None = None) -> Tensor:
        """KV-only form (no state, ``S0 = 0``) for T new tokens per row over paged buffers.

        kv: the family's paged buffers; pplan: ``PagedPlan`` (``num_new == T``); q/k ``[Bt,T,H,K]``,
        v ``[Bt,T,HV,V]``, g ``[Bt,T,HV]`` / ``[Bt,T,HV,K]``, beta ``[Bt,T,HV]``.  With all inputs
        since the start in the pages (``G`` the cumulative log-decay from the start):
        ``u_t = β_t (v_t − Σ_{j<t} ((k_t ⊙ e^{G_t−G_j})·k_j) u_j)``,
        ``y_t = Σ_{j≤t} ((q_t ⊙ e^{G_t−G_j})·k_j) u_j``.  Computed over the held blocks only
        (memory and time grow with the context held, not with ``max_seq_len``): up to
        ``KV_CHUNK`` tokens, history readouts run by run and one triangular solve; more, the
        history folded into a state and the chunked scan.  Writes ``(u, k, g)`` of the new
        tokens with ``write_kv_new``; advance with ``pidx.commit(pplan, accepted)``.
        ``parent [Bt,T]`` / ``[T]`` makes the new tokens a draft tree (as :func:`kv_tree_verify`).
        Returns ``y [Bt,T,HV,V]``; compute dtype fp64 if the pools or the inputs are fp64, else fp32."""
        dims = self._check_inputs(q, k, v, g, beta, True, scale)
        check = want_check(check, q)
        self._check_kv(kv, pplan, dims, q.device, check)
        par = None if parent is None else check_tree(parent, dims[0], dims[1], q.device, check)
        return self._kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims)

    def kv_tree_verify(self, kv, pplan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                       beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                       check: bool | None = None) -> Tensor:
        """KV-only form of :func:`tree_verify`: a draft tree of N nodes per row over paged buffers.

        parent ``[Bt,N]`` or ``[N]`` (topological, ``-1`` = child of the last committed entry).
        With ``S_n`` the state the row's n held entries fold into (never formed: readouts run
        block by block), the system of :func:`tree_verify`; each node's output is the recurrence
        along its root path.  Writes ``(U, k, g)`` at logical ``length .. length+N-1``; commit
        moves the accepted path to the front (``cache.paged.gather_path``) before ``pidx.commit``.
        Returns ``y [Bt,N,HV,V]``."""
        dims = self._check_inputs(q, k, v, g, beta, True, scale)
        check = want_check(check, q)
        self._check_kv(kv, pplan, dims, q.device, check)
        par = check_tree(parent, dims[0], dims[1], q.device, check)
        return self._kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims)

    def check_kv_fold(self, kv, pplan, initial_state: Tensor | None, check: bool | None):
        """Validate a :func:`kv_fold` call (shared with its kernel); returns ``(Bt, H, HV, K, V)``."""
        dims = self._kv_dims(kv, pplan)
        Bt, _, H, HV, K, V = dims
        device = kv.u.device
        self._check_kv(kv, pplan, dims, device, False)
        if initial_state is not None and (not isinstance(initial_state, Tensor)
                                          or tuple(initial_state.shape) != (Bt, HV, K, V)
                                          or initial_state.device != device):
            raise ValueError(f"initial_state must be [{Bt}, {HV}, {K}, {V}] on {device}, "
                             f"got {shape_str(initial_state)}")
        if want_check(check, kv.u) and Bt and bool((pplan.length < 0).any()):
            raise ValueError("negative KV lengths in the paged plan")
        return Bt, H, HV, K, V

    def kv_fold(self, kv, pplan, initial_state: Tensor | None = None, check: bool | None = None) -> Tensor:
        """The state each row's committed paged entries fold into, from ``initial_state``:
        ``S_n = e^{pre_n} ⊙ S0 + Σ_{j<n} (e^{pre_n−pre_j} ⊙ k_j) ⊗ u_j`` (``S0 = 0`` when None).

        kv: the family's paged buffers (a slot's KV-only pages, or the prefix store's blocks);
        ``pplan``: its block tables and lengths ``n`` per row (only those are read);
        ``initial_state [Bt,HV,K,V]``.  Folded run by run over the held blocks.  Returns
        ``[Bt,HV,K,V]`` in fp64 if the pool's g or ``initial_state`` is fp64, else fp32.  Reads only."""
        self.check_kv_fold(kv, pplan, initial_state, check)
        cdt = compute_dtype(kv.g.dtype, *(() if initial_state is None else (initial_state.dtype,)))
        return self._kv_fold(kv, pplan, cdt, initial_state, kv_blocks.FOLD_BUDGET)

    def kv_to_state(self, kv, pplan, buf, slot: Tensor, check: bool | None = None) -> None:
        """Compress each row's committed KV entries into a checkpoint (one flush):
        ``buf.state[slot] = Σ_{j<n} (e^{pre_n−pre_j} ⊙ k_j) ⊗ u_j`` (``S0 = 0``), folded run by
        run over the held blocks.

        ``pplan`` (from ``pidx.plan(slots, T)``; only its committed lengths are used) and
        ``slot [Bt]`` (the rows' state slots in ``buf``).  Ring bookkeeping is the caller's
        (``ring.reset(slot)``); paged blocks may be released afterwards."""
        cls = self.fam.buffers
        if not isinstance(buf, cls):
            raise ValueError(f"buf must be {cls.__name__}, got {type(buf).__name__}")
        dims = self._kv_dims(kv, pplan)
        Bt, _, H, HV, K, V = dims
        check_state_dtype(buf.state, "buf.state dtype")
        if not isinstance(buf.state, Tensor) or buf.state.dim() != 4 or tuple(buf.state.shape[1:]) != (HV, K, V):
            raise ValueError(f"buf.state must be [P, {HV}, {K}, {V}] to match the KV pools, got {shape_str(buf.state)}")
        check = want_check(check, buf.state)
        self._check_kv(kv, pplan, dims, buf.state.device, False)
        sl = check_slot(slot, buf.state.shape[0], Bt, buf.state.device, check)
        if check and Bt and bool((pplan.length < 0).any()):
            raise ValueError("negative KV lengths in the paged plan")
        S = self._kv_fold(kv, pplan, compute_dtype(buf.state.dtype))
        buf.state[sl] = S.to(buf.state.dtype)

    # ------------------------------------------------------------------------ packed prefill
    def check_prefill_varlen(self, q, k, v, g, beta, scale, cu_seqlens, chunk_size, initial_state, state_pool,
                             slots, fresh, check, *, g_form: str | None = None, check_inputs=None):
        """The argument checks of :func:`chunked_prefill_varlen` (its kernel twin runs the same):
        returns ``(Nt, H, HV, K, V, N, slots, fresh, check)``.  ``g_form`` / ``check_inputs``:
        a delta-rule variant's decay layout and input check (default: this family's)."""
        if g_form is None:
            g_form = "[Nt, HV, K]" if self.fam.per_channel else "[Nt, HV]"
        for name, t, form in (("q", q, "[Nt, H, K]"), ("k", k, "[Nt, H, K]"), ("v", v, "[Nt, HV, V]"),
                              ("g", g, g_form), ("beta", beta, "[Nt, HV]")):
            if not isinstance(t, Tensor) or t.dim() != form.count(",") + 1:
                raise ValueError(f"{name} must be {form}, got {shape_str(t)}")
        _, Nt, H, HV, K, V = (check_inputs or self._check_inputs)(q[None], k[None], v[None], g[None], beta[None],
                                                                   True, scale)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        check = want_check(check, q)
        N = check_cu_seqlens(cu_seqlens, Nt, q.device, check)
        sl, fr = check_state_source(initial_state, state_pool, slots, fresh, N, (HV, K, V), q.device, check)
        return Nt, H, HV, K, V, N, sl, fr, check

    def chunked_prefill_varlen(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               cu_seqlens: Tensor, initial_state: Tensor | None = None,
                               scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                               return_u: bool = False, state_pool: Tensor | None = None,
                               slots: Tensor | None = None, fresh: Tensor | None = None,
                               check: bool | None = None):
        """:func:`chunked_prefill` over a packed batch of ``N`` variable-length sequences.

        q/k ``[Nt,H,K]``, v ``[Nt,HV,V]``, g ``[Nt,HV]`` / ``[Nt,HV,K]``, beta ``[Nt,HV]``; sequence
        ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` (may be empty), scanned on its own
        (chunks restart at its first token) from ``initial_state[i] [HV,K,V]`` (zeros if None),
        or, in pool form (:mod:`replayssm.ops.varlen`), from zeros if ``fresh[i]`` else
        ``state_pool[slots[i]]``, its final state written back to ``state_pool[slots[i]]``.
        Math in fp64 if any input or the state source is fp64, else fp32.

        Returns ``(y [Nt,HV,V] in v.dtype, final_state [N,HV,K,V])`` (pool form: ``None`` in
        place of the final states), plus ``u [Nt,HV,V]`` (v.dtype) with ``return_u``:
        ``u_t = β_t (v_t − S_{t−1}(α_t ⊙ k_t))``, the corrected values the replay ring and the
        KV-only pages store."""
        Nt, H, HV, K, V, N, sl, fr, check = self.check_prefill_varlen(
            q, k, v, g, beta, scale, cu_seqlens, chunk_size, initial_state, state_pool, slots, fresh, check)
        src = state_pool if state_pool is not None else initial_state
        cdt = compute_dtype(q.dtype, v.dtype, g.dtype, beta.dtype, *(() if src is None else (src.dtype,)))
        S0 = gather_initial(initial_state, state_pool, sl, fr, N, (HV, K, V), cdt, q.device)
        qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
        vc, gc, bc = v.to(cdt), self.fam.chan(g.to(cdt)), beta.to(cdt)
        ys, us, finals = [], [], []
        for i, (s, e) in enumerate(seq_bounds(cu_seqlens)):
            y_i, S_i, u_i = _scan_chunks(S0[i:i + 1], qn[None, s:e], kn[None, s:e], vc[None, s:e], gc[None, s:e],
                                         bc[None, s:e], chunk_size)
            ys.append(y_i[0])
            us.append(u_i[0])
            finals.append(S_i[0])
        y = torch.cat(ys, 0).to(v.dtype) if ys else v.new_zeros(v.shape)
        final = torch.stack(finals, 0) if finals else S0
        if state_pool is not None:
            if N:
                state_pool[sl] = final.to(state_pool.dtype)
            final = None
        if return_u:
            u = torch.cat(us, 0).to(v.dtype) if us else v.new_zeros(v.shape)
            return y, final, u
        return y, final


#: the public ops every family module binds (same names and signatures in both)
PUBLIC = ("recurrent_step", "recurrent_update", "recurrent_scan", "chunked_prefill", "chunked_prefill_varlen",
          "rebuild_state", "replay_decode", "replay_verify", "tree_verify", "snapshot_verify", "kv_verify",
          "kv_tree_verify", "kv_fold", "kv_to_state")
