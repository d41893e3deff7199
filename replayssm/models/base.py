"""CausalLM: the shared model skeleton and the cached-decoding API.

A model is ``embed -> blocks -> final norm -> lm_head``; a block is a list of residual
sub-blocks ``h = h + mixer(norm(h))``.  Mixers with per-sequence memory (Mamba-2, Gated
DeltaNet, attention) read one :class:`~replayssm.layers.context.StepContext` per call;
MLP / MoE mixers are stateless.

API (the engine codes against exactly this)::

    cache = model.make_cache(num_slots, spec=None, *, device=None, poison=False, **fields)
    layout = model.cache_layout(spec=None, **fields)                # bytes per slot / block
    logits = model(input_ids[B, T])                                  # [B, T, V], no cache
    logits = model.prefill(cache, slots[B], input_ids[B, T], lengths[B])   # [B, V]
    logits = model.decode(cache, slots[B], input_ids[B])                   # [B, V], commits
    logits = model.verify(cache, slots[B], input_ids[B, T])                # [B, T, V]
    logits = model.verify_tree(cache, slots[B], input_ids[B, N], parent)   # [B, N, V]
    model.commit(cache, accepted[B], path=None)     # after verify / verify_tree

``spec`` is a :class:`~replayssm.cache.spec.CacheSpec` (``mode``, ``buffer_size``,
``max_new``, ``max_seq_len``, ``block_size``, pools, prefix store); ``fields`` replace its
fields (``CacheSpec.of(spec, **fields)``: ``make_cache(4, mode="kv", max_seq_len=64)``).
``num_slots`` counts the null slot 0 (usable slots ``1 .. num_slots-1``).  ``prefill``
appends to a slot's committed tokens (a released / new slot starts at position 0).
Between steps: ``cache.reserve(slot, n)``, ``cache.switch_to_state(slots)``,
``cache.release(slots)`` (see :class:`ModelCache` and docs/ARCHITECTURE.md, "Model-level API").
Host-side validation runs for CPU tensors only; on CUDA ``decode`` / ``verify`` /
``verify_tree`` / ``commit`` make no host sync (they are what the engine graph-captures).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cache.spec import CacheSpec
from ..cache.tree import ancestor_bits, ancestor_mask, check_parents, check_path
from ..forms import get_form
from ..layers.attention import Attention
from ..layers.context import StepContext
from ..runtime import compute_dtype
from ..layers.ssm_base import SSMLayer
from .cache import CacheLayout, ModelCache, canonical_device


class Deferred:
    """A sub-block output not yet formed (tensor parallelism: the ranks' partial sums, the
    sum still to do): the block that consumes it calls :meth:`add_norm` (the residual add
    and the next norm) or :meth:`add` (the last add), so whoever made it can fuse the sum
    with them.  ``dtype``: the output's dtype once formed."""

    dtype: torch.dtype

    def add_norm(self, h: Tensor, norm: nn.Module, dtype: torch.dtype, sum_dtype: torch.dtype, last: bool = False):
        """``(norm((h + out).to(dtype)), h + out)``, the sum in ``sum_dtype``; ``last``: the
        block's own outputs will not be deferred (no :class:`Deferred` follows this one)."""
        raise NotImplementedError

    def add(self, h: Tensor, sum_dtype: torch.dtype) -> Tensor:
        """``h + out`` in ``sum_dtype``."""
        raise NotImplementedError


class Block(nn.Module):
    """Residual sub-blocks ``h = h + mixer(norm(h))`` (one HF decoder layer).  The residual
    add of each sub-block's output is deferred into the next norm (one fused pass, see
    :meth:`~replayssm.layers.norms.RMSNorm.add_forward`), across blocks too: :meth:`forward`
    takes and returns the output not yet added, :meth:`finish` adds the last one.  That
    output may be a :class:`Deferred` (its mixer's output as ``pending``, untouched until
    the next norm or :meth:`finish`): ``defers`` says this block's forward allows it."""

    #: whether the mixers' outputs may come as :class:`Deferred` (they only become ``pending``)
    defers = True

    def __init__(self):
        super().__init__()
        self.subs: list[tuple[str, str]] = []   # (norm attr, mixer attr)
        self.residual_fp32 = False

    def add(self, norm_name: str, norm: nn.Module, mixer_name: str, mixer: nn.Module) -> None:
        setattr(self, norm_name, norm)
        setattr(self, mixer_name, mixer)
        self.subs.append((norm_name, mixer_name))

    def forward(self, h: Tensor, ctx: StepContext, dtype: torch.dtype,
                pending: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(h, pending) -> (h', pending')`` where the residual stream is ``h + pending``."""
        for norm_name, mixer_name in self.subs:
            mixer, norm = getattr(self, mixer_name), getattr(self, norm_name)
            if pending is None:
                x = norm(h.to(dtype))
            else:
                x, h = self.add_norm(norm, h, pending, dtype)
            pending = mixer(x, ctx) if isinstance(mixer, (SSMLayer, Attention)) else mixer(x)
        return h, pending

    def add_norm(self, norm: nn.Module, h: Tensor, pending, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(norm(s), s)`` with ``s = h + pending`` (a tensor or a :class:`Deferred`)."""
        sdt = self._sum_dtype(h, pending, dtype)
        if isinstance(pending, Deferred):
            return pending.add_norm(h, norm, dtype, sdt, last=not self.defers)
        return norm.add_forward(h, pending, dtype, sdt)

    def _sum_dtype(self, h: Tensor, out: Tensor, dtype: torch.dtype) -> torch.dtype:
        """The residual stream's dtype: fp32 (or fp64) with ``residual_fp32``, else the sum's."""
        return compute_dtype(dtype) if self.residual_fp32 else torch.promote_types(h.dtype, out.dtype)

    def finish(self, h: Tensor, pending: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The residual stream after the last block: ``h + pending``."""
        if pending is None:
            return h
        if isinstance(pending, Deferred):
            return pending.add(h, self._sum_dtype(h, pending, dtype))
        return h.to(self._sum_dtype(h, pending, dtype)) + pending


def _holder(*shape: int) -> nn.Module:
    """A module with one ``weight`` parameter of ``shape``, filled by the loader."""
    m = nn.Module()
    m.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)
    return m


class CausalLM(nn.Module):
    """Shared skeleton; subclasses build ``embed``, ``blocks``, ``final_norm``, ``lm_head``."""

    config = None
    #: Granite-style scales (1.0: none): the token embeddings are multiplied by
    #: ``embedding_multiplier``, the logits divided by ``logits_scaling``
    embedding_multiplier = 1.0
    logits_scaling = 1.0

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self._dtype, self._device = dtype, canonical_device(device)
        self.blocks: list[Block] = []

    # ---- assembly (subclasses build their layers, then call this) ---------------------------
    def _assemble(self, root: str, embed: str, layers: list, norm_name: str, norm: nn.Module) -> None:
        """Register ``<root>.{<embed>.weight, layers, <norm_name>}`` and, when untied,
        ``lm_head.weight`` under the checkpoint's names (weights stay empty until loaded);
        ``blocks`` are the layers in order."""
        c = self.config
        body = nn.Module()
        setattr(body, embed, _holder(c.vocab_size, c.hidden_size))
        body.layers = nn.ModuleList(layers)
        setattr(body, norm_name, norm)
        setattr(self, root, body)
        if not c.tie_word_embeddings:
            self.lm_head = _holder(c.vocab_size, c.hidden_size)
        self.blocks = list(layers)
        self._names = (root, embed, norm_name)

    def embed_weight(self) -> Tensor:
        root, embed, _ = self._names
        return getattr(getattr(self, root), embed).weight

    def final_norm(self) -> nn.Module:
        root, _, norm_name = self._names
        return getattr(getattr(self, root), norm_name)

    def head_weight(self) -> Tensor:
        return self.lm_head.weight if not self.config.tie_word_embeddings else self.embed_weight()

    def load_transforms(self) -> dict:
        """``{param name: fn(tensor) -> tensor}`` applied to checkpoint tensors at load time."""
        return {}

    @staticmethod
    def tied_copy(config, key: str) -> str | None:
        """For weights the model shares but a checkpoint may store once per use: the key whose
        tensor checkpoint ``key`` copies (the loader reads that one and checks the copy is
        equal), or None."""
        return None

    # ---- properties ------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def stateful_layers(self) -> list[nn.Module]:
        out = []
        for blk in self.blocks:
            for _, mixer_name in blk.subs:
                m = getattr(blk, mixer_name)
                if isinstance(m, (SSMLayer, Attention)):
                    out.append(m)
        return out

    # ---- core ------------------------------------------------------------------------------
    def _embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings ``[..., hidden]`` (tensor parallelism overrides it: a vocabulary shard)."""
        return nn.functional.embedding(input_ids, self.embed_weight())

    def _trunk(self, input_ids: Tensor, ctx: StepContext) -> Tensor:
        h, pending = self._embed(input_ids), None
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        for blk in self.blocks:
            h, pending = blk(h, ctx, self._dtype, pending)
        return self.blocks[-1].finish(h, pending, self._dtype) if len(self.blocks) else h

    def _logits(self, hn: Tensor) -> Tensor:
        """LM head on final-normed hidden states ``hn [..., D]`` -> ``[..., V]``."""
        w = self.head_weight()
        out = nn.functional.linear(hn.to(w.dtype), w).to(compute_dtype(self._dtype))
        return out / self.logits_scaling if self.logits_scaling != 1.0 else out

    def _argmax(self, hn: Tensor) -> Tensor:
        """Greedy tokens ``[...]`` (int64) of the LM head on ``hn [..., D]``:
        ``argmax_v logits[..., v]``, the first index on ties.  Tensor parallelism overrides it
        (each rank's vocabulary shard's max, then an exchange of the ``(max, index)`` pairs)."""
        return self._logits(hn).argmax(-1)

    def _head(self, h: Tensor) -> Tensor:
        return self._logits(self.final_norm()(h))

    def _head_kept(self, cache: ModelCache, slots: Tensor, h: Tensor) -> Tensor:
        """:meth:`_head` of a cached step ``h [B, T, D]``, keeping the final-normed hidden
        states in ``cache.hidden`` when the cache keeps them (``ModelCache.keep_hidden``).
        The logits go through :meth:`_logits`, the one override point (tensor parallelism
        gathers the vocabulary there; an MTP head's logits use it too)."""
        if cache.hidden is not None:
            cache.record_hidden(slots, self.final_norm()(h))
        return self._head(h)

    def _greedy_kept(self, cache: ModelCache, slots: Tensor, h: Tensor) -> Tensor:
        """:meth:`_head_kept` returning the greedy tokens ``[B, T]`` (:meth:`_argmax`)."""
        hn = self.final_norm()(h)
        if cache.hidden is not None:
            cache.record_hidden(slots, hn)
        return self._argmax(hn)

    def _check_ids(self, ids: Tensor, dims: int, what: str) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dim() != dims or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what} must be an integer tensor with {dims} dims")
        if ids.device != self._device:
            raise ValueError(f"{what} on {ids.device}, model on {self._device}")
        if ids.device.type == "cpu" and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"{what}: token ids must be in [0, {self.vocab_size}), got [{lo}, {hi}]")
        return ids.long()

    @torch.no_grad()
    def forward(self, input_ids: Tensor) -> Tensor:
        """Full forward without cache: ``input_ids [B, T] -> logits [B, T, V]``."""
        ids = self._check_ids(input_ids, 2, "input_ids")
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).expand(B, T)
        ctx = StepContext(kind="full", T=T, positions=pos)
        return self._head(self._trunk(ids, ctx))

    # ---- cache API ------------------------------------------------------------------------------
    def make_cache(self, num_slots: int, spec: CacheSpec | None = None, *, device=None, poison: bool = False,
                   **fields) -> ModelCache:
        """Allocate per-slot caches for every layer (see :class:`ModelCache`) as
        ``CacheSpec.of(spec, **fields)`` describes them (pool sizes ``None``: static,
        ``max_seq_len`` per slot; ``prefix_blocks=None``: no prefix store, see
        :mod:`replayssm.models.prefix`).  ``poison`` (tests) fills every cache tensor with NaN
        instead of zeros."""
        if device is not None and canonical_device(device) != self._device:
            raise ValueError(f"cache device {device} differs from the model's {self._device}")
        return ModelCache(self, num_slots, CacheSpec.of(spec, **fields), device, poison)

    def cache_layout(self, spec: CacheSpec | None = None, **fields) -> CacheLayout:
        """Bytes :meth:`make_cache` allocates per slot and per block for
        ``CacheSpec.of(spec, **fields)`` (measured on the ``meta`` device:
        :meth:`ModelCache.layout`)."""
        return ModelCache.layout(self, CacheSpec.of(spec, **fields))

    def _check_slots(self, cache: ModelCache, slots: Tensor, B: int) -> Tensor:
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache must come from model.make_cache, got {type(cache).__name__}")
        if not isinstance(slots, Tensor) or tuple(slots.shape) != (B,) or \
                slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be an integer tensor of shape [{B}]")
        if slots.device != cache.device:
            raise ValueError(f"slots on {slots.device}, cache on {cache.device}")
        if slots.device.type == "cpu" and B:
            s = slots.tolist()
            if min(s) < 0 or max(s) >= cache.P:
                raise ValueError(f"slot ids must be in [0, {cache.P - 1}], got {s}")
            real = [v for v in s if v]
            if len(set(real)) != len(real):
                raise ValueError(f"duplicate slots in one batch: {s}")
        return slots.long()

    def _check_room(self, cache: ModelCache, slots: Tensor, add: Tensor | int) -> None:
        if slots.device.type != "cpu":
            return
        tot = cache.seq_len[slots] + add
        tot = torch.where(slots == 0, torch.zeros_like(tot), tot)
        if slots.numel() and int(tot.max()) > cache.spec.max_seq_len:
            b = int(tot.argmax())
            raise ValueError(f"slot {int(slots[b])}: {int(tot[b])} tokens exceed max_seq_len "
                             f"{cache.spec.max_seq_len}")

    def _context(self, cache: ModelCache, kind: str, slots: Tensor, T: int, positions: Tensor,
                 **kw) -> StepContext:
        form = cache.ssm_form()
        ctx = StepContext(kind=kind, T=T, positions=positions, cache=cache, slots=slots,
                          seq_len=cache.seq_len[slots], ssm_form=form, **kw)
        get_form(form).bind(ctx, cache)
        if cache.attn is not None:
            cache.attn.write_pending()   # a no-op unless a deferred reservation was not written
            ctx.attn_table = cache.attn.block_table[slots]
        return ctx

    def _finish(self, ctx: StepContext, accepted: Tensor | None) -> None:
        """Move every shared pointer by the accepted counts (``None``: decode)."""
        cache = ctx.cache
        if ctx.kind == "prefill":
            if ctx.plan is not None:
                cache.ring.reset(ctx.state_slots)
            if ctx.pplan is not None:
                acc = ctx.lengths if ctx.kv_rows is None else torch.where(
                    ctx.kv_rows, ctx.lengths, torch.zeros_like(ctx.lengths))
                cache.pidx.commit(ctx.pplan, acc, check=False)
            add = ctx.lengths
        elif ctx.kind == "decode":
            if ctx.plan is not None:
                cache.ring.commit(ctx.plan)
            if ctx.pplan is not None:
                cache.pidx.commit(ctx.pplan, None, check=False)
            add = 1
        else:
            if ctx.plan is not None:
                cache.ring.commit(ctx.plan, accepted, check=False)
            if ctx.pplan is not None:
                cache.pidx.commit(ctx.pplan, accepted, check=False)
            add = accepted
        cache.seq_len[ctx.slots] = ctx.seq_len + add
        cache.seq_len[:1].zero_()   # null slot (a kernel, not a host->device copy)

    @torch.no_grad()
    def prefill(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, lengths: Tensor) -> Tensor:
        """Append right-padded prompts ``input_ids [B, T]`` (``lengths [B]`` valid tokens) to
        the slots' sequences; returns the logits ``[B, V]`` after each row's last valid token."""
        cache._check_idle()
        ids = self._check_ids(input_ids, 2, "input_ids")
        B, T = ids.shape
        slots = self._check_slots(cache, slots, B)
        if not isinstance(lengths, Tensor) or tuple(lengths.shape) != (B,) or \
                lengths.dtype not in (torch.int32, torch.int64) or lengths.device != cache.device:
            raise ValueError(f"lengths must be an integer tensor of shape [{B}] on {cache.device}")
        lengths = lengths.long()
        if T < 1:
            raise ValueError("prefill needs at least one token")
        if lengths.device.type == "cpu" and B:
            bad = ((lengths < 1) | (lengths > T)) & (slots != 0)
            if bool(bad.any()) or bool((lengths < 0).any()) or bool((lengths > T).any()):
                raise ValueError(f"prefill lengths must be in [1, {T}] for real rows, got {lengths.tolist()}")
            self._check_room(cache, slots, lengths)
            if cache.uses_pages:     # KV-only entries and attention KV: blocks for the prompt
                for s, n, m in zip(slots.tolist(), cache.seq_len[slots].tolist(), lengths.tolist()):
                    if s:
                        cache.reserve(s, n + m)   # no-op when already reserved
        lengths = torch.where(slots == 0, torch.zeros_like(lengths), lengths)   # padding rows: no tokens
        cache._in_use.update(v for v in slots.tolist() if v)   # host mirror (prefill may sync)
        seq = cache.seq_len[slots]
        t = torch.arange(T, device=ids.device)
        valid = t[None, :] < lengths[:, None]
        # packed: one stream of every row's valid tokens, no padding (finding them syncs)
        cu = torch.zeros(B + 1, dtype=torch.long, device=ids.device)
        cu[1:] = lengths.cumsum(0)
        index = valid.reshape(-1).nonzero().flatten()
        rows = torch.arange(B, device=ids.device)[:, None].expand(B, T).reshape(-1)[index]
        positions = (seq[:, None] + t[None, :]).reshape(-1)[index][None]
        ctx = self._context(cache, "prefill", slots, T, positions, valid=valid, lengths=lengths, fresh=seq == 0,
                            cu_seqlens=cu, token_index=index, token_rows=rows)
        if cache.prefix is not None:   # prefix caching: every token's store row (the null block if uncaptured)
            ctx.prefix_rows = cache.prefix.rows(slots[rows], positions[0])
        if index.numel():
            h = self._trunk(ids.reshape(-1)[index][None], ctx)             # [1, Nt, D]
            last = h[0, (cu[1:] - 1).clamp(min=0)]
            if cache.hidden is not None:
                cache.record_prompt_hidden(slots, self.final_norm()(h[0]), cu)
        else:   # only padding rows
            last = self.embed_weight().new_zeros(B, self.config.hidden_size)
        self._finish(ctx, None)
        return self._head(last)

    @torch.no_grad()
    def decode(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, greedy: bool = False) -> Tensor:
        """One always-accepted token per row: ``input_ids [B] -> logits [B, V]`` (commits);
        ``greedy=True`` returns each row's argmax token ``[B]`` (int64) instead (the logits
        are never assembled: under tensor parallelism no vocabulary gather)."""
        cache._check_idle()
        ids = self._check_ids(input_ids, 1, "input_ids")
        B = ids.shape[0]
        slots = self._check_slots(cache, slots, B)
        self._check_room(cache, slots, 1)
        ctx = self._context(cache, "decode", slots, 1, cache.seq_len[slots][:, None])
        h = self._trunk(ids[:, None], ctx)
        self._finish(ctx, None)
        return (self._greedy_kept if greedy else self._head_kept)(cache, slots, h)[:, 0]

    @torch.no_grad()
    def verify(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, greedy: bool = False) -> Tensor:
        """``T`` tentative tokens per row (a chain): ``input_ids [B, T] -> logits [B, T, V]``
        (``greedy=True``: the argmax tokens ``[B, T]`` int64 instead, as :meth:`decode`).
        Nothing is kept until :meth:`commit`."""
        cache._check_idle()
        ids = self._check_ids(input_ids, 2, "input_ids")
        B, T = ids.shape
        slots = self._check_slots(cache, slots, B)
        if T < 1 or T > cache.spec.max_new:
            raise ValueError(f"verify takes 1..max_new={cache.spec.max_new} tokens per row, got {T}")
        self._check_room(cache, slots, T)
        t = torch.arange(T, device=ids.device)
        ctx = self._context(cache, "verify", slots, T, cache.seq_len[slots][:, None] + t[None, :])
        h = self._trunk(ids, ctx)
        cache.pending = ctx
        return (self._greedy_kept if greedy else self._head_kept)(cache, slots, h)

    @torch.no_grad()
    def verify_tree(self, cache: ModelCache, slots: Tensor, input_ids: Tensor, parent: Tensor,
                    greedy: bool = False) -> Tensor:
        """A draft tree of ``N`` nodes per row (``parent [B, N]`` or ``[N]``, topological,
        ``-1`` = child of the last committed token): ``logits [B, N, V]`` (``greedy=True``:
        the argmax tokens ``[B, N]``); kept until commit."""
        cache._check_idle()
        ids = self._check_ids(input_ids, 2, "input_ids")
        B, N = ids.shape
        slots = self._check_slots(cache, slots, B)
        if N < 1 or N > cache.spec.max_new:
            raise ValueError(f"verify_tree takes 1..max_new={cache.spec.max_new} nodes per row, got {N}")
        if not isinstance(parent, Tensor) or parent.device != cache.device:
            raise ValueError(f"parent must be an integer tensor on {cache.device}")
        if parent.device.type == "cpu":
            parent = check_parents(parent, B)
            if bool((parent[:, 0] != -1).any()):
                raise ValueError("node 0 of every tree must be a root (parent -1)")
        else:
            parent = (parent if parent.dim() == 2 else parent[None].expand(B, -1)).long()
        if tuple(parent.shape) != (B, N):
            raise ValueError(f"parent must have shape [{B}, {N}] or [{N}], got {tuple(parent.shape)}")
        self._check_room(cache, slots, N)
        anc = ancestor_mask(parent)
        depth = anc.sum(-1)
        ctx = self._context(cache, "tree", slots, N, cache.seq_len[slots][:, None] + depth - 1,
                            parent=parent, anc=anc, tree_bits=ancestor_bits(anc) if N <= 31 else None)
        h = self._trunk(ids, ctx)
        cache.pending = ctx
        return (self._greedy_kept if greedy else self._head_kept)(cache, slots, h)

    @torch.no_grad()
    def commit(self, cache: ModelCache, accepted: Tensor, path: Tensor | None = None) -> None:
        """Keep ``accepted[b]`` entries of the pending verify per row.  After ``verify_tree``,
        ``path [B, N]`` lists the accepted root-down nodes (``path[b, :accepted[b]]``)."""
        ctx = cache.pending
        if ctx is None:
            raise RuntimeError("commit without a pending verify / verify_tree")
        B, T = ctx.batch, ctx.T
        if not isinstance(accepted, Tensor) or tuple(accepted.shape) != (B,) or \
                accepted.dtype not in (torch.int32, torch.int64) or accepted.device != cache.device:
            raise ValueError(f"accepted must be an integer tensor of shape [{B}] on {cache.device}")
        accepted = accepted.long()
        if ctx.kind == "tree":
            if path is None:
                path = torch.arange(T, device=cache.device).expand(B, T)
            if not isinstance(path, Tensor) or tuple(path.shape) != (B, T) or \
                    path.dtype not in (torch.int32, torch.int64) or path.device != cache.device:
                raise ValueError(f"path must be an integer tensor of shape [{B}, {T}] on {cache.device}")
            path = path.long()
        elif path is not None:
            raise ValueError("path is only for commits after verify_tree")
        if accepted.device.type == "cpu":
            if B and (int(accepted.min()) < 0 or int(accepted.max()) > T):
                raise ValueError(f"accepted counts must be in [0, {T}], got {accepted.tolist()}")
            if ctx.kind == "tree":
                check_path(ctx.parent, path, accepted)
        for layer in self.stateful_layers():
            layer.commit(ctx, accepted, path)
        self._finish(ctx, accepted)
        cache.pending = None
