"""Data-parallel routing: which engine replica gets a request (prefix affinity, bounded load).

A prompt's token ids are cut into blocks of ``block_tokens``; block ``j`` is named by a
chained hash ``h_j = hash(h_{j-1}, ids[j*B:(j+1)*B])`` (so ``h_j`` names the whole prefix
``ids[:(j+1)*B]``).  The router remembers, for the most recent ``table_size`` block hashes,
the replica that last received a prompt with that prefix: that replica's prefix cache
likely holds it.  A request goes to

1. the replica of its deepest remembered prefix block whose load is within the bound
   ``load < ceil(load_factor * (total + 1) / N)`` (consistent routing with bounded loads:
   no replica takes more than ``load_factor`` times its share, however popular a prefix);
   shallower matches on other replicas are tried next;
2. otherwise the least-loaded replica (ties: round robin),

where a replica's load is its sequences in flight (queued + running, known exactly by the
router).  Replicas that are down or full are never chosen.  The chosen replica then owns
every block of the prompt in the table.  Pure bookkeeping: no engine, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["PrefixRouter", "RouterConfig", "block_hashes"]


@dataclass
class RouterConfig:
    """``block_tokens``: prompt tokens per affinity block (the engine's prefix-cache block);
    ``load_factor`` (>= 1): a replica may hold this many times its share of the load before
    affinity yields to balance; ``table_size``: block hashes remembered (LRU)."""

    block_tokens: int = 16
    load_factor: float = 1.25
    table_size: int = 1 << 16

    def __post_init__(self):
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"RouterConfig.block_tokens must be an int >= 1, got {self.block_tokens!r}")
        if not (isinstance(self.load_factor, (int, float)) and math.isfinite(self.load_factor)
                and self.load_factor >= 1.0):
            raise ValueError(f"RouterConfig.load_factor must be a finite number >= 1, got {self.load_factor!r}")
        if isinstance(self.table_size, bool) or not isinstance(self.table_size, int) or self.table_size < 1:
            raise ValueError(f"RouterConfig.table_size must be an int >= 1, got {self.table_size!r}")


def block_hashes(ids, block_tokens: int) -> list[int]:
    """Chained hashes of the whole ``block_tokens``-blocks of ``ids`` (a partial last block
    is not hashed: an engine caches whole blocks only)."""
    out, h = [], 0
    for j in range(len(ids) // block_tokens):
        h = hash((h, tuple(ids[j * block_tokens:(j + 1) * block_tokens])))
        out.append(h)
    return out


class PrefixRouter:
    """Chooses a replica for each prompt (:meth:`route`); ``num_replicas`` fixed."""

    def __init__(self, num_replicas: int, config: RouterConfig | None = None):
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        self.n = num_replicas
        self.config = config or RouterConfig()
        self._table: OrderedDict = OrderedDict()   # block hash -> replica
        self._rr = 0

    def bound(self, loads: list[int]) -> int:
        """Most sequences a replica may hold for an affinity hit to still go there."""
        return max(1, math.ceil(self.config.load_factor * (sum(loads) + 1) / self.n))

    def route(self, ids, loads: list[int], usable: list[bool]) -> tuple[int, str]:
        """``(replica, reason)`` for a prompt of token ``ids``: reason ``"affinity"`` (its
        prefix was routed there before) or ``"load"`` (least loaded).  ``loads[i]``: sequences
        in flight on replica ``i``; ``usable[i]``: up and with room.  Raises ``ValueError``
        when no replica is usable."""
        if len(loads) != self.n or len(usable) != self.n:
            raise ValueError(f"route needs {self.n} loads and usable flags, got {len(loads)} and {len(usable)}")
        if not any(usable):
            raise ValueError("no replica is usable")
        hashes = block_hashes(ids, self.config.block_tokens)
        bound = self.bound(loads)
        choice, reason, tried = None, "load", set()
        for h in reversed(hashes):   # deepest remembered prefix first
            r = self._table.get(h)
            if r is None or r in tried:
                continue
            tried.add(r)
            if usable[r] and loads[r] < bound:
                choice, reason = r, "affinity"
                break
        if choice is None:
            low = min(loads[i] for i in range(self.n) if usable[i])
            ties = [i for i in range(self.n) if usable[i] and loads[i] == low]
            choice = ties[self._rr % len(ties)]
            self._rr += 1
        self._remember(hashes, choice)
        return choice, reason

    def _remember(self, hashes: list[int], replica: int) -> None:
        t = self._table
        for h in hashes:
            t[h] = replica
            t.move_to_end(h)
        while len(t) > self.config.table_size:
            t.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Drop every prefix owned by ``replica`` (it restarted: its prefix cache is empty)."""
        for h in [h for h, r in self._table.items() if r == replica]:
            del self._table[h]

    def __len__(self) -> int:
        return len(self._table)
