"""Prometheus metrics of the server (``GET /metrics``), one registry per app.

Names follow vLLM's (``vllm:num_requests_running`` ...) under our own prefix
(``replayssm:num_requests_running`` ...), with the same ``model_name`` label, so a vLLM
dashboard reads this server after a prefix change; :data:`VLLM_NAMES` lists them.  Metrics
of our own (slots, the state cache, engine steps, accepted length, the prefix cache's
blocks) use the same prefix.

Gauges are refreshed from the engine thread after every step (and on each scrape);
histograms observe each request's queue time, time to first token, every gap between two
outputs of a request (inter-token latency: a speculative step that emits several tokens is
one gap), end-to-end latency, and its prompt and generated token counts.  Plain running
totals (:attr:`ServerMetrics.totals`) feed the periodic stats log.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "replayssm:"

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 30.0, 60.0)
_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_TOKENS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))

#: the metrics that carry vLLM's names (``vllm:<name>`` there, ``replayssm:<name>`` here)
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
              "prompt_tokens_total", "generation_tokens_total", "request_success_total",
              "request_prompt_tokens", "request_generation_tokens", "time_to_first_token_seconds",
              "inter_token_latency_seconds", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "prefix_cache_queries_total", "prefix_cache_hits_total",
              "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
              "spec_decode_num_accepted_tokens_total")


def kv_blocks(engine, occ: dict) -> tuple[int, int]:
    """``(free, total)`` blocks of the engine's paged pools (KV-only entries and attention
    KV, :meth:`LLMEngine.occupancy`); ``(0, 0)`` without one."""
    free = int(occ.get("free_kv_blocks", -1))
    if free < 0:
        return 0, 0
    return free, max(int(occ.get("total_kv_blocks", free)), free)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = {"model_name": model_name}
        self._lab = lab

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(**lab)

        def counter(name, doc):   # prometheus_client adds the _total suffix
            return Counter(PREFIX + name, doc, ["model_name"], registry=r).labels(**lab)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(**lab)

        # -- vLLM's names -------------------------------------------------------------------
        self.running = gauge("num_requests_running", "Sequences holding a cache slot")
        self.waiting = gauge("num_requests_waiting", "Sequences queued for a slot")
        self.kv_usage = gauge("kv_cache_usage_perc", "Used share of the paged block pools (KV-only entries and "
                                                     "attention KV; 0 to 1, 0 without paged pools)")
        self.preemptions = counter("num_preemptions", "Sequences the engine preempted (their cache swapped "
                                                      "to host memory, restored exactly later)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted at a request's first output)")
        self.tokens = counter("generation_tokens", "Generated tokens")
        self.requests = Counter(PREFIX + "request_success", "Finished sequences by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens of a finished sequence", _TOKENS)
        self.request_generation = histogram("request_generation_tokens", "Generated tokens of a finished sequence",
                                            _TOKENS)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of a request (one engine "
                                                            "step)", _LATENCY)
        self.tpot = histogram("request_time_per_output_token_seconds", "A finished sequence's mean time per "
                                                                       "output token after the first", _LATENCY)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _REQUEST_LATENCY)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the step that admits the request",
                                    _REQUEST_LATENCY)
        self.prefix_query_tokens = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hit_tokens = counter("prefix_cache_hits", "Prompt tokens resumed from the prefix cache "
                                                              "(not recomputed)")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify steps of finished sequences")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed for finished "
                                                                         "sequences")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted for finished "
                                                                        "sequences")
        # -- ours -------------------------------------------------------------------------------
        self.state_usage = gauge("state_cache_usage_perc", "Cache slots in use / cache slots (0 to 1)")
        self.in_flight = gauge("num_requests_in_flight", "Sequences accepted by the server and not finished")
        self.free_slots = gauge("free_slots", "Free cache slots of the engine")
        self.total_slots = gauge("total_slots", "Cache slots of the engine")
        self.free_blocks = gauge("kv_free_blocks", "Free blocks of the paged pools (-1: no paged pool)")
        self.total_blocks = gauge("kv_total_blocks", "Blocks of the paged pools (0: no paged pool)")
        self.steps = counter("engine_steps", "Engine steps")
        self.step_failures = counter("engine_step_failures", "Engine steps that raised (their requests ended "
                                                             "with an error)")
        self.step_seconds = histogram("engine_step_seconds", "Duration of one engine step", _LATENCY)
        self.spec_steps = counter("spec_decode_steps", "Decode or verify steps of finished sequences")
        self.spec_tokens = counter("spec_decode_tokens", "Tokens produced by those steps (accepted drafts + 1 each)")
        self.accepted_length = gauge("mean_accepted_length", "Tokens per decode/verify step over finished "
                                                             "sequences (1.0 without speculation)")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens resumed from the prefix cache / "
                                                              "prompt tokens looked up (0 when prefix caching is off)")
        self.prefix_blocks_saved = counter("prefix_cache_blocks_saved", "Whole cached blocks requests reused")
        self.prefix_cached_blocks = gauge("prefix_cache_blocks", "Blocks held by the prefix cache")
        self.prefix_reply_hits = counter("prefix_cache_reply_hits", "Prompt tokens resumed at a cached reply's end "
                                                                    "(a chat turn; included in prefix_cache_hits)")
        self.prefix_replies = counter("prefix_cache_replies", "Finished requests whose state after prompt and "
                                                              "reply was cached")
        #: running totals for the stats log (plain numbers: read from another thread)
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "prefix_query_tokens": 0,
                       "prefix_hit_tokens": 0, "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted": 0}
        self.last_occupancy: dict = {}
        self._prefix_seen = {}
        self._failures = 0
        self._preemptions = 0
        self._steps_total = 0
        self._spec_tokens_total = 0
        self._refresh_lock = threading.Lock()

    # -- from the engine thread ---------------------------------------------------------------
    def on_queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def on_prompt(self, n: int) -> None:
        self.prompt_tokens.inc(n)
        self.totals["prompt_tokens"] += n

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finish(self, out, seconds: float, first_token_s: float | None = None) -> None:
        self.e2e.observe(seconds)
        self.totals["finished"] += 1
        self.requests.labels(model_name=self.model_name, finished_reason=str(out.finish_reason)).inc()
        n_out = len(out.token_ids)
        self.request_prompt.observe(len(getattr(out, "prompt_token_ids", ()) or ()))
        self.request_generation.observe(n_out)
        if first_token_s is not None and n_out > 1:
            self.tpot.observe(max(seconds - first_token_s, 0.0) / (n_out - 1))
        acc = list(getattr(out, "accepted_lengths", []) or [])
        steps = len(acc) if acc else max(n_out - 1, 0)   # prefill's token excluded
        toks = sum(acc) if acc else steps
        self.spec_steps.inc(steps)
        self.spec_tokens.inc(toks)
        self._steps_total += steps
        self._spec_tokens_total += toks
        if self._steps_total:
            self.accepted_length.set(self._spec_tokens_total / self._steps_total)
        for key, counter, attr in (("spec_drafts", self.spec_drafts, "num_verify_steps"),
                                   ("spec_draft_tokens", self.spec_draft_tokens, "num_drafted"),
                                   ("spec_accepted", self.spec_accepted, "num_accepted")):
            v = int(getattr(out, attr, 0) or 0)
            if v > 0:
                counter.inc(v)
                self.totals[key] += v

    def on_end(self, n: int, reason: str) -> None:
        """``n`` sequences cancelled (client gone) or failed without a final output."""
        if n > 0:
            self.totals["finished"] += n
            self.requests.labels(model_name=self.model_name, finished_reason=reason).inc(n)

    def on_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        self.totals["generation_tokens"] += n

    def on_step(self, engine, outs, seconds: float, loop) -> None:
        self.steps.inc()
        self.step_seconds.observe(seconds)
        self.refresh(engine, loop)

    def refresh(self, engine, loop) -> None:
        """Engine occupancy gauges (also called by ``GET /metrics``, from another thread than
        the engine's: one refresh at a time, or two could add the same preemptions twice)."""
        with self._refresh_lock:
            self._refresh(engine, loop)

    def _refresh(self, engine, loop) -> None:
        occ = engine.occupancy()
        self.running.set(occ["running"])
        self.waiting.set(occ["waiting"])
        total, free = occ["total_slots"], occ["free_slots"]
        self.free_slots.set(free)
        self.total_slots.set(total)
        self.state_usage.set((total - free) / total if total else 0.0)
        free_b, total_b = kv_blocks(engine, occ)
        self.free_blocks.set(occ["free_kv_blocks"])
        self.total_blocks.set(total_b)
        self.kv_usage.set((total_b - free_b) / total_b if total_b else 0.0)
        self.last_occupancy = {**occ, "total_kv_blocks": total_b}
        if "prefix_hit_rate" in occ:   # prefix caching on
            self.prefix_hit_rate.set(occ["prefix_hit_rate"])
            self.prefix_cached_blocks.set(occ["prefix_cached_blocks"])
            for key, counter in (("prefix_query_tokens", self.prefix_query_tokens),
                                 ("prefix_hit_tokens", self.prefix_hit_tokens),
                                 ("prefix_blocks_saved", self.prefix_blocks_saved),
                                 ("prefix_state_hit_tokens", self.prefix_reply_hits),
                                 ("prefix_states_saved", self.prefix_replies)):
                now = occ.get(key, 0)
                delta = now - self._prefix_seen.get(key, 0)
                if delta > 0:
                    counter.inc(delta)
                    if key in self.totals:
                        self.totals[key] += delta
                self._prefix_seen[key] = now
        preempted = int((getattr(engine, "stats", None) or {}).get("preemptions", 0))
        if preempted > self._preemptions:
            self.preemptions.inc(preempted - self._preemptions)
        self._preemptions = preempted   # (an engine reset counts again from 0)
        self.in_flight.set(loop.in_flight)
        if loop.step_failures > self._failures:
            self.step_failures.inc(loop.step_failures - self._failures)
            self._failures = loop.step_failures
