"""Prometheus metrics of the server (``GET /metrics``), one registry per app.

Gauges are refreshed from the engine thread after every step; histograms observe each
request's time to first token, every gap between two outputs of a request (inter-token
latency: a speculative step that emits several tokens is one gap), and end-to-end latency.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"model_name": model_name}
        self._lab = lab
        self.running = Gauge("replayssm_num_requests_running", "Sequences holding a cache slot", ["model_name"],
                             registry=r).labels(**lab)
        self.waiting = Gauge("replayssm_num_requests_waiting", "Sequences queued for a slot", ["model_name"],
                             registry=r).labels(**lab)
        self.in_flight = Gauge("replayssm_num_requests_in_flight",
                               "Sequences accepted by the server and not finished", ["model_name"],
                               registry=r).labels(**lab)
        self.free_slots = Gauge("replayssm_free_slots", "Free cache slots of the engine", ["model_name"],
                                registry=r).labels(**lab)
        self.total_slots = Gauge("replayssm_total_slots", "Cache slots of the engine", ["model_name"],
                                 registry=r).labels(**lab)
        self.free_blocks = Gauge("replayssm_kv_free_blocks", "Free blocks of the KV-only block pool (-1: none)",
                                 ["model_name"], registry=r).labels(**lab)
        self.tokens = Counter("replayssm_generation_tokens", "Generated tokens", ["model_name"],
                              registry=r).labels(**lab)
        self.prompt_tokens = Counter("replayssm_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model_name"], registry=r).labels(**lab)
        self.requests = Counter("replayssm_request_success", "Finished sequences by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.steps = Counter("replayssm_engine_steps", "Engine steps", ["model_name"], registry=r).labels(**lab)
        self.step_failures = Counter("replayssm_engine_step_failures",
                                     "Engine steps that raised (their requests ended with an error)",
                                     ["model_name"], registry=r).labels(**lab)
        self.ttft = Histogram("replayssm_time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY, registry=r).labels(**lab)
        self.itl = Histogram("replayssm_inter_token_latency_seconds",
                             "Time between two outputs of a request (one engine step)", ["model_name"],
                             buckets=_LATENCY, registry=r).labels(**lab)
        self.e2e = Histogram("replayssm_e2e_request_latency_seconds", "Arrival to finish", ["model_name"],
                             buckets=_LATENCY, registry=r).labels(**lab)
        self.spec_steps = Counter("replayssm_spec_decode_steps", "Decode or verify steps of finished sequences",
                                  ["model_name"], registry=r).labels(**lab)
        self.spec_tokens = Counter("replayssm_spec_decode_tokens",
                                   "Tokens produced by those steps (accepted drafts + 1 each)", ["model_name"],
                                   registry=r).labels(**lab)
        self.accepted_length = Gauge("replayssm_mean_accepted_length",
                                     "Tokens per decode/verify step over finished sequences (1.0 without "
                                     "speculation)", ["model_name"], registry=r).labels(**lab)
        self.step_seconds = Histogram("replayssm_engine_step_seconds", "Duration of one engine step",
                                      ["model_name"], buckets=_LATENCY, registry=r).labels(**lab)
        self._failures = 0
        self._steps_total = 0
        self._spec_tokens_total = 0

    # -- from the engine thread ---------------------------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finish(self, out, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.requests.labels(model_name=self._lab["model_name"], finished_reason=str(out.finish_reason)).inc()
        if getattr(out, "index", 0) == 0:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        acc = list(getattr(out, "accepted_lengths", []) or [])
        steps = len(acc) if acc else max(len(out.token_ids) - 1, 0)   # prefill's token excluded
        toks = sum(acc) if acc else steps
        self.spec_steps.inc(steps)
        self.spec_tokens.inc(toks)
        self._steps_total += steps
        self._spec_tokens_total += toks
        if self._steps_total:
            self.accepted_length.set(self._spec_tokens_total / self._steps_total)

    def on_end(self, n: int, reason: str) -> None:
        """``n`` sequences cancelled (client gone) or failed without a final output."""
        if n > 0:
            self.requests.labels(model_name=self._lab["model_name"], finished_reason=reason).inc(n)

    def on_tokens(self, n: int) -> None:
        self.tokens.inc(n)

    def on_step(self, engine, outs, seconds: float, loop) -> None:
        self.steps.inc()
        self.step_seconds.observe(seconds)
        self.refresh(engine, loop)

    def refresh(self, engine, loop) -> None:
        """Engine occupancy gauges (also called by ``GET /metrics``)."""
        occ = engine.occupancy()
        self.running.set(occ["running"])
        self.waiting.set(occ["waiting"])
        self.free_slots.set(occ["free_slots"])
        self.total_slots.set(occ["total_slots"])
        self.free_blocks.set(occ["free_kv_blocks"])
        self.in_flight.set(loop.in_flight)
        if loop.step_failures > self._failures:
            self.step_failures.inc(loop.step_failures - self._failures)
            self._failures = loop.step_failures
