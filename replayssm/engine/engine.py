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

import time
import warnings

import torch

from ..cache.tree import path_to
from ..runtime import canonical_device
from . import speculative as spec
from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .loading import is_model, load, parse_dtype
from .memory import MemoryModel, default_auto_threshold, fmt_bytes, memory_model
from .model_runner import ModelRunner
from .mtp_drafter import MTPDrafter, mtp_head_of
from .outputs import RequestOutput, request_output
from .sampler import Sampler, accept_tree
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus


class LLMEngine:
    """Continuous-batching engine over one model (and an optional draft model).

    ``model``: a Hugging Face-layout directory or an already loaded model object.
    ``decode_mode``: ``"recurrent"`` (state read+written every token; with speculation the
    snapshot baseline), ``"replay"`` (checkpoint + ring buffer), ``"kv"`` (KV-only, no
    state) or ``"auto"`` (KV-only while a request's context is shorter than
    ``auto_threshold`` tokens, then one flush into a state and replay; the default threshold
    is where KV-only stops reading fewer bytes than replay, from the cache's real sizes —
    :func:`replayssm.engine.memory.default_auto_threshold`).
    ``memory_budget``: bytes of cache the scheduler may reserve (``None``: on CUDA,
    ``gpu_memory_utilization`` of the free device memory; on CPU only ``max_num_seqs``
    limits concurrency).

    Not thread-safe: one thread (an event loop's engine task) calls ``add_request``,
    ``abort`` and ``step``.
    """

    def __init__(self, model, device="cpu", dtype="float32", decode_mode: str = "replay",
                 buffer_size: int = 16, speculative: SpeculativeConfig | None = None,
                 max_num_seqs: int = 16, memory_budget: int | None = None, max_seq_len: int = 2048,
                 kv_block_size: int = 16, auto_threshold: int | None = None, cuda_graphs: bool = False,
                 seed: int = 0, tokenizer=None, pad_batches: bool = False,
                 max_prefill_tokens: int = 4096, gpu_memory_utilization: float | None = 0.8):
        self.config = ec = EngineConfig(
            decode_mode=decode_mode, buffer_size=buffer_size, max_num_seqs=max_num_seqs,
            memory_budget=memory_budget, max_seq_len=max_seq_len, kv_block_size=kv_block_size,
            auto_threshold=auto_threshold, speculative=speculative, cuda_graphs=cuda_graphs, seed=seed,
            max_prefill_tokens=max_prefill_tokens)
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but CUDA is not available")
        # as tensors report it ("cuda" -> "cuda:<current>", "cpu:0" -> "cpu"): compare equal
        self.device = canonical_device(self.device)
        if is_model(model):
            self.model, self.tokenizer = model, tokenizer
            if isinstance(getattr(model, "dtype", None), torch.dtype):
                self.dtype = model.dtype  # a loaded model keeps its own dtype
        else:
            mtp = ec.speculative is not None and ec.speculative.method == "mtp"
            self.model, tok = load(model, self.device, self.dtype, mtp=mtp)
            self.tokenizer = tokenizer if tokenizer is not None else tok
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_id = getattr(cfg, "eos_token_id", None)  # an id, a list of ids, or None
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
        self.auto_threshold = ec.auto_threshold or default_auto_threshold(self.layout, ec.buffer_size)
        self.memory: MemoryModel = memory_model(self.layout, ec.decode_mode, T, self.vocab_size,
                                                self.auto_threshold, draft_layout)
        if ec.memory_budget is None and self.device.type == "cuda" and gpu_memory_utilization:
            # like vLLM's gpu_memory_utilization: caches may take this share of the free memory
            free, _ = torch.cuda.mem_get_info(self.device)
            ec.memory_budget = int(free * gpu_memory_utilization)
        self.num_slots = self._plan_slots()
        self.cache = self.model.make_cache(self.num_slots + 1, mode=ec.cache_mode, buffer_size=ec.buffer_size,
                                           max_new=T, max_seq_len=ec.max_seq_len, kv_block_size=ec.kv_block_size,
                                           kv_num_blocks=self._plan_kv_blocks(), device=self.device)
        self.runner = ModelRunner(self.model, self.cache, self.device, self.num_slots, cuda_graphs=cuda_graphs,
                                  pad_batches=pad_batches)
        self.sampler = Sampler(self.device, seed)
        self.blocks = BlockManager(self.cache, self.memory, ec.memory_budget, self.num_slots, ec.max_seq_len)
        self.scheduler = Scheduler(self.blocks, ec.max_prefill_tokens)
        self.drafter = self._make_drafter(sp, self.num_slots, T)
        self.stats = {"steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "generated": 0}
        self._requests: dict = {}            # unfinished requests by id (abort, outputs)
        self._tree_needs_state = False
        self.capture_s = 0.0
        if self.runner.use_graphs:  # every graph a step can need, before the first request
            t0 = time.perf_counter()
            self.runner.capture(self._spec_shapes())
            draft_runner = getattr(self.drafter, "runner", None)
            if draft_runner is not None:
                draft_runner.capture()
            self.capture_s = time.perf_counter() - t0

    # -- construction helpers -----------------------------------------------------------
    def _plan_slots(self) -> int:
        """Concurrent sequences: ``max_num_seqs``, or fewer when the budget's fixed part
        (one sequence with one verify window) says so."""
        ec, need = self.config, self.memory.need(self.config.max_new + 1)
        if ec.memory_budget is None:
            return ec.max_num_seqs
        fit = ec.memory_budget // max(1, need)
        if fit < 1:
            raise ValueError(f"memory_budget {fmt_bytes(ec.memory_budget)} is smaller than one sequence "
                             f"({fmt_bytes(need)})")
        return int(min(ec.max_num_seqs, fit))

    def _plan_kv_blocks(self) -> int | None:
        """Blocks of the KV-only pool (``None``: a static pool, ``max_seq_len`` per slot)."""
        ec, T = self.config, self.config.max_new
        if ec.cache_mode != "kv":
            return None
        per_seq = ec.max_seq_len if ec.decode_mode == "kv" else self.auto_threshold + 2 * T + ec.kv_block_size
        blocks_per_seq = -(-per_seq // ec.kv_block_size) + 1
        blocks = blocks_per_seq * self.num_slots
        if ec.memory_budget is not None and self.memory.kv_block_bytes:
            # the scheduler keeps reservations within the budget; one spare block per slot
            # absorbs rounding to whole blocks
            budget_blocks = ec.memory_budget // self.memory.kv_block_bytes + self.num_slots
            blocks = max(blocks_per_seq, min(blocks, budget_blocks))
        return blocks

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
        """``(text | None, token ids)`` of a prompt (a string or a list of ids), validated."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (tokenizer.json in the model directory); "
                                 "pass token id lists instead")
            ids = self.tokenizer.encode(prompt).ids
            text = prompt
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None
            text = None
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return text, ids

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None) -> Sequence:
        """Queue one request (validated first: a bad one raises ``ValueError`` and queues
        nothing).  ``request_id`` (any hashable, default a fresh int) names it for
        :meth:`abort` and in :meth:`step`'s outputs; returns its :class:`Sequence`."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.encode(prompt)
        seq = Sequence(ids, params, request_id=request_id)
        seq.prompt_text = text
        self.scheduler.add(seq)
        self._requests[seq.request_id] = seq
        return seq

    def abort(self, request_id) -> bool:
        """Stop a request between steps: a waiting one leaves the queue, a running one frees
        its slot and cache at once.  Returns False when no unfinished request has that id."""
        seq = self._requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = "abort"
        self._finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.tokenizer)

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

    def _run(self, batch: ScheduledBatch) -> tuple[list[tuple[Sequence, list[int]]], float]:
        """Run the model for this step: prefill the admitted prompts, then one decode or
        speculative step for the running sequences.  Returns the new tokens per sequence and
        the time the prefill part ended."""
        new = self._prefill(batch.prefill) if batch.prefill else []
        t1 = time.perf_counter()
        if batch.running:
            new += self._decode(batch.running) if self.drafter is None else self._speculate(batch.running)
        return new, t1

    def _postprocess(self, batch: ScheduledBatch, new: list[tuple[Sequence, list[int]]]):
        """Append tokens (stop criteria), free finished sequences, switch KV-only ones that
        reached the threshold to a state."""
        advanced = []
        for s, toks in new:
            if toks:
                advanced.append(s)
                self._append(s, toks)
        finished = list(batch.rejected)
        to_switch = []
        for s in list(self.scheduler.running):
            if s.finish_reason is not None:
                self._finish(s)
                finished.append(s)
            elif self.config.decode_mode == "auto" and s.mode == "kv" and s.num_cached >= self.auto_threshold:
                to_switch.append(s)
        self.blocks.switch_to_state(to_switch)
        for s in finished:
            self._requests.pop(s.request_id, None)
        return advanced, finished

    def _finish(self, s: Sequence) -> None:
        if self.drafter is not None and s.slot is not None:
            self.drafter.release(s)
        self.scheduler.finish(s, s.finish_reason or "stop")

    # -- running the model --------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        if self.config.decode_mode == "auto":
            # prompts already past the threshold skip the KV-only form: an empty slot switched
            # to a (zero) state prefills straight into it; prefill each form separately
            long = [s for s in seqs if s.num_prompt_tokens >= self.auto_threshold]
            short = [s for s in seqs if s.num_prompt_tokens < self.auto_threshold]
            self.blocks.switch_to_state(long)
            if short and long:
                return self._prefill_groups(short) + self._prefill_groups(long)
            seqs = short + long
        return self._prefill_groups(seqs)

    def _prefill_groups(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """Prefill in groups of at most ``max_prefill_tokens`` padded tokens; sample each
        sequence's first token."""
        groups, group, width = [], [], 0
        for s in seqs:
            w = max(width, s.num_prompt_tokens)
            if group and w * (len(group) + 1) > self.config.max_prefill_tokens:
                groups.append(group)
                group, w = [], s.num_prompt_tokens
            group.append(s)
            width = w
        if group:
            groups.append(group)
        fits = set(id(s) for s in self.blocks.reserve_tokens([s for g in groups for s in g], 0))
        groups = [g for g in ([s for s in g if id(s) in fits] for g in groups) if g]
        if not groups:
            return []
        logits, order = [], []
        for g in groups:
            logits.append(self.runner.prefill([s.slot for s in g], [s.prompt_ids for s in g]))
            order.extend(g)
        if self.drafter is not None:
            self.drafter.prefill(order)
        toks = self.sampler.sample(torch.cat(logits, 0), order).tolist()
        for s in order:
            s.mode = self.cache.mode_of(s.slot)
            s.num_steps += 1
        return [(s, [t]) for s, t in zip(order, toks)]

    def _decode(self, seqs: list[Sequence], reserve: bool = True) -> list[tuple[Sequence, list[int]]]:
        if reserve:
            seqs = self.blocks.reserve_tokens(seqs, 1)
            if not seqs:
                return []
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        logits = self.runner.decode([s.slot for s in seqs], toks)
        out = self.sampler.sample(logits, seqs).tolist()
        for s in seqs:
            s.num_steps += 1
        return [(s, [t]) for s, t in zip(seqs, out)]

    def _speculate(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
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
        greedy = all(s.params.greedy for s in seqs)
        if prop.tree and self._tree_needs_state:
            self.blocks.switch_to_state([s for s in seqs if s.mode == "kv"])
        try:
            accepted, bonus, path = self._verify_accept_commit(seqs, slots, prop, greedy)
        except NotImplementedError as e:
            # the model has no KV-only tree verify (it raises before touching the cache):
            # give these requests a state (exact: one flush) and verify in replay form
            kv = [s for s in seqs if s.mode == "kv"]
            if not (prop.tree and kv):
                raise
            warnings.warn(f"tree speculation: KV-only slots switched to state form ({e})", stacklevel=2)
            self._tree_needs_state = True
            self.blocks.switch_to_state(kv)
            accepted, bonus, path = self._verify_accept_commit(seqs, slots, prop, greedy)
        # the step's one host sync: everything the host needs in one transfer
        N = prop.tokens.shape[1]
        parts = [accepted[:, None], bonus[:, None], prop.num_drafts[:, None], prop.tokens]
        if path is not None:
            parts.append(path)
        host = torch.cat([x.long() for x in parts], 1).tolist()
        self.drafter.accepted(seqs, [r[0] for r in host], path)
        out = []
        for s, row in zip(seqs, host):
            a, bonus_b, ndraft, toks = row[0], row[1], row[2], row[3:3 + N]
            nodes = row[3 + N:3 + N + a][1:] if path is not None else range(1, a)
            s.num_steps += 1
            s.num_verify_steps += 1
            s.num_drafted += ndraft
            s.num_accepted_drafts += a - 1
            s.accepted_lengths.append(a)
            out.append((s, [toks[i] for i in nodes] + [bonus_b]))
        return out

    def _verify_accept_commit(self, seqs, slots, prop, greedy: bool):
        if greedy:  # one device-side step (a CUDA graph when enabled)
            return self.runner.greedy_verify_step(slots, prop.tokens, prop.parent, prop.valid, prop.tree)
        if prop.tree:
            logits = self.runner.verify_tree(slots, prop.tokens, prop.parent)
        else:
            logits = self.runner.verify(slots, prop.tokens)
        p = self.sampler.probs(logits, seqs)
        u = self.sampler.uniforms(seqs, prop.tokens.shape[1] + 1)
        accepted, leaf, bonus = accept_tree(p, prop.tokens, prop.parent, prop.valid, prop.q, u)
        path = None
        if prop.tree:
            path, _ = path_to(prop.parent, leaf)
            self.runner.commit(accepted, path)
        else:
            self.runner.commit(accepted)
        return accepted, bonus, path

    # -- postprocessing ---------------------------------------------------------------------
    def _append(self, s: Sequence, toks: list[int]) -> None:
        """Append sampled tokens until a stop criterion (EOS, stop ids, length, stop text)."""
        p = s.params
        cap = s.token_cap if s.token_cap is not None else self.scheduler.token_limit
        eos = self.eos_token_id
        for t in toks:
            s.output_ids.append(int(t))
            self.stats["generated"] += 1
            is_eos = eos is not None and (t in eos if isinstance(eos, (list, tuple, set)) else t == eos)
            if t in p.stop_token_ids or (is_eos and not p.ignore_eos):
                s.finish_reason = "stop"
            elif len(s.output_ids) >= p.max_tokens or s.num_tokens >= cap:
                s.finish_reason = "length"
            if s.finish_reason is not None:
                break
        if p.stop and self.tokenizer is not None and s.finish_reason in (None, "length"):
            text = self.tokenizer.decode(s.output_ids)
            hits = [text.find(x) for x in p.stop if x in text]
            if hits:
                s.stop_text_cut = min(hits)
                s.finish_reason = "stop"
