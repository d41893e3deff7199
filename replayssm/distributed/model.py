"""Rank 0's proxies: a model, cache and runner whose calls run on every rank.

:class:`TensorParallelModel` implements the engine's model protocol
(:class:`replayssm.engine.protocols.CachedModel`); its caches (:class:`ShardedCache`) and
runners (:class:`ShardedRunner`) mirror ``ModelCache`` and ``ModelRunner``.  Each holds
rank 0's own shard (``.local``); a call that changes state — a model step, a cache's
``reserve`` / ``release`` / ``switch_to_state``, a runner's ``decode``, ``greedy_verify_step``
or ``capture`` — is sent to the workers (one message) and then run on ``.local``.  Reads
(``mode_of``, ``ssm_form``, ``use_graphs`` ...) are answered by ``.local``: every rank's
bookkeeping is identical because every rank ran the same calls on the same data.

The engine's hot path goes through the runner: one message per step carries the slot list
and host tokens, the draft tensors follow in one broadcast, and each rank runs its own
``ModelRunner`` — eagerly or by replaying the CUDA graph it captured for the same key
(batch bucket, draft nodes, chain or tree, cache form), NCCL collectives inside.  A greedy
speculative step (verify, acceptance from the gathered logits, commit) is one such call:
one host message, and rank 0 syncs once to read the accepted tokens, as on one GPU.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..runtime import canonical_device

__all__ = ["TensorParallelModel", "ShardedCache", "ShardedRunner"]


def _slot_list(slots) -> list[int]:
    if isinstance(slots, Tensor):
        return [int(v) for v in slots.reshape(-1).tolist()]
    if isinstance(slots, int):
        return [slots]
    return [int(v) for v in slots]


class _Proxy:
    """Rank 0's handle on an object every rank holds (rank 0's own shard: ``local``)."""

    def __init__(self, group, handle: int, local):
        self._group, self._tp_handle, self.local = group, handle, local
        weakref.finalize(self, group.release, handle)

    def _call(self, method: str, *args, **kwargs):
        return self._group.call(self._tp_handle, method, getattr(self.local, method), args, kwargs)

    #: methods of ``local`` that only read (answered by rank 0's shard); a call of any other
    #: method must be forwarded explicitly, or the ranks' states would drift apart
    _READS: frozenset = frozenset()

    def __getattr__(self, name):
        if name in ("local", "_group", "_tp_handle"):
            raise AttributeError(name)
        value = getattr(self.local, name)
        if callable(value) and not isinstance(value, type) and name not in self._READS:
            raise AttributeError(f"{type(self).__name__}.{name}: not forwarded to the tensor-parallel workers "
                                 f"(add it to replayssm/distributed/model.py)")
        return value

    @property
    def group(self):
        return self._group

    def close(self) -> None:
        """Free this object on the workers (with the next message)."""
        self._group.release(self._tp_handle)


class ShardedCache(_Proxy):
    """A ``ModelCache`` over all ranks (each holds its heads' states, rings, blocks, windows)."""

    _READS = frozenset({"mode_of", "ssm_form", "nbytes", "tensors", "layout"})

    def reserve(self, slot: int, total_len: int, defer: bool = False) -> None:
        self._call("reserve", int(slot), int(total_len), bool(defer))

    def write_pending(self) -> None:
        self._call("write_pending")

    def release(self, slots) -> None:
        self._call("release", _slot_list(slots))

    def switch_to_state(self, slots) -> None:
        self._call("switch_to_state", _slot_list(slots))

    def clear_pending(self) -> None:
        self._call("clear_pending")

    def fork(self, src: int, dst) -> None:
        self._call("fork", int(src), _slot_list(dst))

    # prefix caching (replayssm.models.prefix): ids come from rank 0's prefix index
    def prefix_assign(self, slot: int, pairs) -> None:
        self._call("prefix_assign", int(slot), [(int(k), int(b)) for k, b in pairs])

    def prefix_copy(self, src: int, dst: int, count: int) -> None:
        self._call("prefix_copy", int(src), int(dst), int(count))

    def prefix_copies(self, copies) -> None:
        self._call("prefix_copies", [(int(a), int(b), int(c)) for a, b, c in copies])

    def prefix_checkpoint(self, row: int, slot: int | None = None, chain=(), start: int = 0, stop: int = 0,
                          base: int | None = None) -> None:
        self._call("prefix_checkpoint", int(row), None if slot is None else int(slot), [int(b) for b in chain],
                   int(start), int(stop), None if base is None else int(base))

    def prefix_checkpoints(self, jobs: list[dict]) -> None:
        self._call("prefix_checkpoints", [{k: (None if v is None else [int(b) for b in v] if k == "chain" else int(v))
                                           for k, v in j.items()} for j in jobs])

    def load_prefix(self, slot: int, length: int, chain, attn=(), checkpoint=None) -> None:
        ck = None if checkpoint is None else (int(checkpoint[0]), int(checkpoint[1]))
        self._call("load_prefix", int(slot), int(length), [int(b) for b in chain], [int(b) for b in attn], ck)

    def load_prefixes(self, requests) -> list:
        reqs = [(int(slot), int(length), [int(b) for b in chain], [int(b) for b in attn],
                 None if ck is None else (int(ck[0]), int(ck[1]))) for slot, length, chain, attn, ck in requests]
        return self._call("load_prefixes", reqs)   # every rank validates the same requests alike

    def prefix_retain_attn(self, blocks) -> None:
        self._call("prefix_retain_attn", [int(b) for b in blocks])

    def prefix_drop_attn(self, blocks) -> None:
        self._call("prefix_drop_attn", [int(b) for b in blocks])


class ShardedRunner(_Proxy):
    """A ``ModelRunner`` over all ranks; each rank's runner captures and replays its own
    CUDA graphs under the same keys."""

    _READS = frozenset({"_bucket"})

    def prefill(self, slots, prompts):
        return self._call("prefill", list(slots), [list(p) for p in prompts])

    def decode(self, slots, tokens: Tensor) -> Tensor:
        return self._call("decode", list(slots), tokens)

    def verify(self, slots, tokens: Tensor) -> Tensor:
        return self._call("verify", list(slots), tokens)

    def verify_tree(self, slots, tokens: Tensor, parent: Tensor) -> Tensor:
        return self._call("verify_tree", list(slots), tokens, parent)

    def commit(self, accepted: Tensor, path: Tensor | None = None) -> None:
        return self._call("commit", accepted, path)

    def greedy_verify_step(self, slots, tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool):
        return self._call("greedy_verify_step", list(slots), tokens, parent, valid, bool(tree))

    def sampled_verify_step(self, slots, tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool, q, sb, u):
        return self._call("sampled_verify_step", list(slots), tokens, parent, valid, bool(tree), q, sb, u)

    def capture(self, spec_shapes=(), sampled_shapes=()) -> int:
        return self._call("capture", [tuple(s) for s in spec_shapes], [tuple(s) for s in sampled_shapes])


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

    def cache_layout(self, *args, **kwargs):
        return self.local.cache_layout(*args, **kwargs)

    # -- objects on every rank ------------------------------------------------------------------
    def make_cache(self, num_slots: int, mode: str = "replay", buffer_size: int = 16, max_new: int = 1,
                   max_seq_len: int = 2048, kv_block_size: int = 16, kv_num_blocks: int | None = None,
                   device=None, poison: bool = False, attn_num_blocks: int | None = None,
                   prefix_blocks: int | None = None, prefix_checkpoints: int | None = None) -> ShardedCache:
        if device is not None and canonical_device(device) != self.device:
            raise ValueError(f"cache device {device} differs from rank 0's {self.device}")
        h = self._group.new_handle()
        kw = dict(mode=mode, buffer_size=buffer_size, max_new=max_new, max_seq_len=max_seq_len,
                  kv_block_size=kv_block_size, kv_num_blocks=kv_num_blocks, poison=poison,
                  attn_num_blocks=attn_num_blocks, prefix_blocks=prefix_blocks,
                  prefix_checkpoints=prefix_checkpoints)
        local = self._group.call(self._tp_handle, "make_cache", self.local.make_cache, (num_slots,), kw, result=h)
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
        local = self._group.run("runner", (h, self._tp_handle, cache._tp_handle, runner_cls, kw),
                                lambda: runner_cls(self.local, cache.local, self.device, **kw))
        return ShardedRunner(self._group, h, local)

    # -- the model API (direct use; the engine goes through the runner) -------------------------
    def __call__(self, input_ids: Tensor) -> Tensor:
        return self._call("forward", input_ids)

    forward = __call__

    def prefill(self, cache, slots, input_ids, lengths):
        return self._call("prefill", cache, slots, input_ids, lengths)

    def decode(self, cache, slots, input_ids):
        return self._call("decode", cache, slots, input_ids)

    def verify(self, cache, slots, input_ids):
        return self._call("verify", cache, slots, input_ids)

    def verify_tree(self, cache, slots, input_ids, parent):
        return self._call("verify_tree", cache, slots, input_ids, parent)

    def commit(self, cache, accepted, path=None):
        return self._call("commit", cache, accepted, path)

    def close(self) -> None:
        """Free the model on every rank (and stop the workers when it owns its group)."""
        if self.owns_group:
            self._group.close()
        else:
            self._group.release(self._tp_handle)
