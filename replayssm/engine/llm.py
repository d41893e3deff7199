"""The user-facing engine: :class:`LLM` and :class:`RequestOutput`.

``LLM.generate`` adds requests and runs :meth:`LLM.step` until all finish.  A step admits
waiting requests (continuous batching), prefills them, then advances every running
request by one decode step or one speculative verify step (draft, verify, accept,
commit).  Per-sequence decisions inside a step — fill levels, flushes, accepted counts —
are device data for the model; the host syncs once per step to append sampled tokens.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..runtime import check_device
from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .inputs import encode_prompt, prompt_list
from .limits import cache_bytes, check_cache_fits
from .memory import MemoryModel, default_auto_threshold, fmt_bytes, memory_model
from .model_runner import ModelRunner
from .sampler import Sampler, accept_tree
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from . import speculative as spec

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))} or a torch.dtype, got {dtype!r}")


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    num_steps: int = 0               # forward steps that produced tokens (prefill included)
    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0            # accepted draft tokens
    mean_accepted_length: float = 1.0  # tokens produced per decode/verify step
    accepted_lengths: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _load(model, device, dtype):
    from .. import models as _models

    if not os.path.isdir(str(model)):
        raise ValueError(f"model directory not found: {model!r}")
    m = _models.load_model(str(model), device=device, dtype=dtype)
    tok = None
    if hasattr(_models, "load_tokenizer"):
        tok = _models.load_tokenizer(str(model))
    return m, tok


def _is_model(obj) -> bool:
    return all(hasattr(obj, a) for a in ("make_cache", "prefill", "decode", "verify", "commit"))


class LLM:
    """Generate with a Mamba-2 / Gated DeltaNet model.

    ``model``: a Hugging Face-layout directory or an already loaded model object.
    ``decode_mode``: ``"recurrent"`` (state read+written every token; with speculation the
    snapshot baseline), ``"replay"`` (checkpoint + ring buffer), ``"kv"`` (KV-only, no
    state) or ``"auto"`` (KV-only while a request's context is shorter than
    ``auto_threshold`` tokens, then one flush into a state and replay; the default
    threshold is where the traffic model says KV-only stops being cheaper, about ``n`` or
    ``d`` tokens — see :func:`replayssm.engine.memory.default_auto_threshold`).
    ``memory_budget``: bytes of cache the scheduler may reserve (``None``: on CUDA,
    ``gpu_memory_utilization`` of the free device memory; on CPU only ``max_num_seqs``
    limits concurrency).
    """

    def __init__(self, model, device="cpu", dtype="float32", decode_mode: str = "replay",
                 buffer_size: int | None = None, speculative: SpeculativeConfig | None = None,
                 max_num_seqs: int = 16, memory_budget: int | None = None, max_seq_len: int = 2048,
                 kv_block_size: int = 16, auto_threshold: int | None = None, cuda_graphs: bool = False,
                 seed: int = 0, tokenizer=None, pad_batches: bool = False,
                 max_prefill_tokens: int = 4096, gpu_memory_utilization: float | None = 0.8):
        self.config = EngineConfig(decode_mode=decode_mode, buffer_size=buffer_size, max_num_seqs=max_num_seqs,
                                   memory_budget=memory_budget, max_seq_len=max_seq_len,
                                   kv_block_size=kv_block_size, auto_threshold=auto_threshold,
                                   speculative=speculative, cuda_graphs=cuda_graphs, seed=seed,
                                   max_prefill_tokens=max_prefill_tokens)
        # validated, as tensors report it ("cuda" -> "cuda:<current>", "cpu:0" -> "cpu")
        self.device = check_device(device)
        self.dtype = parse_dtype(dtype)
        if _is_model(model):
            self.model, self.tokenizer = model, tokenizer
            if isinstance(getattr(model, "dtype", None), torch.dtype):
                self.dtype = model.dtype  # a loaded model keeps its own dtype
        else:
            self.model, tok = _load(model, self.device, self.dtype)
            self.tokenizer = tokenizer if tokenizer is not None else tok
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_id = getattr(cfg, "eos_token_id", None)  # an id, a list of ids, or None
        act_bytes = torch.finfo(self.dtype).bits // 8
        state_bytes = max(4, act_bytes)
        ec = self.config
        self.auto_threshold = ec.auto_threshold or default_auto_threshold(cfg, ec.buffer_size, act_bytes)
        T = ec.max_new
        self.memory: MemoryModel = memory_model(cfg, ec.decode_mode, ec.buffer_size, T, act_bytes,
                                                state_bytes, self.auto_threshold)
        sp = ec.speculative
        self.draft_model = None
        if sp is not None and sp.draft_model is not None and sp.method in ("draft", "tree"):
            dm = sp.draft_model
            self.draft_model = dm if _is_model(dm) else _load(dm, self.device, self.dtype)[0]
            if int(self.draft_model.config.vocab_size) != self.vocab_size:
                raise ValueError(f"draft model vocab_size {self.draft_model.config.vocab_size} != target "
                                 f"vocab_size {self.vocab_size}")
            self.draft_mode = "recurrent" if ec.decode_mode == "recurrent" else "replay"
            self.memory = self.memory + memory_model(self.draft_model.config, self.draft_mode, ec.buffer_size,
                                                     T, act_bytes, state_bytes)
        if ec.memory_budget is None and self.device.type == "cuda" and gpu_memory_utilization:
            # like vLLM's gpu_memory_utilization: caches may take this share of the free memory
            free, _ = torch.cuda.mem_get_info(self.device)
            ec.memory_budget = int(free * gpu_memory_utilization)
        # concurrency: slots limited by max_num_seqs and by the budget's fixed part
        num_slots = ec.max_num_seqs
        if ec.memory_budget is not None:
            fit = ec.memory_budget // max(1, self.memory.need(T + 1))
            if fit < 1:
                raise ValueError(f"memory_budget {fmt_bytes(ec.memory_budget)} is smaller than one sequence "
                                 f"({fmt_bytes(self.memory.need(T + 1))})")
            num_slots = int(min(num_slots, fit))
        self.num_slots = num_slots
        cache_mode = "kv" if ec.decode_mode in ("kv", "auto") else ec.decode_mode
        kv_blocks = None
        if cache_mode == "kv":
            per_seq_tokens = ec.max_seq_len if ec.decode_mode == "kv" else self.auto_threshold + 2 * T + ec.kv_block_size
            blocks_per_seq = -(-per_seq_tokens // ec.kv_block_size) + 1
            kv_blocks = blocks_per_seq * num_slots
            if ec.memory_budget is not None and self.memory.kv_entry_bytes:
                # the scheduler keeps reservations within the budget; one spare block per slot
                # absorbs rounding to whole blocks
                budget_blocks = ec.memory_budget // (self.memory.kv_entry_bytes * ec.kv_block_size) + num_slots
                kv_blocks = max(blocks_per_seq, min(kv_blocks, budget_blocks))
        check_cache_fits(cache_bytes(self.memory, num_slots, ec.max_seq_len, ec.decode_mode, ec.kv_block_size,
                                     kv_blocks), self.device, num_slots, ec.max_seq_len)
        self.cache = self.model.make_cache(num_slots + 1, mode=cache_mode, buffer_size=ec.buffer_size, max_new=T,
                                           max_seq_len=ec.max_seq_len, kv_block_size=ec.kv_block_size,
                                           kv_num_blocks=kv_blocks, device=self.device)
        self.runner = ModelRunner(self.model, self.cache, self.device, num_slots, cuda_graphs=cuda_graphs,
                                  pad_batches=pad_batches)
        self.sampler = Sampler(self.device, seed)
        self.scheduler = Scheduler(num_slots, self.memory, ec.memory_budget, ec.max_seq_len, ec.max_prefill_tokens)
        self.drafter = self._make_drafter(sp, num_slots, T)
        self.stats = {"steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "generated": 0}
        self._requests: dict = {}     # unfinished requests by id (abort, step outputs)
        self._touched: list[Sequence] = []   # sequences that got tokens in the current step
        self._tree_needs_state = False
        self.capture_s = 0.0
        if self.runner.use_graphs:  # every graph a step can need, before the first request
            t0 = time.perf_counter()
            self.runner.capture(self._spec_shapes())
            draft_runner = getattr(self.drafter, "runner", None)
            if draft_runner is not None:
                draft_runner.capture()
            self.capture_s = time.perf_counter() - t0

    def _spec_shapes(self) -> list[tuple[int, bool]]:
        """``(nodes, tree)`` of the verify steps the drafter proposes (fixed shapes only; an
        n-gram trie's size varies per step, so its graphs are captured when first needed)."""
        sp = self.config.speculative
        if sp is None:
            return []
        if sp.method in ("ngram", "draft"):
            return [(sp.num_tokens + 1, False)]
        if self.draft_model is not None:
            return [(self.drafter.num_nodes, True)]
        return []

    # -- construction helpers -----------------------------------------------------------
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
        dcache = self.draft_model.make_cache(num_slots + 1, mode=self.draft_mode, buffer_size=self.config.buffer_size,
                                             max_new=T, max_seq_len=self.config.max_seq_len,
                                             kv_block_size=self.config.kv_block_size, device=self.device)
        graphs = self.config.cuda_graphs and self.device.type == "cuda"
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
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = "abort"
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            self.scheduler.finish(seq, "abort")
        else:
            self._release(seq)
        self._requests.pop(request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt or a list) to completion; one output per prompt, in order.
        A prompt that fails validation gets an output with ``finish_reason="error"`` and the
        message in ``error``, and the others run; bad arguments of the call itself raise."""
        prompts = prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
        seqs = []
        for p, sp in zip(prompts, params):
            try:
                seqs.append(self.add_request(p, sp))
            except ValueError as e:  # this request fails alone
                seqs.append(Sequence.failed(sp, str(e), p if isinstance(p, str) else None))
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        done = 0
        while self.has_unfinished():
            self._step()
            if bar is not None:
                n = sum(s.is_finished for s in seqs)
                bar.update(n - done)
                done = n
        if bar is not None:
            bar.close()
        return [self.output(s) for s in seqs]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Generate one request, yielding lists of new token ids as they are accepted."""
        seq = self.add_request(prompt, params)
        while not seq.is_finished:
            before = len(seq.output_ids)
            self._step()
            if len(seq.output_ids) > before:
                yield seq.output_ids[before:]
        self.last_output = self.output(seq)

    def output(self, seq: Sequence) -> RequestOutput:
        text = ""
        if self.tokenizer is not None and seq.output_ids:
            text = self.tokenizer.decode(seq.output_ids)
            if seq.stop_text_cut is not None:
                text = text[: seq.stop_text_cut]
        drafted_steps = seq.accepted_lengths
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt_text, prompt_token_ids=seq.prompt_ids,
            text=text, token_ids=list(seq.output_ids), finish_reason=seq.finish_reason, error=seq.error,
            num_steps=seq.num_steps, num_verify_steps=seq.num_verify_steps, num_drafted=seq.num_drafted,
            num_accepted=seq.num_accepted_drafts,
            mean_accepted_length=(sum(drafted_steps) / len(drafted_steps)) if drafted_steps else 1.0,
            accepted_lengths=list(drafted_steps))

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns a :class:`RequestOutput` (cumulative tokens so far) for
        every request that produced tokens or finished in it, in admission order."""
        finished = self._step()
        out, seen = [], set()
        for s in self._touched + finished:
            if id(s) not in seen:
                seen.add(id(s))
                out.append(self.output(s))
        return out

    def _step(self) -> list[Sequence]:
        """Schedule, prefill the admitted, decode/speculate the running; returns the
        sequences that finished in it."""
        self._touched = []
        sch = self.scheduler
        before = set(id(s) for s in sch.rejected)
        t0 = time.perf_counter()
        new = sch.schedule()
        finished = [s for s in sch.rejected if id(s) not in before]
        if new:
            self._prefill(new)
        t1 = time.perf_counter()
        new_ids = set(id(s) for s in new)
        running = [s for s in sch.running if id(s) not in new_ids and not s.is_finished]
        if running:
            if self.drafter is None:
                self._decode(running)
            else:
                self._speculate(running)
        t2 = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["prefill_s"] += t1 - t0
        self.stats["decode_s"] += t2 - t1
        # finish, release, switch forms
        to_switch = []
        for s in list(sch.running):
            if s.status == SequenceStatus.FINISHED or s.finish_reason is not None:
                self._release(s)
                finished.append(s)
            elif self.config.decode_mode == "auto" and s.mode == "kv" and s.num_cached >= self.auto_threshold:
                to_switch.append(s)
        self._switch(to_switch)
        for s in finished:
            self._requests.pop(s.request_id, None)
        return finished

    def _switch(self, seqs: list[Sequence]) -> None:
        """KV-only -> state form for ``seqs`` (one flush each; between model calls)."""
        if not seqs:
            return
        self.cache.switch_to_state(torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device))
        for s in seqs:
            s.mode = self.cache.mode_of(s.slot) if hasattr(self.cache, "mode_of") else "replay"

    def _release(self, s: Sequence) -> None:
        slot = s.slot
        self.cache.release(torch.tensor([slot], dtype=torch.long, device=self.device))
        if self.drafter is not None:
            self.drafter.release(s)
        self.scheduler.finish(s, s.finish_reason or "stop")

    def _prefill(self, seqs: list[Sequence]) -> None:
        if self.config.decode_mode == "auto":
            # prompts already past the threshold skip the KV-only form: an empty slot switched
            # to a (zero) state prefills straight into it; prefill each form separately
            long = [s for s in seqs if s.num_prompt_tokens >= self.auto_threshold]
            if long:
                self.cache.switch_to_state(torch.tensor([s.slot for s in long], dtype=torch.long,
                                                        device=self.device))
            short = [s for s in seqs if s.num_prompt_tokens < self.auto_threshold]
            seqs = short + long
            if short and long:
                self._prefill_groups(short)
                self._prefill_groups(long)
                return
        self._prefill_groups(seqs)

    def _prefill_groups(self, seqs: list[Sequence]) -> None:
        logits_all, order = [], []
        group, width = [], 0
        groups = []
        for s in seqs:
            w = max(width, s.num_prompt_tokens)
            if group and w * (len(group) + 1) > self.config.max_prefill_tokens:
                groups.append(group)
                group, w = [], s.num_prompt_tokens
            group.append(s)
            width = w
        if group:
            groups.append(group)
        fits = set(id(s) for s in self._reserve_kv([s for g in groups for s in g], 0))
        groups = [[s for s in g if id(s) in fits] for g in groups]
        groups = [g for g in groups if g]
        if not groups:
            return
        for g in groups:
            logits_all.append(self.runner.prefill([s.slot for s in g], [s.prompt_ids for s in g]))
            order.extend(g)
        logits = torch.cat(logits_all, 0)
        if self.drafter is not None:
            self.drafter.prefill(order)
        toks = self.sampler.sample(logits, order).tolist()
        for s, t in zip(order, toks):
            s.mode = self.cache.mode_of(s.slot) if hasattr(self.cache, "mode_of") else self.config.decode_mode
            s.num_steps += 1
            self._append(s, [t])

    def _reserve_kv(self, seqs: list[Sequence], extra: int) -> list[Sequence]:
        """KV-only slots draw blocks from a finite pool: reserve this step's entries first
        (host-side, between steps).  ``extra=0`` reserves for a prefill of the prompt.
        The scheduler's budget makes this always succeed; if the pool still runs dry, the
        request ends with an error instead of failing the batch.  Returns the sequences
        that can run."""
        if not hasattr(self.cache, "reserve") or self.config.decode_mode not in ("kv", "auto"):
            return seqs
        ok = []
        for s in seqs:
            if self.cache.mode_of(s.slot) == "kv":
                n = s.num_prompt_tokens if extra == 0 else s.num_cached + extra
                try:
                    self.cache.reserve(s.slot, min(n, self.config.max_seq_len))
                except (RuntimeError, ValueError) as e:  # PoolExhausted is a RuntimeError/ValueError
                    s.error = f"KV-only block pool exhausted: {e}"
                    s.finish_reason = "error"
                    continue
            ok.append(s)
        return ok

    def _decode(self, seqs: list[Sequence], reserve: bool = True) -> None:
        if reserve:
            seqs = self._reserve_kv(seqs, 1)
            if not seqs:
                return
        toks = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        logits = self.runner.decode([s.slot for s in seqs], toks)
        out = self.sampler.sample(logits, seqs).tolist()
        for s, t in zip(seqs, out):
            s.num_steps += 1
            self._append(s, [t])

    def _speculate(self, seqs: list[Sequence]) -> None:
        seqs = self._reserve_kv(seqs, self.config.max_new)
        if not seqs:
            return
        prop = self.drafter.propose(seqs)
        if prop is None:  # nothing to draft anywhere: a plain decode step
            self._decode(seqs, reserve=False)
            for s in seqs:
                s.accepted_lengths.append(1)
            return
        slots = [s.slot for s in seqs]
        greedy = all(s.params.greedy for s in seqs)
        if prop.tree and self._tree_needs_state:
            self._switch([s for s in seqs if s.mode == "kv"])
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
            self._switch(kv)
            accepted, bonus, path = self._verify_accept_commit(seqs, slots, prop, greedy)
        # the step's one host sync: everything the host needs in one transfer
        N = prop.tokens.shape[1]
        parts = [accepted[:, None], bonus[:, None], prop.num_drafts[:, None], prop.tokens]
        if path is not None:
            parts.append(path)
        host = torch.cat([x.long() for x in parts], 1).tolist()
        acc = [r[0] for r in host]
        self.drafter.accepted(seqs, acc, path)
        for b, s in enumerate(seqs):
            row = host[b]
            a, bonus_b, ndraft, toks = row[0], row[1], row[2], row[3:3 + N]
            nodes = row[3 + N:3 + N + a][1:] if path is not None else range(1, a)
            new = [toks[i] for i in nodes] + [bonus_b]
            s.num_steps += 1
            s.num_verify_steps += 1
            s.num_drafted += ndraft
            s.num_accepted_drafts += a - 1
            s.accepted_lengths.append(a)
            self._append(s, new)

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
            from ..cache.tree import path_to

            path, _ = path_to(prop.parent, leaf)
            self.runner.commit(accepted, path)
        else:
            self.runner.commit(accepted)
        return accepted, bonus, path

    def _append(self, s: Sequence, toks: list[int]) -> None:
        p = s.params
        cap = s.token_cap if s.token_cap is not None else self.scheduler.token_limit
        if toks:
            self._touched.append(s)
        for t in toks:
            s.output_ids.append(int(t))
            self.stats["generated"] += 1
            eos = self.eos_token_id
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
