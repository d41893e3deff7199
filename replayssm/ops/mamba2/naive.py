"""Float64-capable pure-PyTorch reference ops for Mamba-2 (every decoding form).

Notation (``docs/MATH.md``, Notation; one head ``h`` of group ``g = h // (H // G)``): state
``S ∈ R^{d×n}``, ``v = x [d]``, ``k = B [n]``, ``q = C [n]``, step size ``Δ = dt``
(after softplus/bias/clamp, ``>= 0``), ``A < 0`` per head, log-decay ``l = A·Δ <= 0``:

    S_t = e^{l_t} S_{t-1} + Δ_t x_t B_tᵀ,        y_t = S_t C_t + D·x_t.

HF state layout ``[.., H, d, n]``.  Every form below computes the same numbers as
:func:`recurrent_scan` up to rounding:

* ``recurrent_step`` / ``recurrent_scan``: the ground truth (the recurrent form).
* ``chunked_prefill``: SSD chunked form (intra-chunk masked GEMMs, chunk states,
  inter-chunk state passing, state read-out).
* ``replay_decode``: replay from a checkpoint ``S0`` and a ring of ``(x, B, Δ)``;
  route ``"output"`` (output-only, ``B_j·C`` once per group) or ``"state"``.
* ``replay_verify`` / ``tree_verify``: speculative verify, T drafts (or a tree of N nodes) read the
  same ``S0`` and ring under a causal (ancestor) mask.
* ``snapshot_verify`` / ``snapshot_commit``: the serial one-state-per-draft baseline.
* ``kv_verify`` / ``kv_tree_verify`` / ``kv_to_state``: KV-only form (``S0 = 0``) over the
  paged blocks a row holds (linear in the held context, see the KV-only section).

With ``pre_j`` the cumulative log-decay from the checkpoint through entry ``j``, the
replay output of a query ``t`` is

    y_t = e^{pre_t} (S0 C_t) + Σ_{j ≤ t} Δ_j e^{pre_t − pre_j} (B_j·C_t) x_j + D·x_t,

where the exponent ``pre_t − pre_j`` is formed as the *segment sum* of the log-decays
after ``j`` (never a ratio of cumulative products).  Math runs in the state's compute dtype
(fp32, fp64 for fp64 states; bf16/fp16 states and activations are upcast, and a 16-bit state
is rounded once per write); ``y`` is returned in
``x``'s dtype.  Ring entries past a row's valid length may hold anything (NaN in tests):
they are masked with ``torch.where``.  Bad input raises ``ValueError`` before any cache
tensor is written.  ``check`` (default: on for CPU tensors) enables host-side value
checks (slot ranges, plan consistency, ``A <= 0``, ``Δ >= 0``, tree order); CUDA-graph
callers pass ``check=False``.  Shape/dtype checks always run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...cache import paged
from ...cache.buffers import Mamba2Buffers
from ...cache.ring import NULL_SLOT, StepPlan, gather_history, write_new
from ...cache.tree import ancestor_mask
from ...runtime import compute_dtype
from .. import kv_blocks  # a module reference: tests spy on kv_blocks.runs
from ..conv.naive import conv_window_out
from ..common import (STATE_DTYPES, check_accepted, check_kv_lengths, check_plan, check_plan_fit,
                      check_plan_rows, check_route, check_slot, check_state_dtype, check_tensors,
                      check_tree, shape_str, want_check, write_state_where)
from ..varlen import check_cu_seqlens, check_state_source, gather_initial, seq_bounds

__all__ = [
    "segsum",
    "recurrent_step",
    "recurrent_update",
    "recurrent_scan",
    "chunked_prefill",
    "rebuild_state",
    "replay_decode",
    "replay_verify",
    "snapshot_verify",
    "snapshot_commit",
    "kv_fold",
    "conv_fold",
    "tree_verify",
    "kv_verify",
    "kv_tree_verify",
    "kv_to_state",
    "chunked_prefill_varlen",
]

_ROUTES = ("output", "state")


# ============================================================================ helpers
def segsum(l: Tensor) -> Tensor:
    """Segment sums of log-decays: ``l [..., Q] -> S [..., Q, Q]``.

    ``S[..., i, j] = Σ_{j < k ≤ i} l[..., k]`` for ``j <= i`` (0 on the diagonal) and
    ``-inf`` above it, so ``exp(S)`` is the causal decay matrix.  Built by a cumulative
    sum of a masked copy (no differences of long prefix sums).
    """
    Q = l.shape[-1]
    strict = torch.ones(Q, Q, dtype=torch.bool, device=l.device).tril(-1)  # [k, j]: k > j
    rep = l[..., :, None].expand(*l.shape, Q)  # rep[k, j] = l_k
    rep = torch.where(strict, rep, torch.zeros((), dtype=l.dtype, device=l.device))
    out = rep.cumsum(-2)  # out[i, j] = Σ_{k ≤ i, k > j} l_k
    causal = torch.ones(Q, Q, dtype=torch.bool, device=l.device).tril()
    return torch.where(causal, out, torch.full((), float("-inf"), dtype=l.dtype, device=l.device))


def _check_inputs(x, dt, B, C, has_time: bool):
    """Validate activations; return ``(Bt, T, H, d, G, n)`` (``T = 1`` without a time axis)."""
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
    nd = 4 if has_time else 3
    if x.dim() != nd:
        form = "[Bt, T, H, d]" if has_time else "[Bt, H, d]"
        raise ValueError(f"x must be {form}, got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-2])
    H, d = x.shape[-2:]
    if tuple(dt.shape) != lead + (H,):
        raise ValueError(f"dt must have shape {lead + (H,)}, got {tuple(dt.shape)}")
    if B.dim() != nd or tuple(B.shape[:-2]) != lead:
        form = "[Bt, T, G, n]" if has_time else "[Bt, G, n]"
        raise ValueError(f"B must be {form} with leading dims {lead}, got shape {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C has shape {tuple(C.shape)}, B has {tuple(B.shape)}: they must match")
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: x is {x.dtype}, B is {B.dtype}, C is {C.dtype}")
    G, n = B.shape[-2:]
    if min(H, d, G, n) < 1:
        raise ValueError(f"empty dims: H={H}, d={d}, G={G}, n={n}")
    if H % G:
        raise ValueError(f"nheads H={H} is not a multiple of ngroups G={G}")
    Bt = x.shape[0]
    T = x.shape[1] if has_time else 1
    return Bt, T, H, d, G, n


def _check_params(A, D, dt, H: int, device, check: bool) -> None:
    """``A [H]`` (``<= 0``), optional ``D [H]``, and ``dt >= 0`` (host check)."""
    if not isinstance(A, Tensor) or not A.is_floating_point() or tuple(A.shape) != (H,):
        raise ValueError(f"A must be a floating-point tensor of shape ({H},), got {shape_str(A)}")
    if A.device != device:
        raise ValueError(f"A is on {A.device}, inputs on {device}")
    if D is not None:
        if not isinstance(D, Tensor) or not D.is_floating_point() or tuple(D.shape) != (H,):
            raise ValueError(f"D must be None or a floating-point tensor of shape ({H},), got {shape_str(D)}")
        if D.device != device:
            raise ValueError(f"D is on {D.device}, inputs on {device}")
    if check:
        if bool((A > 0).any()):
            raise ValueError("A must be <= 0 (A = -exp(A_log)); got positive entries")
        if dt.numel() and bool((dt < 0).any()):
            raise ValueError("dt must be >= 0 (Δ after softplus, bias and clamp); got negative entries")


def _check_slot(slot, P: int, Bt: int, device, check: bool) -> Tensor:
    """:func:`~replayssm.ops.common.check_slot`, plus (host check) no slot in several rows."""
    s = check_slot(slot, P, Bt, device, check)
    if check and Bt:
        _check_unique(s)
    return s


def _check_unique(slot: Tensor) -> None:
    real = slot[slot != NULL_SLOT]
    if real.numel() != torch.unique(real).numel():
        raise ValueError(f"a slot appears in several rows: {slot.tolist()} (only the null slot "
                         f"{NULL_SLOT} may repeat)")


def _check_buffers(buf, plan, kind: str, dims, x: Tensor, check: bool) -> None:
    """Validate a layer's buffers and a step plan against the inputs' dims."""
    Bt, T, H, d, G, n = dims
    device = x.device
    if not isinstance(buf, Mamba2Buffers):
        raise ValueError(f"buf must be Mamba2Buffers, got {type(buf).__name__}")
    check_plan(plan, kind, Bt, T)
    check_state_dtype(buf.state, "buf.state dtype")
    P, L = buf.state.shape[0], plan.capacity
    want = {
        "state": (buf.state, (P, H, d, n)),
        "x": (buf.x, (P, L, H, d)),
        "B": (buf.B, (P, L, G, n)),
        "dt": (buf.dt, (P, L, H)),
    }
    check_tensors("buf", want, device, f" (P={P}, L={L}, H={H}, d={d}, G={G}, n={n})")
    if buf.x.dtype != x.dtype or buf.B.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: inputs x/B are {x.dtype}, ring stores x as {buf.x.dtype} "
                         f"and B as {buf.B.dtype}")
    check_plan_rows(plan, Bt, device)
    if T > L:
        raise ValueError(f"{T} new entries do not fit a ring of capacity {L}")
    if check and Bt:
        if bool(((plan.slot < 0) | (plan.slot >= P)).any()):
            raise ValueError(f"plan slots must be in [0, {P - 1}], got {plan.slot.tolist()}")
        _check_unique(plan.slot.long())
        if bool(((plan.start < 0) | (plan.start >= L)).any()):
            raise ValueError(f"plan starts must be in [0, {L - 1}], got {plan.start.tolist()}")
        check_plan_fit(plan, T, L)


def _group_index(H: int, G: int, device) -> Tensor:
    """Group of each head: ``h // (H // G)``."""
    return torch.arange(H, device=device) // (H // G)


def _segment_logs(logs: Tensor, P: Tensor) -> tuple[Tensor, Tensor]:
    """Decays along a masked window.

    logs ``[Bt, W, H]`` finite log-decays of the window entries (in order);
    P ``[Bt, M, W]`` bool, entries each query reads (an ancestor-closed chain).
    Returns ``E [Bt, M, W, H]``: ``E[m, w] = Σ_{v > w, P[m, v]} logs_v`` (log-decay from
    entry w to query m's end; meaningful where ``P[m, w]``) and ``cum [Bt, M, H]``:
    ``Σ_{v: P[m, v]} logs_v`` (log-decay from the checkpoint).
    """
    W = logs.shape[1]
    after = torch.ones(W, W, dtype=torch.bool, device=logs.device).triu(1)  # [w, v]: v > w
    sel = (P[:, :, None, :] & after).to(logs.dtype)  # [Bt, M, W(w), W(v)], 0/1
    E = torch.einsum("bmwv,bvh->bmwh", sel, logs)
    cum = torch.einsum("bmv,bvh->bmh", P.to(logs.dtype), logs)
    return E, cum


def _attend(S0: Tensor | None, xs, Bs, dts, logs, C, P, gidx) -> Tensor:
    """Output-only replay (``docs/MATH.md``, "Replay, output only") for M queries over a masked window of W entries.

    S0 ``[Bt,H,d,n]`` or None (KV-only); xs ``[Bt,W,H,d]``, Bs ``[Bt,W,G,n]``,
    dts/logs ``[Bt,W,H]`` (finite; masked entries zeroed); C ``[Bt,M,G,n]``; P ``[Bt,M,W]``.
    ``y_m = e^{cum_m} (S0 C_m) + Σ_{w: P[m,w]} e^{E[m,w]} Δ_w (B_w·C_m) x_w`` -> ``[Bt,M,H,d]``.
    ``B_w·C_m`` is formed once per group and shared by the group's heads.
    """
    E, cum = _segment_logs(logs, P)
    neg_inf = torch.full((), float("-inf"), dtype=logs.dtype, device=logs.device)
    decay = torch.exp(torch.where(P[..., None], E, neg_inf))  # 0 outside the mask
    scores = torch.einsum("bwgn,bmgn->bmwg", Bs, C)  # once per group
    coef = decay * dts[:, None] * scores[..., gidx]  # [Bt, M, W, H]
    y = torch.einsum("bmwh,bwhd->bmhd", coef, xs)
    if S0 is not None:
        y = y + torch.exp(cum)[..., None] * torch.einsum("bhdn,bmhn->bmhd", S0, C[:, :, gidx])
    return y


def _build_state(S0: Tensor | None, xs, Bs, dts, logs, P, gidx) -> Tensor:
    """State after a masked window: ``S = e^{cum} S0 + Σ_{w: P_w} e^{E_w} Δ_w x_w B_wᵀ``.

    Same window arguments as :func:`_attend`, ``P [Bt, W]``; returns ``[Bt, H, d, n]``.
    """
    E, cum = _segment_logs(logs, P[:, None])
    neg_inf = torch.full((), float("-inf"), dtype=logs.dtype, device=logs.device)
    coef = torch.exp(torch.where(P[..., None], E[:, 0], neg_inf)) * dts  # [Bt, W, H]
    S = torch.einsum("bwh,bwhd,bwhn->bhdn", coef, xs, Bs[:, :, gidx])
    if S0 is not None:
        S = S + torch.exp(cum[:, 0])[..., None, None] * S0
    return S


def _history(buf: Mamba2Buffers, plan: StepPlan, A: Tensor, cdt):
    """Committed ring entries, oldest first and masked (zeros past ``h``):
    ``xs [Bt,L,H,d]``, ``Bs [Bt,L,G,n]``, ``dts``/``logs [Bt,L,H]``, ``valid [Bt,L]``."""
    valid = plan.hist_mask()
    zero = torch.zeros((), dtype=cdt, device=valid.device)
    xs = torch.where(valid[:, :, None, None], gather_history(buf.x, plan).to(cdt), zero)
    Bs = torch.where(valid[:, :, None, None], gather_history(buf.B, plan).to(cdt), zero)
    dts = torch.where(valid[:, :, None], gather_history(buf.dt, plan).to(cdt), zero)
    return xs, Bs, dts, A.to(cdt) * dts, valid


def _new_entries(x, dt, B, A, cdt):
    """This step's entries ``[Bt,T,...]`` upcast to the compute dtype, with their log-decays."""
    xc, dc, Bc = x.to(cdt), dt.to(cdt), B.to(cdt)
    return xc, Bc, dc, A.to(cdt) * dc


def _skip(y: Tensor, D: Tensor | None, xc: Tensor) -> Tensor:
    """``y + D·x`` (``D [H]`` broadcast over the head axis ``-2``)."""
    return y if D is None else y + D.to(y.dtype)[:, None] * xc


def _write_entries(buf: Mamba2Buffers, plan: StepPlan, x: Tensor, B: Tensor, dt: Tensor) -> None:
    write_new(buf.x, plan, x)
    write_new(buf.B, plan, B)
    write_new(buf.dt, plan, dt)


def _check_replay(buf, plan, kind: str, x, dt, A, B, C, D, route, check):
    """Validation shared by the replay ops; returns ``(dims, check)``."""
    check_route(route, _ROUTES)
    dims = _check_inputs(x, dt, B, C, kind != "decode")
    check = want_check(check, x)
    _check_params(A, D, dt, dims[2], x.device, check)
    _check_buffers(buf, plan, kind, dims, x, check)
    return dims, check


# ============================================================================ recurrence
def _step(S: Tensor, x, dt, A, B, C, gidx):
    """Core of :func:`recurrent_step` on prepared inputs (all in the compute dtype)."""
    a = torch.exp(A * dt)  # [Bt, H]
    Bh, Ch = B[:, gidx], C[:, gidx]  # [Bt, H, n]
    S = a[..., None, None] * S + (dt[..., None] * x)[..., :, None] * Bh[..., None, :]
    y = torch.einsum("bhdn,bhn->bhd", S, Ch)
    return y, S


def recurrent_step(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor | None = None, check: bool | None = None) -> tuple[Tensor, Tensor]:
    """One recurrent step (the recurrent form).

    state ``[Bt,H,d,n]`` (fp32/fp64), x ``[Bt,H,d]``, dt ``[Bt,H]``, A ``[H]``,
    B/C ``[Bt,G,n]``, D ``[H]`` or None.
    ``S ← e^{A·Δ} S + Δ x Bᵀ``; ``y = S C + D·x``.
    Returns ``(y [Bt,H,d] in x.dtype, new_state)`` (a new tensor in the state dtype).
    """
    dims = _check_inputs(x, dt, B, C, False)
    Bt, _, H, d, G, n = dims
    if not isinstance(state, Tensor) or tuple(state.shape) != (Bt, H, d, n):
        raise ValueError(f"state must have shape {(Bt, H, d, n)}, got {shape_str(state)}")
    check_state_dtype(state, "state dtype")
    if state.device != x.device:
        raise ValueError(f"state is on {state.device}, inputs on {x.device}")
    _check_params(A, D, dt, H, x.device, want_check(check, x))
    cdt = compute_dtype(state.dtype)
    xc = x.to(cdt)
    y, S = _step(state.to(cdt), xc, dt.to(cdt), A.to(cdt), B.to(cdt), C.to(cdt),
                 _group_index(H, G, x.device))
    return _skip(y, D, xc).to(x.dtype), S.to(state.dtype)



def recurrent_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     D: Tensor | None = None, slot: Tensor | None = None) -> Tensor:
    """One recurrent step on a state pool, in place: ``state[slot] ← step(state[slot])``.

    state ``[P,H,d,n]``, slot ``[Bt]`` (default: rows ``0..Bt-1``); other shapes as in
    :func:`recurrent_step`.  Returns ``y [Bt,H,d]``.  (The kernel twin updates the pool
    without the gather/scatter copies.)"""
    idx = torch.arange(x.shape[0], device=x.device) if slot is None else slot
    y, S = recurrent_step(state[idx], x, dt, A, B, C, D)
    state[idx] = S.to(state.dtype)
    return y

def _initial(initial_state, dims, cdt, device) -> Tensor:
    Bt, T, H, d, G, n = dims
    if initial_state is None:
        return torch.zeros(Bt, H, d, n, dtype=cdt, device=device)
    if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (Bt, H, d, n):
        raise ValueError(f"initial_state must have shape {(Bt, H, d, n)}, got {shape_str(initial_state)}")
    check_state_dtype(initial_state, "initial_state dtype")
    if initial_state.device != device:
        raise ValueError(f"initial_state is on {initial_state.device}, inputs on {device}")
    return initial_state.to(cdt)


def _scan_dtype(initial_state, x, dt):
    if isinstance(initial_state, Tensor) and initial_state.dtype in STATE_DTYPES:
        return compute_dtype(initial_state.dtype)
    return compute_dtype(x.dtype, dt.dtype)


def recurrent_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   initial_state: Tensor | None = None,
                   check: bool | None = None) -> tuple[Tensor, Tensor]:
    """Ground truth: a loop of :func:`recurrent_step` over T tokens.

    x ``[Bt,T,H,d]``, dt ``[Bt,T,H]``, A ``[H]``, B/C ``[Bt,T,G,n]``, D ``[H]`` or None,
    initial_state ``[Bt,H,d,n]`` (zeros if None).  Math in the initial state's compute dtype
    (without one: fp64 if x or dt is fp64, else fp32).
    Returns ``(y [Bt,T,H,d] in x.dtype, final_state [Bt,H,d,n])``.
    """
    dims = _check_inputs(x, dt, B, C, True)
    Bt, T, H, d, G, n = dims
    _check_params(A, D, dt, H, x.device, want_check(check, x))
    cdt = _scan_dtype(initial_state, x, dt)
    S = _initial(initial_state, dims, cdt, x.device)
    gidx = _group_index(H, G, x.device)
    xc, dc, Ac, Bc, Cc = x.to(cdt), dt.to(cdt), A.to(cdt), B.to(cdt), C.to(cdt)
    ys = []
    for t in range(T):
        y, S = _step(S, xc[:, t], dc[:, t], Ac, Bc[:, t], Cc[:, t], gidx)
        ys.append(y)
    y = torch.stack(ys, 1) if ys else xc.new_zeros(xc.shape)
    return _skip(y, D, xc).to(x.dtype), S


def chunked_prefill(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                    initial_state: Tensor | None = None, chunk_size: int = 64,
                    check: bool | None = None) -> tuple[Tensor, Tensor]:
    """SSD chunked form of :func:`recurrent_scan` (same arguments and returns).

    Tokens are padded to a multiple of ``Q = chunk_size`` with ``Δ = 0`` (which leaves the
    state unchanged) and split into chunks; with ``l = A·Δ`` and ``Λ = segsum(l)`` per chunk:

    1. intra-chunk: ``y_i = Σ_{j≤i} e^{Λ_{ij}} Δ_j (B_j·C_i) x_j`` (masked GEMMs);
    2. chunk states from zero: ``s_c = Σ_j e^{Λ_{Q-1,j}} Δ_j x_j B_jᵀ``;
    3. inter-chunk passing: ``S_c = Σ_{c'≤c} e^{segsum over chunk totals} s_{c'}`` (plus the
       decayed initial state), all chunks at once;
    4. read-out: ``y_i += e^{Σ_{k≤i} l_k} (S_{c-1} C_i)``; then ``+ D·x``.
    """
    dims = _check_inputs(x, dt, B, C, True)
    Bt, T, H, d, G, n = dims
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _check_params(A, D, dt, H, x.device, want_check(check, x))
    cdt = _scan_dtype(initial_state, x, dt)
    S_init = _initial(initial_state, dims, cdt, x.device)
    if T == 0:
        return x.new_zeros(x.shape), S_init
    gidx = _group_index(H, G, x.device)
    Q = chunk_size
    nc = -(-T // Q)
    pad = nc * Q - T

    def prep(t: Tensor) -> Tensor:  # upcast, pad the time axis with zeros, split into chunks
        t = t.to(cdt)
        if pad:
            t = torch.cat([t, t.new_zeros((Bt, pad) + tuple(t.shape[2:]))], 1)
        return t.reshape((Bt, nc, Q) + tuple(t.shape[2:]))

    xc, dc, Bc, Cc = prep(x), prep(dt), prep(B), prep(C)  # [Bt,nc,Q,...]
    l = A.to(cdt) * dc  # [Bt,nc,Q,H]
    seg = segsum(l.permute(0, 1, 3, 2))  # [Bt,nc,H,Q(i),Q(j)]
    decay = torch.exp(seg)
    # 1. intra-chunk outputs; B_j·C_i once per group
    scores = torch.einsum("bcign,bcjgn->bcijg", Cc, Bc)[..., gidx]  # [Bt,nc,Q,Q,H]
    y = torch.einsum("bchij,bcijh,bcjh,bcjhd->bcihd", decay, scores, dc, xc)
    # 2. each chunk's state from zero
    to_end = decay[..., -1, :]  # [Bt,nc,H,Q]: e^{Σ_{j<k≤Q-1} l_k}
    states = torch.einsum("bchj,bcjh,bcjhd,bcjhn->bchdn", to_end, dc, xc, Bc[:, :, :, gidx])
    # 3. inter-chunk state passing (index 0 = the initial state)
    totals = l.sum(2)  # [Bt,nc,H]
    z = torch.cat([totals.new_zeros(Bt, 1, H), totals], 1).transpose(1, 2)  # [Bt,H,nc+1]
    pass_decay = torch.exp(segsum(z))  # [Bt,H,nc+1,nc+1]
    all_states = torch.cat([S_init[:, None], states], 1)  # [Bt,nc+1,H,d,n]
    S_out = torch.einsum("bhij,bjhdn->bihdn", pass_decay, all_states)  # state after chunk i-1
    S_in, final = S_out[:, :nc], S_out[:, nc]
    # 4. read-out of the state entering each chunk
    into = torch.exp(l.cumsum(2))  # [Bt,nc,Q,H]: decay from chunk start through token i
    y = y + into[..., None] * torch.einsum("bchdn,bcihn->bcihd", S_in, Cc[:, :, :, gidx])
    y = y.reshape(Bt, nc * Q, H, d)[:, :T]
    return _skip(y, D, x.to(cdt)).to(x.dtype), final


# ============================================================================ replay
def check_rebuild_state(buf, plan, A) -> None:
    """Validate a :func:`rebuild_state` call (shared with its kernel)."""
    if not isinstance(buf, Mamba2Buffers) or not isinstance(plan, StepPlan):
        raise ValueError("rebuild_state needs Mamba2Buffers and a StepPlan")
    check_state_dtype(buf.state, "buf.state dtype")
    H = buf.state.shape[1]
    if not isinstance(A, Tensor) or tuple(A.shape) != (H,):
        raise ValueError(f"A must be a tensor of shape ({H},), got {shape_str(A)}")


def rebuild_state(buf: Mamba2Buffers, plan: StepPlan, A: Tensor) -> Tensor:
    """``S_h = e^{pre_h} S0 + Σ_{j<h} Δ_j e^{pre_h−pre_j} x_j B_jᵀ`` per row ``[Bt,H,d,n]``
    from each row's checkpoint and committed ring entries (compute dtype).  Reads only;
    any plan kind (``ring.plan_decode(slots)`` is a side-effect-free way to get one)."""
    check_rebuild_state(buf, plan, A)
    H, G = buf.state.shape[1], buf.B.shape[2]
    cdt = compute_dtype(buf.state.dtype)
    xs, Bs, dts, logs, valid = _history(buf, plan, A, cdt)
    return _build_state(buf.state[plan.slot].to(cdt), xs, Bs, dts, logs, valid,
                        _group_index(H, G, buf.state.device))


def replay_decode(buf: Mamba2Buffers, plan: StepPlan, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                  C: Tensor, D: Tensor | None = None, route: str = "output",
                  check: bool | None = None) -> Tensor:
    """Replay decode of one token per row (``docs/MATH.md``, "Replay, output only" and "Flush");
    ``plan.kind == "decode"``.

    x ``[Bt,H,d]``, dt ``[Bt,H]``, A ``[H]``, B/C ``[Bt,G,n]``, D ``[H]`` or None.
    With the new token as entry ``h`` (``t = h``):

    * route ``"output"``: ``y = e^{pre_t}(S0 C) + Σ_{j≤t} Δ_j e^{pre_t−pre_j} (B_j·C) x_j``,
      with ``B_j·C`` computed once per group; no state is formed for the output;
    * route ``"state"``: rebuild ``S_{h+1}`` from ``S0`` and the ring, ``y = S_{h+1} C``;

    plus ``D·x``.  Appends ``(x, B, Δ)`` at ring position ``h``; rows with ``plan.flush``
    write ``state[slot] = S_{h+1}`` (including the new entry).  Returns ``y [Bt,H,d]``;
    then ``ring.commit(plan)``.
    """
    dims, check = _check_replay(buf, plan, "decode", x, dt, A, B, C, D, route, check)
    Bt, _, H, d, G, n = dims
    cdt = compute_dtype(buf.state.dtype)
    gidx = _group_index(H, G, x.device)
    hx, hB, hd, hl, valid = _history(buf, plan, A, cdt)
    nx, nB, nd, nl = _new_entries(x[:, None], dt[:, None], B[:, None], A, cdt)
    xs, Bs, dts, logs = (torch.cat(p, 1) for p in ((hx, nx), (hB, nB), (hd, nd), (hl, nl)))
    P = torch.cat([valid, torch.ones(Bt, 1, dtype=torch.bool, device=x.device)], 1)  # [Bt, L+1]
    S0 = buf.state[plan.slot].to(cdt)
    S_next = _build_state(S0, xs, Bs, dts, logs, P, gidx)  # S_{h+1} (stored on flush rows)
    Cc = C.to(cdt)
    if route == "output":
        y = _attend(S0, xs, Bs, dts, logs, Cc[:, None], P[:, None], gidx)[:, 0]
    else:
        y = torch.einsum("bhdn,bhn->bhd", S_next, Cc[:, gidx])
    y = _skip(y, D, nx[:, 0])
    # ---- writes (all validation done above)
    _write_entries(buf, plan, x[:, None], B[:, None], dt[:, None])
    write_state_where(buf.state, plan.slot, plan.flush, S_next)
    return y.to(x.dtype)


def _draft_verify(buf, plan, mask, x, dt, A, B, C, D, route, dims):
    """Shared body of :func:`replay_verify` / :func:`tree_verify` (inputs validated).

    mask ``[Bt,T,T]``: draft s reads draft s' iff ``mask[s, s']`` (causal or ancestor-or-self).
    """
    Bt, T, H, d, G, n = dims
    cdt = compute_dtype(buf.state.dtype)
    gidx = _group_index(H, G, x.device)
    hx, hB, hd, hl, valid = _history(buf, plan, A, cdt)
    nx, nB, nd, nl = _new_entries(x, dt, B, A, cdt)
    S0 = buf.state[plan.slot].to(cdt)
    Sh = _build_state(S0, hx, hB, hd, hl, valid, gidx)  # committed entries only (flush rows)
    Cc = C.to(cdt)
    if route == "output":
        xs, Bs, dts, logs = (torch.cat(p, 1) for p in ((hx, nx), (hB, nB), (hd, nd), (hl, nl)))
        P = torch.cat([valid[:, None, :].expand(Bt, T, valid.shape[1]), mask], 2)  # [Bt,T,L+T]
        y = _attend(S0, xs, Bs, dts, logs, Cc, P, gidx)
    else:  # read the rebuilt S_h, then the drafts under the mask
        y = _attend(Sh, nx, nB, nd, nl, Cc, mask, gidx)
    y = _skip(y, D, nx)
    # ---- writes (all validation done above)
    _write_entries(buf, plan, x, B, dt)
    write_state_where(buf.state, plan.slot, plan.flush, Sh)
    return y.to(x.dtype)


def replay_verify(buf: Mamba2Buffers, plan: StepPlan, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                  C: Tensor, D: Tensor | None = None, route: str = "output",
                  check: bool | None = None) -> Tensor:
    """Replay verify of T drafts per row (``docs/MATH.md``, "Speculative verify");
    ``plan.kind == "verify"``.

    x ``[Bt,T,H,d]``, dt ``[Bt,T,H]``, A ``[H]``, B/C ``[Bt,T,G,n]``, D ``[H]`` or None.
    Every draft reads the same ``S0`` and ring window under a causal mask, as GEMMs
    (``K_bufᵀ Q_draft`` per group, then the weighted sum over values):
    ``y_s = e^{pre_{h+s}}(S0 C_s) + Σ_{j ≤ h+s} Δ_j e^{pre_{h+s}−pre_j} (B_j·C_s) x_j + D·x_s``.
    Route ``"state"`` rebuilds ``S_h`` first and reads it instead (same numbers).
    Appends the drafts at positions ``h..h+T-1``; flush rows write ``state[slot] = S_h``
    (committed entries only).  Returns ``y [Bt,T,H,d]``; then ``ring.commit(plan, accepted)``.
    """
    dims, check = _check_replay(buf, plan, "verify", x, dt, A, B, C, D, route, check)
    Bt, T = dims[:2]
    mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(Bt, T, T)
    return _draft_verify(buf, plan, mask, x, dt, A, B, C, D, route, dims)


def tree_verify(buf: Mamba2Buffers, plan: StepPlan, parent: Tensor, x: Tensor, dt: Tensor, A: Tensor,
                B: Tensor, C: Tensor, D: Tensor | None = None, route: str = "output",
                check: bool | None = None) -> Tensor:
    """Replay verify of a draft tree of N nodes per row (STree); ``plan.kind == "tree"``.

    parent ``[Bt,N]`` or ``[N]`` (topological: ``-1 <= parent[i] < i``, ``-1`` = child of
    the last committed entry); x ``[Bt,N,H,d]``, dt ``[Bt,N,H]``, B/C ``[Bt,N,G,n]``.
    With ``M`` the ancestor-or-self mask and ``cum_i`` the log-decay over the committed
    history plus node i's ancestor chain:
    ``y_i = e^{cum_i}(S_h C_i) + Σ_{j: M_ij} e^{cum_i−cum_j} Δ_j (B_j·C_i) x_j + D·x_i``
    (route ``"output"`` reads ``S0`` and the ring instead of ``S_h``; same numbers).
    Appends nodes at positions ``h..h+N-1``; flush rows write ``S_h``.  Commit:
    ``cache.tree.gather_path(buf.ring_tensors(), plan, path, accepted)`` then ``ring.commit``.
    """
    dims, check = _check_replay(buf, plan, "tree", x, dt, A, B, C, D, route, check)
    par = check_tree(parent, dims[0], dims[1], x.device, check)
    return _draft_verify(buf, plan, ancestor_mask(par), x, dt, A, B, C, D, route, dims)


# ============================================================================ snapshot baseline
def snapshot_verify(state: Tensor, slot: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                    C: Tensor, D: Tensor | None = None,
                    check: bool | None = None) -> tuple[Tensor, Tensor]:
    """Baseline speculative verify (snapshot verify, what vLLM does): serial scan from ``state[slot]``,
    one stored state per draft.

    state ``[P,H,d,n]`` (read only), slot ``[Bt]``, x ``[Bt,T,H,d]``, dt ``[Bt,T,H]``,
    B/C ``[Bt,T,G,n]``.  Returns ``(y [Bt,T,H,d], snapshots [Bt,T,H,d,n])`` with
    ``snapshots[:, s]`` the state after draft s (state dtype).
    """
    dims = _check_inputs(x, dt, B, C, True)
    Bt, T, H, d, G, n = dims
    if not isinstance(state, Tensor) or state.dim() != 4 or tuple(state.shape[1:]) != (H, d, n):
        raise ValueError(f"state must be [P, {H}, {d}, {n}], got {shape_str(state)}")
    check_state_dtype(state, "state dtype")
    if state.device != x.device:
        raise ValueError(f"state is on {state.device}, inputs on {x.device}")
    check = want_check(check, x)
    _check_params(A, D, dt, H, x.device, check)
    sl = _check_slot(slot, state.shape[0], Bt, x.device, check)
    cdt = compute_dtype(state.dtype)
    gidx = _group_index(H, G, x.device)
    S = state[sl].to(cdt)
    xc, dc, Ac, Bc, Cc = x.to(cdt), dt.to(cdt), A.to(cdt), B.to(cdt), C.to(cdt)
    ys, snaps = [], []
    for t in range(T):
        y, S = _step(S, xc[:, t], dc[:, t], Ac, Bc[:, t], Cc[:, t], gidx)
        ys.append(y)
        snaps.append(S)
    if T == 0:
        return x.new_zeros(x.shape), state.new_zeros((Bt, 0, H, d, n))
    y = _skip(torch.stack(ys, 1), D, xc)
    return y.to(x.dtype), torch.stack(snaps, 1).to(state.dtype)


def snapshot_commit(state: Tensor, slot: Tensor, snapshots: Tensor, accepted: Tensor,
                    check: bool | None = None) -> None:
    """Baseline commit: ``state[slot] = snapshots[:, a-1]`` on rows with ``a = accepted > 0``.

    state ``[P,H,d,n]``, slot ``[Bt]``, snapshots ``[Bt,T,H,d,n]``, accepted ``[Bt]`` in
    ``[0, T]``.  No host sync when ``check=False``.
    """
    if not isinstance(snapshots, Tensor) or snapshots.dim() != 5:
        raise ValueError(f"snapshots must be a tensor [Bt, T, H, d, n], got {shape_str(snapshots)}")
    Bt, T = snapshots.shape[:2]
    if not isinstance(state, Tensor) or state.dim() != 4 or state.shape[1:] != snapshots.shape[2:]:
        raise ValueError(f"state must be [P, {', '.join(map(str, snapshots.shape[2:]))}], "
                         f"got {shape_str(state)}")
    check_state_dtype(state, "state dtype")
    if snapshots.device != state.device:
        raise ValueError(f"snapshots are on {snapshots.device}, state on {state.device}")
    if not snapshots.is_floating_point():
        raise ValueError(f"snapshots must be floating point, got {snapshots.dtype}")
    check = want_check(check, state)
    sl = _check_slot(slot, state.shape[0], Bt, state.device, check)
    a = check_accepted(accepted, Bt, T, state.device, check)
    if T == 0:
        return
    chosen = snapshots[torch.arange(Bt, device=state.device), (a - 1).clamp(0, T - 1)]
    write_state_where(state, sl, a > 0, chosen)


# ============================================================================ KV-only (paged)
# The KV-only form keeps every entry since the start in paged blocks (``S0 = 0``).  The ops
# walk the blocks a batch actually holds, a run of whole blocks at a time
# (:mod:`replayssm.ops.kv_blocks`), so memory and time follow the held context:
#
# * up to ``KV_CHUNK`` new tokens (decode, verify, trees): every new token attends to the
#   history run by run (newest first, carrying the log-decay of the runs already seen),
#   then to the new tokens on its chain / tree path;
# * more new tokens (a prefill): the history is folded into a state run by run and the new
#   tokens run the SSD chunked scan from it (:func:`chunked_prefill`).
KV_CHUNK = 64


def _check_kv(kv, pplan, dims, x: Tensor | None, device, check: bool) -> None:
    Bt, T, H, d, G, n = dims
    if not isinstance(kv, paged.Mamba2PagedBuffers):
        raise ValueError(f"kv must be Mamba2PagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    if not isinstance(pplan.slot, Tensor) or tuple(pplan.slot.shape) != (Bt,):
        raise ValueError(f"paged plan has {shape_str(pplan.slot)} rows, inputs have batch {Bt}")
    if pplan.num_new != T:
        raise ValueError(f"paged plan appends {pplan.num_new} entries per row, inputs have {T} tokens")
    NBbs = kv.x.shape[0] if isinstance(kv.x, Tensor) else -1
    want = {"x": (kv.x, (NBbs, H, d)), "B": (kv.B, (NBbs, G, n)), "dt": (kv.dt, (NBbs, H))}
    check_tensors("kv", want, device)
    if NBbs % pplan.block_size:
        raise ValueError(f"KV pools have {NBbs} entries, not a multiple of block_size {pplan.block_size}")
    if x is not None and (kv.x.dtype != x.dtype or kv.B.dtype != x.dtype):
        raise ValueError(f"dtype mismatch: inputs x/B are {x.dtype}, pool stores x as {kv.x.dtype} "
                         f"and B as {kv.B.dtype}")
    if check and Bt:
        nb = NBbs // pplan.block_size
        if bool(((pplan.block_table < 0) | (pplan.block_table >= nb)).any()):
            raise ValueError(f"block table entries must be in [0, {nb - 1}]")
        check_kv_lengths(pplan, T)
        _check_unique(pplan.slot.long())


def _kv_run(kv, pos: Tensor, valid: Tensor, A: Tensor, cdt):
    """One run of held entries, masked (zeros where not ``valid``): ``xs [Bt,E,H,d]``,
    ``Bs [Bt,E,G,n]``, ``dts``/``logs [Bt,E,H]``."""
    zero = torch.zeros((), dtype=cdt, device=pos.device)
    xs = torch.where(valid[:, :, None, None], kv.x[pos].to(cdt), zero)
    Bs = torch.where(valid[:, :, None, None], kv.B[pos].to(cdt), zero)
    dts = torch.where(valid[:, :, None], kv.dt[pos].to(cdt), zero)
    return xs, Bs, dts, A.to(cdt) * dts


def _kv_fold(kv, pplan, A: Tensor, gidx: Tensor, cdt, S0: Tensor | None = None,
             budget: int = kv_blocks.RUN_BUDGET) -> Tensor:
    """``S_n = e^{pre_n} S0 + Σ_{j<n} Δ_j e^{pre_n−pre_j} x_j B_jᵀ`` per row ``[Bt,H,d,n]``
    (``S0 = 0`` when None), run by run:
    ``S ← e^{Σ_run l} S + Σ_{j∈run} e^{Σ_{v>j in run} l_v} Δ_j x_j B_jᵀ``."""
    Bt = pplan.batch
    H, d = kv.x.shape[1:]
    n = kv.B.shape[2]
    S = torch.zeros(Bt, H, d, n, dtype=cdt, device=kv.x.device) if S0 is None else S0.to(cdt)
    for pos, valid in kv_blocks.runs(pplan, Bt * (2 * H * d + 2 * kv.B.shape[1] * n + H * n + 4 * H), budget=budget):
        xs, Bs, dts, logs = _kv_run(kv, pos, valid, A, cdt)
        coef = torch.exp(kv_blocks.suffix_after(logs)) * dts  # 0 on invalid entries (dts = 0)
        S = torch.exp(logs.sum(1))[..., None, None] * S + torch.einsum(
            "beh,behd,behn->bhdn", coef, xs, Bs[:, :, gidx])
    return S


def _kv_attend(kv, pplan, A, xn, Bn, dn, ln, Cc, mask, gidx, cdt) -> Tensor:
    """Outputs of ``N`` new entries per row that read the held history and their own
    chain / tree (``mask [Bt,N,N]``, ancestor-or-self), without ``D·x``:

    ``y_t = Σ_{j<n} e^{cum_t + Σ_{j<v<n} l_v} Δ_j (B_j·C_t) x_j
          + Σ_{s: mask[t,s]} e^{Σ_{v∈(s,t]} l_v} Δ_s (B_s·C_t) x_s``

    with ``cum_t`` the log-decay along t's path from the last committed entry.  New entries
    ``xn [Bt,N,H,d]``, ``Bn``/``Cc [Bt,N,G,n]``, ``dn``/``ln [Bt,N,H]`` in ``cdt``.
    """
    Bt, N, H, d = xn.shape
    G, n = Bn.shape[2:]
    E, cum = kv_blocks.path_logs(mask, ln)
    neg_inf = torch.full((), float("-inf"), dtype=cdt, device=xn.device)
    decay = torch.exp(torch.where(mask[..., None], E, neg_inf))  # 0 off the path
    scores = torch.einsum("bsgn,btgn->btsg", Bn, Cc)[..., gidx]
    y = torch.einsum("btsh,bshd->bthd", decay * dn[:, None] * scores, xn)
    later = torch.zeros(Bt, H, dtype=cdt, device=xn.device)  # log-decay of the runs after this one
    per_entry = Bt * (H * d + G * n + 3 * H + N * (G + 3 * H))
    for pos, valid in kv_blocks.runs(pplan, per_entry, reverse=True):
        xs, Bs, dts, logs = _kv_run(kv, pos, valid, A, cdt)
        to_end = kv_blocks.suffix_after(logs) + later[:, None]  # [Bt,E,H]: Σ_{j<v<n} l_v
        later = later + logs.sum(1)
        scores = torch.einsum("begn,btgn->bteg", Bs, Cc)[..., gidx]  # [Bt,N,E,H]
        coef = torch.exp(cum[:, :, None] + to_end[:, None]) * dts[:, None] * scores
        y = y + torch.einsum("bteh,behd->bthd", coef, xs)  # invalid entries: dts = xs = 0
    return y


def _kv_write(kv, pplan, x: Tensor, B: Tensor, dt: Tensor) -> None:
    paged.write_kv_new(kv.x, pplan, x)
    paged.write_kv_new(kv.B, pplan, B)
    paged.write_kv_new(kv.dt, pplan, dt.to(kv.dt.dtype))


def _check_kv_call(kv, pplan, x, dt, A, B, C, D, check):
    """Validation shared by :func:`kv_verify` / :func:`kv_tree_verify`; returns ``(dims, check)``."""
    dims = _check_inputs(x, dt, B, C, True)
    check = want_check(check, x)
    _check_params(A, D, dt, dims[2], x.device, check)
    _check_kv(kv, pplan, dims, x, x.device, check)
    return dims, check


def kv_verify(kv, pplan, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
              D: Tensor | None = None, check: bool | None = None) -> Tensor:
    """KV-only form (no state, ``S0 = 0``) for T new tokens per row over paged buffers.

    kv: ``Mamba2PagedBuffers``; pplan from ``pidx.plan(slots, T)`` (n committed entries
    per row); x ``[Bt,T,H,d]``, dt ``[Bt,T,H]``, B/C ``[Bt,T,G,n]``.
    ``y_t = Σ_{j ≤ t} Δ_j e^{pre_t−pre_j} (B_j·C_t) x_j + D·x_t`` over the row's n entries
    and the new tokens up to t (causal).  Computed over the held blocks only: memory and
    time grow with the context held, not with ``max_seq_len`` (up to ``KV_CHUNK`` tokens:
    attention over the history run by run; more: fold the history into a state and run the
    chunked scan).  Writes the new ``(x, B, Δ)`` with ``write_kv_new``; advance with
    ``pidx.commit(pplan, accepted)``.  Returns ``y [Bt,T,H,d]``.
    Compute dtype: fp64 if the pool's dt or the inputs are fp64, else fp32.
    """
    dims, check = _check_kv_call(kv, pplan, x, dt, A, B, C, D, check)
    Bt, T, H, d, G, n = dims
    cdt = compute_dtype(kv.dt.dtype, kv.x.dtype, x.dtype)
    gidx = _group_index(H, G, x.device)
    if T <= KV_CHUNK:
        nx, nB, nd, nl = _new_entries(x, dt, B, A, cdt)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(Bt, T, T)
        y = _skip(_kv_attend(kv, pplan, A, nx, nB, nd, nl, C.to(cdt), causal, gidx, cdt), D, nx)
    else:
        S = _kv_fold(kv, pplan, A, gidx, cdt)
        y = chunked_prefill(x, dt, A, B, C, D, initial_state=S, chunk_size=KV_CHUNK, check=False)[0]
    # ---- writes (all validation done above)
    _kv_write(kv, pplan, x, B, dt)
    return y.to(x.dtype)


def kv_tree_verify(kv, pplan, parent: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                   C: Tensor, D: Tensor | None = None, check: bool | None = None) -> Tensor:
    """KV-only form of :func:`tree_verify`: a draft tree of N nodes per row over paged buffers.

    parent ``[Bt,N]`` or ``[N]`` (topological: ``-1 <= parent[i] < i``, ``-1`` = child of
    the last committed entry); x ``[Bt,N,H,d]``, dt ``[Bt,N,H]``, B/C ``[Bt,N,G,n]``.  With
    ``M`` the ancestor-or-self mask and ``cum_i`` the log-decay along node i's path:
    ``y_i = Σ_{j<n} e^{cum_i + pre_n − pre_j} Δ_j (B_j·C_i) x_j
          + Σ_{j: M_ij} e^{cum_i−cum_j} Δ_j (B_j·C_i) x_j + D·x_i``
    (the recurrence along the root path, from ``S0 = 0``), over the held blocks only.
    Writes the N node entries ``(x, B, Δ)`` at logical ``length .. length+N-1``; commit moves
    the accepted path to the front (``cache.paged.gather_path``) before ``pidx.commit``.
    Returns ``y [Bt,N,H,d]``.
    """
    dims, check = _check_kv_call(kv, pplan, x, dt, A, B, C, D, check)
    Bt, N, H, d, G, n = dims
    par = check_tree(parent, Bt, N, x.device, check)
    cdt = compute_dtype(kv.dt.dtype, kv.x.dtype, x.dtype)
    gidx = _group_index(H, G, x.device)
    nx, nB, nd, nl = _new_entries(x, dt, B, A, cdt)
    y = _kv_attend(kv, pplan, A, nx, nB, nd, nl, C.to(cdt), ancestor_mask(par), gidx, cdt)
    y = _skip(y, D, nx)
    # ---- writes (all validation done above)
    _kv_write(kv, pplan, x, B, dt)
    return y.to(x.dtype)


def check_kv_fold(kv, pplan, A: Tensor, initial_state: Tensor | None, check: bool | None):
    """Validate a :func:`kv_fold` call (shared with its kernel); returns ``(Bt, H, d, G, n)``."""
    if not isinstance(kv, paged.Mamba2PagedBuffers):
        raise ValueError(f"kv must be Mamba2PagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    if not isinstance(kv.x, Tensor) or kv.x.dim() != 3 or not isinstance(kv.B, Tensor) or kv.B.dim() != 3:
        raise ValueError(f"kv pools must be x [NB*bs, H, d] and B [NB*bs, G, n], got {shape_str(kv.x)}, "
                         f"{shape_str(kv.B)}")
    H, d = kv.x.shape[1:]
    G, n = kv.B.shape[1:]
    if G < 1 or H % G:
        raise ValueError(f"nheads H={H} is not a multiple of the KV pool's ngroups {G}")
    Bt = pplan.slot.shape[0] if isinstance(pplan.slot, Tensor) else -1
    device = kv.x.device
    _check_kv(kv, pplan, (Bt, pplan.num_new, H, d, G, n), None, device, False)
    if not isinstance(A, Tensor) or not A.is_floating_point() or tuple(A.shape) != (H,) or A.device != device:
        raise ValueError(f"A must be a floating-point tensor of shape ({H},) on {device}, got {shape_str(A)}")
    if initial_state is not None and (not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (Bt, H, d, n)
                                      or initial_state.device != device):
        raise ValueError(f"initial_state must be [{Bt}, {H}, {d}, {n}] on {device}, got {shape_str(initial_state)}")
    if want_check(check, kv.x) and Bt and bool((pplan.length < 0).any()):
        raise ValueError(f"negative KV lengths in the paged plan: {pplan.length.tolist()}")
    return Bt, H, d, G, n


def kv_fold(kv, pplan, A: Tensor, initial_state: Tensor | None = None, check: bool | None = None) -> Tensor:
    """The state each row's committed paged entries fold into, from ``initial_state``:
    ``S_n = e^{pre_n} S0 + Σ_{j<n} Δ_j e^{pre_n−pre_j} x_j B_jᵀ`` (``S0 = 0`` when None).

    kv: ``Mamba2PagedBuffers`` (any pool in that layout: a slot's KV-only pages, or the
    prefix store's blocks); ``pplan``: its block tables and lengths ``n`` per row (only
    those are read); ``A [H]``; ``initial_state [Bt,H,d,n]``.  Folded run by run over the
    held blocks (:mod:`replayssm.ops.kv_blocks`).  Returns ``[Bt,H,d,n]`` in fp64 if the
    pool's Δ or ``initial_state`` is fp64, else fp32.  Reads only.
    """
    Bt, H, d, G, n = check_kv_fold(kv, pplan, A, initial_state, check)
    cdt = compute_dtype(kv.dt.dtype, *(() if initial_state is None else (initial_state.dtype,)))
    return _kv_fold(kv, pplan, A, _group_index(H, G, kv.x.device), cdt, initial_state, kv_blocks.FOLD_BUDGET)


def check_conv_fold(preconv, dt, pplan, start, conv_weight, conv_bias, A, initial_state, head_dim: int,
                    ngroups: int, d_state: int, check: bool | None) -> tuple[int, int]:
    """Validate a :func:`conv_fold` call (shared with its kernel); returns ``(Bt, H)``."""
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    if not isinstance(preconv, Tensor) or preconv.dim() != 2 or not isinstance(dt, Tensor) or dt.dim() != 2 \
            or dt.shape[0] != preconv.shape[0]:
        raise ValueError(f"preconv must be [rows, C] and dt [rows, H] with the same rows, got {shape_str(preconv)}, "
                         f"{shape_str(dt)}")
    NR, Cch = preconv.shape
    H = dt.shape[1]
    d, G, n = int(head_dim), int(ngroups), int(d_state)
    if min(d, G, n) < 1 or H % G or H * d + 2 * G * n > Cch:
        raise ValueError(f"{H} heads of {d} and {G} groups of {n} do not fit {Cch} conv channels (x | B | C)")
    if NR % pplan.block_size:
        raise ValueError(f"the store has {NR} rows, not a multiple of block_size {pplan.block_size}")
    if not isinstance(conv_weight, Tensor) or conv_weight.dim() != 2 or conv_weight.shape[0] != Cch:
        raise ValueError(f"conv_weight must be [{Cch}, W], got {shape_str(conv_weight)}")
    if conv_bias is not None and (not isinstance(conv_bias, Tensor) or tuple(conv_bias.shape) != (Cch,)):
        raise ValueError(f"conv_bias must be [{Cch}] or None, got {shape_str(conv_bias)}")
    if not isinstance(A, Tensor) or tuple(A.shape) != (H,):
        raise ValueError(f"A must be a tensor of shape ({H},), got {shape_str(A)}")
    Bt = pplan.slot.shape[0] if isinstance(pplan.slot, Tensor) else -1
    if not isinstance(start, Tensor) or tuple(start.shape) != (Bt,) or start.is_floating_point():
        raise ValueError(f"start must be an integer tensor of shape ({Bt},), got {shape_str(start)}")
    if initial_state is not None and (not isinstance(initial_state, Tensor)
                                      or tuple(initial_state.shape) != (Bt, H, d, n)):
        raise ValueError(f"initial_state must be [{Bt}, {H}, {d}, {n}], got {shape_str(initial_state)}")
    for name, t in (("dt", dt), ("A", A), ("start", start), ("block_table", pplan.block_table),
                    ("length", pplan.length), ("initial_state", initial_state)):
        if t is not None and t.device != preconv.device:
            raise ValueError(f"{name} is on {t.device}, preconv on {preconv.device}")
    if want_check(check, preconv) and Bt:
        nb = NR // pplan.block_size
        if bool(((pplan.block_table < 0) | (pplan.block_table >= nb)).any()):
            raise ValueError(f"block table entries must be in [0, {nb - 1}]")
        if bool((start < 0).any() | (pplan.length < 0).any()) or \
                bool((start + pplan.length > pplan.max_len).any()):
            raise ValueError("fold positions must lie inside each row's block table")
    return Bt, H


def conv_fold(preconv: Tensor, dt: Tensor, pplan, start: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
              A: Tensor, initial_state: Tensor | None = None, *, head_dim: int, ngroups: int, d_state: int,
              check: bool | None = None) -> Tensor:
    """:func:`kv_fold` over entries the prefix store keeps as conv inputs: for row ``b``,
    positions ``start_b .. start_b + n_b - 1`` of its chain (``pplan``'s block table from
    position 0, ``n_b = pplan.length``) with ``x, B = split(silu(conv(preconv)))`` at each
    position (the ``W`` conv inputs ending there, zeros before position 0; in the inputs'
    dtype, bit for bit the prefill's, :func:`..conv.naive.conv_window_out`) and ``Δ`` from
    ``dt``: ``S = e^{pre} S0 + Σ_j Δ_j e^{pre−pre_j} x_j B_jᵀ``.

    ``preconv [rows, C]`` (channels ``x | B | C``), ``dt [rows, H]``, ``conv_weight [C, W]``,
    ``conv_bias [C]`` or None, ``A [H]``, ``start [Bt]``, ``initial_state [Bt,H,d,n]``.
    Returns ``[Bt,H,d,n]`` (fp64 if ``dt`` or ``initial_state`` is, else fp32).  Reads only.
    """
    Bt, H = check_conv_fold(preconv, dt, pplan, start, conv_weight, conv_bias, A, initial_state, head_dim, ngroups,
                            d_state, check)
    d, G, n, W = int(head_dim), int(ngroups), int(d_state), conv_weight.shape[1]
    dev = preconv.device
    width = int(pplan.length.max()) if Bt else 0
    j = torch.arange(width, device=dev)
    held = j[None, :] < pplan.length[:, None]                               # [Bt, width] positions folded
    q = (start[:, None] + j[None, :])[..., None] + torch.arange(1 - W, 1, device=dev)   # [Bt, width, W] windows
    rows = pplan.positions(q.clamp(min=0).reshape(Bt, width * W)).reshape(q.shape)[held]   # [R, W]
    valid = (q >= 0)[held]
    xb = conv_window_out(preconv[rows], conv_weight, conv_bias, "silu", valid)   # [R, C]
    R = rows.shape[0]
    entries = paged.Mamba2PagedBuffers(x=xb[:, :H * d].reshape(R, H, d),
                                       B=xb[:, H * d:H * d + G * n].reshape(R, G, n), dt=dt[rows[:, -1]])
    # the rebuilt entries, row after row, as pages of one entry
    offs = torch.cumsum(pplan.length, 0) - pplan.length
    plan = paged.PagedPlan(pplan.slot, pplan.length, torch.where(held, offs[:, None] + j, 0), 1, 1)
    cdt = compute_dtype(dt.dtype, *(() if initial_state is None else (initial_state.dtype,)))
    return _kv_fold(entries, plan, A, _group_index(H, G, dev), cdt, initial_state, kv_blocks.FOLD_BUDGET)


def kv_to_state(kv, pplan, buf: Mamba2Buffers, slot: Tensor, A: Tensor,
                check: bool | None = None) -> None:
    """Compress each row's committed KV entries into a checkpoint (one flush):
    ``buf.state[slot] = Σ_{j<n} Δ_j e^{pre_n−pre_j} x_j B_jᵀ`` (``S0 = 0``), folded run by
    run over the held blocks.

    ``pplan`` (only its committed lengths are used), ``slot [Bt]`` (each row's state slot in
    ``buf``), ``A [H]`` (the pool stores Δ, so the decays need A).  Ring bookkeeping is the
    caller's (``ring.reset(slot)``); the row's blocks may be released afterwards.
    """
    if not isinstance(buf, Mamba2Buffers):
        raise ValueError(f"buf must be Mamba2Buffers, got {type(buf).__name__}")
    if not isinstance(kv, paged.Mamba2PagedBuffers):
        raise ValueError(f"kv must be Mamba2PagedBuffers, got {type(kv).__name__}")
    if not isinstance(pplan, paged.PagedPlan):
        raise ValueError(f"pplan must be a PagedPlan, got {type(pplan).__name__}")
    check_state_dtype(buf.state, "buf.state dtype")
    P, H, d, n = buf.state.shape
    if not isinstance(kv.B, Tensor) or kv.B.dim() != 3:
        raise ValueError(f"kv.B must be [NB*bs, G, n], got {shape_str(kv.B)}")
    G = kv.B.shape[1]
    if G < 1 or H % G:
        raise ValueError(f"nheads H={H} is not a multiple of the KV pool's ngroups {G}")
    Bt = pplan.slot.shape[0] if isinstance(pplan.slot, Tensor) else -1
    device = buf.state.device
    check = want_check(check, buf.state)
    _check_kv(kv, pplan, (Bt, pplan.num_new, H, d, G, n), None, device, False)
    if not isinstance(A, Tensor) or not A.is_floating_point() or tuple(A.shape) != (H,):
        raise ValueError(f"A must be a floating-point tensor of shape ({H},), got {shape_str(A)}")
    if A.device != device:
        raise ValueError(f"A is on {A.device}, state on {device}")
    if check and bool((A > 0).any()):
        raise ValueError("A must be <= 0 (A = -exp(A_log)); got positive entries")
    sl = _check_slot(slot, P, Bt, device, check)
    if check and Bt and bool((pplan.length < 0).any()):
        raise ValueError(f"negative KV lengths in the paged plan: {pplan.length.tolist()}")
    S = _kv_fold(kv, pplan, A, _group_index(H, G, device), compute_dtype(buf.state.dtype))
    buf.state[sl] = S.to(buf.state.dtype)


# ============================================================================ packed prefill
def _check_varlen_inputs(x, dt, B, C):
    """Validate packed activations ``x [Nt,H,d]``, ``dt [Nt,H]``, ``B/C [Nt,G,n]``; returns
    ``(1, Nt, H, d, G, n)``."""
    for name, t, form in (("x", x, "[Nt, H, d]"), ("dt", dt, "[Nt, H]"), ("B", B, "[Nt, G, n]"),
                          ("C", C, "[Nt, G, n]")):
        if not isinstance(t, Tensor) or t.dim() != form.count(",") + 1:
            raise ValueError(f"{name} must be {form}, got {shape_str(t)}")
    return _check_inputs(x[None], dt[None], B[None], C[None], True)


def check_prefill_varlen(x, dt, A, B, C, D, cu_seqlens, chunk_size, initial_state, state_pool, slots, fresh,
                         check):
    """The argument checks of :func:`chunked_prefill_varlen` (its kernel twin runs the same):
    returns ``(Nt, H, d, G, n, N, slots, fresh, check)``."""
    _, Nt, H, d, G, n = _check_varlen_inputs(x, dt, B, C)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check = want_check(check, x)
    _check_params(A, D, dt, H, x.device, check)
    N = check_cu_seqlens(cu_seqlens, Nt, x.device, check)
    sl, fr = check_state_source(initial_state, state_pool, slots, fresh, N, (H, d, n), x.device, check)
    return Nt, H, d, G, n, N, sl, fr, check


def chunked_prefill_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                           *, cu_seqlens: Tensor, initial_state: Tensor | None = None, chunk_size: int = 64,
                           state_pool: Tensor | None = None, slots: Tensor | None = None,
                           fresh: Tensor | None = None, check: bool | None = None):
    """:func:`chunked_prefill` over a packed batch of ``N`` variable-length sequences.

    x ``[Nt,H,d]``, dt ``[Nt,H]`` (Δ after softplus/bias/clamp), A ``[H]``, B/C ``[Nt,G,n]``,
    D ``[H]`` or None; sequence ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` (may be
    empty).  Each sequence is scanned on its own (chunks restart at its first token) from
    ``initial_state[i]`` (zeros if None), or, in pool form (:mod:`replayssm.ops.varlen`),
    from zeros if ``fresh[i]`` else ``state_pool[slots[i]]``, its final state written back
    to ``state_pool[slots[i]]``.  Math in fp64 if x, dt or the state source is fp64, else fp32.

    Returns ``(y [Nt,H,d] in x.dtype incl. D·x, final_state [N,H,d,n])``; in pool form
    ``(y, None)`` (the final states are in the pool).
    """
    Nt, H, d, G, n, N, sl, fr, check = check_prefill_varlen(x, dt, A, B, C, D, cu_seqlens, chunk_size,
                                                            initial_state, state_pool, slots, fresh, check)
    shape = (H, d, n)
    src = state_pool if state_pool is not None else initial_state
    cdt = compute_dtype(x.dtype, dt.dtype, *(() if src is None else (src.dtype,)))
    S0 = gather_initial(initial_state, state_pool, sl, fr, N, shape, cdt, x.device)
    ys, finals = [], []
    for i, (s, e) in enumerate(seq_bounds(cu_seqlens)):
        y_i, S_i = chunked_prefill(x[None, s:e], dt[None, s:e], A, B[None, s:e], C[None, s:e], D,
                                   initial_state=S0[i:i + 1], chunk_size=chunk_size, check=False)
        ys.append(y_i[0])
        finals.append(S_i[0])
    y = torch.cat(ys, 0) if ys else x.new_zeros(x.shape)
    final = torch.stack(finals, 0) if finals else S0
    if state_pool is None:
        return y, final
    if N:
        state_pool[sl] = final.to(state_pool.dtype)
    return y, None
