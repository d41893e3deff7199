"""The step's masks and biases for constrained rows, computed for all rows in one call and
applied on the device to those rows only."""

from __future__ import annotations

import torch
from torch import Tensor

from .grammar import require_llguidance


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


class LogitsMasker:
    """Applies each constrained row's grammar mask, bans (bad words, ``min_tokens``) and
    ``logit_bias`` to a step's logits.  The llguidance thread pool and the host bitmask
    (pinned on CUDA, reused: the step's host sync orders its reuse) are made on first use."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._executor = None
        self._host = HostBitmask(self.device)
        self._shifts = None

    def apply(self, logits: Tensor, seqs) -> Tensor:
        """``logits [B, V]`` with every constrained row (``seq.constraint``) masked and
        biased, as float32 (a new tensor); the same tensor when no row is constrained.
        Host work (the grammar masks) runs here, before anything waits on ``logits``."""
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return logits
        B, V = logits.shape
        # sparse entries: bans (-inf) and biases, as (row, token, value)
        r_idx, t_idx, vals = [], [], []
        for j, i in enumerate(rows):
            c, s = seqs[i].constraint, seqs[i]
            ban = c.banned(s.output_ids)
            r_idx += [j] * len(ban)
            t_idx += ban
            vals += [float("-inf")] * len(ban)
            bi, bv = c.bias
            r_idx += [j] * len(bi)
            t_idx += bi
            vals += bv
        gram = [(seqs[i].constraint, j) for j, i in enumerate(rows) if seqs[i].constraint.matcher is not None]
        mask = None
        if gram:
            mask = self._fill([(c.matcher, j) for c, j in gram], len(rows), gram[0][0].mask_vocab)
        rows_d = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        x = logits.index_select(0, rows_d).float()
        if vals:
            idx = torch.tensor([r_idx, t_idx], dtype=torch.long).to(logits.device, non_blocking=True)
            v = torch.tensor(vals, dtype=torch.float32).to(logits.device, non_blocking=True)
            x.index_put_((idx[0], idx[1]), v, accumulate=True)
        if mask is not None:
            x = x.masked_fill(~self._unpack(mask.to(logits.device, non_blocking=True), V), float("-inf"))
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()
        out.index_copy_(0, rows_d, x)
        return out

    def _fill(self, matchers: list, rows: int, vocab: int) -> Tensor:
        """All grammar rows' bitmasks in one parallel llguidance call (rows without a grammar
        stay all-ones)."""
        llg = require_llguidance()
        from llguidance.torch import fill_next_token_bitmask_par
        if self._executor is None:
            self._executor = llg.LLExecutor()
        words = (vocab + 31) // 32
        buf = self._host.rows(rows, words)
        buf.fill_(-1)
        fill_next_token_bitmask_par(self._executor, matchers, buf)
        return buf

    def _unpack(self, mask: Tensor, V: int) -> Tensor:
        """``[R, W]`` int32 bitmask -> ``[R, V]`` bool (bits past the mask's width: banned)."""
        if self._shifts is None or self._shifts.device != mask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
        bits = ((mask[:, :, None] >> self._shifts) & 1).bool().reshape(mask.shape[0], -1)
        if bits.shape[1] >= V:
            return bits[:, :V]
        return torch.cat([bits, bits.new_zeros(mask.shape[0], V - bits.shape[1])], 1)
