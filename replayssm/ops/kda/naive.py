"""Float64-capable pure-PyTorch reference ops for KDA (Kimi Delta Attention, Kimi-Linear).

KDA is Gated DeltaNet with a log-decay per **key channel** (``docs/MATH.md``, "KDA: the
gated delta rule with a per-channel decay").  Per value head, in the HF/fla state layout
``St = Sᵀ ∈ [.., HV, K, V]`` (``S x = Stᵀ x``, ``u kᵀ`` is ``k ⊗ u``), with ``g ∈ R^K``
(``g <= 0``) and ``α = e^g``::

    St ← diag(α_t) St                 (row c of St, key channel c, scaled by α_t[c])
    u_t = β_t (v_t − Stᵀ k_t)         (= β_t (v_t − S_{t−1} (α_t ⊙ k_t)))
    St ← St + k_t ⊗ u_t               y_t = Stᵀ q_t

This is ``recurrent_kimi_delta_attention`` of transformers' ``kimi_linear`` (and fla's
``fused_recurrent_kda``).  ``use_qk_l2norm`` normalises q and k as ``x / sqrt(Σx² + 1e-6)``,
then q is multiplied by ``scale`` (default ``K**-0.5``).  Value heads ``HV`` may be a
multiple of key heads ``H`` (value head ``hv`` reads key head ``hv // (HV // H)``; Kimi-Linear
itself has ``HV == H``); ``g`` and ``β`` are per value head (``g [.., HV, K]``).

Every form below computes the same numbers as :func:`recurrent_scan` up to rounding:

* ``recurrent_step`` / ``recurrent_scan``: the ground truth (the recurrent form);
  ``recurrent_update``: one step on a state pool, in place.
* ``chunked_prefill``: chunked WY/UT form; per chunk one unit-lower-triangular solve;
  ``chunked_prefill_varlen``: the same over a packed batch of sequences.
* ``rebuild_state`` / ``replay_decode``: replay from a checkpoint ``S0`` and a ring of
  ``(u, k, g)`` (:class:`~replayssm.cache.buffers.KDABuffers`).
* ``replay_verify`` / ``tree_verify``: speculative verify of T drafts (or a tree) in one solve.
* ``snapshot_verify`` / ``snapshot_commit``: the serial one-state-per-draft baseline.
* ``kv_verify`` / ``kv_tree_verify`` / ``kv_fold`` / ``kv_to_state``: the KV-only form
  (``S0 = 0``) over paged blocks (:class:`~replayssm.cache.paged.KDAPagedBuffers`).

Decays are always ``exp`` of sums of log-decays over a segment, formed by adding terms
(suffix sums, path sums), never ratios of cumulative products; each is ``<= 0`` channel by
channel.  Math runs in the state's compute dtype (fp32; fp64 for fp64 states: a bf16 / fp16
state is upcast when read and rounded once when written); ``y`` is returned in ``v``'s dtype.
Ring entries past a row's valid length may be NaN: they are masked with ``torch.where``.
Bad input raises ``ValueError`` before any cache tensor is written.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...cache import paged
from ...cache.buffers import KDABuffers
from ...cache.ring import StepPlan, gather_history, write_new
from ...cache.tree import ancestor_mask
from .. import kv_blocks
from ..common import (check_plan, check_plan_fit, check_plan_rows, check_kv_lengths, check_route,
                      check_slot, check_state_dtype, check_tensors, check_tree, compute_dtype, shape_str,
                      want_check, write_state_where)
from ..gdn.naive import _chain_mask, _heads, _prep_qk, l2norm, snapshot_commit
from ..gdn.naive import check_prefill_varlen as _gdn_check_prefill_varlen
from ..varlen import gather_initial, seq_bounds

__all__ = [
    "l2norm",
    "recurrent_step",
    "recurrent_update",
    "recurrent_scan",
    "chunked_prefill",
    "chunked_prefill_varlen",
    "rebuild_state",
    "replay_decode",
    "replay_verify",
    "tree_verify",
    "snapshot_verify",
    "snapshot_commit",
    "kv_verify",
    "kv_tree_verify",
    "kv_fold",
    "kv_to_state",
]

_ROUTES = ("state", "output")
#: up to this many new tokens the KV-only ops solve them in one block; more run the chunked scan
KV_CHUNK = 64


# ---------------------------------------------------------------------------- checks
def _check_inputs(q, k, v, g, beta, has_time: bool, scale):
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
    if tuple(g.shape) != lead + (HV, K):
        raise ValueError(f"g must have shape {lead + (HV, K)} (a log-decay per value head and key "
                         f"channel), got {tuple(g.shape)}")
    if tuple(beta.shape) != lead + (HV,):
        raise ValueError(f"beta must have shape {lead + (HV,)}, got {tuple(beta.shape)}")
    if H < 1 or HV < 1 or K < 1 or V < 1:
        raise ValueError(f"empty head dims: H={H}, HV={HV}, K={K}, V={V}")
    if HV % H:
        raise ValueError(f"value heads HV={HV} is not a multiple of key heads H={H}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return q.shape[0], (q.shape[1] if has_time else 1), H, HV, K, V


def _check_buffers(buf, plan, kind: str, dims, device, check: bool) -> None:
    Bt, T, H, HV, K, V = dims
    if not isinstance(buf, KDABuffers):
        raise ValueError(f"buf must be KDABuffers, got {type(buf).__name__}")
    check_plan(plan, kind, Bt, T)
    check_state_dtype(buf.state, "buf.state dtype")
    P, L = buf.state.shape[0], plan.capacity
    want = {"state": (buf.state, (P, HV, K, V)), "u": (buf.u, (P, L, HV, V)),
            "k": (buf.k, (P, L, H, K)), "g": (buf.g, (P, L, HV, K))}
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


def _check_kv(kv, pplan, dims, device, check: bool) -> None:
    Bt, T, H, HV, K, V = dims
    if not isinstance(kv, paged.KDAPagedBuffers):
        raise ValueError(f"kv must be KDAPagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    if pplan.num_new != T:
        raise ValueError(f"paged plan appends {pplan.num_new} entries per row, inputs have {T} tokens")
    for name in ("slot", "length", "block_table"):
        t = getattr(pplan, name)
        if t.shape[0] != Bt or t.device != device:
            raise ValueError(f"paged plan's {name} must have {Bt} rows on {device}")
    if not isinstance(kv.u, Tensor) or kv.u.dim() != 3:
        raise ValueError(f"kv.u must be [NB*bs, HV, V], got {shape_str(kv.u)}")
    NBbs = kv.u.shape[0]
    if NBbs % pplan.block_size:
        raise ValueError(f"KV pools have {NBbs} entries, not a multiple of block_size {pplan.block_size}")
    want = {"u": (kv.u, (NBbs, HV, V)), "k": (kv.k, (NBbs, H, K)), "g": (kv.g, (NBbs, HV, K))}
    check_tensors("kv", want, device)
    if check and Bt:
        nb = NBbs // pplan.block_size
        if bool(((pplan.block_table < 0) | (pplan.block_table >= nb)).any()):
            raise ValueError(f"block table entries must be in [0, {nb - 1}]")
        check_kv_lengths(pplan, T)


# ---------------------------------------------------------------------------- helpers
def _state_readout(St: Tensor, x: Tensor) -> Tensor:
    """``S x = Stᵀ x`` for states ``St [Bt,HV,K,V]`` and value-head vectors ``x [Bt,M,HV,K]``."""
    return torch.einsum("bhkv,bmhk->bmhv", St, x)


def _sum_history_state(u: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """``Σ_j (w_j ⊙ k_j) ⊗ u_j`` in state layout ``[Bt,HV,K,V]``; ``w [Bt,J,HV,K]`` per channel."""
    return torch.einsum("bjhk,bjhk,bjhv->bhkv", w, _heads(k, u.shape[-2]), u)


def _history_readout(u: Tensor, k: Tensor, w: Tensor, x: Tensor) -> Tensor:
    """``Σ_j ((w_j ⊙ k_j)·x_m) u_j`` for value-head vectors ``x [Bt,M,HV,K]`` -> ``[Bt,M,HV,V]``.

    Unlike GDN the scores are per value head: the channel weights ``w`` differ between the
    value heads that share a key head."""
    scores = torch.einsum("bjhk,bjhk,bmhk->bjmh", w, _heads(k, u.shape[-2]), x)
    return torch.einsum("bjmh,bjhv->bmhv", scores, u)


def _masked(t: Tensor, valid: Tensor, cdt) -> Tensor:
    """``t`` upcast with entries where not ``valid [Bt,J]`` replaced by 0 (NaN-safe)."""
    shape = valid.shape + (1,) * (t.dim() - 2)
    return torch.where(valid.view(shape), t.to(cdt), torch.zeros((), dtype=cdt, device=t.device))


def _run_weights(g: Tensor, valid: Tensor, later: Tensor | None = None) -> Tensor:
    """``w_j = e^{Σ_{v>j} g_v (+ later)}`` per channel ``[Bt,J,HV,K]``, 0 where not valid."""
    s = kv_blocks.suffix_after(g)
    if later is not None:
        s = s + later[:, None]
    return torch.where(valid[:, :, None, None], torch.exp(s), torch.zeros((), dtype=g.dtype, device=g.device))


def _path_decays(mask: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel log-decays along a chain/tree of T new tokens (sums of terms, no differences).

    mask ``[Bt,T,T]`` (ancestor-or-self), g ``[Bt,T,HV,K]``.  Returns ``E [Bt,HV,T,T,K]``,
    ``E[s,s'] = Σ_{v on the path (s', s]} g_v`` (``-inf`` where s' is not s or an ancestor),
    and ``G [Bt,T,HV,K]``, the log-decay from ``S_h`` through token s."""
    Bt, T, HV, K = g.shape
    E, G = kv_blocks.path_logs(mask, g.reshape(Bt, T, HV * K))
    E = E.reshape(Bt, T, T, HV, K).permute(0, 3, 1, 2, 4)
    neg_inf = torch.full((), float("-inf"), dtype=g.dtype, device=g.device)
    E = torch.where(mask[:, None, :, :, None], E, neg_inf)
    return E, G.reshape(Bt, T, HV, K)


def _delta_block(hk, hq, q, k, v, g, beta, mask):
    """Corrections and outputs of a block of T tokens under a causal/ancestor mask.

    hk, hq: ``[Bt,T,HV,V]`` decayed history readouts ``S_h (e^{G_s} ⊙ k_s)``, ``S_h (e^{G_s} ⊙ q_s)``;
    q, k ``[Bt,T,H,K]`` (normalised, q scaled); v ``[Bt,T,HV,V]``; g ``[Bt,T,HV,K]`` the
    tokens' own log-decays; beta ``[Bt,T,HV]``; mask ``[Bt,T,T]``.

    Solves ``(I + A) U = R``, ``A_{s,s'} = β_s ((k_s ⊙ e^{G_s−G_{s'}})·k_{s'})`` (s' a strict
    predecessor), ``R_s = β_s (v_s − hk_s)``; ``y_s = hq_s + Σ_{s'≤s} ((q_s ⊙ e^{G_s−G_{s'}})·k_{s'}) U_{s'}``.
    Returns ``U, y`` as ``[Bt,T,HV,V]``."""
    T, HV = v.shape[1], v.shape[2]
    cdt = v.dtype
    E, _ = _path_decays(mask, g)
    D = torch.exp(E)  # [Bt,HV,T,T,K], exactly 0 off the mask
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


def _scan_chunks(St, qn, kn, vc, gc, bc, chunk: int):
    """Chunked WY/UT scan of prepared tokens from state ``St`` (chunk-relative decays).

    Per chunk: ``G_s`` = in-chunk cumulative log-decay per channel; readouts of the
    decayed vectors ``e^{G_s} ⊙ k_s`` / ``e^{G_s} ⊙ q_s``; one triangular solve; then
    ``St ← e^{G_C} ⊙ St + Σ_s (e^{Σ_{v>s} g_v} ⊙ k_s) ⊗ U_s``.  Returns ``(y, St, U)``."""
    Bt, T = qn.shape[:2]
    HV = vc.shape[2]
    ys, us = [], []
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        qc, kc, vv, gg, bb = qn[:, sl], kn[:, sl], vc[:, sl], gc[:, sl], bc[:, sl]
        eG = torch.exp(gg.cumsum(1))
        hk = _state_readout(St, eG * _heads(kc, HV))
        hq = _state_readout(St, eG * _heads(qc, HV))
        U, y = _delta_block(hk, hq, qc, kc, vv, gg, bb, _chain_mask(Bt, qc.shape[1], qn.device))
        ys.append(y)
        us.append(U)
        w = torch.exp(kv_blocks.suffix_after(gg))
        St = torch.exp(gg.sum(1))[..., None] * St + _sum_history_state(U, kc, w)
    if not ys:
        return vc.new_zeros(vc.shape), St, vc.new_zeros(vc.shape)
    return torch.cat(ys, 1), St, torch.cat(us, 1)


# ---------------------------------------------------------------------------- recurrence
def _step(St, q, k, v, g, beta):
    """One step on prepared inputs: St ``[Bt,HV,K,V]``, q/k ``[Bt,H,K]``, g ``[Bt,HV,K]``."""
    HV = St.shape[1]
    ke, qe = _heads(k, HV), _heads(q, HV)
    St = torch.exp(g)[..., None] * St
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", St, ke))
    St = St + ke[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", St, qe), St


def _initial(initial_state, dims, cdt, device):
    Bt, T, H, HV, K, V = dims
    if initial_state is None:
        return torch.zeros(Bt, HV, K, V, dtype=cdt, device=device)
    if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (Bt, HV, K, V):
        raise ValueError(f"initial_state must have shape {(Bt, HV, K, V)}, got {shape_str(initial_state)}")
    check_state_dtype(initial_state, "initial_state dtype")
    if initial_state.device != device:
        raise ValueError(f"initial_state is on {initial_state.device}, inputs on {device}")
    return initial_state.to(cdt)


def recurrent_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   scale: float | None = None, use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """One KDA step (the recurrent form).

    state ``[Bt,HV,K,V]``, q/k ``[Bt,H,K]``, v ``[Bt,HV,V]``, g ``[Bt,HV,K]``, beta ``[Bt,HV]``.
    ``St ← e^g ⊙ St`` (per key channel); ``u = β (v − Stᵀ k)``; ``St ← St + k ⊗ u``; ``y = Stᵀ q``.
    Returns ``(y [Bt,HV,V] in v.dtype, new_state)`` (a new tensor, state dtype)."""
    Bt, _, H, HV, K, V = _check_inputs(q, k, v, g, beta, False, scale)
    if not isinstance(state, Tensor) or tuple(state.shape) != (Bt, HV, K, V):
        raise ValueError(f"state must have shape {(Bt, HV, K, V)}, got {shape_str(state)}")
    check_state_dtype(state, "state dtype")
    cdt = compute_dtype(state.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    y, St = _step(state.to(cdt), qn, kn, v.to(cdt), g.to(cdt), beta.to(cdt))
    return y.to(v.dtype), St.to(state.dtype)


def recurrent_update(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     scale: float | None = None, use_qk_l2norm: bool = True,
                     slot: Tensor | None = None) -> Tensor:
    """One KDA step on a state pool, in place: ``state[slot] ← step(state[slot])``.

    state ``[P,HV,K,V]``, slot ``[Bt]`` (default: rows ``0..Bt-1``); other shapes as in
    :func:`recurrent_step`.  Returns ``y [Bt,HV,V]``."""
    if not isinstance(state, Tensor) or state.dim() != 4:
        raise ValueError(f"state must be a pool [P, HV, K, V], got {shape_str(state)}")
    Bt = v.shape[0] if isinstance(v, Tensor) and v.dim() else 0
    idx = torch.arange(Bt, device=state.device) if slot is None else \
        check_slot(slot, state.shape[0], Bt, state.device, want_check(None, state))
    y, S = recurrent_step(state[idx], q, k, v, g, beta, scale, use_qk_l2norm)
    state[idx] = S.to(state.dtype)
    return y


def recurrent_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   scale: float | None = None, initial_state: Tensor | None = None,
                   use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """Ground truth: a loop of :func:`recurrent_step` over T tokens.

    q/k ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g ``[Bt,T,HV,K]``, beta ``[Bt,T,HV]``,
    initial_state ``[Bt,HV,K,V]`` (zeros if None).  Returns ``(y [Bt,T,HV,V], final_state)``;
    math in the initial state's compute dtype (fp64 if any input is fp64 when there is none)."""
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    cdt = compute_dtype(initial_state.dtype) if isinstance(initial_state, Tensor) else compute_dtype(
        q.dtype, v.dtype, g.dtype, beta.dtype)
    St = _initial(initial_state, dims, cdt, q.device)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    ys = []
    for t in range(dims[1]):
        y, St = _step(St, qn[:, t], kn[:, t], vc[:, t], gc[:, t], bc[:, t])
        ys.append(y)
    y = torch.stack(ys, 1) if ys else vc.new_zeros(vc.shape)
    return y.to(v.dtype), St


def chunked_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    scale: float | None = None, initial_state: Tensor | None = None,
                    use_qk_l2norm: bool = True, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked WY/UT form of :func:`recurrent_scan` (same arguments and returns).

    Per chunk of C tokens from state St, with ``G_s`` the in-chunk cumulative log-decay per
    channel: ``(I + A) U = R``, ``A_{s,s'} = β_s ((k_s ⊙ e^{G_s−G_{s'}})·k_{s'})`` (s' < s),
    ``R_s = β_s (v_s − Stᵀ(e^{G_s} ⊙ k_s))``;
    ``y_s = Stᵀ(e^{G_s} ⊙ q_s) + Σ_{s'≤s} ((q_s ⊙ e^{G_s−G_{s'}})·k_{s'}) U_{s'}``;
    ``St ← e^{G_C} ⊙ St + Σ_s (e^{G_C−G_s} ⊙ k_s) ⊗ U_s``.  The last chunk may be shorter."""
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    cdt = compute_dtype(initial_state.dtype) if isinstance(initial_state, Tensor) else compute_dtype(
        q.dtype, v.dtype, g.dtype, beta.dtype)
    St = _initial(initial_state, dims, cdt, q.device)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    y, St, _ = _scan_chunks(St, qn, kn, v.to(cdt), g.to(cdt), beta.to(cdt), chunk_size)
    return y.to(v.dtype), St


# ---------------------------------------------------------------------------- replay
def _history(buf: KDABuffers, plan: StepPlan, cdt):
    """Committed ring entries, masked: ``u [Bt,L,HV,V]``, ``k [Bt,L,H,K]``, channel weights
    ``w_j = e^{pre_h − pre_j}`` (0 past ``h``) ``[Bt,L,HV,K]`` and ``pre_h [Bt,HV,K]``."""
    valid = plan.hist_mask()
    u = _masked(gather_history(buf.u, plan), valid, cdt)
    k = _masked(gather_history(buf.k, plan), valid, cdt)
    g = _masked(gather_history(buf.g, plan), valid, cdt)
    return u, k, _run_weights(g, valid), g.sum(1)


def _readouts(buf, plan, cdt, x: Tensor | None, route: str):
    """History readouts ``S_h x_m`` for value-head vectors ``x [Bt,M,HV,K]`` and ``S_h``.

    route "state": materialise ``S_h`` and read it.  route "output": one read of ``S0``
    (``S0 (e^{pre_h} ⊙ x)``) plus the ring terms; ``S_h`` is still returned (flush rows)."""
    u, k, w, tot = _history(buf, plan, cdt)
    S0 = buf.state[plan.slot].to(cdt)
    Sh = torch.exp(tot)[..., None] * S0 + _sum_history_state(u, k, w)
    if x is None:
        return None, Sh
    if route == "state":
        return _state_readout(Sh, x), Sh
    return _state_readout(S0, torch.exp(tot)[:, None] * x) + _history_readout(u, k, w, x), Sh


def check_rebuild_state(buf, plan) -> None:
    """Validate a :func:`rebuild_state` call."""
    if not isinstance(buf, KDABuffers) or not isinstance(plan, StepPlan):
        raise ValueError("rebuild_state needs KDABuffers and a StepPlan")
    check_state_dtype(buf.state, "buf.state dtype")


def rebuild_state(buf: KDABuffers, plan: StepPlan) -> Tensor:
    """``S_h = e^{pre_h} ⊙ S0 + Σ_{j<h} (e^{pre_h−pre_j} ⊙ k_j) ⊗ u_j`` per row ``[Bt,HV,K,V]``
    (decays per key channel, i.e. per row of ``Sᵀ``), in the compute dtype.  Reads only."""
    check_rebuild_state(buf, plan)
    return _readouts(buf, plan, compute_dtype(buf.state.dtype), None, "state")[1]


def replay_decode(buf: KDABuffers, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                  route: str = "state", check: bool | None = None) -> Tensor:
    """Replay decode of one token per row; ``plan.kind == "decode"``.

    q/k ``[Bt,H,K]``, v ``[Bt,HV,V]``, g ``[Bt,HV,K]``, beta ``[Bt,HV]``.  With ``S_h``
    rebuilt from the checkpoint and ring and ``α = e^g``: ``u = β (v − S_h (α ⊙ k))``,
    ``y = S_h (α ⊙ q) + u (k·q)``; appends ``(u, k, g)`` at ring position ``h``; rows with
    ``plan.flush`` write ``state[slot] = α ⊙ S_h + k ⊗ u`` (= ``S_{h+1}``, from the entry as the
    ring stores it).  Returns ``y [Bt,HV,V]``."""
    check_route(route, _ROUTES)
    dims = _check_inputs(q, k, v, g, beta, False, scale)
    check = want_check(check, q)
    _check_buffers(buf, plan, "decode", dims, q.device, check)
    Bt, _, H, HV, K, V = dims
    cdt = compute_dtype(buf.state.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    a = torch.exp(gc)  # [Bt,HV,K]
    ke, qe = _heads(kn, HV), _heads(qn, HV)
    r, Sh = _readouts(buf, plan, cdt, torch.stack([a * ke, a * qe], 1), route)
    u = bc[..., None] * (vc - r[:, 0])
    y = r[:, 1] + u * (ke * qe).sum(-1, keepdim=True)
    u_s, k_s = u.to(buf.u.dtype).to(cdt), _heads(kn.to(buf.k.dtype).to(cdt), HV)  # as stored
    a_s = torch.exp(gc.to(buf.g.dtype).to(cdt))
    S_next = a_s[..., None] * Sh + k_s[..., :, None] * u_s[..., None, :]
    # ---- writes (all validation done above)
    write_new(buf.u, plan, u[:, None])
    write_new(buf.k, plan, kn[:, None])
    write_new(buf.g, plan, gc[:, None])
    write_state_where(buf.state, plan.slot, plan.flush, S_next)
    return y.to(v.dtype)


def _draft_mask(par: Tensor | None, Bt: int, T: int, device) -> Tensor:
    return _chain_mask(Bt, T, device) if par is None else ancestor_mask(par)


def _draft_verify(buf, plan, par, q, k, v, g, beta, scale, use_qk_l2norm, route, dims):
    """Shared body of :func:`replay_verify` / :func:`tree_verify` (inputs validated)."""
    Bt, T, H, HV = dims[:4]
    cdt = compute_dtype(buf.state.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    M = _draft_mask(par, Bt, T, q.device)
    _, G = _path_decays(M, gc)
    eG = torch.exp(G)
    r, Sh = _readouts(buf, plan, cdt, torch.cat([eG * _heads(kn, HV), eG * _heads(qn, HV)], 1), route)
    U, y = _delta_block(r[:, :T], r[:, T:], qn, kn, vc, gc, bc, M)
    # ---- writes (all validation done above)
    write_new(buf.u, plan, U)
    write_new(buf.k, plan, kn)
    write_new(buf.g, plan, gc)
    write_state_where(buf.state, plan.slot, plan.flush, Sh)
    return y.to(v.dtype)


def replay_verify(buf: KDABuffers, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                  route: str = "state", check: bool | None = None) -> Tensor:
    """Replay verify of T drafts per row in one triangular solve; ``plan.kind == "verify"``.

    q/k ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g ``[Bt,T,HV,K]``, beta ``[Bt,T,HV]``.
    ``G_s = Σ_{i≤s} g_i`` (per channel); ``(I + A) U = R``,
    ``A_{s,s'} = β_s ((k_s ⊙ e^{G_s−G_{s'}})·k_{s'})`` (s' < s), ``R_s = β_s (v_s − S_h(e^{G_s} ⊙ k_s))``;
    ``y_s = S_h(e^{G_s} ⊙ q_s) + Σ_{s'≤s} ((q_s ⊙ e^{G_s−G_{s'}})·k_{s'}) U_{s'}``.
    Appends ``(U, k, g)`` at positions ``h..h+T-1``; flush rows write ``state[slot] = S_h``.
    Returns ``y [Bt,T,HV,V]``; commit with ``ring.commit``."""
    check_route(route, _ROUTES)
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q)
    _check_buffers(buf, plan, "verify", dims, q.device, check)
    return _draft_verify(buf, plan, None, q, k, v, g, beta, scale, use_qk_l2norm, route, dims)


def tree_verify(buf: KDABuffers, plan: StepPlan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor,
                g: Tensor, beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                route: str = "state", check: bool | None = None) -> Tensor:
    """Replay verify of a draft tree of N nodes per row; ``plan.kind == "tree"``.

    parent ``[Bt,N]`` or ``[N]`` (topological, ``-1`` = child of the last committed entry).
    The system of :func:`replay_verify` under the ancestor-or-self mask ``M``, with
    ``G_i = Σ_{j∈M_i} g_j`` and each pairwise decay the sum along the path ``(j, i]``.
    Appends ``(U, k, g)`` at ``h..h+N-1``; flush rows write ``S_h``.  Commit:
    ``cache.tree.gather_path(buf.ring_tensors(), plan, path, accepted)`` then ``ring.commit``."""
    check_route(route, _ROUTES)
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q, parent) if isinstance(parent, Tensor) else True
    _check_buffers(buf, plan, "tree", dims, q.device, check)
    par = check_tree(parent, dims[0], dims[1], q.device, check)
    return _draft_verify(buf, plan, par, q, k, v, g, beta, scale, use_qk_l2norm, route, dims)


# ---------------------------------------------------------------------------- snapshot baseline
def snapshot_verify(state: Tensor, slot: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                    beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                    check: bool | None = None) -> tuple[Tensor, Tensor]:
    """Baseline speculative verify: serial scan from ``state[slot]``, one state per draft.

    state ``[P,HV,K,V]`` (read only), slot ``[Bt]``.  Returns ``(y [Bt,T,HV,V],
    snapshots [Bt,T,HV,K,V])``; commit with :func:`snapshot_commit` (layout-generic, GDN's)."""
    Bt, T, H, HV, K, V = _check_inputs(q, k, v, g, beta, True, scale)
    if not isinstance(state, Tensor) or state.dim() != 4 or tuple(state.shape[1:]) != (HV, K, V):
        raise ValueError(f"state must be [P, {HV}, {K}, {V}], got {shape_str(state)}")
    check_state_dtype(state, "state dtype")
    if state.device != q.device:
        raise ValueError(f"state is on {state.device}, inputs on {q.device}")
    sl = check_slot(slot, state.shape[0], Bt, q.device, want_check(check, q))
    cdt = compute_dtype(state.dtype)
    St = state[sl].to(cdt)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    ys, snaps = [], []
    for t in range(T):
        y, St = _step(St, qn[:, t], kn[:, t], vc[:, t], gc[:, t], bc[:, t])
        ys.append(y)
        snaps.append(St)
    return torch.stack(ys, 1).to(v.dtype), torch.stack(snaps, 1).to(state.dtype)


# ---------------------------------------------------------------------------- KV-only (paged)
def _kv_run(kv, pos: Tensor, valid: Tensor, cdt):
    return _masked(kv.u[pos], valid, cdt), _masked(kv.k[pos], valid, cdt), _masked(kv.g[pos], valid, cdt)


def _kv_fold(kv, pplan, cdt, S0: Tensor | None = None, budget: int = kv_blocks.RUN_BUDGET) -> Tensor:
    """``S_n = e^{pre_n} ⊙ S0 + Σ_{j<n} (e^{pre_n−pre_j} ⊙ k_j) ⊗ u_j`` per row, run by run."""
    HV, V = kv.u.shape[1:]
    H, K = kv.k.shape[1:]
    S = torch.zeros(pplan.batch, HV, K, V, dtype=cdt, device=kv.u.device) if S0 is None else S0.to(cdt)
    per_entry = pplan.batch * (2 * HV * V + 2 * H * K + 4 * HV * K)
    for pos, valid in kv_blocks.runs(pplan, per_entry, budget=budget):
        u, k, g = _kv_run(kv, pos, valid, cdt)
        S = torch.exp(g.sum(1))[..., None] * S + _sum_history_state(u, k, _run_weights(g, valid))
    return S


def _kv_readout(kv, pplan, x: Tensor, cdt) -> Tensor:
    """``S_n x_m`` for value-head vectors ``x [Bt,M,HV,K]``, run by run (newest first,
    carrying the per-channel log-decay of the runs already seen), without forming ``S_n``."""
    Bt, M, HV, K = x.shape
    V = kv.u.shape[2]
    H = kv.k.shape[1]
    r = torch.zeros(Bt, M, HV, V, dtype=cdt, device=x.device)
    later = torch.zeros(Bt, HV, K, dtype=cdt, device=x.device)
    per_entry = Bt * (2 * HV * V + 2 * H * K + 4 * HV * K + M * 2 * HV)
    for pos, valid in kv_blocks.runs(pplan, per_entry, reverse=True):
        u, k, g = _kv_run(kv, pos, valid, cdt)
        r = r + _history_readout(u, k, _run_weights(g, valid, later), x)
        later = later + g.sum(1)
    return r


def _kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims):
    """Shared body of :func:`kv_verify` / :func:`kv_tree_verify` (inputs validated)."""
    Bt, T, H, HV = dims[:4]
    cdt = compute_dtype(kv.g.dtype, kv.u.dtype, q.dtype, v.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    if par is None and T > KV_CHUNK:
        y, _, U = _scan_chunks(_kv_fold(kv, pplan, cdt), qn, kn, vc, gc, bc, KV_CHUNK)
    else:
        M = _draft_mask(par, Bt, T, q.device)
        _, G = _path_decays(M, gc)
        eG = torch.exp(G)
        r = _kv_readout(kv, pplan, torch.cat([eG * _heads(kn, HV), eG * _heads(qn, HV)], 1), cdt)
        U, y = _delta_block(r[:, :T], r[:, T:], qn, kn, vc, gc, bc, M)
    # ---- writes (all validation done above)
    paged.write_kv_new(kv.u, pplan, U)
    paged.write_kv_new(kv.k, pplan, kn)
    paged.write_kv_new(kv.g, pplan, gc)
    return y.to(v.dtype)


def kv_verify(kv, pplan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              scale: float | None = None, use_qk_l2norm: bool = True,
              check: bool | None = None, parent: Tensor | None = None) -> Tensor:
    """KV-only form (no state, ``S0 = 0``) for T new tokens per row over paged buffers.

    kv: ``KDAPagedBuffers``; pplan: ``PagedPlan`` (``num_new == T``); q/k ``[Bt,T,H,K]``,
    v ``[Bt,T,HV,V]``, g ``[Bt,T,HV,K]``, beta ``[Bt,T,HV]``.  With all inputs since the start
    in the pages (``G`` the per-channel cumulative log-decay from the start):
    ``u_t = β_t (v_t − Σ_{j<t} ((k_t ⊙ e^{G_t−G_j})·k_j) u_j)``,
    ``y_t = Σ_{j≤t} ((q_t ⊙ e^{G_t−G_j})·k_j) u_j``, computed over the held blocks only.
    Writes ``(u, k, g)`` of the new tokens; advance with ``pidx.commit(pplan, accepted)``.
    ``parent`` makes the new tokens a draft tree.  Returns ``y [Bt,T,HV,V]``."""
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q)
    _check_kv(kv, pplan, dims, q.device, check)
    par = None if parent is None else check_tree(parent, dims[0], dims[1], q.device, check)
    return _kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims)


def kv_tree_verify(kv, pplan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                   beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                   check: bool | None = None) -> Tensor:
    """KV-only form of :func:`tree_verify` (a draft tree of N nodes per row over paged
    buffers); commit moves the accepted path to the front (``cache.paged.gather_path``)."""
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q)
    _check_kv(kv, pplan, dims, q.device, check)
    par = check_tree(parent, dims[0], dims[1], q.device, check)
    return _kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims)


def _kv_dims(kv, pplan) -> tuple[int, int, int, int, int, int]:
    if not isinstance(kv, paged.KDAPagedBuffers):
        raise ValueError(f"kv must be KDAPagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    for name in ("u", "k"):
        t = getattr(kv, name)
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"kv.{name} must be a pool [NB*bs, heads, dim], got {shape_str(t)}")
    HV, V = kv.u.shape[1:]
    H, K = kv.k.shape[1:]
    if H < 1 or HV % H:
        raise ValueError(f"value heads HV={HV} is not a multiple of the KV pool's key heads {H}")
    return pplan.slot.shape[0], pplan.num_new, H, HV, K, V


def kv_fold(kv, pplan, initial_state: Tensor | None = None, check: bool | None = None) -> Tensor:
    """The state each row's committed paged entries fold into, from ``initial_state``
    (``S0 = 0`` when None): ``[Bt,HV,K,V]``, fp64 if the pool's g or the state is fp64."""
    dims = _kv_dims(kv, pplan)
    Bt, _, H, HV, K, V = dims
    _check_kv(kv, pplan, dims, kv.u.device, False)
    if initial_state is not None and (not isinstance(initial_state, Tensor)
                                      or tuple(initial_state.shape) != (Bt, HV, K, V)
                                      or initial_state.device != kv.u.device):
        raise ValueError(f"initial_state must be [{Bt}, {HV}, {K}, {V}] on {kv.u.device}, "
                         f"got {shape_str(initial_state)}")
    if want_check(check, kv.u) and Bt and bool((pplan.length < 0).any()):
        raise ValueError("negative KV lengths in the paged plan")
    cdt = compute_dtype(kv.g.dtype, *(() if initial_state is None else (initial_state.dtype,)))
    return _kv_fold(kv, pplan, cdt, initial_state, kv_blocks.FOLD_BUDGET)


def kv_to_state(kv, pplan, buf: KDABuffers, slot: Tensor, check: bool | None = None) -> None:
    """Compress each row's committed KV entries into a checkpoint (one flush):
    ``buf.state[slot] = Σ_{j<n} (e^{pre_n−pre_j} ⊙ k_j) ⊗ u_j``, folded run by run.
    Ring bookkeeping is the caller's (``ring.reset(slot)``)."""
    if not isinstance(buf, KDABuffers):
        raise ValueError(f"buf must be KDABuffers, got {type(buf).__name__}")
    dims = _kv_dims(kv, pplan)
    Bt, _, H, HV, K, V = dims
    check_state_dtype(buf.state, "buf.state dtype")
    if not isinstance(buf.state, Tensor) or buf.state.dim() != 4 or tuple(buf.state.shape[1:]) != (HV, K, V):
        raise ValueError(f"buf.state must be [P, {HV}, {K}, {V}] to match the KV pools, got {shape_str(buf.state)}")
    check = want_check(check, buf.state)
    _check_kv(kv, pplan, dims, buf.state.device, False)
    sl = check_slot(slot, buf.state.shape[0], Bt, buf.state.device, check)
    if check and Bt and bool((pplan.length < 0).any()):
        raise ValueError("negative KV lengths in the paged plan")
    S = _kv_fold(kv, pplan, compute_dtype(buf.state.dtype))
    buf.state[sl] = S.to(buf.state.dtype)


# ---------------------------------------------------------------------------- packed prefill
def check_prefill_varlen(q, k, v, g, beta, scale, cu_seqlens, chunk_size, initial_state, state_pool, slots,
                         fresh, check):
    """The argument checks of :func:`chunked_prefill_varlen` (GDN's, with ``g [Nt, HV, K]``):
    returns ``(Nt, H, HV, K, V, N, slots, fresh, check)``."""
    return _gdn_check_prefill_varlen(q, k, v, g, beta, scale, cu_seqlens, chunk_size, initial_state, state_pool,
                                     slots, fresh, check, g_form="[Nt, HV, K]", check_inputs=_check_inputs)


def chunked_prefill_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           cu_seqlens: Tensor, initial_state: Tensor | None = None,
                           scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                           return_u: bool = False, state_pool: Tensor | None = None,
                           slots: Tensor | None = None, fresh: Tensor | None = None,
                           check: bool | None = None):
    """:func:`chunked_prefill` over a packed batch of ``N`` variable-length sequences.

    q/k ``[Nt,H,K]``, v ``[Nt,HV,V]``, g ``[Nt,HV,K]``, beta ``[Nt,HV]``; sequence ``i`` is
    tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` (may be empty), scanned on its own from
    ``initial_state[i] [HV,K,V]`` (zeros if None) or, in pool form
    (:mod:`replayssm.ops.varlen`), from zeros if ``fresh[i]`` else ``state_pool[slots[i]]``,
    its final state written back there.  Math in fp64 if any input or the state source is
    fp64, else fp32.  Returns ``(y [Nt,HV,V], final_state [N,HV,K,V] | None)``, plus the
    corrected values ``u [Nt,HV,V]`` (``u_t = β_t (v_t − S_{t−1}(α_t ⊙ k_t))``, what the
    ring and the pages store) with ``return_u``."""
    Nt, H, HV, K, V, N, sl, fr, check = check_prefill_varlen(q, k, v, g, beta, scale, cu_seqlens, chunk_size,
                                                              initial_state, state_pool, slots, fresh, check)
    src = state_pool if state_pool is not None else initial_state
    cdt = compute_dtype(q.dtype, v.dtype, g.dtype, beta.dtype, *(() if src is None else (src.dtype,)))
    S0 = gather_initial(initial_state, state_pool, sl, fr, N, (HV, K, V), cdt, q.device)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
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
