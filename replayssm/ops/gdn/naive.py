"""Float64-capable pure-PyTorch reference ops for Gated DeltaNet (Qwen3-Next style).

Notation (``docs/MATH.md``, Notation; one value head): ``α = e^g`` with ``g <= 0``, ``β ∈ (0, 1)``,
``u_t = β_t (v_t − α_t S_{t−1} k_t)``, ``S_t = α_t S_{t−1} + u_t k_tᵀ``, ``y_t = S_t q_t``.
States are stored transposed, HF/fla layout ``St = Sᵀ ∈ [.., HV, K, V]``, so
``S x = Stᵀ x`` and ``u kᵀ`` becomes ``k ⊗ u``.  Value head ``hv`` uses key head
``hv // (HV // H)`` (GVA).  ``use_qk_l2norm`` normalises q and k as
``x / sqrt(Σx² + 1e-6)``, then q is multiplied by ``scale`` (default ``K**-0.5``).

Every form below computes the same numbers as :func:`recurrent_scan` up to rounding:

* ``recurrent_step`` / ``recurrent_scan``: the ground truth (the recurrent form).
* ``chunked_prefill``: chunked WY/UT form; per chunk one unit-lower-triangular solve.
* ``replay_decode``: GDN replay from a checkpoint ``S0`` and a ring of ``(u, k, g)``.
* ``replay_verify`` / ``tree_verify``: speculative verify, T drafts (or a tree of N nodes) in one solve.
* ``snapshot_verify`` / ``snapshot_commit``: the serial one-state-per-draft baseline.
* ``kv_verify`` / ``kv_tree_verify`` / ``kv_to_state``: KV-only form (``S0 = 0``) over the
  paged blocks a row holds (linear in the held context, see the KV-only section).

Decays are always ``exp`` of segment sums of log-decays (never ratios of cumulative
products).  Math runs in the state's compute dtype (fp32; fp64 for fp64 states: a bf16 /
fp16 state is upcast when read and rounded once when written); ``y`` is returned in ``v``'s
dtype.  Ring entries past a row's valid length may be NaN: they are masked with
``torch.where``.  Bad input raises ``ValueError`` before any cache tensor is written.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...cache import paged
from ...cache.buffers import GDNBuffers
from ...cache.ring import StepPlan, gather_history, write_new
from ...cache.tree import ancestor_mask
from .. import kv_blocks  # a module reference: tests spy on kv_blocks.runs
from ..common import (check_accepted, check_kv_lengths, check_plan, check_plan_fit, check_plan_rows,
                      check_route, check_slot, check_state_dtype, check_tensors, check_tree,
                      compute_dtype, shape_str, want_check, write_state_where)
from ..varlen import check_cu_seqlens, check_state_source, gather_initial, seq_bounds

__all__ = [
    "l2norm",
    "recurrent_step",
    "recurrent_update",
    "recurrent_scan",
    "chunked_prefill",
    "rebuild_state",
    "replay_decode",
    "replay_verify",
    "snapshot_verify",
    "snapshot_commit",
    "tree_verify",
    "kv_verify",
    "kv_tree_verify",
    "kv_to_state",
    "kv_fold",
    "chunked_prefill_varlen",
]

_ROUTES = ("state", "output")


# ---------------------------------------------------------------------------- helpers
def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last axis (HF/fla ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check_inputs(q, k, v, g, beta, has_time: bool, scale):
    """Validate raw projections; return ``(Bt, T, H, HV, K, V)`` (``T = 1`` if no time axis)."""
    names = ("q", "k", "v", "g", "beta")
    for name, t in zip(names, (q, k, v, g, beta)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    nd = 4 if has_time else 3
    form = "[Bt, T, H, K]" if has_time else "[Bt, H, K]"
    if q.dim() != nd:
        raise ValueError(f"q must be {form}, got shape {tuple(q.shape)}")
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
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != lead + (HV,):
            raise ValueError(f"{name} must have shape {lead + (HV,)}, got {tuple(t.shape)}")
    if H < 1 or HV < 1 or K < 1 or V < 1:
        raise ValueError(f"empty head dims: H={H}, HV={HV}, K={K}, V={V}")
    if HV % H:
        raise ValueError(f"value heads HV={HV} is not a multiple of key heads H={H}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    Bt = q.shape[0]
    T = q.shape[1] if has_time else 1
    return Bt, T, H, HV, K, V


def _check_buffers(buf: GDNBuffers, plan: StepPlan, kind: str, dims, device, check: bool) -> None:
    """Validate a layer's buffers and the step plan against the inputs' dims."""
    Bt, T, H, HV, K, V = dims
    if not isinstance(buf, GDNBuffers):
        raise ValueError(f"buf must be GDNBuffers, got {type(buf).__name__}")
    check_plan(plan, kind, Bt, T)
    check_state_dtype(buf.state, "buf.state dtype")
    P = buf.state.shape[0]
    L = plan.capacity
    want = {
        "state": (buf.state, (P, HV, K, V)),
        "u": (buf.u, (P, L, HV, V)),
        "k": (buf.k, (P, L, H, K)),
        "g": (buf.g, (P, L, HV)),
    }
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


def _history(buf: GDNBuffers, plan: StepPlan, cdt):
    """Committed ring entries, masked: ``u [Bt,L,HV,V]``, ``k [Bt,L,H,K]``, weights
    ``w_j = e^{pre_h − pre_j}`` (0 past ``h``) ``[Bt,L,HV]`` and ``pre_h [Bt,HV]``."""
    valid = plan.hist_mask()
    u = gather_history(buf.u, plan).to(cdt)
    k = gather_history(buf.k, plan).to(cdt)
    g = gather_history(buf.g, plan).to(cdt)
    zero = torch.zeros((), dtype=cdt, device=valid.device)
    u = torch.where(valid[:, :, None, None], u, zero)
    k = torch.where(valid[:, :, None, None], k, zero)
    g = torch.where(valid[:, :, None], g, zero)
    pre = g.cumsum(1)
    tot = g.sum(1)
    w = torch.where(valid[:, :, None], torch.exp(tot[:, None] - pre), zero)
    return u, k, w, tot


def _sum_history_state(u: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """``Σ_j w_j k_j ⊗ u_j`` in state layout ``[Bt, HV, K, V]``."""
    return torch.einsum("bjh,bjhk,bjhv->bhkv", w, _heads(k, u.shape[-2]), u)


def _history_readout(u: Tensor, k: Tensor, w: Tensor, x: Tensor) -> Tensor:
    """``Σ_j w_j (k_j·x_m) u_j`` for key-head vectors ``x [Bt,M,H,K]`` -> ``[Bt,M,HV,V]``.

    ``k_j·x_m`` is formed once per key head and shared by its value heads."""
    HV = u.shape[-2]
    scores = torch.einsum("bjhk,bmhk->bjmh", k, x).repeat_interleave(HV // k.shape[2], dim=-1)
    return torch.einsum("bjh,bjmh,bjhv->bmhv", w, scores, u)


def _state_readout(St: Tensor, x: Tensor) -> Tensor:
    """``S x`` for every state ``St [Bt,HV,K,V]`` and key-head vectors ``x [Bt,M,H,K]``."""
    return torch.einsum("bhkv,bmhk->bmhv", St, _heads(x, St.shape[1]))


def _delta_block(hk, hq, q, k, v, G, beta, mask):
    """Corrections and outputs of a block of tokens under a causal/ancestor mask.

    hk, hq: ``[Bt,T,HV,V]`` history readouts ``S_h k_s`` and ``S_h q_s``;
    q, k:   ``[Bt,T,H,K]`` (normalised, q scaled); v ``[Bt,T,HV,V]``;
    G:      ``[Bt,T,HV]`` log-decay from ``S_h`` to token s (along its ancestor chain);
    beta:   ``[Bt,T,HV]``; mask ``[Bt,T,T]`` bool, ``mask[s, s']`` = s' is s or precedes it.

    Solves ``(I + A) U = R`` with ``A_{s,s'} = β_s e^{G_s−G_{s'}} (k_s·k_{s'})`` (s' strict
    predecessor) and ``R_s = β_s (v_s − e^{G_s} hk_s)``; then
    ``y_s = e^{G_s} hq_s + Σ_{s' ≤ s} e^{G_s−G_{s'}} (k_{s'}·q_s) U_{s'}``.
    Returns ``U, y`` as ``[Bt,T,HV,V]``.
    """
    T, HV = v.shape[1], v.shape[2]
    cdt = v.dtype
    eye = torch.eye(T, dtype=torch.bool, device=v.device)
    Gh = G.transpose(1, 2)  # [Bt,HV,T]
    m = mask[:, None]  # [Bt,1,T,T]
    neg_inf = torch.full((), float("-inf"), dtype=cdt, device=v.device)
    zero = torch.zeros((), dtype=cdt, device=v.device)
    D = torch.exp(torch.where(m, Gh[..., :, None] - Gh[..., None, :], neg_inf))  # [Bt,HV,T,T]
    rep = HV // k.shape[2]  # key-head Gram matrices, shared by each key head's value heads
    kk = torch.einsum("bshk,bthk->bhst", k, k).repeat_interleave(rep, dim=1)  # [Bt,HV,T,T]
    qk = torch.einsum("bshk,bthk->bhst", q, k).repeat_interleave(rep, dim=1)
    bh = beta.transpose(1, 2)  # [Bt,HV,T]
    A = torch.where(m & ~eye, bh[..., :, None] * D * kk, zero)
    eG = torch.exp(G)[..., None]  # [Bt,T,HV,1]
    R = (beta[..., None] * (v - eG * hk)).transpose(1, 2)  # [Bt,HV,T,V]
    I = torch.eye(T, dtype=cdt, device=v.device)
    U = torch.linalg.solve_triangular(I + A, R, upper=False, unitriangular=True)
    W = torch.where(m, D * qk, zero)
    y = eG * hq + torch.einsum("bhst,bhtv->bshv", W, U)
    return U.transpose(1, 2), y


def _chain_mask(Bt: int, T: int, device) -> Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(Bt, T, T)


# ---------------------------------------------------------------------------- recurrence
def recurrent_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   scale: float | None = None, use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """One delta-rule step (the recurrent form).

    state ``[Bt,HV,K,V]``, q/k ``[Bt,H,K]``, v ``[Bt,HV,V]``, g/beta ``[Bt,HV]``.
    ``St ← e^g St``; ``u = β (v − Stᵀ k)``; ``St ← St + k ⊗ u``; ``y = Stᵀ q``.
    Returns ``(y [Bt,HV,V] in v.dtype, new_state)`` (a new tensor, state dtype).
    """
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
    """One delta-rule step on a state pool, in place: ``state[slot] ← step(state[slot])``.

    state ``[P,HV,K,V]``, slot ``[Bt]`` (default: rows ``0..Bt-1``); other shapes as in
    :func:`recurrent_step`.  Returns ``y [Bt,HV,V]``."""
    idx = torch.arange(v.shape[0], device=v.device) if slot is None else slot
    y, S = recurrent_step(state[idx], q, k, v, g, beta, scale, use_qk_l2norm)
    state[idx] = S.to(state.dtype)
    return y

def _step(St, q, k, v, g, beta):
    """Core of :func:`recurrent_step` on prepared inputs (all in the compute dtype)."""
    HV = St.shape[1]
    ke, qe = _heads(k, HV), _heads(q, HV)
    St = torch.exp(g)[..., None, None] * St
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", St, ke))
    St = St + ke[..., :, None] * u[..., None, :]
    y = torch.einsum("bhkv,bhk->bhv", St, qe)
    return y, St


def _shape_of(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else repr(x)


def _initial(initial_state, dims, cdt, device):
    Bt, T, H, HV, K, V = dims
    if initial_state is None:
        return torch.zeros(Bt, HV, K, V, dtype=cdt, device=device)
    if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (Bt, HV, K, V):
        raise ValueError(f"initial_state must have shape {(Bt, HV, K, V)}, got "
                         f"{_shape_of(initial_state)}")
    check_state_dtype(initial_state, "initial_state dtype")
    if initial_state.device != device:
        raise ValueError(f"initial_state is on {initial_state.device}, inputs on {device}")
    return initial_state.to(cdt)


def recurrent_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   scale: float | None = None, initial_state: Tensor | None = None,
                   use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """Ground truth: a loop of :func:`recurrent_step` over T tokens.

    q/k ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g/beta ``[Bt,T,HV]``, initial_state
    ``[Bt,HV,K,V]`` (zeros if None).  Returns ``(y [Bt,T,HV,V], final_state [Bt,HV,K,V])``;
    math in the initial state's compute dtype (fp64 if any input is fp64 when there is none).
    """
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    cdt = compute_dtype(initial_state.dtype) if isinstance(initial_state, Tensor) else compute_dtype(
        q.dtype, v.dtype, g.dtype, beta.dtype)
    St = _initial(initial_state, dims, cdt, q.device)
    out_dtype = v.dtype
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    v, g, beta = v.to(cdt), g.to(cdt), beta.to(cdt)
    ys = []
    for t in range(dims[1]):
        y, St = _step(St, qn[:, t], kn[:, t], v[:, t], g[:, t], beta[:, t])
        ys.append(y)
    y = torch.stack(ys, 1) if ys else v.new_zeros(v.shape)
    return y.to(out_dtype), St


def chunked_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    scale: float | None = None, initial_state: Tensor | None = None,
                    use_qk_l2norm: bool = True, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked WY/UT form of :func:`recurrent_scan` (same arguments and returns).

    Per chunk of C tokens from state St (``G_s`` = in-chunk cumulative log-decay):
    ``(I + A) U = R`` with ``A_{s,s'} = β_s e^{G_s−G_{s'}} k_s·k_{s'}`` (s' < s),
    ``R_s = β_s (v_s − e^{G_s} S k_s)``;
    ``y_s = e^{G_s} S q_s + Σ_{s'≤s} e^{G_s−G_{s'}} (k_{s'}·q_s) U_{s'}``;
    ``St ← e^{G_C} St + Σ_s e^{G_C−G_s} k_s ⊗ U_s``.  The last chunk may be shorter.
    """
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    Bt, T, H, HV, K, V = dims
    cdt = compute_dtype(initial_state.dtype) if isinstance(initial_state, Tensor) else compute_dtype(
        q.dtype, v.dtype, g.dtype, beta.dtype)
    St = _initial(initial_state, dims, cdt, q.device)
    out_dtype = v.dtype
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    v, g, beta = v.to(cdt), g.to(cdt), beta.to(cdt)
    ys = []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(T, c0 + chunk_size))
        qc, kc, vc, gc, bc = qn[:, sl], kn[:, sl], v[:, sl], g[:, sl], beta[:, sl]
        C = qc.shape[1]
        G = gc.cumsum(1)
        hk, hq = _state_readout(St, kc), _state_readout(St, qc)
        U, y = _delta_block(hk, hq, qc, kc, vc, G, bc, _chain_mask(Bt, C, q.device))
        ys.append(y)
        w = torch.exp(G[:, -1:] - G)  # [Bt,C,HV], exponents <= 0
        St = torch.exp(G[:, -1])[..., None, None] * St + _sum_history_state(U, kc, w)
    y = torch.cat(ys, 1) if ys else v.new_zeros(v.shape)
    return y.to(out_dtype), St


# ---------------------------------------------------------------------------- replay
def check_rebuild_state(buf, plan) -> None:
    """Validate a :func:`rebuild_state` call (shared with its kernel)."""
    if not isinstance(buf, GDNBuffers) or not isinstance(plan, StepPlan):
        raise ValueError("rebuild_state needs GDNBuffers and a StepPlan")
    check_state_dtype(buf.state, "buf.state dtype")


def rebuild_state(buf: GDNBuffers, plan: StepPlan) -> Tensor:
    """``S_h = e^{pre_h} S0 + Σ_{j<h} e^{pre_h−pre_j} k_j ⊗ u_j`` per row ``[Bt,HV,K,V]``
    (the first step of GDN replay), in the compute dtype (a 16-bit checkpoint is not rounded
    here).  Reads only; any plan kind."""
    check_rebuild_state(buf, plan)
    return _readouts(buf, plan, compute_dtype(buf.state.dtype), None, "state")[1]


def _readouts(buf, plan, cdt, x: Tensor, route: str):
    """History readouts ``S_h x_m`` for key-head vectors ``x [Bt,M,H,K]`` and ``S_h`` itself.

    route "state": materialise ``S_h`` and read it.  route "output": one read of ``S0``
    serves all M vectors plus buffer terms ``Σ_j w_j (k_j·x) u_j``; ``S_h`` is still
    returned (flush rows need it; a kernel forms it only on those rows)."""
    u, kh, w, tot = _history(buf, plan, cdt)
    S0 = buf.state[plan.slot].to(cdt)
    Sh = torch.exp(tot)[..., None, None] * S0 + _sum_history_state(u, kh, w)
    if x is None:
        return None, Sh
    if route == "state":
        return _state_readout(Sh, x), Sh
    r = torch.exp(tot)[:, None, :, None] * _state_readout(S0, x) + _history_readout(u, kh, w, x)
    return r, Sh


def replay_decode(buf: GDNBuffers, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                  route: str = "state", check: bool | None = None) -> Tensor:
    """Replay decode of one token per row (``docs/MATH.md``, "GDN replay" and "Flush");
    ``plan.kind == "decode"``.

    q/k ``[Bt,H,K]``, v ``[Bt,HV,V]``, g/beta ``[Bt,HV]``.  With ``S_h`` rebuilt from the
    checkpoint and ring: ``u = β (v − e^g S_h k)``, ``y = e^g S_h q + u (k·q)``; appends
    ``(u, k, g)`` at ring position ``h``; rows with ``plan.flush`` write
    ``state[slot] = e^g S_h + u kᵀ`` (= ``S_{h+1}``) with ``(u, k, g)`` as the ring stores
    them (rounded to its dtype), so a checkpoint is always the fold of stored entries.
    Returns ``y [Bt,HV,V]``.
    """
    check_route(route, _ROUTES)
    dims = _check_inputs(q, k, v, g, beta, False, scale)
    check = want_check(check, q)
    _check_buffers(buf, plan, "decode", dims, q.device, check)
    Bt, _, H, HV, K, V = dims
    cdt = compute_dtype(buf.state.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    r, Sh = _readouts(buf, plan, cdt, torch.stack([kn, qn], 1), route)
    hk, hq = r[:, 0], r[:, 1]
    a = torch.exp(gc)[..., None]  # [Bt,HV,1]
    u = bc[..., None] * (vc - a * hk)
    kq = (kn * qn).sum(-1).repeat_interleave(HV // H, dim=1)[..., None]  # [Bt,HV,1]
    y = a * hq + u * kq
    u_s, k_s = u.to(buf.u.dtype).to(cdt), kn.to(buf.k.dtype).to(cdt)    # as stored
    a_s = torch.exp(gc.to(buf.g.dtype).to(cdt))[..., None, None]
    S_next = a_s * Sh + _heads(k_s, HV)[..., :, None] * u_s[..., None, :]
    # ---- writes (all validation done above)
    write_new(buf.u, plan, u[:, None])
    write_new(buf.k, plan, kn[:, None])
    write_new(buf.g, plan, gc[:, None])
    write_state_where(buf.state, plan.slot, plan.flush, S_next)
    return y.to(v.dtype)


def _draft_mask(par: Tensor | None, gc: Tensor, Bt: int, T: int, device) -> tuple[Tensor, Tensor]:
    """Mask ``M [Bt,T,T]`` (draft s reads s') and log-decays ``G [Bt,T,HV]`` from ``S_h``:
    a causal chain (``G`` = cumulative sum) if ``par`` is None, else the tree's
    ancestor-or-self mask (``G`` = sum along each root path)."""
    if par is None:
        return _chain_mask(Bt, T, device), gc.cumsum(1)
    M = ancestor_mask(par)
    return M, torch.einsum("bij,bjh->bih", M.to(gc.dtype), gc)


def _draft_verify(buf, plan, par, q, k, v, g, beta, scale, use_qk_l2norm, route, dims):
    """Shared body of :func:`replay_verify` / :func:`tree_verify` (inputs validated;
    ``par`` None for a chain of drafts)."""
    Bt, T = dims[:2]
    cdt = compute_dtype(buf.state.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    M, G = _draft_mask(par, gc, Bt, T, q.device)
    r, Sh = _readouts(buf, plan, cdt, torch.cat([kn, qn], 1), route)
    U, y = _delta_block(r[:, :T], r[:, T:], qn, kn, vc, G, bc, M)
    # ---- writes (all validation done above)
    write_new(buf.u, plan, U)
    write_new(buf.k, plan, kn)
    write_new(buf.g, plan, gc)
    write_state_where(buf.state, plan.slot, plan.flush, Sh)
    return y.to(v.dtype)


def replay_verify(buf: GDNBuffers, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                  route: str = "state", check: bool | None = None) -> Tensor:
    """Replay verify of T drafts per row in one triangular solve (``docs/MATH.md``, "Speculative
    verify"); ``plan.kind == "verify"``.

    q/k ``[Bt,T,H,K]``, v ``[Bt,T,HV,V]``, g/beta ``[Bt,T,HV]``.  ``G_s = Σ_{i≤s} g_i``;
    ``(I + A) U = R``, ``A_{s,s'} = β_s e^{G_s−G_{s'}} (k_s·k_{s'})`` (s' < s),
    ``R_s = β_s (v_s − e^{G_s} S_h k_s)``;
    ``y_s = e^{G_s} S_h q_s + Σ_{s'≤s} e^{G_s−G_{s'}} (k_{s'}·q_s) U_{s'}``.
    Appends ``(U, k, g)`` at positions ``h..h+T-1``; flush rows write ``state[slot] = S_h``
    (committed entries only).  Returns ``y [Bt,T,HV,V]``; commit with ``ring.commit``.
    """
    check_route(route, _ROUTES)
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q)
    _check_buffers(buf, plan, "verify", dims, q.device, check)
    return _draft_verify(buf, plan, None, q, k, v, g, beta, scale, use_qk_l2norm, route, dims)


def tree_verify(buf: GDNBuffers, plan: StepPlan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor,
                g: Tensor, beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                route: str = "state", check: bool | None = None) -> Tensor:
    """Replay verify of a draft tree of N nodes per row (the triangular solve under the ancestor
    mask, ``docs/MATH.md``, "Speculative verify"); ``plan.kind == "tree"``.

    parent ``[Bt,N]`` or ``[N]`` (topological, ``-1`` = child of the last committed entry);
    q/k ``[Bt,N,H,K]``, v ``[Bt,N,HV,V]``, g/beta ``[Bt,N,HV]``.  With ``M`` the
    ancestor-or-self mask, ``G_i = Σ_{j∈M_i} g_j`` and the system of
    :func:`replay_verify` restricted to ``M`` (``A_{i,j}`` nonzero only for strict
    ancestors j of i).  Each node's output equals the recurrence along its root path.
    Appends ``(U, k, g)`` at positions ``h..h+N-1``; flush rows write ``S_h``.  Commit:
    ``cache.tree.gather_path(buf.ring_tensors(), plan, path, accepted)`` then ``ring.commit``.
    """
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
    """Baseline speculative verify (snapshot verify): serial scan from ``state[slot]``, one state per draft.

    state ``[P,HV,K,V]`` (read only), slot ``[Bt]``, q/k ``[Bt,T,H,K]``, ...
    Returns ``(y [Bt,T,HV,V], snapshots [Bt,T,HV,K,V])`` with ``snapshots[:, s]`` the state
    after draft s (state dtype).
    """
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


# ---------------------------------------------------------------------------- KV-only (paged)
# The KV-only form keeps every entry since the start in paged blocks (``S0 = 0``).  The ops
# walk the blocks a batch actually holds, a run of whole blocks at a time
# (:mod:`replayssm.ops.kv_blocks`), so memory and time follow the held context:
#
# * up to ``KV_CHUNK`` new tokens (decode, verify, trees): the history readouts
#   ``S_n k_t`` / ``S_n q_t`` are sums over the held entries, run by run, and the new
#   tokens are one triangular solve under their chain / tree mask;
# * more new tokens (a prefill): the history is folded into a state run by run and the new
#   tokens run the chunked WY/UT scan from it, keeping each token's correction ``u``.
KV_CHUNK = 64


def _check_kv(kv, pplan, dims, device, check: bool):
    Bt, T, H, HV, K, V = dims
    if not isinstance(kv, paged.GDNPagedBuffers):
        raise ValueError(f"kv must be GDNPagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    if pplan.slot.shape != (Bt,):
        raise ValueError(f"paged plan has {pplan.slot.shape[0]} rows, inputs have batch {Bt}")
    if pplan.num_new != T:
        raise ValueError(f"paged plan appends {pplan.num_new} entries per row, inputs have {T} tokens")
    for name in ("slot", "length", "block_table"):
        t = getattr(pplan, name)
        if t.shape[0] != Bt or t.device != device:
            raise ValueError(f"pplan.{name} must have {Bt} rows on {device}")
    NBbs = kv.u.shape[0]
    if NBbs % pplan.block_size:
        raise ValueError(f"KV pools have {NBbs} entries, not a multiple of block_size {pplan.block_size}")
    want = {"u": (kv.u, (NBbs, HV, V)), "k": (kv.k, (NBbs, H, K)), "g": (kv.g, (NBbs, HV))}
    check_tensors("kv", want, device)
    if check and Bt:
        nb = NBbs // pplan.block_size
        if bool(((pplan.block_table < 0) | (pplan.block_table >= nb)).any()):
            raise ValueError(f"block table entries must be in [0, {nb - 1}]")
        check_kv_lengths(pplan, T)


def _kv_run(kv, pos: Tensor, valid: Tensor, cdt):
    """One run of held entries, masked (zeros where not ``valid``): ``u [Bt,E,HV,V]``,
    ``k [Bt,E,H,K]`` and the log-decays ``g [Bt,E,HV]``."""
    zero = torch.zeros((), dtype=cdt, device=pos.device)
    u = torch.where(valid[:, :, None, None], kv.u[pos].to(cdt), zero)
    k = torch.where(valid[:, :, None, None], kv.k[pos].to(cdt), zero)
    g = torch.where(valid[:, :, None], kv.g[pos].to(cdt), zero)
    return u, k, g


def _kv_fold(kv, pplan, cdt, S0: Tensor | None = None, budget: int = kv_blocks.RUN_BUDGET) -> Tensor:
    """``S_n = e^{pre_n} S0 + Σ_{j<n} e^{pre_n−pre_j} k_j ⊗ u_j`` per row ``[Bt,HV,K,V]``
    (``S0 = 0`` when None), run by run:
    ``S ← e^{Σ_run g} S + Σ_{j∈run} e^{Σ_{v>j in run} g_v} k_j ⊗ u_j``."""
    Bt = pplan.batch
    HV, V = kv.u.shape[1:]
    H, K = kv.k.shape[1:]
    S = torch.zeros(Bt, HV, K, V, dtype=cdt, device=kv.u.device) if S0 is None else S0.to(cdt)
    for pos, valid in kv_blocks.runs(pplan, Bt * (2 * HV * V + 2 * H * K + HV * K + 4 * HV), budget=budget):
        u, k, g = _kv_run(kv, pos, valid, cdt)
        w = torch.where(valid[:, :, None], torch.exp(kv_blocks.suffix_after(g)),
                        torch.zeros((), dtype=cdt, device=u.device))
        S = torch.exp(g.sum(1))[..., None, None] * S + _sum_history_state(u, k, w)
    return S


def _kv_readout(kv, pplan, x: Tensor, cdt) -> Tensor:
    """History readouts ``S_n x_m = Σ_{j<n} e^{pre_n−pre_j} (k_j·x_m) u_j`` for key-head
    vectors ``x [Bt,M,H,K]`` -> ``[Bt,M,HV,V]``, run by run (newest first, carrying the
    log-decay of the runs already seen), without forming ``S_n``."""
    Bt, M, H, K = x.shape
    HV, V = kv.u.shape[1:]
    r = torch.zeros(Bt, M, HV, V, dtype=cdt, device=x.device)
    later = torch.zeros(Bt, HV, dtype=cdt, device=x.device)
    zero = torch.zeros((), dtype=cdt, device=x.device)
    per_entry = Bt * (2 * HV * V + 2 * H * K + 3 * HV + M * (H + 2 * HV))
    for pos, valid in kv_blocks.runs(pplan, per_entry, reverse=True):
        u, k, g = _kv_run(kv, pos, valid, cdt)
        w = torch.where(valid[:, :, None], torch.exp(kv_blocks.suffix_after(g) + later[:, None]), zero)
        later = later + g.sum(1)
        r = r + _history_readout(u, k, w, x)
    return r


def _kv_scan(St: Tensor, qn, kn, vc, gc, bc, chunk: int) -> tuple[Tensor, Tensor]:
    """Chunked WY/UT scan of new tokens from state ``St`` (as :func:`chunked_prefill`),
    keeping the corrections: returns ``U, y`` as ``[Bt,T,HV,V]``."""
    Bt, T = qn.shape[:2]
    Us, ys = [], []
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        qc, kc, vc_, gcc, bcc = qn[:, sl], kn[:, sl], vc[:, sl], gc[:, sl], bc[:, sl]
        hk, hq = _state_readout(St, kc), _state_readout(St, qc)
        U, y = _delta_block(hk, hq, qc, kc, vc_, gcc.cumsum(1), bcc, _chain_mask(Bt, qc.shape[1], qn.device))
        Us.append(U)
        ys.append(y)
        w = torch.exp(kv_blocks.suffix_after(gcc))
        St = torch.exp(gcc.sum(1))[..., None, None] * St + _sum_history_state(U, kc, w)
    return torch.cat(Us, 1), torch.cat(ys, 1)


def _kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims):
    """Shared body of :func:`kv_verify` / :func:`kv_tree_verify` (inputs validated;
    ``par`` None for a chain).  Writes the new ``(u, k, g)``; returns ``y`` in ``v.dtype``."""
    Bt, T = dims[:2]
    cdt = compute_dtype(kv.g.dtype, kv.u.dtype, q.dtype, v.dtype)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    if par is None and T > KV_CHUNK:
        U, y = _kv_scan(_kv_fold(kv, pplan, cdt), qn, kn, vc, gc, bc, KV_CHUNK)
    else:
        M, G = _draft_mask(par, gc, Bt, T, q.device)
        r = _kv_readout(kv, pplan, torch.cat([kn, qn], 1), cdt)
        U, y = _delta_block(r[:, :T], r[:, T:], qn, kn, vc, G, bc, M)
    # ---- writes (all validation done above)
    paged.write_kv_new(kv.u, pplan, U)
    paged.write_kv_new(kv.k, pplan, kn)
    paged.write_kv_new(kv.g, pplan, gc)
    return y.to(v.dtype)


def kv_verify(kv, pplan, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              scale: float | None = None, use_qk_l2norm: bool = True,
              check: bool | None = None, parent: Tensor | None = None) -> Tensor:
    """KV-only form (no state, ``S0 = 0``) for T new tokens per row over paged buffers.

    kv: ``GDNPagedBuffers``; pplan: ``PagedPlan`` (``num_new == T``); q/k ``[Bt,T,H,K]``,
    v ``[Bt,T,HV,V]``, g/beta ``[Bt,T,HV]``.  With all inputs since the start in the pages
    (n committed entries, then the T new; ``G`` = cumulative log-decay from the start):
    ``u_t = β_t (v_t − Σ_{j<t} e^{G_t−G_j} (k_j·k_t) u_j)``,
    ``y_t = Σ_{j≤t} e^{G_t−G_j} (k_j·q_t) u_j``.
    Computed over the held blocks only (memory and time grow with the context held, not
    with ``max_seq_len``): up to ``KV_CHUNK`` tokens, history readouts run by run and one
    triangular solve; more, the history folded into a state and the chunked scan.  Writes
    ``(u, k, g)`` of the new tokens with ``write_kv_new``; advance with
    ``pidx.commit(pplan, accepted)``.  ``parent [Bt,T]`` / ``[T]`` makes the new tokens a
    draft tree (as :func:`kv_tree_verify`).  Returns ``y [Bt,T,HV,V]``.
    Compute dtype: fp64 if the pools or the inputs are fp64, else fp32.
    """
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q)
    _check_kv(kv, pplan, dims, q.device, check)
    par = None if parent is None else check_tree(parent, dims[0], dims[1], q.device, check)
    return _kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims)


def kv_tree_verify(kv, pplan, parent: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                   beta: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                   check: bool | None = None) -> Tensor:
    """KV-only form of :func:`tree_verify`: a draft tree of N nodes per row over paged buffers.

    parent ``[Bt,N]`` or ``[N]`` (topological, ``-1`` = child of the last committed entry);
    q/k ``[Bt,N,H,K]``, v ``[Bt,N,HV,V]``, g/beta ``[Bt,N,HV]``.  With ``S_n`` the state the
    row's n held entries fold into (never formed: readouts run block by block), ``M`` the
    ancestor-or-self mask and ``G_i = Σ_{j∈M_i} g_j``: ``(I + A) U = R`` with
    ``A_{i,j} = β_i e^{G_i−G_j} (k_i·k_j)`` for strict ancestors j of i,
    ``R_i = β_i (v_i − e^{G_i} S_n k_i)``; ``y_i = e^{G_i} S_n q_i + Σ_{j∈M_i} e^{G_i−G_j}
    (k_j·q_i) U_j`` — each node's output is the recurrence along its root path.  Writes
    ``(U, k, g)`` at logical ``length .. length+N-1``; commit moves the accepted path to the
    front (``cache.paged.gather_path``) before ``pidx.commit``.  Returns ``y [Bt,N,HV,V]``.
    """
    dims = _check_inputs(q, k, v, g, beta, True, scale)
    check = want_check(check, q)
    _check_kv(kv, pplan, dims, q.device, check)
    par = check_tree(parent, dims[0], dims[1], q.device, check)
    return _kv_new(kv, pplan, par, q, k, v, g, beta, scale, use_qk_l2norm, dims)


def check_kv_fold(kv, pplan, initial_state: Tensor | None, check: bool | None):
    """Validate a :func:`kv_fold` call (shared with its kernel); returns ``(Bt, H, HV, K, V)``."""
    if not isinstance(kv, paged.GDNPagedBuffers):
        raise ValueError(f"kv must be GDNPagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    if not isinstance(kv.u, Tensor) or kv.u.dim() != 3 or not isinstance(kv.k, Tensor) or kv.k.dim() != 3:
        raise ValueError(f"kv pools must be u [NB*bs, HV, V] and k [NB*bs, H, K], got {_shape_of(kv.u)}, "
                         f"{_shape_of(kv.k)}")
    HV, V = kv.u.shape[1:]
    H, K = kv.k.shape[1:]
    if H < 1 or HV % H:
        raise ValueError(f"value heads HV={HV} is not a multiple of the KV pool's key heads {H}")
    Bt = pplan.slot.shape[0] if isinstance(pplan.slot, Tensor) else -1
    device = kv.u.device
    _check_kv(kv, pplan, (Bt, pplan.num_new, H, HV, K, V), device, False)
    if initial_state is not None and (not isinstance(initial_state, Tensor)
                                      or tuple(initial_state.shape) != (Bt, HV, K, V) or initial_state.device != device):
        raise ValueError(f"initial_state must be [{Bt}, {HV}, {K}, {V}] on {device}, got {_shape_of(initial_state)}")
    if want_check(check, kv.u) and Bt and bool((pplan.length < 0).any()):
        raise ValueError("negative KV lengths in the paged plan")
    return Bt, H, HV, K, V


def kv_fold(kv, pplan, initial_state: Tensor | None = None, check: bool | None = None) -> Tensor:
    """The state each row's committed paged entries fold into, from ``initial_state``:
    ``S_n = e^{pre_n} S0 + Σ_{j<n} e^{pre_n−pre_j} k_j ⊗ u_j`` (``S0 = 0`` when None).

    kv: ``GDNPagedBuffers`` (a slot's KV-only pages, or the prefix store's blocks);
    ``pplan``: its block tables and lengths ``n`` per row (only those are read);
    ``initial_state [Bt,HV,K,V]``.  Folded run by run over the held blocks.  Returns
    ``[Bt,HV,K,V]`` in fp64 if the pool's g or ``initial_state`` is fp64, else fp32.  Reads only.
    """
    check_kv_fold(kv, pplan, initial_state, check)
    cdt = compute_dtype(kv.g.dtype, *(() if initial_state is None else (initial_state.dtype,)))
    return _kv_fold(kv, pplan, cdt, initial_state, kv_blocks.FOLD_BUDGET)


def kv_to_state(kv, pplan, buf: GDNBuffers, slot: Tensor, check: bool | None = None) -> None:
    """Compress each row's committed KV entries into a checkpoint (one flush):
    ``buf.state[slot] = Σ_{j<n} e^{pre_n−pre_j} k_j ⊗ u_j`` (``S0 = 0``), folded run by run
    over the held blocks.

    ``pplan`` (from ``pidx.plan(slots, T)``; only its committed lengths are used) and
    ``slot [Bt]`` (the rows' state slots in ``buf``).  Ring bookkeeping is the caller's
    (``ring.reset(slot)``); paged blocks may be released afterwards.
    """
    if not isinstance(buf, GDNBuffers):
        raise ValueError(f"buf must be GDNBuffers, got {type(buf).__name__}")
    if not isinstance(kv, paged.GDNPagedBuffers):
        raise ValueError(f"kv must be GDNPagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    check_state_dtype(buf.state, "buf.state dtype")
    P, HV, K, V = buf.state.shape
    H = kv.k.shape[1] if kv.k.dim() == 3 else -1
    Bt = pplan.slot.shape[0]
    if H < 1 or HV % H:
        raise ValueError(f"value heads HV={HV} is not a multiple of the KV pool's key heads {H}")
    dims = (Bt, pplan.num_new, H, HV, K, V)
    check = want_check(check, buf.state)
    _check_kv(kv, pplan, dims, buf.state.device, False)
    sl = check_slot(slot, P, Bt, buf.state.device, check)
    if check and Bt and bool((pplan.length < 0).any()):
        raise ValueError("negative KV lengths in the paged plan")
    S = _kv_fold(kv, pplan, compute_dtype(buf.state.dtype))
    buf.state[sl] = S.to(buf.state.dtype)


# ---------------------------------------------------------------------------- packed prefill
def _chunked_scan_u(qn, kn, v, g, beta, St, chunk_size: int):
    """The chunk loop of :func:`chunked_prefill` on prepared inputs of one sequence
    (``[1,T,..]``, compute dtype), also returning the corrected values
    ``U [1,T,HV,V]`` (``u_t = β_t (v_t − α_t S_{t−1} k_t)``).  Returns ``(y, St, U)``."""
    T = v.shape[1]
    ys, us = [], []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(T, c0 + chunk_size))
        qc, kc, vc, gc, bc = qn[:, sl], kn[:, sl], v[:, sl], g[:, sl], beta[:, sl]
        G = gc.cumsum(1)
        hk, hq = _state_readout(St, kc), _state_readout(St, qc)
        U, y = _delta_block(hk, hq, qc, kc, vc, G, bc, _chain_mask(1, qc.shape[1], v.device))
        ys.append(y)
        us.append(U)
        w = torch.exp(G[:, -1:] - G)  # [1,C,HV], exponents <= 0
        St = torch.exp(G[:, -1])[..., None, None] * St + _sum_history_state(U, kc, w)
    if not ys:
        return v.new_zeros(v.shape), St, v.new_zeros(v.shape)
    return torch.cat(ys, 1), St, torch.cat(us, 1)


def check_prefill_varlen(q, k, v, g, beta, scale, cu_seqlens, chunk_size, initial_state, state_pool, slots,
                         fresh, check, *, g_form: str = "[Nt, HV]", check_inputs=None):
    """The argument checks of :func:`chunked_prefill_varlen` (its kernel twin runs the same):
    returns ``(Nt, H, HV, K, V, N, slots, fresh, check)``.  ``g_form`` / ``check_inputs``:
    the delta-rule variant's decay layout and input check (KDA: ``[Nt, HV, K]``)."""
    for name, t, form in (("q", q, "[Nt, H, K]"), ("k", k, "[Nt, H, K]"), ("v", v, "[Nt, HV, V]"),
                          ("g", g, g_form), ("beta", beta, "[Nt, HV]")):
        if not isinstance(t, Tensor) or t.dim() != form.count(",") + 1:
            raise ValueError(f"{name} must be {form}, got {shape_str(t)}")
    _, Nt, H, HV, K, V = (check_inputs or _check_inputs)(q[None], k[None], v[None], g[None], beta[None], True,
                                                          scale)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check = want_check(check, q)
    N = check_cu_seqlens(cu_seqlens, Nt, q.device, check)
    sl, fr = check_state_source(initial_state, state_pool, slots, fresh, N, (HV, K, V), q.device, check)
    return Nt, H, HV, K, V, N, sl, fr, check


def chunked_prefill_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           cu_seqlens: Tensor, initial_state: Tensor | None = None,
                           scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                           return_u: bool = False, state_pool: Tensor | None = None,
                           slots: Tensor | None = None, fresh: Tensor | None = None,
                           check: bool | None = None):
    """:func:`chunked_prefill` over a packed batch of ``N`` variable-length sequences.

    q/k ``[Nt,H,K]``, v ``[Nt,HV,V]``, g/beta ``[Nt,HV]``; sequence ``i`` is tokens
    ``cu_seqlens[i]:cu_seqlens[i+1]`` (may be empty), scanned on its own (chunks restart at
    its first token) from ``initial_state[i] [HV,K,V]`` (zeros if None), or, in pool form
    (:mod:`replayssm.ops.varlen`), from zeros if ``fresh[i]`` else ``state_pool[slots[i]]``,
    its final state written back to ``state_pool[slots[i]]``.  Math in fp64 if any input or
    the state source is fp64, else fp32.

    Returns ``(y [Nt,HV,V] in v.dtype, final_state [N,HV,K,V])`` (pool form: ``None`` in
    place of the final states), plus ``u [Nt,HV,V]`` (v.dtype) with ``return_u``:
    ``u_t = β_t (v_t − α_t S_{t−1} k_t)``, the corrected values the replay ring and the
    KV-only pages store for GDN.
    """
    Nt, H, HV, K, V, N, sl, fr, check = check_prefill_varlen(q, k, v, g, beta, scale, cu_seqlens, chunk_size,
                                                              initial_state, state_pool, slots, fresh, check)
    shape = (HV, K, V)
    src = state_pool if state_pool is not None else initial_state
    cdt = compute_dtype(q.dtype, v.dtype, g.dtype, beta.dtype, *(() if src is None else (src.dtype,)))
    S0 = gather_initial(initial_state, state_pool, sl, fr, N, shape, cdt, q.device)
    qn, kn = _prep_qk(q, k, cdt, scale, use_qk_l2norm)
    vc, gc, bc = v.to(cdt), g.to(cdt), beta.to(cdt)
    ys, us, finals = [], [], []
    for i, (s, e) in enumerate(seq_bounds(cu_seqlens)):
        y_i, S_i, u_i = _chunked_scan_u(qn[None, s:e], kn[None, s:e], vc[None, s:e], gc[None, s:e],
                                        bc[None, s:e], S0[i:i + 1], chunk_size)
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
