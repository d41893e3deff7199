"""The engine a server drives: :class:`LLMEngine` with ``add_request`` / ``step`` / ``abort``.

A step is three calls (nano-vllm's shape)::

    batch = self.scheduler.schedule()        # admit waiting requests, pick the running ones
    new, _ = self.executor.run(batch)        # prefill / decode / draft-verify-accept-commit
    return self._postprocess(batch, new)     # append tokens, stop criteria, free, switch forms

With ``async_scheduling`` a plain greedy decode step is launched before the previous one's
tokens are read, so the host's postprocessing overlaps the device (:mod:`.overlap`).

Each part is a room of its own: memory (``cache_plan``), slots and blocks
(``block_manager``, with ``prefix/``), ``scheduler``, model calls (``executor``), drafters
(``spec/``), the decode-mode policy (``mode_policy``), outputs (``output_processor``).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import time


from ..distributed import TensorParallelModel
from ..runtime import check_device
from .block_manager import BlockManager
from .cache_plan import context_limit, plan_caches
from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .detokenizer import Detokenizer
from .executor import StepExecutor, plain_rows
from .inputs import encode_prompt
from ..models.loader import parse_dtype
from .loading import check_tokenizer_vocab, load_target
from .mode_policy import decode_policy
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .outputs import RequestOutput, request_output
from .overlap import OVERLAP_MODES, InFlight, ends_with_pending
from .prefix import PrefixCache
from .sampler import Sampler
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, fresh_request_id
from .spec import prepare_drafter
from .structured import ConstraintFactory
from .warmup import warm_up


class LLMEngine:
    """Continuous-batching engine over one model (and an optional drafter).

    ``model``: a Hugging Face-layout directory, a Hub id (``org/name``, fetched at ``revision``
    when no such local path exists: :func:`replayssm.models.resolve_model_dir`) or an already
    loaded model object; the other
    arguments are :class:`~replayssm.engine.config.EngineConfig`'s (decode mode, memory
    budget, speculation, tensor parallelism, prefix caching: documented there).  Not
    thread-safe: one thread (an event loop's engine task) calls ``add_request``, ``abort``
    and ``step``.
    """

    def __init__(self, model, device="cpu", dtype="float32", decode_mode: str = "replay",
                 buffer_size: int | None = None, speculative: SpeculativeConfig | None = None,
                 max_num_seqs: int | None = None, memory_budget: int | None = None,
                 max_seq_len: int | None = None, kv_block_size: int = 16, auto_threshold: int | None = None,
                 cuda_graphs: bool | None = None,
                 seed: int = 0, tokenizer=None, pad_batches: bool = False,
                 max_num_batched_tokens: int = 8192, gpu_memory_utilization: float | None = 0.8,
                 tensor_parallel_size: int | None = None, enable_prefix_caching: bool = False,
                 prefix_checkpoint_interval: int | None = None, prefix_cache_fraction: float = 0.25,
                 prefix_cache_blocks: int | None = None, prefix_cache_replies: bool = True,
                 preemption_mode: str = "swap",
                 revision: str | None = None, ssm_state_dtype: str = "auto", gc_freeze: bool = False,
                 async_scheduling: bool | None = None):
        self.config = ec = EngineConfig(
            decode_mode=decode_mode, buffer_size=buffer_size, max_num_seqs=max_num_seqs,
            memory_budget=memory_budget, max_seq_len=max_seq_len, kv_block_size=kv_block_size,
            auto_threshold=auto_threshold, speculative=speculative, cuda_graphs=cuda_graphs, seed=seed,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            prefix_checkpoint_interval=prefix_checkpoint_interval, prefix_cache_fraction=prefix_cache_fraction,
            prefix_cache_blocks=prefix_cache_blocks, prefix_cache_replies=prefix_cache_replies,
            gpu_memory_utilization=gpu_memory_utilization,
            pad_batches=pad_batches, tensor_parallel_size=tensor_parallel_size, preemption_mode=preemption_mode,
            ssm_state_dtype=ssm_state_dtype, gc_freeze=gc_freeze, async_scheduling=async_scheduling)
        # validated, as tensors report it ("cuda" -> "cuda:<current>", "cpu:0" -> "cpu")
        self.device = check_device(device)
        if ec.cuda_graphs is None:   # the fast default: graphs wherever they can run
            ec.cuda_graphs = self.device.type == "cuda"
        if ec.async_scheduling is None:   # overlap where a device runs the steps
            ec.async_scheduling = self.device.type == "cuda"
        self.model, self.tokenizer, self.dtype, self._owns_model = load_target(
            model, self.device, parse_dtype(dtype), ec, tokenizer, revision)
        self.vocab_size = int(self.model.config.vocab_size)
        check_tokenizer_vocab(self.tokenizer, self.vocab_size)
        draft = self._plan_caches()
        plan, spec = self.plan, self.plan.spec
        self.cache = self.model.make_cache(plan.num_slots + 1, plan.spec, device=self.device)
        self.runner = self._make_runner()
        self.sampler = Sampler(self.device, seed, num_slots=self.num_slots + 1, vocab_size=self.vocab_size)
        self.stats = {"steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "generated": 0}
        ps = plan.prefix_store
        self.prefix_cache = None if ps is None else PrefixCache(
            self.cache, spec.block_size, ps.blocks, ps.checkpoints, ps.interval, stats=self.stats,
            cache_replies=ec.prefix_cache_replies)
        self.blocks = BlockManager(self.cache, plan, prefix=self.prefix_cache, preemption_mode=ec.preemption_mode)
        self.blocks.drafter_of, self.blocks.sampler = (lambda: self.drafter), self.sampler   # swap hooks
        self.scheduler = Scheduler(self.blocks, ec.max_num_batched_tokens, stats=self.stats)
        self.policy = decode_policy(ec.decode_mode, plan.auto_threshold)
        eos = getattr(self.model.config, "eos_token_id", None)   # an id, a list of ids, or None
        self.outputs = OutputProcessor(eos, self.scheduler.token_limit, self.sampler, self.stats)
        self.executor = StepExecutor(
            self.runner, self.sampler, self.blocks, self.cache, self.policy, prefix=self.prefix_cache,
            spec_config=ec.speculative, stats=self.stats, drafter=None if draft is None else draft.build(
                target=self.model, cache=self.cache, sampler=self.sampler, runner=self.runner,
                num_slots=self.num_slots))
        self._requests: dict = {}            # unfinished requests by id (abort, outputs)
        self._inflight: InFlight | None = None   # async scheduling: the decode step on the device
        if ec.async_scheduling:
            self.stats.update(async_steps=0, async_dropped_rows=0, async_wasted_steps=0)
        self.constraints = ConstraintFactory(self.tokenizer, self.vocab_size, eos)
        t0 = time.perf_counter()
        if self.runner.use_graphs:   # every graph a step can need, before the first request
            self.executor.capture()
        self.capture_s = time.perf_counter() - t0 if self.runner.use_graphs else 0.0
        self.executor.measure_step_costs()   # adaptive speculation on CUDA: its t(B, T) table
        if ec.gc_freeze:   # what exists now lives as long as the engine: full collections skip it
            gc.collect()
            gc.freeze()

    def _plan_caches(self):
        """Load the drafter (at the model's context) and plan the caches (``self.plan``: the
        context, slots and pools settled; the config records them); returns the drafter's
        setup or None."""
        ec = self.config
        draft = prepare_drafter(ec.speculative, self.model,
                                ec.cache_spec(ec.max_seq_len or context_limit(self.model.config)[0]),
                                self.device, self.dtype)
        self.draft_model = draft.draft_model if draft is not None else None
        self.plan = plan = plan_caches(
            ec, self.device, self.model.config, self.vocab_size, self.model.cache_layout,
            None if draft is None else lambda s: draft.cls.own_layout(dataclasses.replace(draft, spec=s)))
        ec.max_seq_len, ec.max_seq_len_source = plan.max_seq_len, plan.context_source
        if ec.max_num_seqs is None:
            ec.max_num_seqs = plan.num_slots
        if draft is not None:
            draft.spec, draft.layout = ec.cache_spec(), plan.draft_layout
        self.num_slots = plan.num_slots
        return draft

    def _make_runner(self):
        ec = self.config
        kw = dict(cuda_graphs=ec.cuda_graphs, pad_batches=ec.pad_batches)
        if isinstance(self.model, TensorParallelModel):   # every rank runs its own runner
            return self.model.make_runner(self.cache, self.num_slots, runner_cls=ModelRunner, **kw)
        if ec.async_scheduling and "greedy" in inspect.signature(self.model.decode).parameters:
            kw["greedy_decode"] = True   # overlapped steps feed on the device's greedy tokens
        return ModelRunner(self.model, self.cache, self.device, self.num_slots, **kw)

    # -- parts -----------------------------------------------------------------------------
    @property
    def drafter(self):
        """The drafter (None without speculation)."""
        return self.executor.drafter

    @drafter.setter
    def drafter(self, d) -> None:
        self.executor.drafter = d

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine's caches; stop tensor-parallel workers the engine started itself
        (a model passed in stays usable); with ``gc_freeze``, unfreeze the collector's objects
        (a dropped engine's cycles are collected again).  The engine cannot step afterwards."""
        if self.config.gc_freeze:
            gc.unfreeze()
        if self._inflight is not None:   # async scheduling: let the step on the device end first
            self._inflight.wait()
            self._inflight = None
        if isinstance(self.model, TensorParallelModel):   # the workers' runner and cache
            self.runner.close()
            self.cache.close()
            if self._owns_model:
                self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests -------------------------------------------------------------------------
    def encode(self, prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt, validated (:mod:`replayssm.engine.inputs`)."""
        return encode_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None) -> Sequence:
        """Queue one request (validated first: a bad one raises ``ValueError`` and queues
        nothing; so does a prompt that can never fit, ``len(prompt) >= max_seq_len``, with both
        numbers).  ``request_id`` (any hashable, default a fresh int) names it for
        :meth:`abort` and in :meth:`step`'s outputs; returns its :class:`Sequence`."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        # the request's own copy, validated again: the caller may change (or have changed)
        # the object it passed, which would otherwise reach the sampler unchecked mid-step
        params = dataclasses.replace(params)
        if request_id is None:
            request_id = fresh_request_id(self._requests)
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n > self.num_slots:
            raise ValueError(f"SamplingParams.n={params.n} exceeds the engine's {self.num_slots} slots "
                             f"(the samples of a request run together)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (tokenizer.json in the model directory)")
        text, ids = self.encode(prompt)
        limit = self.scheduler.token_limit   # = max_seq_len: prompt + generated, with or without speculation
        if len(ids) + 1 > limit:
            src = self.config.max_seq_len_source or ""
            src = "" if src.startswith("max_seq_len") else f" ({src})"
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_seq_len={limit}{src}: a sequence holds "
                             f"at most {limit} tokens (prompt + generated), so a prompt may have at most {limit - 1}")
        constraints = self.constraints.build(params, params.n)   # validated (grammar compiled) first
        tok = self.tokenizer
        seq = Sequence.request(ids, params, request_id, text, None if tok is None else lambda p: Detokenizer(tok, p))
        for s, c in zip(seq.group, constraints):
            s.constraint = c
        for s in seq.group:
            self.scheduler.add(s)
        self._requests[seq.request_id] = seq
        return seq

    def abort(self, request_id) -> bool:
        """Stop a request between steps: a waiting one leaves the queue, a running one frees
        its slot and cache at once.  Returns False when no unfinished request has that id."""
        head = self._requests.pop(request_id, None)
        if head is None or all(s.is_finished for s in head.group):
            return False
        for seq in head.group:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        return True

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or (async scheduling) a decode step still in flight."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def warm_up(self, max_prompt_len: int | None = None) -> float:
        """Run every kind of step once before serving (:func:`replayssm.engine.warmup.warm_up`);
        only for an idle engine; returns seconds."""
        return warm_up(self, max_prompt_len)

    def output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq)

    def occupancy(self) -> dict:
        """Running / waiting requests, free and total slots, and the paged pools' free and
        total blocks (KV-only entries and hybrids' attention KV together; -1 / 0: no pool)."""
        pools = [p for p in (self.cache.pidx, self.cache.attn) if p is not None]
        occ = {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
               "free_slots": len(self.blocks.free_slots), "total_slots": self.num_slots,
               "free_kv_blocks": sum(p.free_blocks for p in pools) if pools else -1,
               "total_kv_blocks": sum(p.num_blocks - 1 for p in pools)}   # block 0: the null block
        return {**occ, **self.prefix_stats()}

    def prefix_stats(self) -> dict:
        """Prefix-cache counters and hit rate (:meth:`PrefixCache.snapshot`); empty when off."""
        return {} if self.prefix_cache is None else self.prefix_cache.snapshot()

    def recover(self) -> None:
        """After a step raised half-way: forget the verify that will never be committed
        (target and draft caches), so that aborts and the next steps can run.  A decode step
        still in flight (async scheduling) is dropped and its unfinished sequences end with an
        error: their caches hold a token their outputs never got."""
        fl, self._inflight = self._inflight, None
        if fl is not None:
            self._abandon(fl)
        self.cache.clear_pending()
        if self.drafter is not None:
            self.drafter.reset()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns a :class:`RequestOutput` (cumulative tokens so far) for
        every request that produced tokens or finished in it, in admission order."""
        advanced, finished = self._step()
        out, seen = [], set()
        for s in advanced + finished:
            if id(s) not in seen:
                seen.add(id(s))
                out.append(self.output(s))
        return out

    def _step(self) -> tuple[list[Sequence], list[Sequence]]:
        """schedule -> run -> postprocess; returns (sequences that got tokens, finished ones)."""
        if self.config.async_scheduling:
            return self._async_step()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        return self._run(batch, t0)

    def _run(self, batch, t0: float) -> tuple[list[Sequence], list[Sequence]]:
        """A synchronous step of ``batch`` (scheduled at ``t0``): run, then postprocess."""
        new, t1 = self.executor.run(batch)
        self.stats["steps"] += 1
        self.stats["prefill_s"] += t1 - t0
        out = self._postprocess(batch, new)
        # the decode part and the postprocessing (as an async step counts its whole time), so
        # decode tokens/s compare across scheduling modes
        self.stats["decode_s"] += time.perf_counter() - t1
        return out

    def _postprocess(self, batch, new: list) -> tuple[list[Sequence], list[Sequence]]:
        """Append tokens (stop criteria), free finished sequences, switch KV-only ones that
        reached the threshold to a state."""
        advanced = []
        for s, toks, lps in new:
            if toks:
                advanced.append(s)
                self.outputs.append(s, toks, lps)
        finished = list(batch.rejected)
        if self.prefix_cache is not None:   # the step's finished replies, cached in one call
            self.prefix_cache.capture_ends([s for s in self.scheduler.running if s.finish_reason is not None])
        with self.blocks.batched_releases():   # the step's finished slots in one release
            for s in list(self.scheduler.running):
                if s.finish_reason is not None:
                    self._finish(s)
                    finished.append(s)
        self.blocks.switch_to_state(self.policy.after_step(self.scheduler.running))
        self._forget_done(finished)
        return advanced, finished

    def _forget_done(self, seqs) -> None:
        """Drop the requests of ``seqs`` whose every sample has finished (``abort`` and the
        outputs look requests up here)."""
        for s in seqs:
            if all(m.is_finished for m in s.group):
                self._requests.pop(s.group_id, None)

    # -- async scheduling (engine.overlap) ----------------------------------------------------
    def _async_step(self) -> tuple[list[Sequence], list[Sequence]]:
        """One step with async scheduling: launch the next decode step (when it may overlap),
        then collect and postprocess the one in flight; without one in flight, schedule as
        usual and either launch an overlappable decode step or run synchronously."""
        t0 = time.perf_counter()
        fl = self._inflight
        if fl is None:
            batch = self.scheduler.schedule()
            if not self._overlaps(batch):
                return self._run(batch, t0)
            t1 = time.perf_counter()   # scheduling counts as prefill time, as in a synchronous step
            self.stats["prefill_s"] += t1 - t0
            t0 = t1
            fl = self.executor.launch(batch.running)
            if fl is None:   # no row could reserve its block: they end with the error
                return self._run(ScheduledBatch(), t0)
        self._inflight, failed = self._launch_next(fl)
        try:
            new = self.executor.collect(fl)
        except BaseException:
            self._abandon(fl)
            raise
        # a step whose rows were all dropped (every sequence ended by the step before) is
        # no step of the synchronous engine: counted apart
        self.stats["steps" if new else "async_wasted_steps"] += 1
        self.stats["async_steps"] += fl.lagged and bool(new)
        advanced, finished = self._postprocess(ScheduledBatch(), new)
        # the whole step, postprocessing included: it runs while the device runs the next
        # step, so this is the step's wall time (a synchronous step counts its postprocessing too)
        self.stats["decode_s"] += time.perf_counter() - t0
        if failed:   # reservations for the next step that failed: they end now, as a synchronous step ends them
            with self.blocks.batched_releases():
                for s, reason, error in failed:
                    if not s.is_finished:
                        s.finish_reason, s.error = reason, error
                        self._finish(s)
                        finished.append(s)
            self._forget_done([s for s, _, _ in failed])
        return advanced, finished

    def _abandon(self, fl: InFlight) -> None:
        """End ``fl``'s unfinished sequences with an error (a step failed while ``fl`` was in
        flight: their caches may hold a token their outputs never got)."""
        for s in fl.seqs:
            if not s.is_finished:
                s.finish_reason, s.error = "error", "an engine step failed while this request's step was in flight"
                self._finish(s)
                self._forget_done([s])

    def _overlaps(self, batch) -> bool:
        """Whether a freshly scheduled step may start the overlapped loop: a pure decode step
        of every running sequence, all plain greedy, on an engine whose decode steps can
        overlap (:meth:`_can_overlap`)."""
        return (bool(batch.running) and not batch.prefill and not batch.rejected
                and len(batch.running) == len(self.scheduler.running) and self._can_overlap(len(batch.running))
                and plain_rows(batch.running))

    def _can_overlap(self, rows: int) -> bool:
        """A step of ``rows`` sequences that does not speculate (no drafter, or a drafter
        that catches up lazily on a step above ``disable_by_batch_size``:
        :meth:`StepExecutor.overlaps_drafter`), decode mode replay or recurrent (``auto`` switches forms from host
        lengths after each step), no caching of finished replies (a reply's state is
        captured at finish: the wasted row would have advanced it), a runner with greedy
        decode (the tokens the next step feeds on)."""
        ec = self.config
        return (self.executor.overlaps_drafter(rows) and ec.decode_mode in OVERLAP_MODES and self.runner.greedy_decode
                and (self.prefix_cache is None or not ec.prefix_cache_replies))

    def _launch_next(self, fl: InFlight) -> tuple[InFlight | None, list]:
        """Launch the decode step after ``fl`` before its tokens are read, when it may
        overlap: no waiting request could be admitted now, the rows that continue (every
        sequence of ``fl`` not known to end with its token) grow their reservations without
        preempting.  Returns ``(the launched step or None, [(sequence, finish reason,
        error)] whose blocks could not be reserved)``: those end after ``fl``'s tokens."""
        if not self.scheduler.admits_nothing():
            return None, []
        limit = self.scheduler.token_limit
        rows = [s for s in fl.seqs if not s.is_finished and s.finish_reason is None
                and not ends_with_pending(s, limit)]
        if not rows or not self._can_overlap(len(rows)) or not self.scheduler.grow_ahead(rows):
            return None, []
        ok = self.blocks.reserve_tokens(rows, 2)   # the pending token and the new one
        failed = []
        if len(ok) < len(rows):
            kept = set(map(id, ok))
            for s in rows:
                if id(s) not in kept:   # its reason applies after fl's token (which may end it first)
                    failed.append((s, s.finish_reason, s.error))
                    s.finish_reason = s.error = None
        return (self.executor.launch_rows(fl, ok) if ok else None), failed

    def _finish(self, s: Sequence) -> None:
        if self.drafter is not None:   # (a swapped-out one holds no slot: its per-request state goes)
            self.drafter.release(s)
        self.scheduler.finish(s, s.finish_reason or "stop")
