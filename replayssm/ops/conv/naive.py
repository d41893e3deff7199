"""Reference ops of the short causal depthwise conv (Mamba-2 and GDN), over a rollback-able
window (:class:`replayssm.cache.conv.ConvWindow`).

Both layer types run a width-``W`` causal depthwise conv over their pre-conv inputs.
A slot keeps the ``W-1`` most recent *committed* inputs, ``window[P, C, W-1]`` (oldest
first, the HF ``conv_state`` layout minus its newest column).  Speculative steps convolve
``[window; x_new]`` without touching the window (:func:`conv_verify`, :func:`conv_tree`);
the commit then keeps the accepted inputs (:func:`conv_commit`, :func:`conv_commit_tree`)
with index arithmetic only (no host synchronisation).  A plain decode step is
``conv_verify`` + ``conv_commit`` with ``accepted = 1`` (:func:`conv_decode`).

Weights are ``[C, W]`` (HF ``conv1d.weight [C, 1, W]`` is accepted and squeezed):
``out[t, c] = bias[c] + Σ_k weight[c, k] · xpad[t + k, c]`` where ``xpad`` is the input
preceded by the ``W-1`` window entries (zeros for a fresh prefill), i.e.
``F.conv1d(x, weight[:, None], bias, padding=W-1, groups=C)[..., :T]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...cache.conv import ConvWindow, check_slot as _check_slot
from ...cache.tree import check_parents, check_path
from ...runtime import compute_dtype, want_check
from ..varlen import check_cu_seqlens, check_slots, seq_bounds

__all__ = ["conv_prefill", "conv_decode", "conv_verify", "conv_commit", "conv_tree", "conv_commit_tree",
           "conv_prefill_varlen", "conv_window_out"]

_ACTIVATIONS = (None, "silu", "swish")


# ---------------------------------------------------------------------------- checks
def _check_weight(weight: Tensor, bias: Tensor | None, C: int, W: int | None = None) -> Tensor:
    if not isinstance(weight, Tensor):
        raise ValueError("conv weight must be a tensor [C, W]")
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"conv weight has shape {tuple(weight.shape)}, expected [{C}, W]")
    if W is not None and weight.shape[1] != W:
        raise ValueError(f"conv weight has width {weight.shape[1]}, the window has width {W}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (C,)):
        raise ValueError(f"conv bias must have shape [{C}], got {tuple(getattr(bias, 'shape', ()))}")
    return weight


def _check_activation(activation) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")


def _check_x(x: Tensor, C: int, name: str = "x") -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[2] != C:
        raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}, expected [Bt, T, {C}]")
    if x.shape[1] < 1:
        raise ValueError(f"{name} needs at least one token")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {x.dtype}")


def _check_counts(counts: Tensor, batch: int, hi: int, name: str, check: bool) -> Tensor:
    if not isinstance(counts, Tensor) or tuple(counts.shape) != (batch,):
        raise ValueError(f"{name} must be a tensor of shape [{batch}]")
    if counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an integer tensor, got {counts.dtype}")
    if check and counts.numel():
        lo_v, hi_v = int(counts.min()), int(counts.max())
        if lo_v < 0 or hi_v > hi:
            raise ValueError(f"{name} must be in [0, {hi}], got [{lo_v}, {hi_v}]")
    return counts.long()


def _act(y: Tensor, activation) -> Tensor:
    return F.silu(y) if activation in ("silu", "swish") else y


# ---------------------------------------------------------------------------- forms
def _conv_over(xp: Tensor, weight: Tensor, bias: Tensor | None, activation) -> Tensor:
    """``xp [Bt, C, W-1+T]`` (window then inputs) -> ``[Bt, T, C]`` (compute dtype of xp)."""
    W = weight.shape[1]
    T = xp.shape[2] - (W - 1)
    w = weight.to(xp.dtype)
    # shift-and-add over the W taps (same sums as conv1d; no per-call conv setup cost)
    y = xp[:, :, W - 1:] * w[None, :, W - 1, None]
    for k in range(W - 1):
        y = y + xp[:, :, k:k + T] * w[None, :, k, None]
    if bias is not None:
        y = y + bias.to(xp.dtype)[None, :, None]
    return _act(y, activation).transpose(1, 2)


def _last_window(xp: Tensor, count: Tensor, Wm1: int) -> Tensor:
    """Last ``W-1`` of ``xp[:, :, :W-1+count]`` per row: ``xp [Bt, C, W-1+T]``, ``count [Bt]``."""
    idx = count[:, None] + torch.arange(Wm1, device=xp.device)[None, :]  # [Bt, W-1]
    return xp.gather(2, idx[:, None, :].expand(-1, xp.shape[1], -1))


def conv_prefill(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                 window_init: Tensor | None = None, activation: str | None = None,
                 lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv of ``x [Bt, T, C]`` from ``window_init [Bt, C, W-1]`` (zeros if None).

    Returns ``(out [Bt, T, C] in x.dtype, final_window [Bt, C, W-1])``.  With
    ``lengths [Bt]`` (right-padded rows) the final window is taken after ``lengths[b]``
    tokens instead of ``T``.
    """
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must be [Bt, T, C], got {tuple(getattr(x, 'shape', ()))}")
    Bt, T, C = x.shape
    _check_x(x, C)
    _check_activation(activation)
    weight = _check_weight(weight, bias, C)
    W = weight.shape[1]
    cdt = compute_dtype(x, weight, window_init)
    if window_init is None:
        win = torch.zeros(Bt, C, W - 1, dtype=cdt, device=x.device)
    else:
        if tuple(window_init.shape) != (Bt, C, W - 1):
            raise ValueError(f"window_init has shape {tuple(window_init.shape)}, "
                             f"expected {(Bt, C, W - 1)}")
        win = window_init.to(cdt)
    xp = torch.cat([win, x.to(cdt).transpose(1, 2)], dim=2)
    out = _conv_over(xp, weight, bias, activation).to(x.dtype)
    if lengths is None:
        final = xp[:, :, T:]
    else:
        lengths = _check_counts(lengths, Bt, T, "lengths", want_check(None, lengths))
        final = _last_window(xp, lengths, W - 1)
    return out, final.to(x.dtype if window_init is None else window_init.dtype)


def conv_window_out(pre: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
                    valid: Tensor | None = None) -> Tensor:
    """The causal conv's output at the last of each row's ``W`` inputs:
    ``y_r = act(Σ_k w[:, k] · pre[r, k, :] + b)`` for ``pre [R, W, C]`` (``valid [R, W]``: inputs
    where False read as zeros) -> ``[R, C]`` in ``pre.dtype``.

    The same products summed in the same order as :func:`conv_prefill`'s last position (last
    tap first, then taps ``0 .. W-2``), so equal to ``conv_prefill(pre)[0][:, -1]`` bit for bit,
    without computing the other ``W - 1`` outputs (prefix-store rebuilds of ``x, B``).
    """
    if not isinstance(pre, Tensor) or pre.dim() != 3:
        raise ValueError(f"pre must be [R, W, C], got {tuple(getattr(pre, 'shape', ()))}")
    R, W, C = pre.shape
    _check_x(pre, C, "pre")
    _check_activation(activation)
    weight = _check_weight(weight, bias, C, W)
    if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                              or tuple(valid.shape) != (R, W)):
        raise ValueError(f"valid must be a bool tensor of shape [{R}, {W}]")
    cdt = compute_dtype(pre, weight)
    w = weight.to(cdt)
    zero = torch.zeros((), dtype=cdt, device=pre.device)

    def tap(k):
        v = pre[:, k].to(cdt)
        return v if valid is None else torch.where(valid[:, k, None], v, zero)

    y = tap(W - 1) * w[None, :, W - 1]
    for k in range(W - 1):
        y = y + tap(k) * w[None, :, k]
    if bias is not None:
        y = y + bias.to(cdt)[None, :]
    return _act(y, activation).to(pre.dtype)


def _check_step(win: ConvWindow, slot, x_new, weight, bias, activation, check):
    _check_x(x_new, win.channels, "x_new")
    _check_activation(activation)
    weight = _check_weight(weight, bias, win.channels, win.width)
    check = want_check(check, x_new)
    slot = _check_slot(win, slot, check, x_new.shape[0])
    return slot, weight, check


def conv_verify(win: ConvWindow, slot: Tensor, x_new: Tensor, weight: Tensor,
                bias: Tensor | None = None, activation: str | None = None,
                check: bool | None = None) -> Tensor:
    """Conv of ``x_new [Bt, T, C]`` after each row's committed window; window untouched.

    Returns ``out [Bt, T, C]`` (x_new's dtype).
    """
    slot, weight, _ = _check_step(win, slot, x_new, weight, bias, activation, check)
    cdt = compute_dtype(x_new, weight, win.window)
    xp = torch.cat([win.window[slot].to(cdt), x_new.to(cdt).transpose(1, 2)], dim=2)
    return _conv_over(xp, weight, bias, activation).to(x_new.dtype)


def conv_commit(win: ConvWindow, slot: Tensor, x_new: Tensor, accepted: Tensor,
                check: bool | None = None) -> None:
    """Window becomes the last ``W-1`` of ``[window; x_new[:accepted]]`` per row.

    ``x_new [Bt, T, C]``, ``accepted [Bt]`` in ``[0, T]`` (host-checked for CPU tensors).
    """
    _check_x(x_new, win.channels, "x_new")
    check = want_check(check, x_new)
    Bt, T, _ = x_new.shape
    slot = _check_slot(win, slot, check, Bt)
    accepted = _check_counts(accepted, Bt, T, "accepted", check)
    if win.width == 1:
        return
    xp = torch.cat([win.window[slot], x_new.to(win.window.dtype).transpose(1, 2)], dim=2)
    win.window[slot] = _last_window(xp, accepted, win.width - 1)


def conv_decode(win: ConvWindow, slot: Tensor, x: Tensor, weight: Tensor,
                bias: Tensor | None = None, activation: str | None = None,
                check: bool | None = None) -> Tensor:
    """One always-accepted token ``x [Bt, C]``: returns ``out [Bt, C]`` and advances the window."""
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x must be [Bt, C], got {tuple(getattr(x, 'shape', ()))}")
    out = conv_verify(win, slot, x[:, None], weight, bias, activation, check)
    ones = torch.ones(x.shape[0], dtype=torch.long, device=x.device)
    conv_commit(win, slot, x[:, None], ones, check=False)
    return out[:, 0]


def _tree_lag_index(parent: Tensor, W: int) -> Tensor:
    """``idx [Bt, N, W]``: index into ``[window (W-1); nodes (N)]`` of each node's lag-k input.

    Lag 0 is the node itself, lag k its k-th ancestor, continuing into the committed window
    (newest window entry first) once the root is passed.
    """
    Bt, N = parent.shape
    Wm1 = W - 1
    cur = (Wm1 + torch.arange(N, device=parent.device)).expand(Bt, N)
    lags = [cur]
    for _ in range(Wm1):
        node = (cur - Wm1).clamp(min=0)
        up = Wm1 + parent.gather(1, node)  # parent -1 -> W-2, the newest window entry
        cur = torch.where(cur >= Wm1, up, cur - 1)
        lags.append(cur)
    return torch.stack(lags, dim=2)


def conv_tree(win: ConvWindow, slot: Tensor, x_new: Tensor, parent: Tensor, weight: Tensor,
              bias: Tensor | None = None, activation: str | None = None,
              check: bool | None = None) -> Tensor:
    """Conv over a draft tree: node ``i`` sees its ancestors' inputs, then the window.

    ``x_new [Bt, N, C]``, ``parent [Bt, N]`` or ``[N]`` (topological, -1 = child of the last
    committed entry).  Returns ``out [Bt, N, C]``; the window is untouched.
    """
    slot, weight, check = _check_step(win, slot, x_new, weight, bias, activation, check)
    Bt, N, C = x_new.shape
    if check:
        parent = check_parents(parent, Bt)
    else:
        parent = (parent if parent.dim() == 2 else parent[None].expand(Bt, -1)).long()
    if tuple(parent.shape) != (Bt, N):
        raise ValueError(f"parent has {parent.shape[-1]} nodes, x_new has {N}")
    W = win.width
    cdt = compute_dtype(x_new, weight, win.window)
    xcat = torch.cat([win.window[slot].to(cdt).transpose(1, 2), x_new.to(cdt)], dim=1)
    idx = _tree_lag_index(parent, W)  # [Bt, N, W], lag order
    g = xcat.gather(1, idx.reshape(Bt, N * W, 1).expand(-1, -1, C)).reshape(Bt, N, W, C)
    w_lag = weight.to(cdt).flip(1).transpose(0, 1)  # [W, C]; lag k <-> weight[:, W-1-k]
    y = (g * w_lag).sum(2)
    if bias is not None:
        y = y + bias.to(cdt)
    return _act(y, activation).to(x_new.dtype)


def conv_commit_tree(win: ConvWindow, slot: Tensor, x_new: Tensor, path: Tensor,
                     accepted: Tensor, parent: Tensor | None = None,
                     check: bool | None = None) -> None:
    """Window becomes the last ``W-1`` of ``[window; x_new[path[:accepted]]]`` per row.

    ``path [Bt, N]`` root-down node indices (e.g. :func:`replayssm.cache.tree.path_to`),
    ``accepted [Bt]`` in ``[0, N]``.  With ``parent`` and ``check``, the path is also
    verified to be a chain of the tree.
    """
    _check_x(x_new, win.channels, "x_new")
    check = want_check(check, x_new)
    Bt, N, C = x_new.shape
    if not isinstance(path, Tensor) or tuple(path.shape) != (Bt, N) or \
            path.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"path must be an integer tensor of shape {(Bt, N)}")
    slot = _check_slot(win, slot, check, Bt)
    accepted = _check_counts(accepted, Bt, N, "accepted", check)
    if check:
        if bool(((path < 0) | (path >= N)).any()):
            raise ValueError(f"path node ids must be in [0, {N})")
        if parent is not None:
            check_path(parent, path, accepted)
    xs = x_new.gather(1, path.long().clamp(0, N - 1)[:, :, None].expand(-1, -1, C))
    conv_commit(win, slot, xs, accepted, check=False)


def check_varlen_args(x, weight, bias, cu_seqlens, window_pool, activation, check):
    """The argument checks :func:`conv_prefill_varlen` and its kernel twin share: returns
    ``(pool [P, C, W-1], Nt, C, W, weight, N, check)``."""
    pool = window_pool.window if isinstance(window_pool, ConvWindow) else window_pool
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor [Nt, C], got {tuple(getattr(x, 'shape', ()))}")
    Nt, C = x.shape
    _check_activation(activation)
    if not isinstance(pool, Tensor) or pool.dim() != 3 or pool.shape[1] != C:
        raise ValueError(f"window_pool must be [P, {C}, W-1], got {tuple(getattr(pool, 'shape', ()))}")
    W = pool.shape[2] + 1
    weight = _check_weight(weight, bias, C, W)
    check = want_check(check, x)
    N = check_cu_seqlens(cu_seqlens, Nt, x.device, check)
    return pool, Nt, C, W, weight, N, check


def conv_prefill_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor,
                        window_pool, slots: Tensor, fresh: Tensor | None = None,
                        activation: str | None = None, check: bool | None = None) -> Tensor:
    """Causal depthwise conv of a packed batch ``x [Nt, C]`` of ``N`` sequences, in place on
    the window pool.

    Sequence ``i`` (tokens ``cu_seqlens[i]:cu_seqlens[i+1]``, may be empty) is convolved
    after its starting window: zeros if ``fresh[i]``, else ``window_pool[slots[i]]`` (fresh
    rows are never read).  Afterwards ``window_pool[slots[i]]`` holds the last ``W-1`` of
    ``[start window; x_i]`` (old entries kept when the sequence is shorter than ``W-1``).
    ``window_pool`` is ``[P, C, W-1]`` (a tensor or a :class:`ConvWindow`); ``fresh`` defaults
    to all False.  Returns ``out [Nt, C]`` in x's dtype.
    """
    pool, Nt, C, W, weight, N, check = check_varlen_args(x, weight, bias, cu_seqlens, window_pool, activation, check)
    if not pool.is_floating_point() or pool.device != x.device:
        raise ValueError(f"window_pool must be floating point on {x.device}, got {pool.dtype} on {pool.device}")
    sl, fr = check_slots(pool, slots, fresh, N, x.device, check)
    cdt = compute_dtype(x, weight, pool)
    out = torch.empty(Nt, C, dtype=x.dtype, device=x.device)
    finals = []
    for i, (s, e) in enumerate(seq_bounds(cu_seqlens)):
        if fr is not None and bool(fr[i]):
            init = torch.zeros(C, W - 1, dtype=cdt, device=x.device)
        else:
            init = pool[sl[i]].to(cdt)
        if e > s:
            y, fin = conv_prefill(x[None, s:e].to(cdt), weight, bias, init[None], activation)
            out[s:e] = y[0].to(x.dtype)
            finals.append(fin[0])
        else:
            finals.append(init)
    if N and W > 1:
        pool[sl] = torch.stack(finals, 0).to(pool.dtype)
    return out

