"""ModelCache: everything one model keeps per resident sequence (slot).

Slots ``0 .. num_slots-1``; slot 0 is the null slot (padding rows read and write it; it
holds garbage).  Per layer (``layers[layer_id]``):

* Mamba-2 / GDN: ``buf`` (checkpoint state + input ring, ``cache.buffers``), ``conv``
  (``cache.conv.ConvWindow``), ``kv`` (paged KV-only pools, ``cache.paged``; only in
  ``mode="kv"``).
* attention: ``k``, ``v`` ``[P, max_seq_len, Hkv, Dh]``.

Shared bookkeeping: ``ring`` (``RingIndex``, replay form), ``pidx`` (``PagedIndex``, KV-only
form), ``seq_len [P]`` (committed tokens per slot, device), the per-slot form (host list,
changed only between steps by :meth:`switch_to_state` / :meth:`release`) and the pending
verify (a :class:`~replayssm.layers.context.StepContext` awaiting ``model.commit``).

Optionally (:meth:`keep_hidden`, for a drafter that conditions on the model, e.g. MTP):
``hidden [P, max_new, D]``, the final-normed hidden state (the LM head's input) of each token
of every slot's latest call, written on the device inside the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.paged import PagedIndex
from ..cache.ring import RingIndex, check_speculative_capacity
from ..forms import CACHE_FORMS, get_form
from ..runtime import canonical_device  # noqa: F401  (re-exported: models code imports it here)

MODES = ("recurrent", "replay", "kv")


def _as_list(slots) -> list[int]:
    if isinstance(slots, Tensor):
        return [int(v) for v in slots.reshape(-1).tolist()]
    if isinstance(slots, int):
        return [slots]
    return [int(v) for v in slots]


def _tensors(store: dict) -> list[Tensor]:
    """The floating-point tensors of a layer store (what ``poison`` fills with NaN)."""
    return [t for t in _owned(store) if t.is_floating_point()]


def _owned(obj) -> list[Tensor]:
    """Every tensor held by ``obj``: itself, a dict's values, an object's attributes
    (buffers, pools, indices), recursively one level of containers deep."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _owned(v)]
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return []
    return [t for t in vars(obj).values() if isinstance(t, Tensor)]


@dataclass(frozen=True)
class CacheLayout:
    """Bytes a :class:`ModelCache` allocates, measured by running its own allocation on the
    ``meta`` device (no memory is touched), so admission budgets what the cache really holds.

    ``slot_bytes``: one usable slot (checkpoint states, rings, conv windows, attention KV,
    per-slot bookkeeping).  ``block_bytes``: one block of the KV-only pool over all SSM
    layers (0 outside ``mode="kv"``), ``block_size`` entries each.  ``state_bytes`` /
    ``entry_bytes``: one slot's checkpoint states and one input entry (ring or KV-only) over
    all SSM layers: the two sizes that decide when the KV-only form stops paying
    (:func:`replayssm.forms.kv.kv_only_threshold`).
    """

    mode: str
    slot_bytes: int
    block_bytes: int
    block_size: int
    state_bytes: int
    entry_bytes: int

    @property
    def kv_token_bytes(self) -> int:
        """Bytes of one KV-only token (its share of a block)."""
        return self.block_bytes // self.block_size


class ModelCache:
    def __init__(self, model, num_slots: int, mode: str = "replay", buffer_size: int = 16,
                 max_new: int = 1, max_seq_len: int = 2048, kv_block_size: int = 16,
                 kv_num_blocks: int | None = None, device=None, poison: bool = False):
        if mode not in MODES:
            raise ValueError(f"cache mode must be one of {MODES}, got {mode!r}")
        for name, v, lo in (("num_slots", num_slots, 2), ("buffer_size", buffer_size, 1),
                            ("max_new", max_new, 1), ("max_seq_len", max_seq_len, 1),
                            ("kv_block_size", kv_block_size, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}"
                                 + (" (slot 0 is the null slot)" if name == "num_slots" else ""))
        forms = [get_form(f) for f in CACHE_FORMS[mode]]
        uses_ring = any(f.uses_ring for f in forms)
        uses_pages = any(f.uses_pages for f in forms)
        if uses_ring:
            check_speculative_capacity(buffer_size, max_new, "tokens verified per step (max_new)")
        self.model = model
        self.num_slots, self.mode, self.buffer_size = num_slots, mode, buffer_size
        self.max_new, self.max_seq_len, self.kv_block_size = max_new, max_seq_len, kv_block_size
        self.device = canonical_device(device) if device is not None else model.device
        self.dtype = model.dtype
        P = num_slots
        self.P = P
        self.seq_len = torch.zeros(P, dtype=torch.long, device=self.device)
        self._modes = ["none"] + [mode] * (P - 1)
        self._in_use: set[int] = set()      # slots holding a sequence (host mirror)
        self.kv_slot = torch.zeros(P, dtype=torch.bool, device=self.device)
        cap = buffer_size if uses_ring else 1
        self.ring = RingIndex(P - 1, cap, self.device)
        self.uses_pages = uses_pages
        self.pidx = None
        paged = None
        if uses_pages:
            max_blocks = -(-max_seq_len // kv_block_size)
            self._static_kv = kv_num_blocks is None
            if kv_num_blocks is None:
                kv_num_blocks = (P - 1) * max_blocks
            if not isinstance(kv_num_blocks, int) or kv_num_blocks < 1:
                raise ValueError(f"kv_num_blocks must be a positive int, got {kv_num_blocks!r}")
            self.pidx = PagedIndex(P - 1, kv_block_size, kv_num_blocks + 1, max_blocks, self.device)
            paged = (kv_num_blocks + 1, kv_block_size)
            self.kv_slot[1:] = True
            if self._static_kv:
                for s in range(1, P):
                    self.pidx.reserve(s, max_seq_len)
        self.layers: dict[int, dict] = {}
        for layer in model.stateful_layers():
            if hasattr(layer, "conv_dim"):
                store = layer.allocate(P, cap, self.dtype, self.device, paged, mode=mode)
            else:
                store = layer.allocate(P, max_seq_len, self.dtype, self.device)
            if poison:  # tests: every byte a step may not read is NaN
                for t in _tensors(store):
                    t.fill_(float("nan"))
            self.layers[layer.layer_id] = store
        self.pending = None
        self.hidden: Tensor | None = None                # keep_hidden(): [P, max_new, D]
        self.prompt_hidden: dict[int, list[Tensor]] = {}  # slot -> prefilled hidden states

    # ------------------------------------------------------------------ hidden states
    def keep_hidden(self, width: int) -> None:
        """From now on keep the final-normed hidden state ``hn`` (the LM head's input) of the
        tokens each call processes, for a drafter that reads it (MTP):

        * ``hidden [P, max_new, width]`` (static, so CUDA graphs write it in place): after a
          ``decode`` / ``verify`` / ``verify_tree`` of ``T`` tokens, ``hidden[slot, i]`` is
          token (node) ``i``'s; after a ``prefill``, ``hidden[slot, 0]`` is the last prompt
          token's.  Written by the call on the device (no host round trip).
        * ``prompt_hidden[slot]``: each prefill's ``[n, width]`` rows (every valid prompt
          token), kept until :meth:`take_prompt_hidden` or :meth:`release`.
        """
        if self.hidden is None:
            self.hidden = torch.zeros(self.P, self.max_new, int(width), dtype=self.dtype, device=self.device)

    def record_hidden(self, slots: Tensor, hn: Tensor) -> None:
        """``hidden[slots, :T] = hn [B, T, D]`` (no-op unless :meth:`keep_hidden`)."""
        if self.hidden is not None:
            self.hidden[slots, : hn.shape[1]] = hn.to(self.hidden.dtype)

    def record_prompt_hidden(self, slots: Tensor, hn: Tensor, lengths: Tensor) -> None:
        """After a prefill of ``hn [B, T, D]`` (``lengths`` valid per row): the last valid
        row to ``hidden[slot, 0]``, every valid row appended to ``prompt_hidden[slot]``."""
        B = hn.shape[0]
        last = hn[torch.arange(B, device=hn.device), (lengths - 1).clamp(min=0)]
        self.hidden[slots, 0] = last.to(self.hidden.dtype)
        for b, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
            if s:
                self.prompt_hidden.setdefault(s, []).append(hn[b, :n])

    def take_prompt_hidden(self, slot: int) -> Tensor | None:
        """The prefilled hidden states of ``slot`` since the last take ``[n, D]`` (or None)."""
        parts = self.prompt_hidden.pop(int(slot), None)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    # ------------------------------------------------------------------ memory
    def tensors(self) -> list[Tensor]:
        """Every tensor this cache holds (layer stores and the shared bookkeeping)."""
        out = [self.seq_len, self.kv_slot] + _owned(self.ring) + _owned(self.pidx)
        if self.hidden is not None:
            out.append(self.hidden)
        for store in self.layers.values():
            out += _owned(store)
        return out

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @classmethod
    def layout(cls, model, mode: str = "replay", buffer_size: int = 16, max_new: int = 1,
               max_seq_len: int = 2048, kv_block_size: int = 16) -> CacheLayout:
        """What a cache of these settings allocates per slot and per KV-only block, measured
        by building it on the ``meta`` device with one and two slots (one and two blocks)."""
        meta = torch.device("meta")

        def build(P: int, blocks: int) -> "ModelCache":
            return cls(model, P, mode, buffer_size, max_new, max_seq_len, kv_block_size,
                       blocks if mode == "kv" else None, device=meta)

        one = build(2, 1)
        slot = build(3, 1).nbytes() - one.nbytes()
        block = build(2, 2).nbytes() - one.nbytes() if one.pidx is not None else 0
        bufs = [st["buf"] for st in one.layers.values() if "buf" in st]
        state = sum(b.state.nbytes for b in bufs) // one.P
        entry = sum(t.nbytes // (t.shape[0] * t.shape[1]) for b in bufs for t in b.ring_tensors())
        return CacheLayout(mode, slot, block, kv_block_size, state, entry)

    # ------------------------------------------------------------------ queries
    def mode_of(self, slot: int) -> str:
        """Form of ``slot``'s recurrent layers: ``"recurrent"``, ``"replay"`` or ``"kv"``."""
        slot = int(slot)
        if not 0 <= slot < self.P:
            raise ValueError(f"slot must be in [0, {self.P - 1}], got {slot}")
        return self._modes[slot] if slot else self.mode

    def ssm_form(self) -> str:
        """Form a step runs in: the cache mode, or ``"mixed"`` when KV and replay slots coexist."""
        if self.mode != "kv":
            return self.mode
        kinds = {self._modes[s] for s in self._in_use} or {self.mode}
        return "kv" if kinds == {"kv"} else ("mixed" if "kv" in kinds else "replay")

    def _check_idle(self):
        if self.pending is not None:
            raise RuntimeError("a verify is waiting for its commit (call model.commit first)")

    def reserve(self, slot: int, total_len: int) -> None:
        """KV-only slots with a finite block pool: make room for ``total_len`` entries."""
        if total_len > self.max_seq_len:
            raise ValueError(f"slot {slot}: {total_len} tokens > max_seq_len {self.max_seq_len}")
        if self.pidx is not None and self._modes[int(slot)] == "kv":
            self.pidx.reserve(int(slot), total_len)

    # ------------------------------------------------------------------ slot lifecycle
    def release(self, slots) -> None:
        """Free ``slots`` (their next prefill starts a new sequence in the cache's mode)."""
        self._check_idle()
        ids = [s for s in _as_list(slots) if s != 0]
        for s in ids:
            if not 0 < s < self.P:
                raise ValueError(f"slot must be in [1, {self.P - 1}], got {s}")
        if not ids:
            return
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.seq_len[t] = 0
        self.ring.reset(t)
        for s in ids:
            self._modes[s] = self.mode
            self._in_use.discard(s)
            self.prompt_hidden.pop(s, None)
            if self.pidx is not None:
                self.pidx.release(s)
                if self._static_kv:
                    self.pidx.reserve(s, self.max_seq_len)
        if self.pidx is not None:
            self.kv_slot[t] = True

    def switch_to_state(self, slots) -> None:
        """KV-only slots -> replay form: compress each layer's KV entries into its checkpoint
        state (one flush, ``kv_to_state``), empty the ring, free the slot's blocks."""
        self._check_idle()
        ids = [s for s in _as_list(slots) if s != 0 and self._modes[s] == "kv"]
        if not ids:
            return
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pplan = self.pidx.plan(t, 1, check=False)
        for layer in self.model.stateful_layers():
            if hasattr(layer, "kv_to_state"):
                layer.kv_to_state(self.layers[layer.layer_id], pplan, t)
        self.ring.reset(t)
        for s in ids:
            self._modes[s] = "replay"
            self.pidx.release(s)
        self.kv_slot[t] = False
