"""Memory-traffic model of one SSM head per decode step (``docs/MATH.md``, Traffic model).

A decode step of an SSM layer is memory-bound: its time is the bytes it must move over
the device's bandwidth.  Per head, with state ``S ∈ R^{d×n}`` stored in ``sb`` bytes
per element (fp32: 4) and vectors in ``vb`` bytes (bf16: 2):

* recurrent:  ``2·sb·dn + vb(d + 2n + 1)``  (state read + written; x, B, C, dt read)
* replay, ``h`` entries cached: ``sb·dn + vb·h(d+n+1) + vb(d+2n+1) + vb(d+n+1)``
  (checkpoint read, ring read, inputs read, new entry written), plus ``sb·dn`` on the
  flush step.  Over a flush cycle of ``L`` steps ``h`` runs ``0..L-1``, so the
  amortised cost is minimal at ``L* = sqrt(2·sb·dn / (vb(d+n+1)))`` — ``sqrt(4dn/(d+n+1))``
  for fp32 states and 2-byte vectors.
* speculative, snapshot baseline (T drafts): ``sb·dn`` read + ``T·sb·dn`` written.
* speculative, replay: one ``sb·dn`` read, the ring, the T new entries, amortised flush.
* KV-only with context ``c``: ``vb·c(d+n+1)`` plus the step's own inputs; no state.

``d`` is the value dimension (Mamba-2 head_dim, GDN V) and ``n`` the key dimension
(Mamba-2 d_state, GDN K).  ``key_share`` divides the key bytes of the ring when a key
is shared by several heads (Mamba-2 groups: ``nheads / ngroups``); 1 gives the per-head
table of ``docs/MATH.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from ..argtypes import positive_int


@dataclass(frozen=True)
class HeadShape:
    """One head's sizes and storage widths (bytes per element)."""

    d: int = 64
    n: int = 128
    state_bytes: int = 4
    vec_bytes: int = 2
    key_share: int = 1

    def __post_init__(self):
        for name in ("d", "n", "state_bytes", "vec_bytes", "key_share"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"HeadShape.{name} must be a positive int, got {v!r}")

    @property
    def state(self) -> int:
        """Bytes of one state ``S``."""
        return self.state_bytes * self.d * self.n

    @property
    def entry(self) -> float:
        """Bytes of one ring entry ``(v, k, Δ)`` per head."""
        return self.vec_bytes * (self.d + self.n / self.key_share + 1)

    @property
    def inputs(self) -> int:
        """Bytes of one token's inputs ``(x, B, C, dt)`` per head."""
        return self.vec_bytes * (self.d + 2 * self.n + 1)


def recurrent_bytes(s: HeadShape) -> float:
    """Load S, update, store S: ``2·state + inputs``."""
    return 2 * s.state + s.inputs


def replay_bytes(s: HeadShape, h: int, flush: bool = False) -> float:
    """One replay step with ``h`` cached entries (``flush`` adds the state store)."""
    if h < 0:
        raise ValueError(f"h must be >= 0, got {h}")
    return s.state + h * s.entry + s.inputs + s.entry + (s.state if flush else 0)


def replay_cycle_bytes(s: HeadShape, L: int) -> float:
    """Replay bytes per step averaged over a flush cycle of ``L`` steps (the decode flush: at
    ``h = L - 1``)."""
    if L < 1:
        raise ValueError(f"buffer size must be >= 1, got {L}")
    return sum(replay_bytes(s, h, flush=(h == L - 1)) for h in range(L)) / L


def optimal_buffer_size(s: HeadShape) -> float:
    """Continuous optimum of :func:`replay_cycle_bytes`: ``sqrt(2·state / entry)``."""
    return math.sqrt(2 * s.state / s.entry)


def best_buffer_size(s: HeadShape, max_L: int = 256) -> int:
    """Integer buffer size minimising the amortised replay bytes."""
    return min(range(1, max_L + 1), key=lambda L: replay_cycle_bytes(s, L))


def snapshot_spec_bytes(s: HeadShape, T: int) -> float:
    """Snapshot speculation (vLLM): read the state, store one snapshot per draft."""
    return s.state + T * s.state + T * s.inputs


def replay_spec_bytes(s: HeadShape, T: int, L: int, accepted: int, steps: int = 4096) -> float:
    """Replay speculation per verify step, averaged over a long run.

    Every step reads the checkpoint and the committed ring, reads T inputs, writes T
    entries; a flush (when ``h + 2T > L``) stores the state once.  ``accepted`` entries
    are committed each step (``0..T``).
    """
    if not 0 <= accepted <= T:
        raise ValueError(f"accepted must be in [0, {T}], got {accepted}")
    if L < 2 * T:
        raise ValueError(f"buffer size {L} < 2T = {2 * T}")
    h, total = 0, 0.0
    for _ in range(steps):
        flush = h + 2 * T > L
        total += s.state + h * s.entry + T * (s.inputs + s.entry) + (s.state if flush else 0)
        h = (0 if flush else h) + accepted
    return total / steps


def kv_only_bytes(s: HeadShape, context: int) -> float:
    """KV-only step with ``context`` earlier entries: read them all, append one."""
    return context * s.entry + s.inputs + s.entry


def kv_switch_threshold(s: HeadShape, L: int | None = None) -> int:
    """First context length at which KV-only decoding costs more than amortised replay."""
    L = best_buffer_size(s) if L is None else L
    target = replay_cycle_bytes(s, L)
    c = 0
    while kv_only_bytes(s, c) <= target:
        c += 1
    return c


def sequence_memory_bytes(s: HeadShape, mode: str, L: int = 16, T: int = 4) -> float:
    """Resident bytes per sequence and head: state(s) plus buffers or snapshots."""
    if mode == "snapshot":
        return (T + 1) * s.state
    if mode == "replay":
        return s.state + L * s.entry
    raise ValueError(f"mode must be 'snapshot' or 'replay', got {mode!r}")


def report(s: HeadShape, L: int | None = None, T_max: int = 6) -> dict:
    """Everything above for one head shape, as plain numbers."""
    L = best_buffer_size(s) if L is None else L
    rec = recurrent_bytes(s)
    spec = []
    for T in range(1, T_max + 1):
        Ls = max(L, 2 * T)
        row = {"T": T, "L": Ls, "snapshot": snapshot_spec_bytes(s, T)}
        for a in sorted({0, T // 2, T}):
            row[f"replay_accept_{a}"] = replay_spec_bytes(s, T, Ls, a)
        spec.append(row)
    return {
        "shape": asdict(s),
        "recurrent": rec,
        "buffer_size": L,
        "optimal_buffer_size": optimal_buffer_size(s),
        "best_integer_buffer_size": best_buffer_size(s),
        "replay_by_fill": [replay_bytes(s, h, flush=(h == L - 1)) for h in range(L)],
        "replay_amortised": replay_cycle_bytes(s, L),
        "replay_speedup_bound": rec / replay_cycle_bytes(s, L),
        "speculative": spec,
        "kv_switch_threshold": kv_switch_threshold(s, L),
        "memory_per_seq": {
            "snapshot_T4": sequence_memory_bytes(s, "snapshot", L, 4),
            "replay": sequence_memory_bytes(s, "replay", L, 4),
        },
    }


def format_report(name: str, r: dict) -> str:
    s = r["shape"]
    out = [
        f"== {name}: d={s['d']} n={s['n']} state {s['state_bytes']} B/elem, vectors "
        f"{s['vec_bytes']} B/elem, key shared by {s['key_share']} head(s) ==",
        f"recurrent step            {r['recurrent']:>10.0f} B/head",
        f"optimal buffer size L*    {r['optimal_buffer_size']:>10.2f}  (best integer "
        f"{r['best_integer_buffer_size']}; using L={r['buffer_size']})",
        f"replay amortised (L={r['buffer_size']:<3})  {r['replay_amortised']:>10.0f} B/head  "
        f"-> bound {r['replay_speedup_bound']:.2f}x vs recurrent",
        "replay by fill level h:   " + " ".join(f"{b:.0f}" for b in r["replay_by_fill"]),
        f"KV-only beats replay while context < {r['kv_switch_threshold']} tokens",
        "speculative verify (bytes/head/step; replay at accepted 0 / mid / all):",
    ]
    for row in r["speculative"]:
        rep = [v for k, v in row.items() if k.startswith("replay_accept_")]
        ratio = row["snapshot"] / max(rep)
        out.append(
            f"  T={row['T']} L={row['L']:<3} snapshot {row['snapshot']:>9.0f}   replay "
            + " / ".join(f"{v:.0f}" for v in rep)
            + f"   (>= {ratio:.2f}x fewer bytes)"
        )
    m = r["memory_per_seq"]
    out.append(
        f"resident bytes/seq/head: snapshot(T=4) {m['snapshot_T4']:.0f}, replay {m['replay']:.0f} "
        f"-> {m['snapshot_T4'] / m['replay']:.2f}x more sequences in the same memory"
    )
    return "\n".join(out)


DEFAULT_SHAPES = {
    "Mamba-2 (head_dim 64, d_state 128)": HeadShape(d=64, n=128),
    "Mamba-2, key shared by 16 heads (128 heads / 8 groups)": HeadShape(d=64, n=128, key_share=16),
    "Gated DeltaNet (K = V = 128)": HeadShape(d=128, n=128),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replayssm traffic", description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=positive_int, help="value dim (head_dim / V); with --n, report one custom shape")
    p.add_argument("--n", type=positive_int, help="key dim (d_state / K)")
    p.add_argument("--state-bytes", type=positive_int, default=4)
    p.add_argument("--vec-bytes", type=positive_int, default=2)
    p.add_argument("--key-share", type=positive_int, default=1)
    p.add_argument("--buffer-size", type=positive_int, default=None, help="L (default: best integer)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a = p.parse_args(argv)
    if (a.d is None) != (a.n is None):
        p.error("--d and --n go together")
    shapes = DEFAULT_SHAPES if a.d is None else {
        "custom": HeadShape(a.d, a.n, a.state_bytes, a.vec_bytes, a.key_share)}
    reports = {name: report(s, a.buffer_size) for name, s in shapes.items()}
    if a.json:
        print(json.dumps(reports, indent=1))
    else:
        print("\n\n".join(format_report(name, r) for name, r in reports.items()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
