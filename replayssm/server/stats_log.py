"""Periodic stats lines (``--log-stats-interval``, off with ``--disable-log-stats``).

Every interval, if the server had traffic since the last line (tokens processed, requests
finished, or requests still running or waiting), one info line on the ``replayssm.server``
logger: prompt and generation throughput over the interval, running and waiting
sequences, the state cache's slots in use, the paged KV pool's free blocks (when the engine
has paged pools), the prefix cache's hit rate (when prefix caching is on) and the draft
acceptance (with speculation).  It reads the metrics' running totals and the occupancy the
engine thread recorded after its last step, so it never calls into the engine itself.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("replayssm.server")


class StatsLogger:
    def __init__(self, metrics, loop, interval: float):
        if not interval > 0:
            raise ValueError(f"stats log interval must be > 0 seconds, got {interval}")
        self.metrics, self.loop, self.interval = metrics, loop, float(interval)
        self._last = dict(metrics.totals)
        self._last_t = time.monotonic()

    def line(self, now: float | None = None) -> str | None:
        """The stats line for the time since the previous call, or None without traffic."""
        now = time.monotonic() if now is None else now
        totals = dict(self.metrics.totals)
        d = {k: totals[k] - self._last.get(k, 0) for k in totals}
        dt = max(now - self._last_t, 1e-9)
        self._last, self._last_t = totals, now
        occ = self.metrics.last_occupancy or {}
        running, waiting = int(occ.get("running", 0)), int(occ.get("waiting", 0))
        busy = running or waiting or self.loop.in_flight
        if not (busy or d["prompt_tokens"] or d["generation_tokens"] or d["finished"]):
            return None
        parts = [f"prompt throughput {d['prompt_tokens'] / dt:.1f} tokens/s",
                 f"generation throughput {d['generation_tokens'] / dt:.1f} tokens/s",
                 f"running {running} reqs", f"waiting {waiting} reqs"]
        total = int(occ.get("total_slots", 0))
        if total:
            used = total - int(occ.get("free_slots", 0))
            parts.append(f"state cache {used}/{total} slots ({100.0 * used / total:.1f}%)")
        free_b = int(occ.get("free_kv_blocks", -1))
        if free_b >= 0:
            parts.append(f"KV blocks free {free_b}/{int(occ.get('total_kv_blocks', 0))}")
        if "prefix_hit_rate" in occ:
            q = d["prefix_query_tokens"]
            rate = d["prefix_hit_tokens"] / q if q else float(occ["prefix_hit_rate"])
            parts.append(f"prefix cache hit rate {100.0 * rate:.1f}%")
        if d["spec_draft_tokens"]:
            parts.append(f"draft acceptance {100.0 * d['spec_accepted'] / d['spec_draft_tokens']:.1f}%")
        return "stats: " + ", ".join(parts)

    async def run(self) -> None:
        """Log a line every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                text = self.line()
            except Exception as e:  # pragma: no cover - never let the logger end the server
                log.warning("stats log failed: %s: %s", type(e).__name__, e)
                continue
            if text is not None:
                log.info(text)
