"""Run every kind of step once before serving, so no request waits for a compile.

Triton compiles a kernel variant when a shape bucket is first met (seconds each on a GPU):
without a warm-up, the first requests of each bucket stall for everyone in flight.
"""

from __future__ import annotations

import time

import torch

from .config import SamplingParams


def warm_up(engine, max_prompt_len: int | None = None) -> float:
    """Waves of greedy requests through ``engine``'s normal scheduler, two tokens each
    (prefill then a decode or speculative step): one 8-token prompt (the small-prompt
    tiles); a full batch of ``max_num_seqs`` prompts sharing the step's token budget (up to
    256 tokens each: a burst of arrivals, many sequences in one prefill, the allocator's
    largest activations); one prompt of ``max_prompt_len`` (default: the token budget, at
    most the context less two tokens; long-prompt tiles and chunking); with prefix caching,
    that prompt again with its last token changed (a resume from a checkpoint).  Afterwards
    no slot is held, the prefix cache is emptied and the engine's counters are zero.  Only
    for an idle engine; returns seconds."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up() needs an idle engine (requests are in flight)")
    ec, V = engine.config, engine.vocab_size
    long = min(ec.max_num_batched_tokens, ec.max_seq_len - 2) if max_prompt_len is None else max_prompt_len
    if not 1 <= long <= ec.max_seq_len - 2:
        raise ValueError(f"max_prompt_len must be in [1, max_seq_len - 2 = {ec.max_seq_len - 2}], got {long}")

    def ids(i, n):
        return [(7919 * i + 104729 * j + 1) % V for j in range(n)]

    burst = min(ec.max_seq_len - 2, 256, max(8, ec.max_num_batched_tokens // engine.num_slots))
    waves = [[ids(0, min(8, long))], [ids(1 + i, burst) for i in range(engine.num_slots)], [ids(0, long)]]
    if engine.prefix_cache is not None and long >= 2:
        p = waves[2][0]   # a hit on the long prompt but its last token: a resume from its last checkpoint
        waves.append([p[:-1] + [(p[-1] + 1) % V]])
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=("warm-up", w, i))
        while engine.has_unfinished():
            engine.step()
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    for k, v in engine.stats.items():
        if isinstance(v, (int, float)):
            engine.stats[k] = type(v)(0)
    return time.perf_counter() - t0


def _ring_of(runner, slots):
    """``(cache, ring)`` when ``runner``'s cache is a local replay-form cache whose slots can
    be set up directly (else ``(cache, None)``; ``cache`` is None when not a local cache)."""
    from ..cache.ring import RingIndex
    from ..models.cache import ModelCache

    cache = getattr(runner, "cache", None)
    if not slots or not isinstance(cache, ModelCache):
        return None, None
    ring = cache.ring if isinstance(cache.ring, RingIndex) and cache.ring.capacity > 1 else None
    return cache, (ring if cache.ssm_form() == "replay" else None)


def _timer(device, reps: int):
    """``timed(fn, before=None)``: the fastest of ``reps`` synchronised runs of ``fn`` after
    one untimed run; ``before()`` (untimed) precedes every run."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn, before=None) -> float:
        best = float("inf")
        for r in range(reps + 1):
            if before is not None:
                before()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r:
                best = min(best, time.perf_counter() - t0)
        return best

    return timed


def measure_step_costs(runner, shapes, reps: int = 3, slots=None, context: int = 64) -> tuple[dict, dict]:
    """Time, at every batch bucket ``Bp`` of ``runner``, a decode step and a greedy verify
    step of each ``(T, nodes, tree)`` in ``shapes`` (the graphs captured for them, if any):
    ``(table, flush)``, both ``{(bucket, T): seconds}`` (``T = 0``: decode).

    ``slots``: free cache slots to time on (an idle engine's; rows cycle through them when
    a bucket has more rows than there are slots), each set to ``context`` committed tokens
    (its attention blocks reserved) and released afterwards, so a step reads ``Bp``
    distinct states as a served batch does.  In replay form each step is timed twice:
    with every row's ring at a fill where it does not flush (half the room it has: ``table``)
    and at one where every row flushes (``flush``: the extra seconds, >= 0); the policy
    prices a step as ``table + φ · flush`` (:func:`replayssm.engine.spec.policy.flush_fraction`).
    Without ``slots`` (or with a cache that is not a local one) rows use the null slot as
    CUDA-graph padding does (one state, read from cache: an underestimate at large
    batches), and ``flush`` is empty.  Each time is the fastest of ``reps`` synchronised
    runs after one untimed run, the slots' bookkeeping reset before each.  A shape the cache
    form cannot verify (``NotImplementedError``) gets ``nodes`` decode steps' time."""
    dev = runner.device
    timer = _timer(dev, reps)
    cache, ring = _ring_of(runner, slots)
    free = sorted(int(s) for s in slots) if cache is not None else [0]
    if cache is not None:
        if any(not 0 < s < cache.P for s in free):
            raise ValueError(f"measure_step_costs: slots must be in [1, {cache.P - 1}], got {free}")
        most = 1 + max([N for _, N, _ in shapes] + [1])
        context = max(0, min(context, cache.spec.max_seq_len - most - (reps + 2)))
        try:
            for s in free:
                cache.reserve(s, context + most)
        except ValueError:   # PoolExhausted (no room for them all): the null slot, as padding uses it
            cache.release(free)
            cache, ring, free = None, None, [0]
    if cache is not None:
        idx = torch.tensor(free, dtype=torch.long, device=cache.device)

    def setup(h: int) -> None:   # every timed slot: `context` tokens, a ring of h entries
        if cache is not None:
            cache.seq_len[idx] = max(context, h)
            if ring is not None:
                ring.start[idx] = 0
                ring.length[idx] = h

    def timed(fn, h: int = 0) -> float:
        return timer(fn, lambda: setup(h))

    table, flush = {}, {}
    L = ring.capacity if ring is not None else 0
    try:
        for Bp in runner.buckets:
            rows = [free[i % len(free)] for i in range(Bp)]
            tok = torch.zeros(Bp, dtype=torch.long)
            dec = table[(Bp, 0)] = timed(lambda: runner.decode(rows, tok), (L - 1) // 2 if L else 0)
            if ring is not None:
                flush[(Bp, 0)] = max(timed(lambda: runner.decode(rows, tok), L - 1) - dec, 0.0)
            for T, N, tree in shapes:
                tokens = torch.zeros(Bp, N, dtype=torch.long, device=dev)
                parent = torch.arange(-1, N - 1, device=dev).expand(Bp, N).contiguous()
                valid = torch.zeros(Bp, N, dtype=torch.bool, device=dev)
                valid[:, 0] = True

                def step():
                    runner.greedy_verify_step(rows, tokens, parent, valid, tree)

                try:
                    table[(Bp, T)] = t = timed(step, max(L - 2 * N, 0) // 2 if L else 0)
                    if ring is not None:
                        flush[(Bp, T)] = max(timed(step, min(L - 2 * N + 1, L - 1)) - t, 0.0)
                except NotImplementedError:   # e.g. KV-only slots without a tree verify (raised before any write)
                    table[(Bp, T)] = dec * N
    finally:
        if cache is not None:
            cache.release(free)   # back to fresh slots (their next prefill starts a new sequence)
    return table, flush


def measure_draft_costs(drafter, buckets, lengths, device, reps: int = 3) -> dict:
    """The drafter's own device work per step, ``{(bucket, T): seconds}`` for ``T`` in
    ``{0} ∪ lengths`` at every bucket, timed like :func:`measure_step_costs` through
    ``drafter.null_step(bucket, T)`` (its graph on null-slot rows; ``T = 0``: what it does
    before a plain step).  Keys whose probe is None (host-only drafters, split models) are
    left out.  A step of ``T`` drafts costs the verify step plus this: the length policy's
    table gets both."""
    null_step = getattr(drafter, "null_step", None)   # (duck-typed drafters may lack it)
    if null_step is None:
        return {}
    timed = _timer(torch.device(device), reps)
    out = {}
    for Bp in buckets:
        for T in (0, *lengths):
            fn = null_step(Bp, T)
            if fn is not None:
                out[(Bp, T)] = timed(fn)
    return out


def measure_catchup_costs(drafter, buckets, device, reps: int = 3) -> dict:
    """``{bucket: seconds}`` of one drafter catch-up pass (MTP: ``width`` deferred pairs per
    row, ``drafter.null_flush(bucket)`` on null-slot rows), timed like
    :func:`measure_draft_costs`; empty for drafters without one."""
    probe = getattr(drafter, "null_flush", None)
    if probe is None:
        return {}
    timed = _timer(torch.device(device), reps)
    out = {}
    for Bp in buckets:
        fn = probe(Bp)
        if fn is not None:
            out[Bp] = timed(fn)
    return out
