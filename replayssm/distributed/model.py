"""Rank 0's proxies: a model, cache and runner whose calls run on every rank.

:class:`TensorParallelModel` implements the engine's model protocol
(:class:`replayssm.engine.protocols.CachedModel`); its caches (:class:`ShardedCache`) and
runners (:class:`ShardedRunner`) stand for ``ModelCache`` and ``ModelRunner``.  Each holds
rank 0's own shard (``.local``); a call that changes state — a model step, a cache change
(every ``@every_rank`` method of :class:`~replayssm.models.protocols.ModelCacheLike`:
``reserve``, ``release``, ``switch_to_state``, the prefix store's ...), a runner's
``decode``, ``greedy_verify_step`` or ``capture`` — is sent to the workers (one message) and
then run on ``.local``.  Reads (the protocol's others: ``mode_of``, ``ssm_form``; a runner's
``use_graphs`` ...) are answered by ``.local``: every rank's bookkeeping is identical because
every rank ran the same calls on the same data.

The engine's hot path goes through the runner: one message per step carries the slot list
and host tokens, the draft tensors follow in one broadcast, and each rank runs its own
``ModelRunner`` — eagerly or by replaying the CUDA graph it captured for the same key
(batch bucket, draft nodes, chain or tree, cache form), NCCL collectives inside.  A greedy
speculative step (verify, acceptance from the gathered logits, commit) is one such call:
one host message, and rank 0 syncs once to read the accepted tokens, as on one GPU.

Engine objects with device state of their own (the MTP drafter's head, cache and step
graphs: ``engine.spec.mtp.MTPSteps``) are made on every rank by
:meth:`TensorParallelModel.make_on_every_rank` from a class the engine passes down, as it
passes its runner class; the :class:`ShardedObject` proxy forwards the methods the class
lists in ``EVERY_RANK`` (one message per call) and reads the rest from rank 0's object.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import weakref

import torch
from torch import Tensor

from ..cache.spec import CacheSpec
from ..models.protocols import ModelCacheLike, changes, reads
from ..runtime import canonical_device
from .comm import Plain

__all__ = ["TensorParallelModel", "ShardedCache", "ShardedObject", "ShardedRunner"]


class _Proxy:
    """Rank 0's handle on an object every rank holds (rank 0's own shard: ``local``)."""

    def __init__(self, group, handle: int, local):
        self._group, self._tp_handle, self.local = group, handle, local
        weakref.finalize(self, group.release, handle)

    def _call(self, method: str, *args, **kwargs):
        return self._group.call(self._tp_handle, method, getattr(self.local, method), args, kwargs)

    #: methods of ``local`` that only read (answered by rank 0's shard); a call of any other
    #: method must be forwarded, or the ranks' states would drift apart
    _READS: frozenset = frozenset()

    def __getattr__(self, name):
        if name in ("local", "_group", "_tp_handle"):
            raise AttributeError(name)
        value = getattr(self.local, name)
        if callable(value) and not isinstance(value, type) and name not in self._READS:
            raise AttributeError(f"{type(self).__name__}.{name}: not forwarded to the tensor-parallel workers "
                                 f"(a cache's: add it to ModelCacheLike in replayssm/models/protocols.py; "
                                 f"else to replayssm/distributed/model.py)")
        return value

    @property
    def group(self):
        return self._group

    def close(self) -> None:
        """Free this object on the workers (with the next message)."""
        self._group.release(self._tp_handle)


def _plain(x):
    """``x`` as plain host values (tensors as lists or ints, integers as ``int``), so rank 0
    and the workers run a cache call on the same arguments."""
    t = type(x)
    if t is int or t is bool or t is str or t is float or x is None:   # most arguments: no ABC checks
        return x
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, bool):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _forwarding(protocol):
    """Class decorator: a method running ``name`` on every rank for each change of
    ``protocol`` (:func:`~replayssm.models.protocols.changes`); its reads go to ``.local``."""

    def forward(name: str):
        @functools.wraps(getattr(protocol, name))
        def method(self, *args, **kwargs):
            return self._call(name, *_plain(args), **_plain(kwargs))
        return method

    def wrap(cls):
        for name in sorted(changes(protocol)):
            setattr(cls, name, forward(name))
        cls._READS = reads(protocol)
        return cls

    return wrap


@_forwarding(ModelCacheLike)
class ShardedCache(_Proxy):
    """A ``ModelCache`` over all ranks (each holds its heads' states, rings, blocks, windows):
    every change of :class:`~replayssm.models.protocols.ModelCacheLike` runs on every rank
    (prefix-store ids come from rank 0's prefix index), its reads on rank 0's shard."""


class ShardedRunner(_Proxy):
    """A ``ModelRunner`` over all ranks; each rank's runner captures and replays its own
    CUDA graphs under the same keys."""

    def prefill(self, slots, prompts):
        return self._call("prefill", list(slots), [list(p) for p in prompts])

    def replay_ms(self, batch: int, n: int = 20, greedy: bool = False) -> float:
        """Every rank replays its plain-decode graph ``n`` times (rank 0's time returned)."""
        return self._call("replay_ms", int(batch), int(n), bool(greedy))

    def decode(self, slots, tokens: Tensor, greedy: bool = False) -> Tensor:
        """Logits ``[B, V]`` on rank 0, or with ``greedy=True`` the greedy tokens ``[B]``
        (every rank's shard maxima exchanged, no vocabulary gather)."""
        if greedy:
            return self._call("decode", Plain(list(slots)), tokens, True)
        return self._call("decode", Plain(list(slots)), tokens)

    def decode_rows(self, slots, rows) -> Tensor:
        """A greedy decode step fed from the previous one's greedy tokens, gathered by ``rows``
        on every rank from its own copy (identical on every rank): the message carries the
        two index lists only, no tokens.  The greedy tokens ``[B]`` on rank 0."""
        return self._call("decode_rows", Plain(list(slots)), Plain(list(rows)))

    def verify(self, slots, tokens: Tensor) -> Tensor:
        return self._call("verify", Plain(list(slots)), tokens)

    def verify_tree(self, slots, tokens: Tensor, parent: Tensor) -> Tensor:
        return self._call("verify_tree", Plain(list(slots)), tokens, parent)

    def commit(self, accepted: Tensor, path: Tensor | None = None) -> None:
        return self._call("commit", accepted, path)

    def greedy_verify_step(self, slots, tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool,
                           mask: Tensor | None = None):
        """``mask [B, N, V]`` (constrained rows' grammar masks) travels as bytes: every rank
        applies it, so every rank accepts the same tokens."""
        return self._call("greedy_verify_step", Plain(list(slots)), tokens, parent, valid, bool(tree), mask=mask)

    def sampled_verify_step(self, slots, tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool, q, sb, u,
                            mask: Tensor | None = None):
        return self._call("sampled_verify_step", Plain(list(slots)), tokens, parent, valid, bool(tree), q, sb, u, mask=mask)

    def capture(self, spec_shapes=(), sampled_shapes=()) -> int:
        return self._call("capture", [tuple(s) for s in spec_shapes], [tuple(s) for s in sampled_shapes])


class ShardedObject(_Proxy):
    """An engine object every rank holds (made by :meth:`TensorParallelModel.make_on_every_rank`
    from a class the engine passes down, as it passes its runner class): a call of a method
    its class names in ``EVERY_RANK`` runs on every rank (one message, host arguments and
    tensors as for a runner call); other attributes are read from rank 0's object
    (``.local``), and its other methods are refused (they would run on rank 0 alone)."""

    def __getattr__(self, name):
        if name in getattr(type(self.local), "EVERY_RANK", ()):
            return functools.partial(self._call, name)
        if name in ("local", "_group", "_tp_handle"):
            raise AttributeError(name)
        value = getattr(self.local, name)
        if inspect.ismethod(value):
            raise AttributeError(f"{type(self.local).__name__}.{name}: not in its EVERY_RANK, so not run on "
                                 f"the tensor-parallel workers")
        return value


class TensorParallelModel(_Proxy):
    """A model split over a :class:`~replayssm.distributed.group.TensorParallelGroup`
    (rank 0's handle; pass it to ``LLM`` / ``LLMEngine`` like any loaded model).

    ``config`` is the checkpoint's (global) config; ``cache_layout`` reports what one rank
    allocates (its share of every state, ring and block: the per-GPU budget); logits are
    complete on rank 0.  ``close()`` frees the model on every rank and, when the model
    started its own group (``LLM(path, tensor_parallel_size=N)``), stops the workers.
    """

    def __init__(self, group, handle: int, local, owns_group: bool = False):
        super().__init__(group, handle, local)
        self.config = local.tp.config
        self.owns_group = owns_group

    # -- what the engine reads ----------------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self._group.size

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def cache_layout(self, spec: CacheSpec | None = None, **fields):
        return self.local.cache_layout(CacheSpec.of(spec, **fields))

    @property
    def mtp(self):
        """Rank 0's shard of the MTP head (loaded with ``mtp=True``; else None), for reads:
        its config and ``cache_layout`` (one rank's share).  Its steps run on every rank
        through an object of :meth:`make_on_every_rank` (the MTP drafter's)."""
        return getattr(self.local, "mtp", None)

    # -- objects on every rank ------------------------------------------------------------------
    def make_cache(self, num_slots: int, spec: CacheSpec | None = None, *, device=None, poison: bool = False,
                   **fields) -> ShardedCache:
        """``make_cache`` on every rank with one :class:`CacheSpec` (``CacheSpec.of(spec,
        **fields)``, validated here first)."""
        if device is not None and canonical_device(device) != self.device:
            raise ValueError(f"cache device {device} differs from rank 0's {self.device}")
        spec = CacheSpec.of(spec, **fields)
        h = self._group.new_handle()
        local = self._group.call(self._tp_handle, "make_cache", self.local.make_cache, (num_slots, spec),
                                 dict(poison=poison), result=h)
        return ShardedCache(self._group, h, local)

    def make_runner(self, cache: ShardedCache, max_batch: int, cuda_graphs: bool = False,
                    pad_batches: bool = False, *, runner_cls) -> ShardedRunner:
        """The engine's runner (``runner_cls``, e.g. ``engine.model_runner.ModelRunner``:
        the engine passes it, so this wing never imports the engine) over ``cache`` on every
        rank."""
        if not isinstance(cache, ShardedCache) or cache.group is not self._group:
            raise ValueError("a tensor-parallel runner needs a cache from this model's make_cache")
        h = self._group.new_handle()
        kw = dict(max_batch=max_batch, cuda_graphs=cuda_graphs, pad_batches=pad_batches)
        if "greedy_decode" in inspect.signature(runner_cls).parameters:
            # rank 0 decides (REPLAYSSM_TP_GREEDY_LOCAL as rank 0 reads it): every rank then
            # captures the same graphs and runs the same collectives
            kw["greedy_decode"] = bool(self.local.argmax_head)
        local = self._group.run("runner", (h, self._tp_handle, cache._tp_handle, runner_cls, kw),
                                lambda: runner_cls(self.local, cache.local, self.device, **kw))
        return ShardedRunner(self._group, h, local)

    def make_on_every_rank(self, cls, *args, **kwargs) -> ShardedObject:
        """``cls(*args, **kwargs)`` on every rank, each with its own shards where the
        arguments hold this model or its caches (``cls``: an engine class, pickled by
        reference; its ``EVERY_RANK`` methods are then forwarded, see :class:`ShardedObject`)."""
        for x in (*args, *kwargs.values()):
            if isinstance(x, _Proxy) and x.group is not self._group:
                raise ValueError(f"{cls.__name__}: an argument belongs to another tensor-parallel group")
        h = self._group.new_handle()
        return ShardedObject(self._group, h, self._group.make(h, cls, args, kwargs))

    # -- the model API (direct use; the engine goes through the runner) -------------------------
    def __call__(self, input_ids: Tensor) -> Tensor:
        return self._call("forward", input_ids)

    forward = __call__

    def prefill(self, cache, slots, input_ids, lengths):
        return self._call("prefill", cache, slots, input_ids, lengths)

    def decode(self, cache, slots, input_ids, greedy: bool = False):
        if greedy:
            return self._call("decode", cache, slots, input_ids, True)
        return self._call("decode", cache, slots, input_ids)

    def verify(self, cache, slots, input_ids, greedy: bool = False):
        if greedy:
            return self._call("verify", cache, slots, input_ids, True)
        return self._call("verify", cache, slots, input_ids)

    def verify_tree(self, cache, slots, input_ids, parent, greedy: bool = False):
        if greedy:
            return self._call("verify_tree", cache, slots, input_ids, parent, True)
        return self._call("verify_tree", cache, slots, input_ids, parent)

    def commit(self, cache, accepted, path=None):
        return self._call("commit", cache, accepted, path)

    def close(self) -> None:
        """Free the model on every rank (and stop the workers when it owns its group)."""
        if self.owns_group:
            self._group.close()
        else:
            self._group.release(self._tp_handle)
