"""The router's own Prometheus metrics (chapter 13): what it routed, and what each hop cost.

    minillm_router_requests_total{worker}, minillm_router_request_errors_total{worker}      counters
    minillm_router_worker_healthy{worker}, minillm_router_worker_in_flight_requests{worker},
    minillm_router_prefix_match_rate, minillm_router_decisions_total{policy,decision}      gauges, counters
    minillm_router_time_to_first_token_seconds{worker}         arrival at the router -> a stream's first
                                                               bytes written to the client (TTFT as the
                                                               client sees it, less its own network)
    minillm_router_e2e_request_latency_seconds{worker}         arrival -> the answer's last byte written
    minillm_router_worker_time_to_first_token_seconds{worker}  request sent to the worker -> its first bytes
                                                               back (its answer, if not streamed): the
                                                               worker's TTFT as the router sees it
    minillm_router_routing_latency_seconds{worker}             arrival -> the request sent to the worker
                                                               (reading the body, the policy, the pool)

`time_to_first_token - worker_time_to_first_token` is what one hop adds inside the router's process.
Histograms use the servers' latency buckets (`minillm.server.metrics.LATENCY_BUCKETS`: vLLM's TTFT
bounds with finer ones between them, down to 0.5 ms), so percentiles are readable at millisecond
scale. The names follow vLLM's (`vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`)
with the router's prefix; `worker` is the worker's URL (in PD mode, the prefill instance for the
forwarded first token and the prefill hop, the decode instance for the rest).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minillm.server.metrics import E2E_BUCKETS, LATENCY_BUCKETS


class WorkerSeries:
    """The per-worker children of the router's counters and histograms."""

    __slots__ = ("routed", "errors", "ttft", "e2e", "worker_ttft", "routing")

    def __init__(self, routed, errors, ttft, e2e, worker_ttft, routing) -> None:
        self.routed, self.errors, self.ttft, self.e2e = routed, errors, ttft, e2e
        self.worker_ttft, self.routing = worker_ttft, routing


class RouterMetrics:
    """The router's series, in its own registry (several routers can share a process)."""

    def __init__(self, workers: list, policy) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("minillm_router_requests", "Requests routed, per worker.", ["worker"], registry=r)
        self.errors = Counter("minillm_router_request_errors", "Requests that failed at the worker (died, "
                              "refused, timed out), per worker.", ["worker"], registry=r)
        self.healthy = Gauge("minillm_router_worker_healthy", "1 if the worker is healthy.", ["worker"], registry=r)
        self.in_flight = Gauge("minillm_router_worker_in_flight_requests", "Requests in flight per worker "
                               "(the router's queue depth, the load its policy sees).", ["worker"], registry=r)
        self.match_rate = Gauge("minillm_router_prefix_match_rate", "Matched over routed characters "
                                "(cache_aware's tree; 0 for the other policies).", registry=r)
        self.decisions = Counter("minillm_router_decisions", "Routing decisions by rule.", ["policy", "decision"],
                                 registry=r)
        self.ttft = Histogram("minillm_router_time_to_first_token_seconds", "Arrival at the router to a "
                              "streamed answer's first bytes written to the client.", ["worker"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minillm_router_e2e_request_latency_seconds", "Arrival at the router to the "
                             "answer's last byte written to the client.", ["worker"], buckets=E2E_BUCKETS,
                             registry=r)
        self.worker_ttft = Histogram("minillm_router_worker_time_to_first_token_seconds", "Request sent to the "
                                     "worker to its first bytes back (its whole answer if not streamed).",
                                     ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.routing = Histogram("minillm_router_routing_latency_seconds", "Arrival at the router to the request "
                                 "sent to the worker.", ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self._workers, self._policy, self._decisions_seen = workers, policy, {}
        for w in workers:
            for family in (self.routed, self.errors, self.ttft, self.e2e, self.worker_ttft, self.routing):
                family.labels(w.url)

    def of(self, url: str) -> WorkerSeries:
        """One worker's series, looked up once (`labels()` takes a lock and builds a key on every call)."""
        return WorkerSeries(*(family.labels(url) for family in (self.routed, self.errors, self.ttft, self.e2e,
                                                                 self.worker_ttft, self.routing)))

    def exposition(self) -> bytes:
        for w in self._workers:
            self.healthy.labels(w.url).set(1 if w.healthy else 0)
            self.in_flight.labels(w.url).set(w.in_flight)
        self.match_rate.set(self._policy.prefix_match_rate)
        for decision, n in self._policy.decisions.items():
            seen = self._decisions_seen.get(decision, 0)
            self.decisions.labels(self._policy.name, decision).inc(n - seen)
            self._decisions_seen[decision] = n
        return generate_latest(self.registry)
