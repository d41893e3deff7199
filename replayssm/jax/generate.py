"""``JaxLLM``: generation with the whole decode phase compiled as one ``lax.while_loop``.

A ``generate`` call runs the batch of prompts in two compiled programs:

1. *start* (``jax.jit``): chunked prefill of the right-padded prompts (target and draft
   model), sampling of each row's first token, and the loop state (the carry);
2. *loop* (``jax.jit`` of one ``lax.while_loop``): each iteration is one decode step
   (replay or recurrent form) or one speculative step — propose ``k`` drafts (n-gram lookup
   over the row's tokens, or ``k + 1`` draft-model steps), verify the chain in one target
   call, accept (greedy or lossless speculative sampling), commit ring pointers / conv
   windows / states, append the tokens, update stop flags.  It runs until every row has
   stopped (EOS, stop ids, ``max_tokens``) or a step limit given as data, so streaming is
   the same compiled loop called with ``limit = step + chunk``.

Nothing in the loop syncs with the host (``tests/jax`` checks its jaxpr for callbacks):
per-row decisions (fill levels, flushes, accepted counts, finished rows) are arrays.
Finished rows keep running (static shapes) but commit nothing.

Sampling takes the engine's parameters: temperature, top-k, top-p, min-p, the repetition /
frequency / presence penalties (per-row token counts carried by the loop; a verify step adds
the chain's drafts), ``logit_bias``, ``min_tokens``, stop ids, logprobs (written beside the
tokens), ``n`` samples (``n`` rows) and stop strings (checked on the host between chunks of
loop iterations).  ``structured_outputs`` and ``bad_words`` are refused by name.

Differences from the PyTorch engine: one static batch per call (no continuous batching), the
``recurrent``, ``replay``, ``kv`` and ``auto`` forms (``kv`` / ``auto`` keep a static entry buffer of
``max_seq_len`` per row), chain speculation only (n-gram or
draft model; the draft runs the recurrent form and keeps one state snapshot per drafted
token so that its rollback is a selection; penalties, ``logit_bias`` and ``min_tokens`` with
n-gram drafts only), and its own PRNG (sampled outputs follow the same distributions, not
the same draws).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..engine.config import SpeculativeConfig, sampling_params_list
from ..engine.inputs import encode_prompt, prompt_list
from ..engine.llm import RequestOutput
from ..models import load_tokenizer
from . import model as M
from .compiler import compiler_options as _compiler_options
from .params import MixerSpec, ModelSpec, load_params
from .shard import constrain_cache, fold_norms, make_mesh, shard_params
from .sampling import (accept_chain, accept_greedy, constrain, ngram_propose, penalize, sample, split_rows,
                       token_logprobs, transform, uniform_rows)

__all__ = ["JaxLLM", "GenerateConfig", "LAYER_LOOPS"]

#: how the decode loop runs a stage's layers (:class:`JaxLLM` ``layer_loop``)
LAYER_LOOPS = ("scan", "group", "unroll")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class GenerateConfig:
    """Static settings of one compiled generation program (the jit cache key)."""

    batch: int
    prompt_len: int          # padded prompt length
    max_seq_len: int         # cache rows per sequence (attention)
    max_out: int             # output buffer per row
    mode: str                # "recurrent" | "replay"
    buffer_size: int
    spec_method: str | None  # None | "ngram" | "draft"
    num_tokens: int          # drafts per step (k)
    greedy: bool
    use_top_k: bool
    use_top_p: bool
    n_min: int = 1
    n_max: int = 3
    num_stop: int = 1
    use_min_p: bool = False
    use_penalties: bool = False
    use_bias: bool = False       # logit_bias
    use_min_tokens: bool = False
    logprobs: int = -1           # alternatives kept per token (-1: no logprobs)
    auto_threshold: int = 0      # mode "auto": cached tokens at which a row switches KV-only -> replay


def _ssm_part(cache: M.Cache):
    """The per-row recurrent part of a cache (states and conv windows of every stage)."""
    return [{k: v for k, v in c.items() if k == "state" or k.startswith("win_")} for c in cache.stages]


def _select_step(snaps, before, accepted):
    """Per row, the snapshot after node ``a - 1`` (``snaps`` stacked ``[k+1, Ly, B, ...]``),
    or the pre-step value when ``a == 0``."""
    def pick(s, b):
        idx = jnp.clip(accepted - 1, 0, s.shape[0] - 1)
        shaped = idx.reshape((1, 1, -1) + (1,) * (s.ndim - 3))
        got = jnp.take_along_axis(s, shaped, axis=0)[0]
        return jnp.where((accepted > 0).reshape((1, -1) + (1,) * (b.ndim - 2)), got, b)

    return jax.tree_util.tree_map(pick, snaps, before)


class _Program:
    """The two compiled functions (start, loop) for one :class:`GenerateConfig`."""

    def __init__(self, spec: ModelSpec, dspec: ModelSpec | None, cfg: GenerateConfig, mesh=None,
                 compiler_options: dict | None = None):
        self.spec, self.dspec, self.cfg, self.mesh = spec, dspec, cfg, mesh
        opts = compiler_options or None
        self.start = jax.jit(self._start, compiler_options=opts)
        # the carry is donated: the loop updates the caches in the caller's buffers (every backend)
        self.loop = jax.jit(self._loop, donate_argnums=(2,), compiler_options=opts)

    # -- token bookkeeping ------------------------------------------------------------------
    def _emit(self, c: dict, toks, count, rowp, lps=None):
        """Append ``toks[:, :count]`` to each active row, stopping at EOS / stop ids /
        ``max_tokens``; with them their logprobs ``lps = (chosen, values, ids)`` and the
        penalty statistics."""
        B, m = toks.shape
        j = jnp.arange(m)[None, :]
        eos = jnp.asarray(self.spec.eos_token_ids or (-1,), jnp.int32)
        is_eos = jnp.any(toks[:, :, None] == eos[None, None, :], -1) & ~rowp["ignore_eos"][:, None]
        is_stop = is_eos | jnp.any(toks[:, :, None] == rowp["stop_ids"][:, None, :], -1)
        before = (jnp.cumsum(is_stop.astype(jnp.int32), 1) - is_stop.astype(jnp.int32)) > 0
        room = rowp["max_tokens"] - c["n"]
        emit = (j < count[:, None]) & (j < room[:, None]) & ~c["done"][:, None] & ~before
        num = emit.sum(1).astype(jnp.int32)
        rows = jnp.arange(B)[:, None]
        out_pos = jnp.where(emit, c["n"][:, None] + j, c["out"].shape[1])
        out = c["out"].at[rows, out_pos].set(toks, mode="drop")
        stopped = c["stopped"] | jnp.any(emit & is_stop, 1)
        n = c["n"] + num
        new = {**c, "out": out, "n": n, "stopped": stopped, "done": c["done"] | stopped | (n >= rowp["max_tokens"])}
        if "counts" in c:
            V = c["counts"].shape[1]
            tpos = jnp.where(emit, toks, V)
            new["counts"] = c["counts"].at[rows, tpos].add(1, mode="drop")
            new["seen"] = c["seen"].at[rows, tpos].set(True, mode="drop")
        if lps is not None:
            for name, v in zip(("lp", "lp_v", "lp_i"), lps):
                new[name] = c[name].at[rows, out_pos].set(v, mode="drop")
        if "hist" in c:
            hpos = jnp.where(emit, c["hlen"][:, None] + j, c["hist"].shape[1])
            new["hist"] = c["hist"].at[rows, hpos].set(toks, mode="drop")
            new["hlen"] = c["hlen"] + num
        return new

    # -- start: prefill + first token -------------------------------------------------------
    def _start(self, params, dparams, ids, lengths, rowp, key):
        cfg, spec = self.cfg, self.spec
        B = cfg.batch
        cache = M.init_cache(spec, B, cfg.mode, cfg.buffer_size, cfg.max_seq_len, auto_threshold=cfg.auto_threshold)
        logits, cache = M.prefill(spec, params, cache, ids, lengths)
        if isinstance(params["stages"][0], list):   # unrolled layers: per-layer caches
            cache = M.split_cache(cache)
        key, sub = split_rows(key)
        z = jnp.zeros((B,), jnp.int32)
        c = {"cache": cache, "out": jnp.zeros((B, cfg.max_out), jnp.int32), "n": z,
             "done": jnp.zeros((B,), bool), "stopped": jnp.zeros((B,), bool), "key": key,
             "step": jnp.zeros((), jnp.int32), "steps": z, "acc_sum": z, "drafted": z}
        if cfg.use_penalties:   # output-token counts; seen = prompt and output tokens
            V = spec.vocab_size
            ppos = jnp.where(jnp.arange(ids.shape[1])[None, :] < lengths[:, None], ids, V)
            c["counts"] = jnp.zeros((B, V), jnp.int32)
            c["seen"] = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], ppos].set(True, mode="drop")
        if cfg.logprobs >= 0:
            K, ldt = cfg.logprobs, jnp.promote_types(logits.dtype, jnp.float32)
            c.update(lp=jnp.zeros((B, cfg.max_out), ldt), lp_v=jnp.zeros((B, cfg.max_out, K), ldt),
                     lp_i=jnp.zeros((B, cfg.max_out, K), jnp.int32))
        tok, _ = sample(self._process(logits[:, None], c, rowp)[:, 0], rowp, sub, cfg.greedy, cfg.use_top_k,
                        cfg.use_top_p, cfg.use_min_p)
        c["last"] = tok
        lps = self._logprobs(logits[:, None], tok[:, None])
        if cfg.spec_method == "ngram":
            S = cfg.max_seq_len
            hist = jnp.zeros((B, S), jnp.int32).at[:, :ids.shape[1]].set(ids.astype(jnp.int32))
            c["hist"], c["hlen"] = hist, lengths.astype(jnp.int32)
        if cfg.spec_method == "draft":
            dcache = M.init_cache(self.dspec, B, "recurrent", cfg.buffer_size, cfg.max_seq_len)
            _, c["dcache"] = M.prefill(self.dspec, dparams, dcache, ids, lengths)
        return self._constrain(self._emit(c, tok[:, None], jnp.ones((B,), jnp.int32), rowp, lps))

    def _process(self, logits, c: dict, rowp, tokens=None, valid=None):
        """The logits a step samples from ``[B, N, V]``: constraints (``logit_bias``,
        ``min_tokens``), then penalties; unchanged when the batch uses none."""
        cfg = self.cfg
        eos = jnp.asarray(self.spec.eos_token_ids or (-1,), jnp.int32)
        x = constrain(logits, rowp, c["n"], eos, cfg.use_bias, cfg.use_min_tokens)
        if cfg.use_penalties:
            x = penalize(x, c["counts"], c["seen"], rowp, tokens, valid)
        return x

    def _logprobs(self, logits, toks):
        """``(chosen, values, ids)`` of ``toks [B, N]`` under the raw ``logits [B, N, V]``, or None."""
        if self.cfg.logprobs < 0:
            return None
        return token_logprobs(logits, toks, self.cfg.logprobs)

    def _constrain(self, c: dict) -> dict:
        """Pin the carry's caches to their shardings (no-op on one device)."""
        if self.mesh is None:
            return c
        c = {**c, "cache": constrain_cache(self.spec, c["cache"], self.mesh)}
        if "dcache" in c:
            c["dcache"] = constrain_cache(self.dspec, c["dcache"], self.mesh)
        return c

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self, params, dparams, c, rowp, limit):
        """Steps until every row stopped or ``step == limit``.  Replay form: an inner loop runs
        steps compiled without checkpoint writes while no row flushes; then one step that
        scatters the flushing rows' checkpoints.  (No ``lax.cond``: XLA copies the arrays a
        branch passes through or updates, which here is the whole cache.)"""
        cfg = self.cfg

        def running(c):
            return jnp.any(~c["done"]) & (c["step"] < limit)

        def step(flush: bool):
            def body(c):
                c = self._spec_step(params, dparams, c, rowp, flush) if cfg.spec_method else \
                    self._decode_step(params, c, rowp, flush)
                return self._constrain({**c, "step": c["step"] + 1})
            return body

        if not M.uses_ring(cfg.mode):
            return lax.while_loop(running, step(True), c)
        T = cfg.num_tokens + 1 if cfg.spec_method else 1
        kind = "verify" if cfg.spec_method else "decode"

        def no_flush(c):
            return running(c) & ~jnp.any(M.flush_rows(c["cache"], kind, T))

        def outer(c):
            return step(True)(lax.while_loop(no_flush, step(False), c))

        return lax.while_loop(running, outer, c)

    def _decode_step(self, params, c, rowp, flush: bool = True):
        cfg = self.cfg
        active = ~c["done"]
        logits, cache = M.decode(self.spec, params, c["cache"], c["last"], active=active, flush=flush)
        key, sub = split_rows(c["key"])
        tok, _ = sample(self._process(logits[:, None], c, rowp)[:, 0], rowp, sub, cfg.greedy, cfg.use_top_k,
                        cfg.use_top_p, cfg.use_min_p)
        one = active.astype(jnp.int32)
        lps = self._logprobs(logits[:, None], tok[:, None])
        c = {**c, "cache": cache, "key": key, "last": jnp.where(active, tok, c["last"]),
             "steps": c["steps"] + one, "acc_sum": c["acc_sum"] + one}
        return self._emit(c, tok[:, None], jnp.ones_like(one), rowp, lps)

    def _draft_chain(self, dparams, c, rowp, key):
        """``k + 1`` draft-model steps on ``[last, d_1 .. d_k]`` (recurrent form), keeping the
        draft's per-row states after each step; returns drafts ``[B, k]``, their proposal
        distributions ``[B, k, V]`` (None when greedy) and the stacked snapshots."""
        cfg, dspec = self.cfg, self.dspec

        def body(carry, _):
            dc, tok, key = carry
            logits, dc = M.decode(dspec, dparams, dc, tok)
            key, sub = split_rows(key)
            nxt, q = sample(logits, rowp, sub, cfg.greedy, cfg.use_top_k, cfg.use_top_p, cfg.use_min_p)
            return (dc, nxt, key), (nxt, q, _ssm_part(dc))

        (dc, _, _), (toks, qs, snaps) = lax.scan(body, (c["dcache"], c["last"], key), None,
                                                 length=cfg.num_tokens + 1)
        drafts = jnp.swapaxes(toks[:cfg.num_tokens], 0, 1)
        q = None if qs is None else jnp.swapaxes(qs[:cfg.num_tokens], 0, 1)
        return drafts, q, dc, snaps

    def _spec_step(self, params, dparams, c, rowp, flush: bool = True):
        cfg, spec = self.cfg, self.spec
        B, k = cfg.batch, cfg.num_tokens
        active = ~c["done"]
        key, kd, ku = split_rows(c["key"], 3)
        q = None
        if cfg.spec_method == "ngram":
            limit = jnp.minimum(k, jnp.maximum(rowp["max_tokens"] - c["n"] - 1, 0))
            drafts, dvalid = ngram_propose(c["hist"], c["hlen"], k, cfg.n_min, cfg.n_max, limit)
        else:
            d0 = c["dcache"]
            drafts, qd, dc, snaps = self._draft_chain(dparams, c, rowp, kd)
            dvalid = jnp.ones((B, k), bool)
            if qd is not None:
                q = jnp.concatenate([jnp.zeros_like(qd[:, :1]), qd], 1)
        tokens = jnp.concatenate([c["last"][:, None], drafts], 1)          # [B, k + 1]
        valid = jnp.concatenate([jnp.ones((B, 1), bool), dvalid], 1)
        raw, cache, pend = M.verify(spec, params, c["cache"], tokens, flush=flush)
        logits = self._process(raw, c, rowp, tokens, valid)
        if cfg.greedy:
            a, bonus = accept_greedy(logits, tokens, valid)
        else:
            p = transform(logits, rowp["temperature"], rowp["top_k"], rowp["top_p"], cfg.use_top_k, cfg.use_top_p,
                          rowp["min_p"], cfg.use_min_p)
            u = uniform_rows(ku, (k + 2,), p.dtype)
            a, bonus = accept_chain(p, tokens, valid, q, u)
        a_commit = jnp.where(active, a, 0)
        cache = M.commit(spec, cache, pend, a_commit)
        c = {**c, "cache": cache, "key": key}
        if cfg.spec_method == "draft":
            stages = [{**dst, **sel} for dst, sel in
                      zip(dc.stages, _select_step(snaps, _ssm_part(d0), a_commit))]
            c["dcache"] = dc.replace(stages=stages, seq_len=d0.seq_len + a_commit)
        j = jnp.arange(k + 1)[None, :]
        padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
        toks = jnp.where(j < (a - 1)[:, None], padded, bonus[:, None])
        one = active.astype(jnp.int32)
        c = {**c, "last": jnp.where(active, bonus, c["last"]), "steps": c["steps"] + one,
             "acc_sum": c["acc_sum"] + one * a, "drafted": c["drafted"] + one * dvalid.sum(1).astype(jnp.int32)}
        return self._emit(c, toks, a, rowp, self._logprobs(raw, toks))


@dataclass
class _Row:
    prompt: str | None
    ids: list
    params: object
    index: int = 0          # sample index (SamplingParams.n > 1)
    group: int = 0          # the row of sample 0


#: context when ``max_seq_len`` is not given (the PyTorch engine's default)
DEFAULT_MAX_SEQ_LEN = 2048


def default_auto_threshold(spec: ModelSpec, buffer_size: int) -> int:
    """The PyTorch engine's default switch point: the context length past which a KV-only step
    reads more bytes than amortised replay (:func:`replayssm.forms.kv.kv_only_threshold`), from
    one row's state and per-token entry bytes."""
    from ..forms.kv import kv_only_threshold

    entry = M.entry_bytes(spec, "kv", 1, buffer_size, 1)
    if entry <= 0:
        return 1
    _, cdt = M._dtypes(spec)
    state = sum(cnt * (sb.mixer.H * sb.mixer.d * sb.mixer.n if sb.mixer.kind == "mamba"
                       else sb.mixer.HV * sb.mixer.K * sb.mixer.V)
                for sb, cnt in spec.stages if sb.mixer.kind in ("mamba", "gdn")) * jnp.dtype(cdt).itemsize
    return kv_only_threshold(state, entry, buffer_size)


def _memory_bytes() -> int:
    """Memory of the first device (its allocator's limit), else the host's physical memory."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:   # backends without memory statistics
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_entry_memory(spec: ModelSpec, mode: str, batch: int, buffer_size: int, max_seq_len: int) -> None:
    """Refuse a KV-only entry buffer (``max_seq_len`` tokens per row and SSM layer) larger than
    the device's memory, before anything is allocated or compiled."""
    need = M.entry_bytes(spec, mode, batch, buffer_size, max_seq_len)
    have = _memory_bytes()
    if need > have:
        raise ValueError(f"decode_mode={mode!r} keeps every token's entries: {batch} row(s) x max_seq_len "
                         f"{max_seq_len} need {need / 2**30:.1f} GiB of entry buffers, more than the "
                         f"{have / 2**30:.1f} GiB of device memory; lower max_seq_len or use decode_mode='replay'")


def _processed(sp) -> bool:
    """The request changes the logits before sampling (penalties, logit_bias, min_tokens)."""
    return (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0
            or bool(sp.logit_bias) or sp.min_tokens > 0)


def _check_supported(sp, speculative, tokenizer) -> None:
    """Refuse, by name, what the compiled loop does not do (rather than ignore it)."""
    if sp.structured_outputs is not None:
        raise ValueError("SamplingParams.structured_outputs is not supported by the JAX backend (a grammar "
                         "automaton advances on the host per token; use the PyTorch engine)")
    if sp.bad_words:
        raise ValueError("SamplingParams.bad_words is not supported by the JAX backend (use the PyTorch engine)")
    if speculative is not None and speculative.method == "draft" and _processed(sp):
        raise ValueError("penalties, logit_bias and min_tokens are not supported with draft-model speculation "
                         "by the JAX backend (use n-gram speculation or none)")
    if sp.stop and tokenizer is None:
        raise ValueError("SamplingParams.stop (text stops) needs a tokenizer; use stop_token_ids")


class JaxLLM:
    """Generate with the JAX backend (same checkpoints and settings as :class:`replayssm.LLM`).

    ``model``: an HF-layout directory (or a ``(ModelSpec, params)`` pair from
    :func:`replayssm.jax.params.load_params`).  ``decode_mode``: ``"replay"``,
    ``"recurrent"``, ``"kv"`` (KV-only: no state, every token's entries in a buffer of
    ``max_seq_len``, checked against the device's memory before any compile) or ``"auto"``
    (each row KV-only until ``auto_threshold`` tokens are cached, default
    :func:`default_auto_threshold`, then folded into a state and replay with a ring of
    ``buffer_size``, in the same buffer).  ``speculative``: ``None`` or a
    :class:`~replayssm.engine.config.SpeculativeConfig` with method ``"ngram"`` or
    ``"draft"`` (chains).  ``dtype="float64"`` needs ``jax_enable_x64``.  Each
    ``generate`` runs its prompts as one batch; compiled programs are cached per shape
    (batch, padded prompt length, output length, sampling flags).
    ``tensor_parallel_size=N`` shards heads, MLPs and experts over the first ``N`` devices
    with ``jax.sharding`` (:mod:`replayssm.jax.shard`; the compiler inserts the collectives).
    ``layer_loop``: ``"group"`` (the default, on one device and under tensor parallelism:
    a scan over groups of ``layer_group`` layers, each group unrolled,
    :func:`replayssm.jax.model.group_params`, each group's weight stacks split over the mesh
    on the stacked weights' axes; 0.55x / 0.58x the PyTorch
    engine at B=1 / 64 on an H100 against the scan's 0.42x, with compiles as short),
    ``"scan"`` (one ``lax.scan`` over each stage's stacked weights) or ``"unroll"``
    (per-layer weights and caches, :func:`replayssm.jax.model.unstack_params`: 0.74x at B=1 on
    an H100, but a compile per layer — ~100 s for the 2.7B's replay program — so it is not
    the default; JAX's persistent compilation cache makes later processes load it).  ``compiler_options``: XLA options over the backend's
    defaults (:mod:`replayssm.jax.compiler`; a ``None`` value drops a default).
    """

    def __init__(self, model, dtype: str = "float32", decode_mode: str = "replay", buffer_size: int = 16,
                 speculative=None, max_seq_len: int | None = None, chunk_size: int | None = None,
                 seed: int = 0, tokenizer=None, tensor_parallel_size: int = 1, layer_loop: str | None = None,
                 layer_group: int = 8, compiler_options: dict | None = None, auto_threshold: int | None = None):
        if layer_loop is None:   # the grouped loop, on one device and under tensor parallelism
            layer_loop = "group"
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
        M.group_size(1, layer_group)   # validates layer_group
        # cuBLAS without autotuning for the unrolled loops (their compile); the scan as measured
        self.compiler_options = _compiler_options(compiler_options, defaults=layer_loop != "scan")
        mesh = make_mesh(tensor_parallel_size)   # validates the size and the device count
        self.mesh = mesh if tensor_parallel_size > 1 else None
        if decode_mode not in M.MODES + (M.AUTO,):
            raise ValueError(f"decode_mode must be one of {M.MODES + (M.AUTO,)} for the JAX backend, "
                             f"got {decode_mode!r}")
        if auto_threshold is not None and (decode_mode != M.AUTO or isinstance(auto_threshold, bool)
                                           or not isinstance(auto_threshold, int) or auto_threshold < 1):
            raise ValueError(f"auto_threshold must be a positive int with decode_mode='auto', got "
                             f"{auto_threshold!r} with decode_mode={decode_mode!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig or None, got {speculative!r}")
            if speculative.method not in ("ngram", "draft"):
                raise ValueError(f"the JAX backend speculates with chains: method 'ngram' or 'draft', "
                                 f"not {speculative.method!r}")
            need = 2 * speculative.verify_tokens
            if M.uses_ring(decode_mode) and buffer_size < need:
                raise ValueError(f"buffer_size {buffer_size} < 2 * (draft tokens + 1) = {need}: the replay "
                                 f"buffer must hold two verify windows")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or max_seq_len < 1):
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if isinstance(model, tuple):
            self.spec, self.params = model
            path = None
        else:
            path = os.fspath(model)
            if not os.path.isdir(path):
                raise ValueError(f"model directory not found: {path!r}")
            self.spec, self.params = load_params(path, dtype)
        if chunk_size is not None:
            self.spec = _with_chunk(self.spec, chunk_size)
        self.decode_mode, self.buffer_size, self.speculative = decode_mode, buffer_size, speculative
        self.max_seq_len = max_seq_len
        self.auto_threshold = 0
        if decode_mode == M.AUTO:
            self.auto_threshold = auto_threshold or default_auto_threshold(self.spec, buffer_size)
        if max_seq_len is not None:   # KV-only: one row's entry buffer must fit at all
            _check_entry_memory(self.spec, decode_mode, 1, buffer_size, max_seq_len)
        self.key = jax.random.PRNGKey(seed)
        self.dspec = self.dparams = None
        if speculative is not None and speculative.method == "draft":
            dm = speculative.draft_model
            self.dspec, self.dparams = dm if isinstance(dm, tuple) else load_params(os.fspath(dm), self.spec.dtype)
            if chunk_size is not None:
                self.dspec = _with_chunk(self.dspec, chunk_size)
            if self.dspec.vocab_size != self.spec.vocab_size:
                raise ValueError(f"draft model vocab_size {self.dspec.vocab_size} != target vocab_size "
                                 f"{self.spec.vocab_size}")
        self.tokenizer = tokenizer
        if tokenizer is None and path is not None:
            self.tokenizer = load_tokenizer(path)
        if self.mesh is not None:   # heads / MLP / experts split over the mesh (replayssm.jax.shard)
            self.params = shard_params(self.spec, self.params, self.mesh)
            self.spec = fold_norms(self.spec)
            if self.dparams is not None:
                self.dparams = shard_params(self.dspec, self.dparams, self.mesh)
                self.dspec = fold_norms(self.dspec)
        self.layer_loop, self.layer_group = layer_loop, layer_group
        if layer_loop != "scan":   # per-layer or grouped weights (decode / verify unroll them)
            lay = M.unstack_params if layer_loop == "unroll" else (lambda p: M.group_params(p, layer_group))
            # under a mesh: sliced from the split stacks (no device holds a whole copy), then
            # placed by the layout's own specs (each stack split on the stacked leaves' axes)
            self.params = lay(self.params)
            if self.mesh is not None:
                self.params = shard_params(self.spec, self.params, self.mesh)
            if self.dparams is not None:
                self.dparams = lay(self.dparams)
                if self.mesh is not None:
                    self.dparams = shard_params(self.dspec, self.dparams, self.mesh)
        self._programs: dict = {}
        self.last_stats: dict = {}

    # -- requests -----------------------------------------------------------------------------

    def _rows(self, prompts, sampling_params):
        prompts = prompt_list(prompts)          # the PyTorch engine's reading of the argument
        if not prompts:
            raise ValueError("no prompts")
        params = sampling_params_list(sampling_params, len(prompts))
        rows = []
        limit = self.max_seq_len or DEFAULT_MAX_SEQ_LEN
        T = (self.speculative.num_tokens if self.speculative else 0) + 1
        for p, sp in zip(prompts, params):
            _check_supported(sp, self.speculative, self.tokenizer)
            # the PyTorch engine's checks: text, a tokenizer for it, ints, non-empty, in the vocabulary
            text, ids = encode_prompt(p, self.tokenizer, self.spec.vocab_size)
            room = limit - len(ids) - T    # as the PyTorch engine: generation stops at the context ("length")
            if room < 1:
                raise ValueError(f"a prompt of {len(ids)} tokens leaves no room in max_seq_len {limit}"
                                 f"{' (default)' if self.max_seq_len is None else ''}")
            if sp.max_tokens > room:
                sp = dataclasses.replace(sp, max_tokens=room)
            for i in range(sp.n):   # n samples: n rows (the prompt's prefill repeated)
                rows.append(_Row(text, ids, sp, i, len(rows) - i if i else len(rows)))
        return rows

    def _program(self, rows) -> tuple[_Program, GenerateConfig]:
        sp = self.speculative
        k = sp.num_tokens if sp else 0
        T = k + 1
        Tp = _round_up(max(len(r.ids) for r in rows), 16)
        max_out = _round_up(max(r.params.max_tokens for r in rows), 16)
        # rows: the padded sizes (lengths were checked against max_seq_len in _rows)
        S = max(self.max_seq_len or 0, _round_up(Tp + max_out + 2 * T + 16, 64))
        greedy = all(r.params.temperature == 0 for r in rows)
        cfg = GenerateConfig(
            batch=len(rows), prompt_len=Tp, max_seq_len=S, max_out=max_out, mode=self.decode_mode,
            buffer_size=self.buffer_size, spec_method=sp.method if sp else None, num_tokens=k, greedy=greedy,
            use_top_k=not greedy and any(r.params.top_k > 0 for r in rows),
            use_top_p=not greedy and any(r.params.top_p < 1 for r in rows),
            n_min=sp.prompt_lookup_min if sp else 1, n_max=sp.prompt_lookup_max if sp else 3,
            num_stop=max([1] + [len(r.params.stop_token_ids) for r in rows]),
            use_min_p=not greedy and any(r.params.min_p > 0 for r in rows),
            use_penalties=any(r.params.presence_penalty != 0 or r.params.frequency_penalty != 0
                              or r.params.repetition_penalty != 1 for r in rows),
            use_bias=any(bool(r.params.logit_bias) for r in rows),
            use_min_tokens=any(r.params.min_tokens > 0 for r in rows),
            logprobs=max([-1] + [r.params.logprobs for r in rows if r.params.logprobs is not None]),
            auto_threshold=self.auto_threshold)
        prog = self._programs.get(cfg)
        if prog is None:   # before any compile: the batch's entry buffers must fit
            _check_entry_memory(self.spec, cfg.mode, cfg.batch, cfg.buffer_size, cfg.max_seq_len)
            prog = self._programs[cfg] = _Program(self.spec, self.dspec, cfg, self.mesh, self.compiler_options)
        return prog, cfg

    def _inputs(self, rows, cfg: GenerateConfig):
        B = cfg.batch
        ids = np.zeros((B, cfg.prompt_len), np.int32)
        for b, r in enumerate(rows):
            ids[b, :len(r.ids)] = r.ids
        stop = np.full((B, cfg.num_stop), -1, np.int32)
        for b, r in enumerate(rows):
            stop[b, :len(r.params.stop_token_ids)] = r.params.stop_token_ids
        f32 = np.float32
        rowp = {"temperature": jnp.asarray([r.params.temperature for r in rows], f32),
                "top_k": jnp.asarray([r.params.top_k for r in rows], np.int32),
                "top_p": jnp.asarray([r.params.top_p for r in rows], f32),
                "max_tokens": jnp.asarray([r.params.max_tokens for r in rows], np.int32),
                "ignore_eos": jnp.asarray([r.params.ignore_eos for r in rows], bool),
                "stop_ids": jnp.asarray(stop),
                "min_p": jnp.asarray([r.params.min_p for r in rows], f32),
                "presence": jnp.asarray([r.params.presence_penalty for r in rows], f32),
                "frequency": jnp.asarray([r.params.frequency_penalty for r in rows], f32),
                "repetition": jnp.asarray([r.params.repetition_penalty for r in rows], f32),
                "min_tokens": jnp.asarray([r.params.min_tokens for r in rows], np.int32)}
        if cfg.use_bias:
            bias = np.zeros((B, self.spec.vocab_size), f32)
            for b, r in enumerate(rows):
                for t, v in (r.params.logit_bias or {}).items():
                    if not 0 <= int(t) < self.spec.vocab_size:
                        raise ValueError(f"logit_bias token id {t} is out of range for vocab_size {self.spec.vocab_size}")
                    bias[b, int(t)] = v
            rowp["bias"] = jnp.asarray(bias)
        keys = []                      # one per row: its seed's, else the next of the engine's stream
        for r in rows:
            if r.params.seed is not None:   # sample i of a seeded request: its own stream
                k = jax.random.PRNGKey(r.params.seed)
                keys.append(jax.random.fold_in(k, r.index) if r.index else k)
            else:
                self.key, k = jax.random.split(self.key)
                keys.append(k)
        key = jnp.stack(keys)
        return jnp.asarray(ids), jnp.asarray([len(r.ids) for r in rows], np.int32), rowp, key

    def start(self, rows):
        """Prefill and first tokens: ``(program, carry, rowp)`` (device arrays)."""
        prog, cfg = self._program(rows)
        ids, lengths, rowp, key = self._inputs(rows, cfg)
        carry = prog.start(self.params, self.dparams, ids, lengths, rowp, key)
        return prog, carry, rowp

    _HOST = ("out", "n", "stopped", "steps", "acc_sum", "drafted", "step", "lp", "lp_v", "lp_i")

    def _host(self, carry) -> dict:
        return jax.device_get({k: carry[k] for k in self._HOST if k in carry})

    def generate(self, prompts, sampling_params=None, chunk_steps: int = 16) -> list:
        """Generate for every prompt (strings or token-id lists) in one batch; returns
        :class:`~replayssm.engine.llm.RequestOutput` objects in order (``n > 1``: the first
        sample, every sample in ``samples``).  Without stop strings the whole decode phase is
        one call of the compiled loop; with them the loop runs ``chunk_steps`` iterations at a
        time and the host checks the new text between calls (:class:`_TextStops`)."""
        rows = self._rows(prompts, sampling_params)
        stops = _TextStops(rows, self.tokenizer, self.spec.eos_token_ids)
        t0 = time.perf_counter()
        prog, carry, rowp = self.start(rows)
        jax.block_until_ready(carry["n"])
        t1 = time.perf_counter()
        if not stops.watch:
            carry = prog.loop(self.params, self.dparams, carry, rowp, jnp.asarray(np.iinfo(np.int32).max, jnp.int32))
        else:
            while True:
                out, n, done, step = jax.device_get((carry["out"], carry["n"], carry["done"], carry["step"]))
                new = stops.check(out, n)
                if new:   # rows whose text hit a stop string: finished for the loop too
                    carry = {**carry, "done": carry["done"].at[jnp.asarray(new)].set(True)}
                if all(bool(d) or b in stops.cut for b, d in enumerate(done)):
                    break
                carry = prog.loop(self.params, self.dparams, carry, rowp, jnp.asarray(int(step) + chunk_steps, jnp.int32))
        host = self._host(carry)
        t2 = time.perf_counter()
        self.last_stats = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "loop_steps": int(host["step"]),
                           "generated": int(host["n"].sum())}
        outs = [self._output(b, r, host, stops.cut.get(b)) for b, r in enumerate(rows)]
        leaders = []
        for b, r in enumerate(rows):
            if r.index == 0:
                outs[b].request_id = len(leaders)
                leaders.append(outs[b])
                if r.params.n > 1:
                    outs[b].samples = [outs[j] for j in range(b, b + r.params.n)]
            else:
                outs[b].request_id = outs[r.group].request_id
        return leaders

    def stream(self, prompt, params=None, chunk_steps: int = 8) -> Iterator[list[int]]:
        """One request; yields lists of new token ids every ``chunk_steps`` loop iterations
        (the same compiled loop, stopped by a step limit given as data)."""
        if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
            raise ValueError(f"chunk_steps must be a positive int, got {chunk_steps!r}")
        rows = self._rows([prompt], params)
        if len(rows) > 1:
            raise ValueError("stream takes one sample (SamplingParams.n == 1); use generate for n > 1")
        stops = _TextStops(rows, self.tokenizer, self.spec.eos_token_ids)
        prog, carry, rowp = self.start(rows)
        shown = 0
        while True:
            out, n, done, step = jax.device_get((carry["out"], carry["n"], carry["done"], carry["step"]))
            stops.check(out, n)
            end = stops.cut[0][0] if 0 in stops.cut else int(n[0])
            if end > shown:
                yield [int(t) for t in out[0, shown:end]]
                shown = end
            if bool(done[0]) or 0 in stops.cut:
                break
            carry = prog.loop(self.params, self.dparams, carry, rowp, jnp.asarray(int(step) + chunk_steps, jnp.int32))
        self.last_output = self._output(0, rows[0], self._host(carry), stops.cut.get(0))

    def _output(self, b: int, row: _Row, host: dict, cut=None):
        """Row ``b``'s :class:`RequestOutput`; ``cut = (tokens kept, text)`` for a row whose
        text hit a stop string."""
        n = int(host["n"][b]) if cut is None else cut[0]
        ids = [int(t) for t in host["out"][b, :n]]
        if cut is not None:
            text = cut[1]
        else:
            text = self.tokenizer.decode(ids) if self.tokenizer is not None and ids else ""
        steps = int(host["steps"][b])
        acc = int(host["acc_sum"][b])
        drafted = int(host["drafted"][b])
        lps = None
        if row.params.logprobs is not None:
            k = row.params.logprobs
            lps = [(float(host["lp"][b, i]), [(int(host["lp_i"][b, i, j]), float(host["lp_v"][b, i, j]))
                                              for j in range(k)]) for i in range(n)]
        return RequestOutput(
            request_id=b, prompt=row.prompt, prompt_token_ids=list(row.ids), text=text, token_ids=ids,
            finish_reason="stop" if (cut is not None or bool(host["stopped"][b])) else "length", num_steps=steps + 1,
            num_verify_steps=steps if self.speculative else 0, num_drafted=drafted,
            num_accepted=(acc - steps) if self.speculative else 0,
            mean_accepted_length=(acc / steps) if (steps and self.speculative) else 1.0,
            index=row.index, logprobs=lps)


class _TextStops:
    """Stop strings on the host, between calls of the compiled loop (the engine's rule,
    :meth:`replayssm.engine.output_processor.OutputProcessor._finish_reason`): each row's new
    tokens go through a :class:`~replayssm.engine.detokenizer.Detokenizer`; once more than
    ``min_tokens`` were generated, the first stop string in the text ends the row there (the
    text cut before it, the token that completed it kept, later tokens dropped).  EOS / stop
    ids are not pushed (the loop ends the row on them)."""

    def __init__(self, rows, tokenizer, eos=()):
        from ..engine.detokenizer import Detokenizer

        self.rows, self.eos = rows, set(eos)
        self.watch = {b: Detokenizer(tokenizer, r.ids) for b, r in enumerate(rows) if r.params.stop}
        self.pushed = dict.fromkeys(self.watch, 0)
        self.cut: dict = {}

    def check(self, out, n) -> list[int]:
        """Push the rows' new tokens (``out [B, max_out]``, ``n [B]``); returns the rows that
        hit a stop string now."""
        from ..engine.detokenizer import find_stop

        new = []
        for b, d in self.watch.items():
            p = self.rows[b].params
            while b not in self.cut and self.pushed[b] < int(n[b]):
                t = int(out[b, self.pushed[b]])
                self.pushed[b] += 1
                if t in p.stop_token_ids or (t in self.eos and not p.ignore_eos):
                    break
                piece = d.push(t)
                cut = find_stop(d.text, len(piece), p.stop) if self.pushed[b] > p.min_tokens else None
                if cut is not None:
                    self.cut[b] = (self.pushed[b], d.text[:cut])
                    new.append(b)
        return new


def _with_chunk(spec: ModelSpec, chunk: int) -> ModelSpec:
    """``spec`` with every SSM stage's prefill chunk set to ``chunk``."""
    import dataclasses

    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk!r}")
    stages = []
    for sb, cnt in spec.stages:
        m = sb.mixer
        if m.kind in ("mamba", "gdn"):
            m = MixerSpec(m.kind, tuple((k, chunk if k == "chunk" else v) for k, v in m.opts))
            sb = dataclasses.replace(sb, mixer=m)
        stages.append((sb, cnt))
    return dataclasses.replace(spec, stages=tuple(stages))
