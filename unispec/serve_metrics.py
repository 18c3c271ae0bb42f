"""`/metrics` of `unispec serve`, in Prometheus' text format (prometheus-client).

Every series is prefixed `unispec_`. Speculative decoding is exported as counters (as vLLM does), so a
dashboard can take rates over any window; two gauges give the totals since start directly:

    mean accepted length          = 1 + spec_accepted_tokens_total / spec_decode_steps_total
    acceptance at draft position j = spec_accepted_tokens_per_position_total{position=j} / spec_decode_steps_total

Each server (each Ray Serve replica) keeps its own registry, so two servers in one process never share
series and every replica reports only what it served.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.sequence import RequestOutput

__all__ = ["ServeMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServeMetrics:
    """The server's series; `record` is called once per request that reached the engine."""

    def __init__(self, llm: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.k = llm.manifest.num_speculative_tokens
        self.requests = Counter("unispec_requests", "Requests that reached the engine, by endpoint and finish "
                                "reason (cancelled = the client went away)", ["endpoint", "finish_reason"],
                                registry=r)
        self.rejected = Counter("unispec_rejected_requests", "Requests answered with an error, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("unispec_prompt_tokens", "Prompt tokens of requests that reached the engine", registry=r)
        self.generation_tokens = Counter("unispec_generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter("unispec_preemptions", "Times a request lost its KV blocks to a full pool and "
                                   "was recomputed (counted when the request ends)", registry=r)
        self.ttft = Histogram("unispec_time_to_first_token_seconds", "Submission to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("unispec_inter_token_latency_seconds", "Per request: mean time between generated "
                             "tokens after the first", buckets=GAP_BUCKETS, registry=r)
        self.latency = Histogram("unispec_request_latency_seconds", "Submission to finish",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode_steps = Counter("unispec_spec_decode_steps", "Decode steps (each verifies K drafts)", registry=r)
        self.accepted = Counter("unispec_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_at = Counter("unispec_spec_accepted_tokens_per_position", "Decode steps that accepted the "
                                   "draft at this position", ["position"], registry=r)
        self.mean_accepted_length = Gauge("unispec_spec_mean_accepted_length", "Tokens committed per decode step "
                                          "since start (1 + accepted / decode steps)", registry=r)
        self.acceptance = Gauge("unispec_spec_acceptance_rate", "Share of decode steps since start that accepted "
                                "the draft at this position", ["position"], registry=r)
        self._gauges(llm)

    def _gauges(self, llm: Any) -> None:
        from prometheus_client import Gauge

        r, engine = self.registry, llm.engine
        # read without the engine lock: len() of a deque / list is atomic, and a scrape may be one step stale
        Gauge("unispec_kv_blocks_total", "KV pool blocks", registry=r).set(llm.num_blocks)
        Gauge("unispec_kv_blocks_used", "KV pool blocks held by requests", registry=r).set_function(
            lambda: llm.num_blocks - engine.blocks.num_free)
        Gauge("unispec_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: len(engine.running))
        self.server_queue = 0                   # requests waiting for one of --max-batch-size slots
        Gauge("unispec_requests_waiting", "Requests waiting for a batch slot (server queue and engine queue)",
              registry=r).set_function(lambda: len(engine.waiting) + self.server_queue)
        self._steps, self._accepted_at = 0, [0] * self.k     # totals since start, for the two gauges
        for j in range(self.k):
            self.acceptance.labels(position=str(j)).set(0.0)
            self.accepted_at.labels(position=str(j))
        self.mean_accepted_length.set(1.0)

    def record(self, endpoint: str, output: RequestOutput | None, latency_s: float) -> None:
        """Count one request's outcome; its timings and acceptance only when it ran to the end."""
        if output is None:
            return
        self.requests.labels(endpoint=endpoint, finish_reason=output.finish_reason).inc()
        m = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(m.num_generated)
        self.preemptions.inc(m.num_preemptions)
        if output.finish_reason == "cancelled":
            return
        if not math.isnan(m.time_to_first_token_s):
            self.ttft.observe(m.time_to_first_token_s)
            if m.num_generated > 1:
                self.itl.observe(max(latency_s - m.time_to_first_token_s, 0.0) / (m.num_generated - 1))
        self.latency.observe(latency_s)
        self._record_acceptance(m.accepted_per_step)

    def _record_acceptance(self, accepted_per_step: tuple[int, ...]) -> None:
        if self.k == 0 or not accepted_per_step:
            return
        self.decode_steps.inc(len(accepted_per_step))
        self.accepted.inc(sum(accepted_per_step))
        for j in range(self.k):
            self.accepted_at.labels(position=str(j)).inc(sum(a > j for a in accepted_per_step))
        self._steps += len(accepted_per_step)
        for j in range(self.k):
            self._accepted_at[j] += sum(a > j for a in accepted_per_step)
            self.acceptance.labels(position=str(j)).set(self._accepted_at[j] / self._steps)
        # accepted drafts = the sum over positions of the steps that accepted each one
        self.mean_accepted_length.set(1.0 + sum(self._accepted_at) / self._steps)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
