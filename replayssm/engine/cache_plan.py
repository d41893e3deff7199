"""Memory planning in one place: what a sequence costs, how many slots and blocks fit, and
whether the caches fit the device — one :class:`CachePlan` from one :class:`CacheSpec`.

Sizes come from the caches' own layouts (``model.cache_layout(spec)``: the allocation run on
the ``meta`` device), for the target and the drafter's cache, so admission counts exactly the
bytes the caches allocate.  A sequence costs a fixed part, allocated up front for every
slot, plus a part that grows with its tokens, drawn in blocks from the paged pools
(:class:`MemoryModel`):

* fixed: the target's (and drafter's) slot bytes — checkpoint states, rings, conv windows,
  bookkeeping — plus per-step scratch: ``T * vocab * 4`` bytes of logits and, for
  speculation in the recurrent form (the snapshot baseline), ``T`` state copies; in
  ``"auto"`` the KV-only entries up to the switch threshold (a per-slot pool); with prefix
  caching, the store's per-slot capture row;
* per token, in whole blocks of ``block_size`` tokens: the attention keys and values of
  hybrid models (every mode) and one KV-only entry over all SSM layers (``mode="kv"``).

With a memory budget the engine allocates ``num_slots`` fixed parts, the prefix store
(:func:`replayssm.engine.prefix.plan_store`), and gives the rest to the block pools; a
request is admitted when its blocks fit what is left (:mod:`replayssm.engine.block_manager`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from ..cache.spec import CacheSpec
from ..forms.kv import kv_only_threshold
from .prefix import StorePlan, plan_store

#: context (tokens) when neither the caller nor the model's config states one
DEFAULT_CONTEXT = 8192
#: slots (``max_num_seqs``) when none is given and no memory budget sizes them (CPU)
DEFAULT_MAX_NUM_SEQS = 16
#: most slots ``max_num_seqs=None`` sizes from the memory budget
MAX_AUTO_SLOTS = 256


@dataclass
class MemoryModel:
    """Bytes one sequence needs: ``fixed`` plus ``per_token`` bytes for each of its tokens,
    counted in whole blocks of ``block_size`` tokens (:meth:`dynamic`)."""

    fixed: int
    per_token: int
    verify_tokens: int
    block_size: int = 16
    kv_entry_bytes: int = 0   # per token over SSM layers in KV-only form
    kv_block_bytes: int = 0   # per block of the KV-only pool
    attn_block_bytes: int = 0  # per block of the attention KV pool

    def dynamic(self, tokens: int) -> int:
        """Block bytes ``tokens`` tokens draw from the paged pools."""
        return -(-tokens // self.block_size) * self.block_size * self.per_token

    def need(self, tokens: int) -> int:
        return self.fixed + self.dynamic(tokens)


def memory_model(layout, mode: str, verify_tokens: int, vocab_size: int, auto_threshold: int = 0,
                 draft_layout=None, max_seq_len: int = 0) -> MemoryModel:
    """Per-sequence bytes in decode ``mode`` (``recurrent|replay|kv|auto``) from the target's
    cache ``layout`` (and the drafter's, when it has a cache: its attention KV, if any, is a
    static ``max_seq_len`` per slot)."""
    T = verify_tokens
    fixed = layout.slot_bytes + T * vocab_size * 4      # + the logits of one step
    if draft_layout is not None:
        fixed += draft_layout.slot_bytes + -(-max_seq_len // draft_layout.block_size) * draft_layout.attn_block_bytes
    per_token = layout.attn_token_bytes
    if mode == "recurrent":
        if T > 1:  # snapshot speculation: one state per verified token until commit
            fixed += T * layout.state_bytes
    elif mode == "kv":
        per_token += layout.kv_token_bytes
    elif mode == "auto":  # KV-only up to the threshold, then state + ring (both in slot_bytes)
        fixed += auto_kv_blocks(auto_threshold, T, layout.block_size) * layout.block_bytes
    elif mode != "replay":
        raise ValueError(f"unknown decode mode {mode!r}")
    return MemoryModel(int(fixed), int(per_token), T, layout.block_size, layout.kv_token_bytes,
                       layout.block_bytes, layout.attn_block_bytes)


def auto_kv_blocks(threshold: int, verify_tokens: int, block_size: int) -> int:
    """KV-only blocks one slot holds in ``mode="auto"``: its context up to the switch
    threshold plus two verify windows, and one block of slack for block rounding."""
    return -(-(threshold + 2 * verify_tokens + block_size) // block_size) + 1


def default_auto_threshold(layout, buffer_size: int) -> int:
    """Context length past which KV-only decoding reads more bytes than amortised replay,
    from the layout's real state and entry sizes (:func:`~replayssm.forms.kv.kv_only_threshold`)."""
    if layout.entry_bytes <= 0:       # no SSM layer: KV-only never pays
        return 1
    return kv_only_threshold(layout.state_bytes, layout.entry_bytes, max(1, buffer_size))


@dataclass(frozen=True)
class PlanRequest:
    """What the engine asks of the plan, beyond the cache spec: ``max_num_seqs`` slots at
    most, a ``memory_budget`` in bytes (None: only ``max_num_seqs`` limits), the ``auto``
    switch threshold (None: from the layout) and the prefix store's settings (``prefix``:
    whether there is one; ``prefix_fraction`` of the budget, or ``prefix_blocks``;
    ``prefix_interval`` tokens between checkpoints)."""

    max_num_seqs: int
    memory_budget: int | None = None
    auto_threshold: int | None = None
    prefix: bool = False
    prefix_fraction: float = 0.25
    prefix_blocks: int | None = None
    prefix_interval: int | None = None

    @classmethod
    def of(cls, config, device) -> "PlanRequest":
        """From an :class:`~replayssm.engine.config.EngineConfig`; on CUDA without a budget,
        like vLLM's ``gpu_memory_utilization``: caches may take that share of the free memory."""
        budget = config.memory_budget
        if budget is None and device.type == "cuda" and config.gpu_memory_utilization:
            budget = int(torch.cuda.mem_get_info(device)[0] * config.gpu_memory_utilization)
        return cls(config.max_num_seqs, budget, config.auto_threshold, config.enable_prefix_caching,
                   config.prefix_cache_fraction, config.prefix_cache_blocks, config.prefix_checkpoint_interval)


@dataclass(frozen=True)
class CachePlan:
    """The engine's caches, sized: ``spec`` (pools and prefix store filled in) for
    ``num_slots`` usable slots (``make_cache(num_slots + 1, spec)``: slot 0 is the null
    slot), the target's ``layout``, the drafter's ``draft_layout`` (or None), what a
    sequence costs (``memory``), the ``auto`` switch threshold, the prefix store (or None)
    and the ``budget`` (bytes, None without one) with ``store_bytes`` of it the store's.
    ``max_seq_len``: the tokens (prompt + generated) one sequence may hold (the spec's
    ``max_seq_len`` less the verify window, which the cache holds on top);
    ``context_source``: where that number came from (:func:`plan_caches`)."""

    spec: CacheSpec
    num_slots: int
    layout: object
    draft_layout: object
    memory: MemoryModel
    auto_threshold: int
    prefix_store: StorePlan | None
    budget: int | None
    store_bytes: int
    context_source: str = ""

    @property
    def max_seq_len(self) -> int:
        """Most tokens (prompt + generated) a sequence holds: the block manager's token limit."""
        return self.spec.max_seq_len - self.spec.max_new

    @classmethod
    def build(cls, spec: CacheSpec, req: PlanRequest, layout, vocab_size: int,
              draft_layout=None) -> "CachePlan":
        """Plan the caches for ``spec`` (its pools are ignored: the plan sets them) from the
        target's measured ``layout`` (``model.cache_layout(spec)``)."""
        # a context never reaches a threshold past max_seq_len: clamped, so the KV-only blocks
        # reserved per slot never exceed what one sequence can hold
        threshold = min(req.auto_threshold or default_auto_threshold(layout, spec.buffer_size),
                        spec.max_seq_len - spec.max_new)
        memory = memory_model(layout, spec.mode, spec.max_new, vocab_size, threshold, draft_layout,
                              spec.max_seq_len)
        store = _plan_prefix_store(spec, req, layout, memory)
        store_bytes = store.bytes if store is not None else 0
        budget = None if req.memory_budget is None else req.memory_budget - store_bytes   # slots + pools
        num_slots = _plan_slots(req, memory, budget, spec.max_new, store is not None)
        kv, attn = _plan_pools(spec, memory, budget, num_slots, threshold, store)
        spec = dataclasses.replace(spec, kv_num_blocks=kv, attn_num_blocks=attn,
                                   prefix_blocks=None if store is None else store.blocks,
                                   prefix_checkpoints=None if store is None else store.checkpoints)
        return cls(spec, num_slots, layout, draft_layout, memory, threshold, store, req.memory_budget, store_bytes)

    def cache_bytes(self) -> int:
        """What ``make_cache`` (and the drafter's cache) allocate: the slots plus the null
        slot, the paged pools (``None``: static, ``max_seq_len`` per slot) and their null
        blocks, and the prefix store's own tensors (its attention blocks are in the pool)."""
        s, lay = self.spec, self.layout
        static = self.num_slots * -(-s.max_seq_len // lay.block_size)
        total = (self.num_slots + 1) * lay.slot_bytes
        if lay.block_bytes:
            total += ((s.kv_num_blocks if s.kv_num_blocks is not None else static) + 1) * lay.block_bytes
        if lay.attn_block_bytes:
            total += ((s.attn_num_blocks if s.attn_num_blocks is not None else static) + 1) * lay.attn_block_bytes
        if self.draft_layout is not None:
            d = self.draft_layout
            d_static = self.num_slots * -(-s.max_seq_len // d.block_size)
            total += (self.num_slots + 1) * d.slot_bytes + (d_static + 1) * d.attn_block_bytes
        if self.prefix_store is not None:
            total += self.store_bytes - self.prefix_store.blocks * lay.attn_block_bytes
        return total

    def check_fits(self, device) -> None:
        """Raise ``ValueError`` when the caches exceed the memory ``device`` has free, naming
        ``max_seq_len`` / ``max_num_seqs`` and the figures, before anything is allocated."""
        need, free = self.cache_bytes(), available_memory(device)
        if free is not None and need > free:
            raise ValueError(
                f"max_seq_len = {self.max_seq_len} with max_num_seqs = {self.num_slots} needs about "
                f"{fmt_bytes(need)} of cache, more than the {fmt_bytes(free)} free on {device}; lower "
                f"max_seq_len or max_num_seqs (or pass memory_budget)")


def _plan_prefix_store(spec: CacheSpec, req: PlanRequest, layout, memory: MemoryModel) -> StorePlan | None:
    """Size of the prefix store, or None without prefix caching; its per-slot capture row
    joins each slot's fixed part."""
    if not req.prefix:
        return None
    if not layout.prefix_block_bytes:
        raise ValueError("enable_prefix_caching=True needs a model whose cache has a prefix store "
                         "(replayssm.models with SSM layers); this model's cache has none")
    memory.fixed += layout.prefix_slot_bytes
    return plan_store(layout, budget=req.memory_budget, fraction=req.prefix_fraction, blocks=req.prefix_blocks,
                      interval=req.prefix_interval, num_slots=req.max_num_seqs, max_seq_len=spec.max_seq_len)


def _plan_slots(req: PlanRequest, memory: MemoryModel, budget: int | None, T: int, store: bool) -> int:
    """Concurrent sequences: ``max_num_seqs``, or fewer when the budget's fixed part (one
    sequence with one verify window) says so."""
    if budget is None:
        return req.max_num_seqs
    need = memory.need(T + 1)
    fit = budget // max(1, need)
    if fit < 1:
        raise ValueError(f"memory_budget {fmt_bytes(req.memory_budget)} is smaller than one sequence "
                         f"({fmt_bytes(need)})" + (" plus the prefix store" if store else ""))
    return int(min(req.max_num_seqs, fit))


def _plan_pools(spec: CacheSpec, mem: MemoryModel, budget: int | None, num_slots: int, threshold: int,
                store: StorePlan | None) -> tuple[int | None, int | None]:
    """Blocks of the KV-only pool and of the attention pool (``None``: a static pool,
    ``max_seq_len`` per slot).  ``auto`` gives each slot KV-only room up to the switch
    threshold; with a memory budget, what the slots' fixed parts leave is split over the
    pools that grow with each token (one block of each per block of tokens)."""
    kv = attn = None
    if spec.mode == "auto":
        kv = num_slots * auto_kv_blocks(threshold, spec.max_new, spec.block_size)
    static = num_slots * -(-spec.max_seq_len // spec.block_size)
    if budget is not None:
        per_block = (mem.kv_block_bytes if spec.mode == "kv" else 0) + mem.attn_block_bytes
        if per_block:
            n = int(max(1, min(static, (budget - num_slots * mem.fixed) // per_block)))
            kv = n if spec.mode == "kv" else kv
            attn = n if mem.attn_block_bytes else None
    if store is not None and mem.attn_block_bytes:
        # shared attention blocks: a finite pool (blocks drawn as contexts grow) plus the
        # blocks the prefix store may hold
        attn = (static if attn is None else attn) + store.blocks
    return kv, attn


def plan_caches(config, device, model_config, vocab_size: int, layout_of, draft_layout_of=None) -> CachePlan:
    """The engine's :class:`CachePlan` under one context rule (``config``: an
    :class:`~replayssm.engine.config.EngineConfig`; ``layout_of(spec)`` / ``draft_layout_of(spec)``:
    the target's / drafter's measured layouts for a spec).

    * ``max_num_seqs``: the config's; ``None``: as many slots as the budget holds sequences
      of the full context (``memory.need(spec.max_seq_len)`` each, at most
      :data:`MAX_AUTO_SLOTS`), or :data:`DEFAULT_MAX_NUM_SEQS` without a budget.
    * ``max_seq_len`` given: kept; the caches must fit the device (:meth:`CachePlan.check_fits`).
    * ``max_seq_len=None``: the model's context (:func:`context_limit`) when the caches of
      the slots at that context fit the memory, else the largest multiple of
      ``kv_block_size`` below it that fits; ``plan.context_source`` says which.  Fitting:
      with a budget (``memory_budget``, or on CUDA ``gpu_memory_utilization`` of the free
      memory) the slots are planned as always (``max_num_seqs`` at most, fewer when their
      fixed parts fill the budget; admission then shares the block pools) and the pools left
      must hold one sequence of the full context — with ``max_num_seqs=None`` every slot
      holds one; and the caches must fit the device's free memory (on CPU the available RAM:
      ``max_num_seqs`` slots of static pools, a full context each).

    The cache spec holds ``max_seq_len + verify window`` tokens (``config.cache_spec``), so
    ``plan.max_seq_len`` — prompt + generated tokens — is the same with or without
    speculation.  Raises ``ValueError`` with the figures when nothing fits."""
    req = PlanRequest.of(config, device)
    # a layout is measured once per spec (the slot count and the budget search revisit them)
    layout_of = functools.lru_cache(maxsize=None)(layout_of)
    if draft_layout_of is not None:
        draft_layout_of = functools.lru_cache(maxsize=None)(draft_layout_of)

    def build(L: int, slots: int) -> CachePlan:
        spec = config.cache_spec(L)
        return CachePlan.build(spec, dataclasses.replace(req, max_num_seqs=slots), layout_of(spec), vocab_size,
                               None if draft_layout_of is None else draft_layout_of(spec))

    def slots_at(L: int) -> int:
        if config.max_num_seqs is not None:
            return config.max_num_seqs
        return _auto_slots(build(L, MAX_AUTO_SLOTS))

    if config.max_seq_len is not None:
        L = config.max_seq_len
        plan = build(L, max(1, slots_at(L)))
        plan.check_fits(device)
        return dataclasses.replace(plan, context_source="max_seq_len (given)")
    return _fit_context(config, req, device, model_config, build, slots_at)


def _fit_context(config, req: PlanRequest, device, model_config, build, slots_at) -> CachePlan:
    """``max_seq_len=None``: the plan at the model's context, or at the largest multiple of
    the block size below it whose caches fit (binary search; :func:`plan_caches`)."""
    limit, source = context_limit(model_config)
    free = available_memory(device)

    def fitting(L: int) -> CachePlan | None:
        slots = slots_at(L)
        if slots < 1:
            return None
        try:
            plan = build(L, slots)
        except ValueError:   # the budget holds not even one slot's fixed part
            return None
        if plan.budget is not None:   # one full-length sequence beside every slot's fixed part
            pool = plan.budget - plan.store_bytes - plan.num_slots * plan.memory.fixed
            if pool < plan.memory.dynamic(plan.spec.max_seq_len):
                return None
        if free is not None and plan.cache_bytes() > free:
            return None
        return plan

    plan = fitting(limit)
    if plan is not None:
        return dataclasses.replace(plan, context_source=f"{source} ({limit})")
    bs = config.kv_block_size
    lo, hi = -(-2 // bs), (limit - 1) // bs          # contexts lo*bs .. hi*bs, all below the limit
    best = fitting(lo * bs) if lo <= hi else None
    if best is None:
        slots = config.max_num_seqs or 1
        raise ValueError(f"the caches of {slots} slot(s) (max_num_seqs) do not fit {_memory_str(config, req, device, free)} even at "
                         f"max_seq_len = {max(2, lo * bs)} ({source} is {limit}); lower max_num_seqs or give "
                         f"more memory (memory_budget / gpu_memory_utilization)")
    while lo < hi:   # the largest multiple of bs that fits: fitting(lo * bs) holds, hi is the bound
        mid = (lo + hi + 1) // 2
        p = fitting(mid * bs)
        if p is not None:
            lo, best = mid, p
        else:
            hi = mid - 1
    return dataclasses.replace(best, context_source=(
        f"{source} ({limit}), lowered to what {best.num_slots} slot(s) fit in "
        f"{_memory_str(config, req, device, free)}"))


def _auto_slots(plan: CachePlan) -> int:
    """Slots a budget holds at ``plan``'s full context (None budget: the default count)."""
    if plan.budget is None:
        return DEFAULT_MAX_NUM_SEQS
    room = plan.budget - plan.store_bytes
    return int(min(MAX_AUTO_SLOTS, room // max(1, plan.memory.need(plan.spec.max_seq_len))))


def _memory_str(config, req: PlanRequest, device, free: int | None) -> str:
    if config.memory_budget is not None:
        return f"memory_budget {fmt_bytes(config.memory_budget)}"
    if req.memory_budget is not None:
        return (f"gpu_memory_utilization={config.gpu_memory_utilization} of the free memory on {device} "
                f"({fmt_bytes(req.memory_budget)})")
    return f"the {fmt_bytes(free)} free on {device}" if free is not None else f"the memory of {device}"


def context_limit(cfg) -> tuple[int, str]:
    """``(tokens, where it comes from)``: the config's ``max_position_embeddings`` when
    present, else :data:`DEFAULT_CONTEXT`."""
    v = getattr(cfg, "max_position_embeddings", None)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v, "the model's max_position_embeddings"
    return DEFAULT_CONTEXT, "the default context limit (replayssm.engine.cache_plan.DEFAULT_CONTEXT)"


def available_memory(device) -> int | None:
    """Bytes free for new allocations on ``device`` (a ``torch.device``; None when unknown)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # pragma: no cover - driver without the query
            return None
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return None
    return None


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b}"
