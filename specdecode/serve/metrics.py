"""Prometheus metrics (`GET /metrics`), named like vLLM's where they mean the same thing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specdecode:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    """One registry per server. The engine worker reports steps (`observe_step`), the handlers
    report requests, first tokens and token gaps."""

    def __init__(self, worker_gauges):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "HTTP generation requests by outcome",
                                ["status"], registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens returned to clients", registry=r)
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Row steps that verified at least one draft",
                                  registry=r)
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each position of a block", ["position"],
                                        registry=r)
        self.target_calls = Counter(PREFIX + "num_target_calls", "Target forwards (one per engine step)",
                                    registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap between a request's consecutive token deliveries, per token",
                             buckets=LATENCY_BUCKETS, registry=r)
        waiting, running = worker_gauges
        Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a row", registry=r).set_function(waiting)
        Gauge(PREFIX + "num_requests_running", "Rows in the running batch", registry=r).set_function(running)

    def observe_step(self, outputs, seconds: float) -> None:
        """Called by the engine worker after each step (its thread)."""
        if outputs:
            self.target_calls.inc()
        for output in outputs:
            if output.num_drafted:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(output.num_drafted)
                self.num_accepted_tokens.inc(output.num_accepted)
                for position in range(output.num_accepted):
                    self.accepted_per_pos.labels(position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
