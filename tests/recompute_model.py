"""A reference implementation of the model-cache API the engine drives, by recomputation.

:class:`RecomputeModel` wraps any causal LM given as a full forward ``f(input_ids[1, T]) ->
logits[1, T, V]`` and implements ``make_cache / prefill / decode / verify / verify_tree /
commit`` by keeping each slot's committed token history and re-running the full forward.
It is exact by construction (every logit is the full model's logit for that prefix), slow,
and strict: it checks the call protocol (a verify must be followed by one commit before the
next call on that cache; slot 0 is the null slot; tree parents are topological; accepted
counts are in range; KV-only slots draw blocks from a finite pool).  The engine's tests run
against it (it implements :class:`replayssm.engine.protocols.CachedModel`).

:class:`TinyLM` is a small random causal LM (float64 by default) with a strong, structured
bigram preference so that generated text repeats and drafts get accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from replayssm.cache.spec import CacheSpec
from replayssm.models.cache import CacheLayout, ModelCache
from replayssm.runtime import canonical_device



@dataclass
class RefConfig:
    vocab_size: int
    eos_token_id: int | None = None
    hidden_size: int = 16
    num_hidden_layers: int = 1
    model_type: str = "reference"


class TinyLM(torch.nn.Module):
    """Causal LM over a window of the last ``window`` tokens (exactly causal, no state).

    ``logits_t = W2 tanh(W1 concat(E[x_{t-window+1..t}])) + bigram[x_t]``.  ``seed`` fixes
    the random MLP; ``bigram_seed`` fixes the bigram table, so two TinyLMs with the same
    ``bigram_seed`` and different ``seed`` make a target/draft pair that mostly agree.
    """

    def __init__(self, vocab_size=32, hidden=16, window=4, seed=0, bigram_seed=1234,
                 bigram_strength=3.0, noise=1.0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        gb = torch.Generator().manual_seed(bigram_seed)
        self.vocab_size, self.window = vocab_size, window
        self.emb = torch.nn.Parameter(torch.randn(vocab_size + 1, hidden, generator=g, dtype=dtype))
        with torch.no_grad():
            self.emb[vocab_size].zero_()  # padding id (before the sequence start)
        self.w1 = torch.nn.Parameter(torch.randn(window * hidden, hidden, generator=g, dtype=dtype) / math.sqrt(window * hidden))
        self.w2 = torch.nn.Parameter(noise * torch.randn(hidden, vocab_size, generator=g, dtype=dtype))
        self.bigram = torch.nn.Parameter(bigram_strength * torch.randn(vocab_size, vocab_size, generator=gb, dtype=dtype))

    @torch.no_grad()
    def forward(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        pad = torch.full((B, self.window - 1), self.vocab_size, dtype=torch.long, device=input_ids.device)
        x = torch.cat([pad, input_ids.long()], 1)
        win = x.unfold(1, self.window, 1)                     # [B, T, window]
        e = self.emb[win].reshape(B, T, -1)                   # [B, T, window*hidden]
        return torch.tanh(e @ self.w1) @ self.w2 + self.bigram[input_ids.long()]


class RecomputeCache:
    def __init__(self, num_slots, spec: CacheSpec, device=None):
        if num_slots < 2:
            raise ValueError("num_slots must be >= 2 (slot 0 is the null slot)")
        mode, max_new, max_seq_len = spec.initial_form, spec.max_new, spec.max_seq_len
        if mode == "replay" and spec.buffer_size < 2 * max_new and max_new > 1:
            raise ValueError(f"buffer_size {spec.buffer_size} < 2 * max_new = {2 * max_new}")
        self.spec, self.num_slots, self.mode = spec, num_slots, mode
        self.max_new, self.max_seq_len, self.kv_block_size = max_new, max_seq_len, spec.block_size
        kv_num_blocks = spec.kv_num_blocks
        self.device = canonical_device(device or "cpu")
        self.history: list[list[int]] = [[] for _ in range(num_slots)]
        self._modes = [mode] * num_slots
        self._in_use = [False] * num_slots
        self._static_kv = kv_num_blocks is None
        if kv_num_blocks is None:
            kv_num_blocks = (num_slots - 1) * spec.max_blocks
        self.kv_num_blocks = kv_num_blocks
        self._blocks = [0] * num_slots
        self.uses_pages = mode == "kv"
        self.pending = None           # (kind, slots, ids, parent) of an uncommitted verify
        self.pidx = self.attn = None  # no paged pools are modelled (free_blocks counts blocks)
        self.calls: list[tuple] = []  # (kind, batch, T) log for tests
        self.switched: list[int] = []
        self._swapped: dict = {}      # swap_out key -> (history, form, blocks)

    # -- bookkeeping ------------------------------------------------------------------
    @property
    def seq_len(self) -> Tensor:
        return torch.tensor([len(h) for h in self.history], dtype=torch.long, device=self.device)

    @property
    def free_blocks(self) -> int:
        return self.kv_num_blocks - sum(self._blocks)

    def mode_of(self, slot: int) -> str:
        return self._modes[int(slot)]

    def switch_to_state(self, slots) -> None:
        self._check_idle()
        for s in _as_list(slots):
            if s == 0:
                continue
            if self._modes[s] == "kv":
                self._modes[s] = "replay"
                self._blocks[s] = 0
                self.switched.append(s)

    def fork(self, src: int, dst) -> None:
        """Copy slot ``src``'s history into the free slots ``dst`` (n samples of one prompt)."""
        self._check_idle()
        src = int(src)
        if not self._in_use[src]:
            raise ValueError(f"fork source slot {src} holds no sequence")
        for d in _as_list(dst):
            if d == 0 or d == src or self._in_use[d]:
                raise ValueError(f"fork target slot {d} must be free and not the null slot")
        for d in _as_list(dst):
            self.history[d] = list(self.history[src])
            self._modes[d] = self._modes[src]
            self._blocks[d] = self._blocks[src] if self._modes[src] == "kv" else 0
            self._in_use[d] = True

    def release(self, slots) -> None:
        for s in _as_list(slots):
            if s == 0:
                continue
            self.history[s] = []
            self._blocks[s] = 0
            self._modes[s] = self.mode
            self._in_use[s] = False

    def swap_out(self, slot: int, key) -> None:
        """Keep ``slot``'s history, form and blocks under ``key`` and free the slot (preemption)."""
        self._check_idle()
        slot = int(slot)
        if not 0 < slot < self.num_slots or not self._in_use[slot]:
            raise ValueError(f"swap_out: slot {slot} holds no sequence")
        if key in self._swapped:
            raise ValueError(f"swap_out: key {key!r} already holds a swapped-out slot")
        self._swapped[key] = (list(self.history[slot]), self._modes[slot], self._blocks[slot])
        self.release([slot])

    def swap_in(self, slot: int, key) -> None:
        """Restore what :meth:`swap_out` kept under ``key`` into the free ``slot``."""
        self._check_idle()
        slot = int(slot)
        if key not in self._swapped:
            raise ValueError(f"swap_in: no swapped-out slot under key {key!r}")
        if not 0 < slot < self.num_slots or self._in_use[slot]:
            raise ValueError(f"swap_in: slot {slot} must be free and not the null slot")
        history, mode, blocks = self._swapped[key]
        if mode == "kv" and not self._static_kv and blocks > self.free_blocks:
            raise RuntimeError(f"KV block pool exhausted (swap_in needs {blocks}, {self.free_blocks} free)")
        del self._swapped[key]
        self.history[slot], self._modes[slot], self._in_use[slot] = list(history), mode, True
        self._blocks[slot] = blocks if mode == "kv" else 0

    def drop_swapped(self, key) -> None:
        self._swapped.pop(key, None)

    def clear_pending(self) -> None:
        self.pending = None

    def _check_idle(self):
        if self.pending is not None:
            raise RuntimeError("a verify is waiting for its commit")

    def write_pending(self) -> None:
        """Nothing is deferred here (``reserve`` writes at once)."""

    reserve_step = ModelCache.reserve_step   # per-slot reserve, then write_pending (a no-op here)

    def reserve(self, slot: int, total_len: int, defer: bool = False) -> None:
        """KV-only slots with a finite pool: make room for ``total_len`` entries (between steps)."""
        self._check_idle()
        if total_len > self.max_seq_len:
            raise ValueError(f"slot {slot}: {total_len} tokens > max_seq_len {self.max_seq_len}")
        if self._modes[int(slot)] == "kv" and not self._static_kv:
            self._grow(int(slot), total_len)

    def _reserve(self, slot: int, total: int):
        """Check (static pool: allocate) room for ``total`` entries at call time."""
        if total > self.max_seq_len:
            raise RuntimeError(f"slot {slot}: {total} tokens > max_seq_len {self.max_seq_len}")
        if self._modes[slot] != "kv":
            return
        if not self._static_kv:
            have = self._blocks[slot] * self.kv_block_size
            if total > have:
                raise RuntimeError(f"slot {slot}: {total} entries exceed its {self._blocks[slot]} blocks; reserve first")
            return
        self._grow(slot, total)

    def _grow(self, slot: int, total: int):
        need = -(-total // self.kv_block_size)
        extra = need - self._blocks[slot]
        if extra > self.free_blocks:
            raise RuntimeError(f"KV block pool exhausted (slot {slot} needs {extra}, {self.free_blocks} free)")
        self._blocks[slot] = max(need, self._blocks[slot])

    def _check_slots(self, slots: Tensor, B: int):
        if slots.shape != (B,):
            raise ValueError(f"slots must have shape [{B}], got {tuple(slots.shape)}")
        s = [int(v) for v in slots]
        real = [v for v in s if v != 0]
        if len(set(real)) != len(real):
            raise ValueError(f"duplicate slots in one batch: {s}")
        if any(v < 0 or v >= self.num_slots for v in s):
            raise ValueError(f"slot out of range: {s}")
        return s


def _as_list(slots) -> list[int]:
    if isinstance(slots, Tensor):
        return [int(v) for v in slots.reshape(-1)]
    if isinstance(slots, int):
        return [slots]
    return [int(v) for v in slots]


class RecomputeModel:
    """The engine's model API over a full-forward causal LM (exact, by recomputation)."""

    def __init__(self, lm, vocab_size: int | None = None, eos_token_id: int | None = None,
                 device="cpu", dtype=torch.float64):
        self.lm = lm
        self.device = canonical_device(device)
        self.dtype = dtype
        vocab_size = vocab_size if vocab_size is not None else getattr(lm, "vocab_size")
        self.config = RefConfig(vocab_size=vocab_size, eos_token_id=eos_token_id)

    # full forward ------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, input_ids: Tensor) -> Tensor:
        out = self.lm(input_ids.to(self.device))
        out = out.logits if hasattr(out, "logits") else out
        return out.to(self.dtype)

    def _last_logits(self, seqs: list[list[int]]) -> Tensor:
        """Logits after each token list (one forward per distinct length)."""
        out = [None] * len(seqs)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_len.setdefault(len(s), []).append(i)
        for n, idx in by_len.items():
            ids = torch.tensor([seqs[i] for i in idx], dtype=torch.long, device=self.device)
            lg = self(ids)[:, -1]
            for j, i in enumerate(idx):
                out[i] = lg[j]
        return torch.stack(out)

    def make_cache(self, num_slots, spec: CacheSpec | None = None, *, device=None, **fields):
        return RecomputeCache(num_slots, CacheSpec.of(spec, **fields), device or self.device)

    def cache_layout(self, spec: CacheSpec | None = None, **fields):
        """Nominal sizes: what one Mamba-2 layer of 8 heads x 64, ``n = 128``, one group and a
        width-4 conv would allocate in this dtype (the recomputation itself keeps only token
        lists), so memory budgets in tests behave like a small real model's."""
        ab = torch.finfo(self.dtype).bits // 8
        sb = max(4, ab)
        H, d, n, G, W = 8, 64, 128, 1, 4
        state, entry = sb * H * d * n, ab * (H * d + G * n) + sb * H
        spec = CacheSpec.of(spec, **fields)
        ring = spec.buffer_size if spec.mode != "recurrent" else 1
        slot = state + ring * entry + ab * (H * d + 2 * G * n) * (W - 1)
        block = spec.block_size * entry if spec.paged else 0
        return CacheLayout(spec.mode, slot, block, spec.block_size, state, entry)

    def _null_logits(self, n):
        return torch.zeros(n, self.config.vocab_size, dtype=self.dtype, device=self.device)

    # API -----------------------------------------------------------------------------------
    def prefill(self, cache: RecomputeCache, slots: Tensor, input_ids: Tensor, lengths: Tensor) -> Tensor:
        cache._check_idle()
        B = input_ids.shape[0]
        s = cache._check_slots(slots, B)
        cache.calls.append(("prefill", B, input_ids.shape[1]))
        rows = []
        for b, slot in enumerate(s):
            n = int(lengths[b])
            if slot == 0:
                rows.append(None)
                continue
            if n < 1:
                raise ValueError(f"row {b}: prefill length must be >= 1")
            toks = [int(t) for t in input_ids[b, :n]]
            cache._reserve(slot, len(cache.history[slot]) + n)
            cache.history[slot] = cache.history[slot] + toks
            cache._in_use[slot] = True
            rows.append(cache.history[slot])
        return self._stack_rows(rows)

    def _stack_rows(self, rows):
        real = [r for r in rows if r is not None]
        lg = self._last_logits(real) if real else None
        out, j = [], 0
        for r in rows:
            if r is None:
                out.append(self._null_logits(1)[0])
            else:
                out.append(lg[j])
                j += 1
        return torch.stack(out)

    def decode(self, cache: RecomputeCache, slots: Tensor, input_ids: Tensor) -> Tensor:
        cache._check_idle()
        B = input_ids.shape[0]
        s = cache._check_slots(slots, B)
        cache.calls.append(("decode", B, 1))
        rows = []
        for b, slot in enumerate(s):
            if slot == 0:
                rows.append(None)
                continue
            if not cache.history[slot]:
                raise RuntimeError(f"decode on slot {slot} before prefill")
            cache._reserve(slot, len(cache.history[slot]) + 1)
            cache.history[slot].append(int(input_ids[b]))
            rows.append(cache.history[slot])
        return self._stack_rows(rows)

    def verify(self, cache: RecomputeCache, slots: Tensor, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        parent = torch.arange(-1, T - 1, device=input_ids.device).expand(B, T)
        out = self._tree(cache, slots, input_ids, parent, "verify")
        return out

    def verify_tree(self, cache: RecomputeCache, slots: Tensor, input_ids: Tensor, parent: Tensor) -> Tensor:
        B, N = input_ids.shape
        if parent.dim() == 1:
            parent = parent[None].expand(B, N)
        return self._tree(cache, slots, input_ids, parent, "tree")

    def _tree(self, cache, slots, input_ids, parent, kind):
        cache._check_idle()
        B, N = input_ids.shape
        s = cache._check_slots(slots, B)
        if N > cache.max_new:
            raise ValueError(f"{N} tentative tokens > max_new {cache.max_new}")
        par = parent.tolist()
        for b in range(B):
            for i in range(N):
                if not (-1 <= par[b][i] < i):
                    raise ValueError(f"tree not topological at row {b} node {i}")
            if par[b][0] != -1:
                raise ValueError("node 0 must be a root")
        cache.calls.append((kind, B, N))
        ids = input_ids.tolist()
        rows = []
        for b, slot in enumerate(s):
            if slot == 0:
                rows.extend([None] * N)
                continue
            cache._reserve(slot, len(cache.history[slot]) + N)
            for i in range(N):
                path, j = [], i
                while j >= 0:
                    path.append(ids[b][j])
                    j = par[b][j]
                rows.append(cache.history[slot] + path[::-1])
        out = self._stack_rows(rows).reshape(B, N, -1)
        cache.pending = (kind, s, ids, par)
        return out

    def commit(self, cache: RecomputeCache, accepted: Tensor, path: Tensor | None = None) -> None:
        if cache.pending is None:
            raise RuntimeError("commit without a pending verify")
        kind, s, ids, par = cache.pending
        B, N = len(s), len(ids[0])
        acc = [int(a) for a in accepted.reshape(-1)]
        if len(acc) != B:
            raise ValueError(f"accepted has {len(acc)} rows, the verify had {B}")
        if any(a < 0 or a > N for a in acc):
            raise ValueError(f"accepted counts must be in [0, {N}], got {acc}")
        if kind == "tree" and path is None and any(a > 1 for a in acc):
            raise ValueError("tree commit needs a path")
        pth = path.tolist() if path is not None else [list(range(N))] * B
        for b, slot in enumerate(s):
            prev = -1
            for i in range(acc[b]):
                node = pth[b][i]
                if par[b][node] != prev:
                    raise ValueError(f"row {b}: path step {i} (node {node}) is not a child of {prev}")
                prev = node
            if slot == 0:
                continue
            cache.history[slot] = cache.history[slot] + [ids[b][pth[b][i]] for i in range(acc[b])]
        cache.pending = None
        cache.calls.append(("commit", B, 0))


def tiny_pair(vocab_size=32, eos_token_id=None, device="cpu", draft_noise=0.25, seed=0):
    """A (target, draft) pair of :class:`RecomputeModel` over TinyLMs that mostly agree
    (the draft is the target with its output layer perturbed by ``draft_noise``)."""
    tlm = TinyLM(vocab_size, seed=seed)
    dlm = TinyLM(vocab_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 99)
    with torch.no_grad():
        dlm.w2.add_(draft_noise * torch.randn(dlm.w2.shape, generator=g, dtype=dlm.w2.dtype))
    target = RecomputeModel(tlm, eos_token_id=eos_token_id, device=device)
    draft = RecomputeModel(dlm, eos_token_id=eos_token_id, device=device)
    return target, draft
