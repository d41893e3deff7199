"""Metrics of a data-parallel server: the single-engine ones summed over replicas, plus
per-replica series labelled ``replica`` (:class:`DPMetrics`)."""

from __future__ import annotations

import threading

from .metrics import ServerMetrics

__all__ = ["DPMetrics"]


class DPMetrics(ServerMetrics):
    """The server's metrics (summed over replicas) plus per-replica series labelled
    ``replica``: up, sequences in flight / running / waiting, requests routed (by reason:
    ``affinity`` or ``load``), generated tokens, restarts."""

    def __init__(self, model_name: str, size: int):
        super().__init__(model_name)
        from prometheus_client import Counter, Gauge

        r, lab = self.registry, ["model_name", "replica"]
        p = "replayssm:dp_replica_"
        self.r_up = Gauge(p + "up", "1 while the replica serves, 0 while it is down or restarting", lab, registry=r)
        self.r_in_flight = Gauge(p + "in_flight", "Sequences the replica holds (queued + running)", lab, registry=r)
        self.r_running = Gauge(p + "running", "Sequences holding a cache slot of the replica", lab, registry=r)
        self.r_waiting = Gauge(p + "waiting", "Sequences queued in the replica's engine", lab, registry=r)
        self.r_routed = Counter(p + "requests_routed", "Requests routed to the replica by reason (affinity: its "
                                "prefix went there before; load: least loaded)", lab + ["reason"], registry=r)
        self.r_tokens = Counter(p + "generation_tokens", "Tokens the replica generated", lab, registry=r)
        self.r_restarts = Counter(p + "restarts", "Times the replica was restarted after dying", lab, registry=r)
        self._metrics_lock = threading.RLock()   # one thread per replica steps the metrics
        self._pending_tokens = 0
        for i in range(size):   # every series exists from the start
            self.r_up.labels(model_name, str(i)).set(0)
            for reason in ("affinity", "load"):
                self.r_routed.labels(model_name, str(i), reason)
            self.r_tokens.labels(model_name, str(i))
            self.r_restarts.labels(model_name, str(i))

    def on_tokens(self, n: int) -> None:
        """Counted here, added to the Prometheus counter once per step (:meth:`refresh`): a
        counter increment costs more than the rest of an output's bookkeeping."""
        with self._metrics_lock:
            self._pending_tokens += n

    def on_step(self, engine, outs, seconds: float, loop) -> None:
        with self._metrics_lock:
            super().on_step(engine, outs, seconds, loop)

    def refresh(self, engine, loop) -> None:
        with self._metrics_lock:
            if self._pending_tokens:
                super().on_tokens(self._pending_tokens)
                self._pending_tokens = 0
            super().refresh(engine, loop)
            for c in getattr(loop, "clients", ()):
                lab = (self.model_name, str(c.index))
                occ = c.engine.occ if c.state == "up" else {}
                self.r_up.labels(*lab).set(1 if c.state == "up" else 0)
                self.r_in_flight.labels(*lab).set(c.in_flight)
                self.r_running.labels(*lab).set(occ.get("running", 0))
                self.r_waiting.labels(*lab).set(occ.get("waiting", 0))
