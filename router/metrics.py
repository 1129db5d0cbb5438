"""Router metrics (Prometheus), named like vLLM's where the meaning is the same.

One `RequestTrace` per request records the moments that define the latencies: arrival, admission,
first token, each later token chunk, the end. `finish()` turns them into observations exactly
once, so counters move by exactly one per request whatever path it ended on.

The latencies are what clients see: a request arrives when its front first holds it (the ASGI
call, before the body is read; the gRPC handler), and a token counts when its bytes have been
handed to the client's connection (`Lifecycle.sent` in router/lifecycle.py, which the front calls
after each write), not when the router first had it (issue #45: taken where the router had them,
they said 0.27 s of TTFT on a busy host while clients waited 1.2-1.8 s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.outcome import LABELS

# Buckets in seconds: vLLM's (sub-millisecond to minutes) and more between 0.1 and 5 s, where
# most times to first token fall, so that a quantile read from the histogram (Prometheus
# interpolates within a bucket) lands within a few percent of the one a load tool reports.
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4,
            0.5, 0.6, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_TOKEN = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
          0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        labels = ["model_name"]
        self.model = model
        self.requests = Counter("splitserve:requests", "Requests by outcome",
                                [*labels, "outcome"], registry=registry)
        self.ttft = Histogram("splitserve:time_to_first_token_seconds",
                              "Arrival to first token at the router", labels,
                              buckets=_LATENCY, registry=registry)
        self.itl = Histogram("splitserve:inter_token_latency_seconds",
                             "Time between token chunks of a stream", labels, buckets=_TOKEN,
                             registry=registry)
        self.tpot = Histogram("splitserve:time_per_output_token_seconds",
                              "(e2e - ttft) / (output tokens - 1) per request", labels,
                              buckets=_TOKEN, registry=registry)
        self.e2e = Histogram("splitserve:e2e_request_latency_seconds", "Arrival to last token",
                             labels, buckets=_LATENCY, registry=registry)
        self.queue = Histogram("splitserve:request_queue_time_seconds",
                               "Time waiting for an admission slot", labels, buckets=_LATENCY,
                               registry=registry)
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens", labels,
                                     registry=registry)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Generated tokens",
                                         labels, registry=registry)
        self.routing = Counter("splitserve:routing_decisions",
                               "Where prefill ran: remote (disaggregated) or local",
                               [*labels, "prefill"], registry=registry)
        self.migrations = Counter("splitserve:request_migrations",
                                  "Requests moved to other workers after a worker failed them",
                                  labels, registry=registry)
        self.running = Gauge("splitserve:num_requests_running", "Requests in flight",
                             labels, registry=registry)
        self.waiting = Gauge("splitserve:num_requests_waiting", "Requests queued for a slot",
                             labels, registry=registry)
        # What SLO-aware admission predicts from (router/slo.py); kept with or without it.
        self.prefill_rate = Gauge("splitserve:prefill_tokens_per_second",
                                  "Prompt tokens answered with a first token per busy second "
                                  "(recent requests)", labels, registry=registry)
        self.pending_prompt_tokens = Gauge("splitserve:pending_prompt_tokens",
                                           "Prompt tokens admitted, first token not yet sent",
                                           labels, registry=registry)
        self.predicted_tpot = Gauge("splitserve:predicted_tpot_seconds",
                                    "Time per output token predicted for a request admitted now "
                                    "(router/slo.py; 0 until three streams finished)", labels,
                                    registry=registry)
        self.workers = Gauge("splitserve:workers", "Live workers by role", [*labels, "role"],
                             registry=registry)
        # The children every request touches, looked up once: labels() costs a lock and a hash
        # per call, a request touches a dozen, and some run for every token. Looking them up
        # here also exports zeros, so rate() and the dashboard work from the first request on.
        self.outcome_m = {o: self.requests.labels(model, o) for o in LABELS}
        self.running_m, self.waiting_m = self.running.labels(model), self.waiting.labels(model)
        self.ttft_m, self.itl_m = self.ttft.labels(model), self.itl.labels(model)
        self.migrations_m = self.migrations.labels(model)
        self.tpot_m, self.e2e_m = self.tpot.labels(model), self.e2e.labels(model)
        self.queue_m = self.queue.labels(model)
        self.routing_m = {remote: self.routing.labels(model, "remote" if remote else "local")
                          for remote in (True, False)}
        self.prompt_tokens_m = self.prompt_tokens.labels(model)
        self.generation_tokens_m = self.generation_tokens.labels(model)

    def trace(self, arrival: float | None = None) -> RequestTrace:
        """A request's trace; `arrival` (time.perf_counter()) when the front stamped it earlier."""
        return RequestTrace(self) if arrival is None else RequestTrace(self, arrival)


@dataclass
class RequestTrace:
    metrics: RouterMetrics
    arrival: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    first_token_at: float | None = None
    num_prompt: int = 0
    num_out: int = 0
    done: bool = False

    def admitted(self, num_prompt: int, remote_prefill: bool) -> None:
        m = self.metrics
        self.num_prompt = num_prompt
        m.queue_m.observe(time.perf_counter() - self.arrival)
        m.routing_m[remote_prefill].inc()

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.first_token_at is None:
            self.first_token_at = now
            m.ttft_m.observe(now - self.arrival)
        else:
            m.itl_m.observe(now - self.last_token_at)
        self.last_token_at = now
        self.num_out += n

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.outcome_m[outcome].inc()
        if outcome != "finished":
            return
        now = time.perf_counter()
        m.e2e_m.observe(now - self.arrival)
        m.prompt_tokens_m.inc(self.num_prompt)
        m.generation_tokens_m.inc(self.num_out)
        if self.num_out > 1 and self.first_token_at is not None:
            m.tpot_m.observe((now - self.first_token_at) / (self.num_out - 1))
