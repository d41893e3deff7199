"""The engine a server drives: :class:`LLMEngine` with ``add_request`` / ``step`` / ``abort``.

A step is three calls (nano-vllm's shape)::

    batch = self.scheduler.schedule()       # admit waiting requests, pick the running ones
    new = self._run(batch)                  # prefill / decode / draft-verify-accept-commit
    return self._postprocess(batch, new)    # append tokens, stop criteria, free, switch forms

Per-sequence decisions inside a model call — fill levels, flushes, accepted counts — are
device data; the host syncs once per step to read the sampled tokens.  Between steps the
:class:`~replayssm.engine.block_manager.BlockManager` owns slots, KV-only blocks and the
memory budget.  ``decode_mode="auto"`` keeps a request KV-only until its context reaches
``auto_threshold`` tokens, then switches it to a state (one flush).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings

import torch
from torch import Tensor

from ..runtime import check_device
from . import speculative as spec
from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .detokenizer import Detokenizer, find_stop
from .inputs import encode_prompt
from .limits import cache_bytes, check_cache_fits
from .loading import is_model, load, parse_dtype
from .memory import MemoryModel, auto_kv_blocks, default_auto_threshold, fmt_bytes, memory_model
from .model_runner import ModelRunner
from .mtp_drafter import MTPDrafter, mtp_head_of
from .outputs import RequestOutput, request_output
from .prefix_cache import PrefixCache, plan_store
from .sampler import Sampler, token_logprobs
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, fresh_request_id


class LLMEngine:
    """Continuous-batching engine over one model (and an optional draft model).

    ``model``: a Hugging Face-layout directory or an already loaded model object.
    ``decode_mode``: ``"recurrent"`` (state read+written every token; with speculation the
    snapshot baseline), ``"replay"`` (checkpoint + ring buffer), ``"kv"`` (KV-only, no
    state) or ``"auto"`` (KV-only while a request's context is shorter than
    ``auto_threshold`` tokens, then one flush into a state and replay; the default threshold
    is where KV-only stops reading fewer bytes than replay, from the cache's real sizes —
    :func:`replayssm.engine.memory.default_auto_threshold`).
    ``memory_budget``: bytes of cache for the sequences (``None``: on CUDA,
    ``gpu_memory_utilization`` of the free device memory; on CPU only ``max_num_seqs``
    limits concurrency): ``num_slots`` fixed parts (states, rings, conv windows, step scratch)
    and block pools for what grows with the context (attention KV of hybrids, KV-only
    entries) in the rest; the null slot and null blocks that padding rows write to come on
    top.  Without a budget the pools are static (``max_seq_len`` per slot).
    ``tensor_parallel_size``: split the model by heads over that many processes (rank ``r``
    on ``cuda:<index + r>``, or CPU over gloo; :mod:`replayssm.distributed`); the engine
    starts the workers and :meth:`close` stops them.  A model loaded with
    ``TensorParallelGroup.load_model`` brings its own group.  Budgets are per rank.
    ``enable_prefix_caching``: reuse cached prompt prefixes, resumed exactly at any token
    (:mod:`replayssm.engine.prefix_cache`): checkpoints every ``prefix_checkpoint_interval``
    tokens (default from the cache's sizes), a store of ``prefix_cache_blocks`` blocks or
    ``prefix_cache_fraction`` of the memory budget; counters in :meth:`prefix_stats`.

    Not thread-safe: one thread (an event loop's engine task) calls ``add_request``,
    ``abort`` and ``step``.
    """

    def __init__(self, model, device="cpu", dtype="float32", decode_mode: str = "replay",
                 buffer_size: int | None = None, speculative: SpeculativeConfig | None = None,
                 max_num_seqs: int = 16, memory_budget: int | None = None, max_seq_len: int = 2048,
                 kv_block_size: int = 16, auto_threshold: int | None = None, cuda_graphs: bool = False,
                 seed: int = 0, tokenizer=None, pad_batches: bool = False,
                 max_num_batched_tokens: int = 8192, gpu_memory_utilization: float | None = 0.8,
                 tensor_parallel_size: int | None = None, enable_prefix_caching: bool = False,
                 prefix_checkpoint_interval: int | None = None, prefix_cache_fraction: float = 0.25,
                 prefix_cache_blocks: int | None = None):
        self.config = ec = EngineConfig(
            decode_mode=decode_mode, buffer_size=buffer_size, max_num_seqs=max_num_seqs,
            memory_budget=memory_budget, max_seq_len=max_seq_len, kv_block_size=kv_block_size,
            auto_threshold=auto_threshold, speculative=speculative, cuda_graphs=cuda_graphs, seed=seed,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            prefix_checkpoint_interval=prefix_checkpoint_interval, prefix_cache_fraction=prefix_cache_fraction,
            prefix_cache_blocks=prefix_cache_blocks)
        # validated, as tensors report it ("cuda" -> "cuda:<current>", "cpu:0" -> "cpu")
        self.device = check_device(device)
        self.dtype = parse_dtype(dtype)
        self._owns_model = not is_model(model)
        if gpu_memory_utilization is not None and not (
                isinstance(gpu_memory_utilization, (int, float)) and not isinstance(gpu_memory_utilization, bool)
                and 0.0 < gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] or None, got {gpu_memory_utilization!r}")
        if not isinstance(pad_batches, bool):
            raise ValueError(f"pad_batches must be a bool, got {pad_batches!r}")
        tp = tensor_parallel_size
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        ranks = tp or (int(getattr(model, "tensor_parallel_size", 1)) if is_model(model) else 1)
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                          and callable(getattr(tokenizer, "decode", None))):
            raise ValueError(f"tokenizer must have encode() and decode() (a tokenizers.Tokenizer or a "
                             f"transformers tokenizer), got {type(tokenizer).__name__}")
        if ec.speculative is not None and ec.speculative.method == "mtp" and ranks > 1:
            raise ValueError(f"speculative method 'mtp' is not supported with tensor_parallel_size={ranks} "
                             f"(the MTP head is not sharded over the workers); use tensor_parallel_size=1 "
                             f"or method='ngram'/'draft'")
        if is_model(model):
            have = int(getattr(model, "tensor_parallel_size", 1))
            if tp is not None and tp != have:
                raise ValueError(f"tensor_parallel_size={tp} but the model given is split over {have} rank(s) "
                                 f"(load it with that many, or pass a model directory)")
            self.model, self.tokenizer = model, tokenizer
            if isinstance(getattr(model, "dtype", None), torch.dtype):
                self.dtype = model.dtype  # a loaded model keeps its own dtype
        else:  # a directory (tensor_parallel_size > 1: workers started here, each reading its shard)
            mtp = ec.speculative is not None and ec.speculative.method == "mtp"
            self.model, tok = load(model, self.device, self.dtype, tp or 1, mtp=mtp)
            self.tokenizer = tokenizer if tokenizer is not None else tok
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_id = getattr(cfg, "eos_token_id", None)  # an id, a list of ids, or None
        tok_size = getattr(self.tokenizer, "get_vocab_size", None)
        if callable(tok_size) and tok_size(with_added_tokens=True) > self.vocab_size:
            warnings.warn(f"the tokenizer has {tok_size(with_added_tokens=True)} tokens, more than the model's "
                          f"vocab_size {self.vocab_size}: text that tokenizes to the extra ids will be refused "
                          f"(is this the model's own tokenizer?)", stacklevel=2)
        T = ec.max_new
        sp = ec.speculative
        self.draft_model = None
        draft_layout = None
        if sp is not None and sp.draft_model is not None and sp.method in ("draft", "tree"):
            dm = sp.draft_model
            self.draft_model = dm if is_model(dm) else load(dm, self.device, self.dtype)[0]
            if int(self.draft_model.config.vocab_size) != self.vocab_size:
                raise ValueError(f"draft model vocab_size {self.draft_model.config.vocab_size} != target "
                                 f"vocab_size {self.vocab_size}")
            draft_layout = self.draft_model.cache_layout(ec.draft_mode, ec.buffer_size, T, ec.max_seq_len,
                                                         ec.kv_block_size)
        if sp is not None and sp.method == "mtp":  # the head's own cache, per slot like a draft model's
            draft_layout = mtp_head_of(self.model).cache_layout(ec.draft_mode, ec.buffer_size, T, ec.max_seq_len,
                                                                ec.kv_block_size)
        self.layout = self.model.cache_layout(ec.cache_mode, ec.buffer_size, T, ec.max_seq_len, ec.kv_block_size)
        # a context never reaches a threshold past max_seq_len: clamped, so the KV-only blocks
        # reserved per slot never exceed what one sequence can hold
        self.auto_threshold = min(ec.auto_threshold or default_auto_threshold(self.layout, ec.buffer_size),
                                  ec.max_seq_len)
        self.memory: MemoryModel = memory_model(self.layout, ec.decode_mode, T, self.vocab_size,
                                                self.auto_threshold, draft_layout, ec.max_seq_len)
        if ec.memory_budget is None and self.device.type == "cuda" and gpu_memory_utilization:
            # like vLLM's gpu_memory_utilization: caches may take this share of the free memory
            free, _ = torch.cuda.mem_get_info(self.device)
            ec.memory_budget = int(free * gpu_memory_utilization)
        self.prefix_store = self._plan_prefix_store()   # None without prefix caching
        store_bytes = self.prefix_store.bytes if self.prefix_store is not None else 0
        self._budget = None if ec.memory_budget is None else ec.memory_budget - store_bytes  # slots + pools
        self.num_slots = self._plan_slots()
        kv_blocks, attn_blocks = self._plan_pools()
        ps = self.prefix_store
        store_own = store_bytes - (ps.blocks * self.layout.attn_block_bytes if ps is not None else 0)  # (attn: in the pool)
        check_cache_fits(cache_bytes(self.layout, draft_layout, self.num_slots, ec.max_seq_len, kv_blocks,
                                     attn_blocks) + store_own, self.device, self.num_slots, ec.max_seq_len)
        prefix_kw = {} if ps is None else dict(prefix_blocks=ps.blocks, prefix_checkpoints=ps.checkpoints)
        self.cache = self.model.make_cache(self.num_slots + 1, mode=ec.cache_mode, buffer_size=ec.buffer_size,
                                           max_new=T, max_seq_len=ec.max_seq_len, kv_block_size=ec.kv_block_size,
                                           kv_num_blocks=kv_blocks, device=self.device, attn_num_blocks=attn_blocks,
                                           **prefix_kw)
        make_runner = getattr(self.model, "make_runner", None)   # a tensor-parallel model runs every rank
        if make_runner is not None:
            self.runner = make_runner(self.cache, self.num_slots, cuda_graphs=cuda_graphs, pad_batches=pad_batches,
                                      runner_cls=ModelRunner)
        else:
            self.runner = ModelRunner(self.model, self.cache, self.device, self.num_slots, cuda_graphs=cuda_graphs,
                                      pad_batches=pad_batches)
        self.sampler = Sampler(self.device, seed, num_slots=self.num_slots + 1, vocab_size=self.vocab_size)
        self.stats = {"steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "generated": 0}
        self.prefix_cache = None if ps is None else PrefixCache(
            self.cache, ec.kv_block_size, ps.blocks, ps.checkpoints, ps.interval, stats=self.stats)
        self.blocks = BlockManager(self.cache, self.memory, ec.memory_budget, self.num_slots, ec.max_seq_len,
                                   prefix=self.prefix_cache, prefix_bytes=store_bytes)
        self.scheduler = Scheduler(self.blocks, ec.max_num_batched_tokens)
        self.drafter = self._make_drafter(sp, self.num_slots, T)
        self._requests: dict = {}            # unfinished requests by id (abort, outputs)
        self._tree_needs_state = False
        self.capture_s = 0.0
        if self.runner.use_graphs:  # every graph a step can need, before the first request
            t0 = time.perf_counter()
            self.runner.capture(self._spec_shapes(), self._sampled_shapes())
            draft_runner = getattr(self.drafter, "runner", None)
            if draft_runner is not None:
                draft_runner.capture()
            self.capture_s = time.perf_counter() - t0

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine's caches; stop tensor-parallel workers the engine started itself
        (a model passed in stays usable).  The engine cannot step afterwards."""
        for obj in (self.runner, self.cache):
            release = getattr(obj, "close", None)
            if release is not None:
                release()
        if self._owns_model and hasattr(self.model, "close"):
            self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- construction helpers -----------------------------------------------------------
    def _plan_prefix_store(self):
        """Size of the prefix store (:func:`~replayssm.engine.prefix_cache.plan_store`), or None
        without prefix caching.  Its per-slot bookkeeping joins each slot's fixed part."""
        ec = self.config
        if not ec.enable_prefix_caching:
            return None
        if "prefix_blocks" not in inspect.signature(self.model.make_cache).parameters or \
                not getattr(self.layout, "prefix_block_bytes", 0):
            raise ValueError(f"enable_prefix_caching=True needs a model whose cache has a prefix store "
                             f"(replayssm.models with SSM layers); {type(self.model).__name__} has none")
        self.memory.fixed += self.layout.prefix_slot_bytes
        return plan_store(self.layout, budget=ec.memory_budget, fraction=ec.prefix_cache_fraction,
                          blocks=ec.prefix_cache_blocks, interval=ec.prefix_checkpoint_interval,
                          num_slots=ec.max_num_seqs, max_seq_len=ec.max_seq_len)

    def _plan_slots(self) -> int:
        """Concurrent sequences: ``max_num_seqs``, or fewer when the budget's fixed part
        (one sequence with one verify window) says so."""
        ec, need = self.config, self.memory.need(self.config.max_new + 1)
        if self._budget is None:
            return ec.max_num_seqs
        fit = self._budget // max(1, need)
        if fit < 1:
            raise ValueError(f"memory_budget {fmt_bytes(ec.memory_budget)} is smaller than one sequence "
                             f"({fmt_bytes(need)})" + (" plus the prefix store" if self.prefix_store else ""))
        return int(min(ec.max_num_seqs, fit))

    def _plan_pools(self) -> tuple[int | None, int | None]:
        """Blocks of the KV-only pool and of the attention pool (``None``: a static pool,
        ``max_seq_len`` per slot).  ``auto`` gives each slot KV-only room up to the switch
        threshold; with a memory budget, what the slots' fixed parts leave is split over the
        pools that grow with each token (one block of each per block of tokens)."""
        ec, mem = self.config, self.memory
        kv = attn = None
        if ec.decode_mode == "auto":
            kv = self.num_slots * auto_kv_blocks(self.auto_threshold, ec.max_new, ec.kv_block_size)
        static = self.num_slots * -(-ec.max_seq_len // ec.kv_block_size)
        if self._budget is not None:
            per_block = (mem.kv_block_bytes if ec.decode_mode == "kv" else 0) + mem.attn_block_bytes
            if per_block:
                n = int(max(1, min(static, (self._budget - self.num_slots * mem.fixed) // per_block)))
                kv = n if ec.decode_mode == "kv" else kv
                attn = n if mem.attn_block_bytes else None
        if self.prefix_store is not None and mem.attn_block_bytes:
            # shared attention blocks: a finite pool (blocks drawn as contexts grow) plus the
            # blocks the prefix store may hold
            attn = (static if attn is None else attn) + self.prefix_store.blocks
        return kv, attn

    def _spec_shapes(self) -> list[tuple[int, bool]]:
        """``(nodes, tree)`` of the verify steps the drafter proposes (fixed shapes only; an
        n-gram trie's size varies per step, so its graphs are captured when first needed)."""
        sp = self.config.speculative
        if sp is None:
            return []
        if sp.method in ("ngram", "draft"):
            return [(sp.num_tokens + 1, False)]
        if sp.method == "mtp":
            return [(self.drafter.num_nodes, self.drafter.tree)]
        if self.draft_model is not None:
            return [(self.drafter.num_nodes, True)]
        return []

    def _sampled_shapes(self) -> list[tuple[int, bool, bool]]:
        """``(nodes, tree, draft distributions)`` of sampled speculative steps (fixed shapes)."""
        sp = self.config.speculative
        has_q = self.draft_model is not None or (sp is not None and sp.method == "mtp")
        return [(n, tree, has_q) for n, tree in self._spec_shapes()]

    def _make_drafter(self, sp: SpeculativeConfig | None, num_slots: int, T: int):
        if sp is None:
            return None
        if sp.method == "ngram":
            # with CUDA graphs, chains are padded to num_tokens drafts: one graph per batch bucket
            return spec.NgramDrafter(sp.num_tokens, sp.prompt_lookup_min, sp.prompt_lookup_max, self.device,
                                     pad=self.runner.use_graphs)
        if sp.method == "tree" and self.draft_model is None:
            return spec.NgramTreeDrafter(sp.tree_width, sp.depth, sp.prompt_lookup_min, sp.prompt_lookup_max,
                                         self.device)
        ec = self.config
        if sp.method == "mtp":
            return MTPDrafter(self.model, self.cache, self.sampler, self.device, num_slots, sp.num_tokens,
                              tree=sp.tree, cache_mode=ec.draft_mode, buffer_size=ec.buffer_size, max_new=T,
                              max_seq_len=ec.max_seq_len, kv_block_size=ec.kv_block_size,
                              cuda_graphs=self.runner.use_graphs, pad_batches=self.runner.pad_batches)
        dcache = self.draft_model.make_cache(num_slots + 1, mode=ec.draft_mode, buffer_size=ec.buffer_size,
                                             max_new=T, max_seq_len=ec.max_seq_len,
                                             kv_block_size=ec.kv_block_size, device=self.device)
        graphs = ec.cuda_graphs and self.device.type == "cuda"
        if sp.method == "draft":
            return spec.DraftModelDrafter(self.draft_model, dcache, self.sampler, self.device, num_slots,
                                          sp.num_tokens, cuda_graphs=graphs)
        return spec.DraftTreeDrafter(self.draft_model, dcache, self.sampler, self.device, num_slots, sp.tree,
                                     sp.tree_width, sp.depth, cuda_graphs=graphs)

    # -- requests -------------------------------------------------------------------------
    def encode(self, prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt, validated (:mod:`replayssm.engine.inputs`)."""
        return encode_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None) -> Sequence:
        """Queue one request (validated first: a bad one raises ``ValueError`` and queues
        nothing).  ``request_id`` (any hashable, default a fresh int) names it for
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
        seq = Sequence(ids, params, request_id=request_id)
        for i in range(1, params.n):   # the other samples: own generators, one shared prefill
            sp = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            sib = Sequence(ids, sp, request_id=(seq.request_id, i))
            sib.group_id, sib.index, sib.group = seq.request_id, i, seq.group
            seq.group.append(sib)
        for s in seq.group:
            s.prompt_text = text
            if self.tokenizer is not None:
                s.detok = Detokenizer(self.tokenizer, ids)
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
        return self.scheduler.has_unfinished()

    def warm_up(self, max_prompt_len: int | None = None) -> float:
        """Run every kind of step once before serving, so no request waits for a compile.

        Triton compiles a kernel variant when a shape bucket is first met (seconds each on
        a GPU): without this, the first requests of each bucket stall for everyone in flight.
        Waves of greedy requests through the normal scheduler, two tokens each (prefill
        then a decode or speculative step): one 8-token prompt (the small-prompt tiles); a
        full batch of ``max_num_seqs`` prompts sharing the step's token budget (up to 256
        tokens each: a burst of arrivals, many sequences in one prefill, the allocator's
        largest activations); one prompt of ``max_prompt_len`` (default: the token budget, at
        most the context less two tokens; long-prompt tiles and chunking); with prefix caching,
        that prompt again with its last token changed (a resume from a checkpoint).  Afterwards no slot
        is held, the prefix cache is emptied and the engine's counters are zero.  Only for an
        idle engine; returns seconds.
        """
        if self.has_unfinished():
            raise RuntimeError("warm_up() needs an idle engine (requests are in flight)")
        ec, V = self.config, self.vocab_size
        long = min(ec.max_num_batched_tokens, ec.max_seq_len - 2) if max_prompt_len is None else max_prompt_len
        if not 1 <= long <= ec.max_seq_len - 2:
            raise ValueError(f"max_prompt_len must be in [1, max_seq_len - 2 = {ec.max_seq_len - 2}], got {long}")
        ids = lambda i, n: [(7919 * i + 104729 * j + 1) % V for j in range(n)]
        burst = min(ec.max_seq_len - 2, 256, max(8, ec.max_num_batched_tokens // self.num_slots))
        waves = [[ids(0, min(8, long))], [ids(1 + i, burst) for i in range(self.num_slots)], [ids(0, long)]]
        if self.prefix_cache is not None and long >= 2:
            # a hit on the long prompt but its last token: a resume from its last checkpoint
            p = waves[2][0]
            waves.append([p[:-1] + [(p[-1] + 1) % V]])
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        for w, prompts in enumerate(waves):
            for i, p in enumerate(prompts):
                self.add_request(p, params, request_id=("warm-up", w, i))
            while self.has_unfinished():
                self.step()
        if self.prefix_cache is not None:
            while self.prefix_cache.index.evict_one():
                pass
            self.prefix_cache.index.evictions = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for k, v in self.stats.items():
            if isinstance(v, (int, float)):
                self.stats[k] = type(v)(0)
        return time.perf_counter() - t0

    def output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq)

    def occupancy(self) -> dict:
        """Running / waiting requests, free and total slots, free KV-only blocks (-1: none)."""
        pidx = getattr(self.cache, "pidx", None)
        occ = {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
               "free_slots": len(self.blocks.free_slots), "total_slots": self.num_slots,
               "free_kv_blocks": pidx.free_blocks if pidx is not None else -1}
        return {**occ, **self.prefix_stats()}

    def prefix_stats(self) -> dict:
        """Prefix-cache counters and hit rate (:meth:`PrefixCache.snapshot`); empty when off."""
        return {} if self.prefix_cache is None else self.prefix_cache.snapshot()

    def recover(self) -> None:
        """After a step raised half-way: forget the verify that will never be committed
        (target and draft caches), so that aborts and the next steps can run."""
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
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        new, t1 = self._run(batch)
        self.stats["steps"] += 1
        self.stats["prefill_s"] += t1 - t0
        self.stats["decode_s"] += time.perf_counter() - t1
        return self._postprocess(batch, new)

    def _run(self, batch: ScheduledBatch) -> tuple[list[Step], float]:
        """Run the model for this step: prefill the admitted prompts, then one decode or
        speculative step for the running sequences.  Returns the new tokens per sequence and
        the time the prefill part ended."""
        new = self._prefill(batch.prefill) if batch.prefill else []
        t1 = time.perf_counter()
        if batch.running:
            new += self._speculate(batch.running) if self._speculates(len(batch.running)) \
                else self._decode(batch.running)
        return new, t1

    def _speculates(self, batch: int) -> bool:
        """Whether a step of ``batch`` running sequences speculates (``disable_by_batch_size``)."""
        if self.drafter is None:
            return False
        limit = self.config.speculative.disable_by_batch_size
        return limit is None or batch <= limit

    def _postprocess(self, batch: ScheduledBatch, new: list[Step]):
        """Append tokens (stop criteria), free finished sequences, switch KV-only ones that
        reached the threshold to a state."""
        advanced = []
        for s, toks, lps in new:
            if toks:
                advanced.append(s)
                self._append(s, toks, lps)
        finished = list(batch.rejected)
        to_switch = []
        for s in list(self.scheduler.running):
            if s.finish_reason is not None:
                self._finish(s)
                finished.append(s)
            elif self.config.decode_mode == "auto" and s.mode == "kv" and not s.prefilling \
                    and s.num_cached >= self.auto_threshold:
                to_switch.append(s)
        self.blocks.switch_to_state(to_switch)
        for s in finished:
            if all(m.is_finished for m in s.group):
                self._requests.pop(s.group_id, None)
        return advanced, finished

    def _finish(self, s: Sequence) -> None:
        if self.drafter is not None and s.slot is not None:
            self.drafter.release(s)
        self.scheduler.finish(s, s.finish_reason or "stop")

    # -- running the model --------------------------------------------------------------------
    def _prefill(self, items: list[tuple[Sequence, int]]) -> list[Step]:
        """Prefill this step's prompt chunks (each continues its sequence; a chunk of 0 tokens
        is a sample waiting for its first sample); sequences whose prompt is now complete
        sample their first token — the waiting samples of a completed request copy its cache
        (``cache.fork``) and sample from its logits."""
        chunks = [(s, n) for s, n in items if n > 0]
        waiting = [s for s, n in items if n == 0]
        if self.config.decode_mode == "auto":
            # prompts already past the threshold skip the KV-only form: an empty slot switched
            # to a (zero) state prefills straight into it; each form prefills in its own call
            self.blocks.switch_to_state([s for s, _ in chunks if s.num_prompt_tokens >= self.auto_threshold and (
                s.num_prefilled == 0 or (s.prefix is not None and s.prefix.load is not None))])
        if self.prefix_cache is not None:
            chunks = self._prefix_before(chunks)
        fits = set(id(s) for s in self.blocks.reserve([(s, s.num_prefilled + n) for s, n in chunks]))
        chunks = [(s, n) for s, n in chunks if id(s) in fits]
        groups = [chunks]
        if self.config.decode_mode == "auto":
            groups = [[c for c in chunks if self.cache.mode_of(c[0].slot) == m] for m in ("kv", "replay")]
        logits, order = [], []
        for g in groups:
            if not g:
                continue
            lg = self.runner.prefill([s.slot for s, _ in g],
                                     [s.prompt_ids[s.num_prefilled:s.num_prefilled + n] for s, n in g])
            for (s, n), row in zip(g, lg):
                s.num_prefilled += n
                s.mode = self.cache.mode_of(s.slot)
                if self.prefix_cache is not None:
                    self.prefix_cache.after_prefill(s)
                if not s.prefilling:
                    logits.append(row)
                    order.append(s)
            if self.prefix_cache is not None:
                self.prefix_cache.write_checkpoints()
        done = {id(s): i for i, s in enumerate(order)}
        forked = [s for s in waiting if id(s.group[0]) in done]
        if forked:
            by_head: dict = {}
            for s in forked:
                by_head.setdefault(id(s.group[0]), (s.group[0], []))[1].append(s)
            for head, sibs in by_head.values():
                self.cache.fork(head.slot, [s.slot for s in sibs])
            for s in forked:
                s.num_prefilled, s.mode = s.num_prompt_tokens, self.cache.mode_of(s.slot)
                logits.append(logits[done[id(s.group[0])]])
            order = order + forked
        if not order:
            return []
        logits = torch.stack(logits, 0)
        if self.drafter is not None:
            self.drafter.prefill(order)
        self.sampler.start(order)
        sb = self.sampler.batch(order)
        toks = self.sampler.sample(logits, order, sb)
        lps = self._logprobs_host(logits, toks, sb)
        for s in order:
            s.num_steps += 1
        return [(s, [t], None if lps is None else [lps[b]]) for b, (s, t) in enumerate(zip(order, toks.tolist()))]

    def _prefix_before(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Resume prefix-cache hits (before a sequence's first chunk) and mark the prompt
        blocks this step's chunks capture.  A hit that cannot be loaded (a pool ran dry)
        ends that request with an error; the others go on."""
        hits = [s for s, _ in chunks if s.prefix is not None and s.prefix.load is not None]
        failed = set()
        for s, e in zip(hits, self.prefix_cache.load_many(hits)):   # one batched load for all hits
            if e is not None:
                s.error, s.finish_reason = f"prefix cache: resuming the cached prefix failed: {e}", "error"
                failed.add(id(s))
            else:
                s.mode = self.cache.mode_of(s.slot)
        ok = []
        for s, n in chunks:
            if id(s) not in failed:
                self.prefix_cache.before_prefill(s, n)
                ok.append((s, n))
        return ok

    def _decode(self, seqs: list[Sequence], reserve: bool = True) -> list[Step]:
        if reserve:
            seqs = self.blocks.reserve_tokens(seqs, 1)
            if not seqs:
                return []
            if self.drafter is not None:   # speculation is off for this step (disable_by_batch_size)
                self.drafter.plain_step(seqs)
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        logits = self.runner.decode([s.slot for s in seqs], toks)
        sb = None if all(_plain(s.params) for s in seqs) else self.sampler.batch(seqs)  # plain: argmax
        out = self.sampler.sample(logits, seqs, sb)
        lps = self._logprobs_host(logits, out, sb)
        for s in seqs:
            s.num_steps += 1
        return [(s, [t], None if lps is None else [lps[b]]) for b, (s, t) in enumerate(zip(seqs, out.tolist()))]

    @staticmethod
    def _logprobs_host(logits: Tensor, toks: Tensor, sb) -> list | None:
        """Per row ``(logprob of the sampled token, [(id, logprob), ...] top alternatives)``."""
        if sb is None or sb.logprobs < 0:
            return None
        chosen, vals, idx = token_logprobs(logits, toks, sb.logprobs)
        return _lp_rows(chosen.tolist(), vals.tolist(), idx.tolist())

    def _speculate(self, seqs: list[Sequence]) -> list[Step]:
        seqs = self.blocks.reserve_tokens(seqs, self.config.max_new)
        if not seqs:
            return []
        prop = self.drafter.propose(seqs)
        if prop is None:  # nothing to draft anywhere: a plain decode step
            out = self._decode(seqs, reserve=False)
            for s in seqs:
                s.accepted_lengths.append(1)
            return out
        slots = [s.slot for s in seqs]
        greedy = all(_plain(s.params) for s in seqs)   # the fast greedy step
        if prop.tree and self._tree_needs_state:
            self.blocks.switch_to_state([s for s in seqs if s.mode == "kv"])
        try:
            accepted, bonus, path, lps = self._verify_accept_commit(seqs, slots, prop, greedy)
        except NotImplementedError as e:
            # the model has no KV-only tree verify (it raises before touching the cache):
            # give these requests a state (exact: one flush) and verify in replay form
            kv = [s for s in seqs if s.mode == "kv"]
            if not (prop.tree and kv):
                raise
            warnings.warn(f"tree speculation: KV-only slots switched to state form ({e})", stacklevel=2)
            self._tree_needs_state = True
            self.blocks.switch_to_state(kv)
            accepted, bonus, path, lps = self._verify_accept_commit(seqs, slots, prop, greedy)
        # the step's one host sync: everything the host needs in one transfer
        N = prop.tokens.shape[1]
        parts = [accepted[:, None], bonus[:, None], prop.num_drafts[:, None], prop.tokens]
        if path is not None:
            parts.append(path)
        host = torch.cat([x.long() for x in parts], 1).tolist()
        lp_rows = None
        if lps is not None:
            chosen, vals, idx = (x.tolist() for x in lps)
            lp_rows = [_lp_rows(c, v, i) for c, v, i in zip(chosen, vals, idx)]
        self.drafter.accepted(seqs, [r[0] for r in host], path)
        out = []
        for b, (s, row) in enumerate(zip(seqs, host)):
            a, bonus_b, ndraft, toks = row[0], row[1], row[2], row[3:3 + N]
            nodes = row[3 + N:3 + N + a][1:] if path is not None else range(1, a)
            s.num_steps += 1
            s.num_verify_steps += 1
            s.num_drafted += ndraft
            s.num_accepted_drafts += a - 1
            s.accepted_lengths.append(a)
            out.append((s, [toks[i] for i in nodes] + [bonus_b], None if lp_rows is None else lp_rows[b][:a]))
        return out

    def _verify_accept_commit(self, seqs, slots, prop, greedy: bool):
        """One device-side step (a CUDA graph when enabled): verify, accept, commit.
        Returns ``(accepted, bonus, path, logprobs | None)``."""
        if greedy:
            return (*self.runner.greedy_verify_step(slots, prop.tokens, prop.parent, prop.valid, prop.tree), None)
        sb = self.sampler.batch(seqs)
        u = self.sampler.uniforms(seqs, prop.tokens.shape[1] + 1)
        return self.runner.sampled_verify_step(slots, prop.tokens, prop.parent, prop.valid, prop.tree, prop.q, sb, u)

    # -- postprocessing ---------------------------------------------------------------------
    def _append(self, s: Sequence, toks: list[int], lps: list | None = None) -> None:
        """Append accepted tokens until one ends the request (EOS, a stop token, the length
        limit, or a stop string completed in the incrementally decoded text: the text is cut
        before the stop string and later tokens of the step are dropped)."""
        p = s.params
        cap = s.token_cap if s.token_cap is not None else self.scheduler.token_limit
        eos = self.eos_token_id
        kept = 0
        for t in toks:
            t = int(t)
            s.output_ids.append(t)
            if s.logprobs is not None and lps is not None and kept < len(lps):
                s.logprobs.append(lps[kept])
            kept += 1
            self.stats["generated"] += 1
            is_eos = eos is not None and (t in eos if isinstance(eos, (list, tuple, set)) else t == eos)
            if t in p.stop_token_ids or (is_eos and not p.ignore_eos):
                s.finish_reason = "stop"
            elif s.detok is not None:
                piece = s.detok.push(t)
                cut = find_stop(s.detok.text, len(piece), p.stop)
                if cut is not None:
                    s.stop_text_cut = cut
                    s.detok.text = s.detok.text[:cut]
                    s.finish_reason = "stop"
            if s.finish_reason is None and (len(s.output_ids) >= p.max_tokens or s.num_tokens >= cap):
                s.finish_reason = "length"
            if s.finish_reason is not None:
                break
        self.sampler.observe(s, toks[:kept])


#: one sequence's result of a step: (sequence, new tokens, per-token logprobs or None)
Step = tuple


def _plain(p: SamplingParams) -> bool:
    """Greedy with no penalties and no logprobs: the argmax fast path."""
    return p.greedy and not p.penalized and p.logprobs is None


def _lp_rows(chosen: list, vals: list, idx: list) -> list:
    """Host lists -> ``[(logprob, [(token id, logprob), ...]), ...]``."""
    return [(c, list(zip(i, v))) for c, v, i in zip(chosen, vals, idx)]
