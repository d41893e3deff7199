"""On-device sampling, speculative acceptance and the n-gram drafter of the JAX backend.

Everything is array math with static shapes: per-row parameters (temperature, top-k,
top-p) are arrays; randomness comes from one ``jax.random`` key per row (``[B, 2]``),
carried by the generation loop and split per row, so a row's draws depend on its own key
alone (a seeded request gives the same tokens in any batch).  Greedy rows (``temperature == 0``) get a one-hot distribution, which reduces
speculative sampling to "accept while the draft equals the argmax".  The math is that of
:mod:`replayssm.engine.sampler` (inverse-CDF sampling; lossless speculative sampling along a
chain, point-mass proposals for deterministic drafts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["split_rows", "uniform_rows", "transform", "sample_from", "sample", "constrain", "penalize",
           "token_logprobs", "accept_greedy", "accept_chain", "ngram_propose"]


def split_rows(keys, num: int = 2):
    """``jax.random.split`` of every row's key: ``num`` arrays of keys ``[B, 2]``."""
    parts = jax.vmap(lambda k: jax.random.split(k, num))(keys)          # [B, num, 2]
    return tuple(parts[:, i] for i in range(num))


def uniform_rows(keys, shape=(), dtype=jnp.float32):
    """Uniforms ``[B, *shape]``, row ``b`` drawn from ``keys[b]``."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape, dtype=dtype))(keys)


def transform(logits, temp, top_k, top_p, use_top_k: bool, use_top_p: bool, min_p=None, use_min_p: bool = False):
    """Temperature, top-k, top-p, min-p -> probabilities ``[B, (N,) V]`` (float32 at least);
    rows with ``temp == 0`` become one-hot at the argmax.  min-p keeps the tokens with at least
    ``min_p`` times the largest probability (after top-k and top-p) and renormalises.
    ``use_*`` are static (decided on the host from the batch's parameters)."""
    squeeze = logits.ndim == 2
    x = logits[:, None] if squeeze else logits
    dt = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(dt)
    B, N, V = x.shape
    t = jnp.where(temp > 0, temp, 1.0).astype(dt)[:, None, None]
    x = x / t
    if use_top_k:
        k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
        desc = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(desc, jnp.broadcast_to((k - 1)[:, None, None], (B, N, 1)), axis=-1)
        x = jnp.where(x < kth, -jnp.inf, x)
    p = jax.nn.softmax(x, axis=-1)
    if use_top_p:
        si = jnp.argsort(-p, axis=-1)
        sp = jnp.take_along_axis(p, si, axis=-1)
        drop = (jnp.cumsum(sp, -1) - sp) > top_p.astype(dt)[:, None, None]
        sp = jnp.where(drop, 0.0, sp)
        p = jnp.take_along_axis(sp, jnp.argsort(si, axis=-1), axis=-1)
        p = p / p.sum(-1, keepdims=True)
    if use_min_p:
        floor = min_p.astype(dt)[:, None, None] * jnp.max(p, -1, keepdims=True)
        p = jnp.where(p < floor, 0.0, p)
        p = p / p.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(jnp.argmax(logits.reshape(B, N, V), -1), V, dtype=dt)
    p = jnp.where((temp == 0)[:, None, None], onehot, p)
    return p[:, 0] if squeeze else p


def sample_from(p, u):
    """Inverse-CDF sample from ``p [B, V]`` (rows need not be normalised) with ``u [B]``."""
    cdf = jnp.cumsum(p, -1)
    x = (u.astype(cdf.dtype) * cdf[:, -1])[:, None]
    idx = jnp.sum(cdf <= x, -1)
    last_pos = jnp.argmax(jnp.cumsum((p > 0).astype(jnp.int32), -1), -1)  # never a zero-prob token
    return jnp.minimum(idx, last_pos).astype(jnp.int32)


def sample(logits, rowp: dict, keys, greedy: bool, use_top_k: bool, use_top_p: bool, use_min_p: bool = False):
    """One token per row from ``logits [B, V]`` (row ``b`` draws with ``keys[b]``); returns
    ``(tokens [B], probs or None)``."""
    if greedy:
        return jnp.argmax(logits, -1).astype(jnp.int32), None
    p = transform(logits, rowp["temperature"], rowp["top_k"], rowp["top_p"], use_top_k, use_top_p,
                  rowp.get("min_p"), use_min_p)
    return sample_from(p, uniform_rows(keys, (), p.dtype)), p


def constrain(logits, rowp: dict, n, eos, use_bias: bool, use_min_tokens: bool):
    """Constraints on ``logits [B, N, V]`` before any penalty (as the engine): ``logit_bias``
    added (``rowp["bias"] [B, V]``), and EOS / stop ids masked at the positions whose token
    would be output number ``n + j < min_tokens`` (``n [B]`` tokens generated so far)."""
    x = logits
    if use_bias:
        x = x + rowp["bias"].astype(x.dtype)[:, None, :]
    if use_min_tokens:
        B, N, V = x.shape
        early = (n[:, None] + jnp.arange(N)[None, :]) < rowp["min_tokens"][:, None]          # [B, N]
        v = jnp.arange(V)
        banned = jnp.any(v[None, :, None] == rowp["stop_ids"][:, None, :], -1)                # [B, V]
        banned = banned | (jnp.any(v[:, None] == eos[None, :], -1)[None, :] & ~rowp["ignore_eos"][:, None])
        x = jnp.where(early[:, :, None] & banned[:, None, :], -jnp.inf, x)
    return x


def penalize(logits, counts, seen, rowp: dict, tokens=None, valid=None):
    """Repetition, frequency and presence penalties on ``logits [B, N, V]`` (the engine's
    :func:`replayssm.engine.sampler.apply_penalties`): ``x' = (seen ? (x > 0 ? x / r : x r) :
    x) − f·count − p·(count > 0)``, ``count [B, V]`` the row's output tokens, ``seen [B, V]``
    its prompt and output tokens.  In a chain verify (``tokens/valid [B, N]``) position ``i``
    also counts the drafts at positions ``1 .. i`` (the path before the token it predicts)."""
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    B, N, V = x.shape
    cnt = jnp.broadcast_to(counts[:, None, :].astype(x.dtype), (B, N, V))
    if tokens is not None and N > 1:
        j = jnp.arange(N)
        w = ((j[None, :] <= j[:, None]) & (j[None, :] >= 1))[None] & valid[:, None, :]       # [B, i, j]
        onehot = jax.nn.one_hot(tokens, V, dtype=x.dtype)                                     # [B, j, V]
        cnt = cnt + jnp.einsum("bij,bjv->biv", w.astype(x.dtype), onehot)
    seen_ = seen[:, None, :] | (cnt > 0)
    r = rowp["repetition"].astype(x.dtype)[:, None, None]
    x = jnp.where(seen_, jnp.where(x > 0, x / r, x * r), x)
    f = rowp["frequency"].astype(x.dtype)[:, None, None]
    pr = rowp["presence"].astype(x.dtype)[:, None, None]
    return x - f * cnt - pr * (cnt > 0).astype(x.dtype)


def token_logprobs(logits, tokens, k: int):
    """Log-probabilities under the raw model distribution (log-softmax of the logits, before
    constraints, penalties and temperature) of ``tokens [B, N]`` given ``logits [B, N, V]``,
    and the ``k`` most likely tokens: ``(chosen [B, N], values [B, N, k], ids [B, N, k])``."""
    lp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), -1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0]
    if k <= 0:
        return chosen, lp[..., :0], jnp.zeros(lp.shape[:-1] + (0,), jnp.int32)
    vals, ids = jax.lax.top_k(lp, k)
    return chosen, vals, ids.astype(jnp.int32)


def accept_greedy(logits, tokens, valid):
    """Greedy acceptance along a chain: ``logits [B, T, V]`` after each node (node 0 = the
    last accepted token), ``tokens/valid [B, T]``.  Returns ``(accepted [B], bonus [B])``:
    nodes on the accepted path (root included) and the argmax after the last of them."""
    g = jnp.argmax(logits, -1).astype(jnp.int32)                    # [B, T]
    ok = valid[:, 1:] & (tokens[:, 1:] == g[:, :-1])
    accepted = 1 + jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    bonus = jnp.take_along_axis(g, (accepted - 1)[:, None], axis=1)[:, 0]
    return accepted.astype(jnp.int32), bonus


def accept_chain(p, tokens, valid, q, u):
    """Lossless speculative sampling along a chain (as :func:`replayssm.engine.sampler.accept_tree`
    with ``parent[i] = i - 1``).  ``p [B, T, V]`` target distributions after each node,
    ``q [B, T, V]`` draft distributions node ``i >= 1`` was drawn from (``None``: point masses),
    ``u [B, T + 1]`` uniforms.  Returns ``(accepted [B], bonus [B])``."""
    B, T, V = p.shape
    res = p[:, 0]
    cur = jnp.zeros((B,), jnp.int32)
    depth = jnp.ones((B,), jnp.int32)
    tiny = jnp.finfo(res.dtype).tiny
    for i in range(1, T):
        x = tokens[:, i]
        live = valid[:, i] & (cur == i - 1)
        px = jnp.take_along_axis(res, x[:, None], 1)[:, 0]
        qi = jax.nn.one_hot(x, V, dtype=res.dtype) if q is None else q[:, i].astype(res.dtype)
        qx = jnp.take_along_axis(qi, x[:, None], 1)[:, 0]
        ratio = jnp.where(qx > 0, px / jnp.maximum(qx, tiny), 0.0)
        acc = live & (u[:, i].astype(ratio.dtype) < ratio)
        rej = live & ~acc
        r = jnp.maximum(res - qi, 0.0)
        rs = r.sum(-1, keepdims=True)
        r = jnp.where(rs > 0, r / jnp.maximum(rs, tiny), res)
        res = jnp.where(rej[:, None], r, res)
        res = jnp.where(acc[:, None], p[:, i], res)
        cur = jnp.where(acc, i, cur)
        depth = depth + acc.astype(jnp.int32)
    return depth, sample_from(res, u[:, T])


def ngram_propose(hist, hlen, k: int, n_min: int, n_max: int, limit):
    """Prompt lookup on the device.  ``hist [B, S]`` holds each row's tokens (prompt then
    output), ``hlen [B]`` how many.  For ``n = n_max .. n_min`` (longest first) find the most
    recent earlier occurrence of the row's last ``n`` tokens (start ``s`` with ``s + n <
    hlen``) and propose the up to ``k`` tokens that followed it, at most ``limit [B]`` of
    them.  Returns ``drafts [B, k]`` and ``valid [B, k]`` (a prefix of each row)."""
    B, S = hist.shape
    s = jnp.arange(S)
    best = jnp.full((B,), -1, jnp.int32)
    best_n = jnp.zeros((B,), jnp.int32)
    found = jnp.zeros((B,), bool)
    for n in range(n_max, n_min - 1, -1):
        match = s[None, :] + n < hlen[:, None]
        for i in range(n):
            tail = jnp.take_along_axis(hist, jnp.maximum(hlen - n + i, 0)[:, None], 1)   # [B, 1]
            cand = jnp.concatenate([hist[:, i:], jnp.full((B, i), -1, hist.dtype)], 1) if i else hist
            match = match & (cand == tail)
        last = jnp.max(jnp.where(match, s[None, :], -1), 1).astype(jnp.int32)
        take = ~found & (hlen - 1 >= n) & (last >= 0)
        best = jnp.where(take, last, best)
        best_n = jnp.where(take, n, best_n)
        found = found | take
    pos = best[:, None] + best_n[:, None] + jnp.arange(k)[None, :]
    valid = found[:, None] & (pos < hlen[:, None]) & (jnp.arange(k)[None, :] < limit[:, None])
    drafts = jnp.take_along_axis(hist, jnp.clip(pos, 0, S - 1), 1)
    return jnp.where(valid, drafts, 0).astype(jnp.int32), valid
