"""The step's masks and biases for constrained rows, computed for all rows in one call and
applied on the device to those rows only.

Timeline of a decode step with constrained rows (CUDA)::

    host:   prepare (fill starts on the worker) | launch forward | wait fill | launch mask ops | sync
    worker:                    llguidance parallel fill of the [R, W] bitmask |
    device:                                     forward ...................... | copy, mask, argmax

:meth:`LogitsMasker.prepare` starts the grammar fill on a worker thread (llguidance releases
the GIL and fills the rows in parallel) before the forward is launched; :meth:`LogitsMasker.apply`
waits for it and applies the mask with a few device ops of ``O(R * V)`` elements (no per-row
host loop, nothing that waits for the device).  The matchers were advanced by the previous
step's tokens and are not touched until the next step's output processing.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from ...runtime import host_to_device
from .grammar import require_llguidance

#: engine stats this module and the output processor add to (seconds, summed over steps)
GRAMMAR_STATS = ("grammar_fill_s", "grammar_wait_s", "grammar_apply_s", "grammar_walk_s", "grammar_advance_s")


class HostBitmask:
    """A host int32 bitmask ``[rows, words]`` reused between steps (pinned on CUDA, so its
    copy to the device is asynchronous; the step's host sync orders its reuse); it grows
    when a step needs more rows or another vocabulary width."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buf: Tensor | None = None

    def rows(self, rows: int, words: int) -> Tensor:
        b = self._buf
        if b is None or b.shape[0] < rows or b.shape[1] != words:
            b = torch.empty(max(rows, 8), words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._buf = b
        return b[:rows]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list -> a device tensor without waiting for queued device work
    (:func:`replayssm.runtime.host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def fill_bitmask(executor, matchers: list, buf: Tensor, drafts: bool = False) -> None:
    """llguidance's parallel fill of ``buf [R, W]`` (host int32, contiguous): ``matchers`` as
    ``(matcher, row)`` or, with ``drafts``, ``(matcher, first row, draft tokens)`` (the masks
    along the drafts, matcher rolled back).  Calls the executor directly: llguidance's torch
    helpers module imports ``torch.compile`` (seconds, and thousands of modules)."""
    if buf.dtype != torch.int32 or buf.device.type != "cpu" or buf.dim() != 2 or not buf.is_contiguous():
        raise ValueError(f"fill_bitmask: the bitmask must be a contiguous 2-D int32 host tensor, got "
                         f"{buf.dtype} {tuple(buf.shape)} on {buf.device}")
    f = executor.unsafe_compute_mask_ptr_with_draft_token if drafts else executor.unsafe_compute_mask_ptr
    f(matchers, buf.data_ptr(), buf.shape[1] * 4, buf.shape[0])


class MaskJob:
    """One step's host part for the constrained rows: ``rows`` (batch indices), the sparse
    ``(row, token, value)`` entries (bans ``-inf`` and biases; row = index into ``rows``)
    ``gram`` (the indices into ``rows`` with a grammar) and the pending bitmask fill
    (``None`` when no row has a grammar)."""

    def __init__(self, seqs, rows, gram, r_idx, t_idx, vals, fill, vocab):
        self.seqs, self.rows, self.gram = seqs, rows, gram
        self.r_idx, self.t_idx, self.vals = r_idx, t_idx, vals
        self.fill, self.vocab = fill, vocab


class LogitsMasker:
    """Applies each constrained row's grammar mask, bans (bad words, ``min_tokens``) and
    ``logit_bias`` to a step's logits.  The llguidance thread pool, the worker thread that
    calls it and the host bitmask (pinned on CUDA, reused: the step's host sync orders its
    reuse) are made on first use.  ``stats``: the engine's counters (``GRAMMAR_STATS``)."""

    def __init__(self, device, stats: dict | None = None):
        self.device = torch.device(device)
        self.stats = {} if stats is None else stats
        for k in GRAMMAR_STATS:
            self.stats.setdefault(k, 0.0)
        self._executor = None
        self._worker: ThreadPoolExecutor | None = None
        self._pending = None   # the last fill handed to the worker
        self._host = HostBitmask(self.device)
        self._bits = None

    def _add(self, key: str, dt: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + dt

    def prepare(self, seqs) -> MaskJob | None:
        """Start the step's host work for ``seqs`` (call it before launching the forward):
        the grammar rows' bitmask fill goes to the worker thread; bans and biases are listed
        here.  None when no row is constrained (free rows pay nothing)."""
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return None
        self.wait()   # the bitmask is reused: the previous fill must be over
        gram = [(seqs[i].constraint.matcher, j) for j, i in enumerate(rows) if seqs[i].constraint.matcher is not None]
        fill, vocab = None, 0
        if gram:
            vocab = seqs[rows[gram[0][1]]].constraint.mask_vocab
            buf = self._host.rows(len(rows), (vocab + 31) // 32)
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            started = threading.Event()
            fill = self._pending = self._worker.submit(self._fill, gram, buf, started)
            started.wait()   # the worker holds the GIL until llguidance releases it: the fill is running
        r_idx, t_idx, vals = [], [], []   # sparse entries: bans (-inf) and biases
        for j, i in enumerate(rows):
            c, s = seqs[i].constraint, seqs[i]
            ban = c.banned(s.output_ids) if c.bad_words or len(s.output_ids) < c.min_tokens else ()
            bi, bv = c.bias
            if ban or bi:
                r_idx += [j] * (len(ban) + len(bi))
                t_idx += list(ban) + list(bi)
                vals += [float("-inf")] * len(ban) + list(bv)
        return MaskJob(seqs, rows, [j for _, j in gram], r_idx, t_idx, vals, fill, vocab)

    def wait(self) -> None:
        """Wait for a fill still running on the worker (the matchers are borrowed by it
        until then); its error, if any, belongs to the step that prepared it."""
        p, self._pending = self._pending, None
        if p is not None:
            p.exception()

    def apply(self, logits: Tensor, seqs, job: MaskJob | None = None) -> Tensor:
        """``logits [B, V]`` with every constrained row (``seq.constraint``) masked and
        biased, as float32 (a new tensor); the same tensor when no row is constrained.
        ``job``: this step's :meth:`prepare` of ``seqs`` (made here when not given).  Waits
        for the fill, then queues device ops only (nothing here waits on ``logits``)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            self.wait()   # the matchers are free again before the caller sees the error
            raise ValueError(f"LogitsMasker.apply: logits must be [B, V] for B = {len(seqs)} sequences, got "
                             f"{tuple(logits.shape)}")
        if job is None:
            job = self.prepare(seqs)
        elif job.seqs is not seqs:
            self.wait()
            raise ValueError("LogitsMasker.apply: the job was prepared for another batch")
        if job is None:
            return logits
        mask = None
        if job.fill is not None:
            t0 = time.perf_counter()
            mask = job.fill.result()
            self._add("grammar_wait_s", time.perf_counter() - t0)
        t0 = time.perf_counter()
        B, V = logits.shape
        dev = logits.device
        every = len(job.rows) == B   # all rows constrained: no gather / scatter
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()
        rows_d = None if every else to_device(job.rows, torch.long, dev)
        x = out if every else out.index_select(0, rows_d)
        if job.vals:
            idx = to_device([job.r_idx, job.t_idx], torch.long, dev)
            x.index_put_((idx[0], idx[1]), to_device(job.vals, torch.float32, dev), accumulate=True)
        if mask is not None:
            wide = mask.shape[1] * 32   # the bitmask's tokens: rows with a grammar ban any past them
            mask = mask.to(dev, non_blocking=True)
            if V <= wide or len(job.gram) == len(job.rows):
                x.masked_fill_(self.banned(mask, V), float("-inf"))
            else:
                x[:, :wide].masked_fill_(self.banned(mask, wide), float("-inf"))
                x[to_device(job.gram, torch.long, dev), wide:] = float("-inf")
        if not every:
            out.index_copy_(0, rows_d, x)
        self._add("grammar_apply_s", time.perf_counter() - t0)
        return out

    def _fill(self, gram: list, buf: Tensor, started=None) -> Tensor:
        """All grammar rows' bitmasks in one parallel llguidance call into ``buf`` (rows
        without a grammar stay all-ones); runs on the worker thread (``started`` is set just
        before the call)."""
        t0 = time.perf_counter()
        try:
            if self._executor is None:
                self._executor = require_llguidance().LLExecutor()
            buf.fill_(-1)
        finally:
            if started is not None:
                started.set()
        fill_bitmask(self._executor, gram, buf)
        self._add("grammar_fill_s", time.perf_counter() - t0)
        return buf

    def _bit_values(self, device: torch.device) -> Tensor:
        if self._bits is None or self._bits.device != device:
            self._bits = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)
        return self._bits

    def banned(self, mask: Tensor, V: int) -> Tensor:
        """``[R, W]`` int32 bitmask -> ``[R, V]`` bool, True = banned (bit clear, or past the
        mask's ``32 W`` tokens): two device ops."""
        R, W = mask.shape
        bits = (mask[:, :, None] & self._bit_values(mask.device)).eq(0).view(R, W * 32)
        if W * 32 >= V:
            return bits[:, :V]
        return torch.cat([bits, bits.new_ones(R, V - W * 32)], 1)

    def _unpack(self, mask: Tensor, V: int) -> Tensor:
        """``[R, W]`` int32 bitmask -> ``[R, V]`` bool, True = allowed."""
        return ~self.banned(mask, V)
