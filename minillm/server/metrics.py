"""Prometheus metrics with vLLM V1's names, fed by the engine thread (chapter 11).

    vllm:num_requests_running / _waiting        gauges, after every step and every command
    vllm:kv_cache_usage_perc                    gauge, a fraction 0…1 of KV blocks in use (vLLM's
                                                meaning: cached blocks no request holds count as free)
    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total,
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens),
    vllm:request_success_total{finished_reason}, vllm:spec_decode_num_drafts_total,
    vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
                                                counters
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
    vllm:iteration_tokens_total                 histograms

Each exporter has its own `CollectorRegistry` (not prometheus_client's global one), so one
process can run several servers or `LLM`s. Everything here has a fixed number of series (labels
are the model name, three finish reasons, k speculative positions), and the engine's own
per-request records are dropped once folded in (`MetricsCollector.retain`), so nothing grows
with uptime. Histogram buckets reach down to 1 ms because this CPU toy's steps take milliseconds
(vLLM's TTFT buckets start at 1 ms too, its ITL ones at 10 ms).

`LLM.get_metrics()` reads the same registry back as vLLM's `Counter`/`Gauge`/`Histogram`/`Vector`.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from minillm.metrics import RequestMetrics, StepRecord
from minillm.server.metrics_reader import read_metrics

# No `*_created` timestamp series, as vLLM (this is process-wide in prometheus_client).
disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusMetrics:
    """Attach to an engine once: `PrometheusMetrics(engine, "minillm")`; serve `exposition()`.

    Its callbacks run on the engine thread (the only writer); prometheus_client's values are
    thread-safe, so a scrape from the HTTP thread reads them at any time."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting (incl. preempted).", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions.", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.", labels,
                                         registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative rows verified.", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                     registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position.", labels + ["position"],
                                             registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive token chunks.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", labels, buckets=E2E_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.", labels,
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.model_name = model_name
        self._bind(model_name)
        self._spec_seen = (0, 0, 0)
        self._spec_pos_seen: list[int] = []
        engine.metrics.add_observer(self.on_step)
        engine.metrics.add_request_observer(self)
        engine.command_observers.append(self.refresh)
        self.refresh()

    def _bind(self, name: str) -> None:
        """Label every series once (they then exist, at 0, before anything happens)."""
        for attr in ("running", "waiting", "kv_usage", "preemptions", "prompt_tokens", "generation_tokens",
                     "prefix_queries", "prefix_hits", "spec_drafts", "spec_draft_tokens", "spec_accepted", "ttft",
                     "itl", "e2e", "queue_time", "iteration_tokens"):
            setattr(self, "_" + attr, getattr(self, attr).labels(model_name=name))
        self._success = {reason: self.success.labels(model_name=name, finished_reason=reason)
                         for reason in FINISH_REASONS}

    # ---- engine-thread callbacks ---------------------------------------------------------------
    def refresh(self) -> None:
        """The gauges, from the engine's state now (after a step, or after commands changed it)."""
        engine = self.engine
        self._running.set(engine.scheduler.num_running)
        self._waiting.set(engine.scheduler.num_waiting + len(engine._pending))
        usage = engine.kv.usage()
        self._kv_usage.set(usage.reserved_tokens / usage.total_tokens if usage.total_tokens else 0.0)

    def on_step(self, step: StepRecord) -> None:
        self.refresh()
        self._iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
        if step.num_preemptions:
            self._preemptions.inc(step.num_preemptions)
        if step.num_prefix_queried_tokens:
            self._prefix_queries.inc(step.num_prefix_queried_tokens)
            self._prefix_hits.inc(step.num_prefix_hit_tokens)
        spec = self.engine.metrics.spec_decode
        now = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        if now != self._spec_seen:
            for counter, new, old in zip((self._spec_drafts, self._spec_draft_tokens, self._spec_accepted),
                                         now, self._spec_seen):
                counter.inc(new - old)
            per_pos = spec.num_accepted_tokens_per_pos
            self._spec_pos_seen += [0] * (len(per_pos) - len(self._spec_pos_seen))
            for pos, (new, old) in enumerate(zip(per_pos, self._spec_pos_seen)):
                if new > old:
                    self.spec_accepted_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(new - old)
            self._spec_seen, self._spec_pos_seen = now, list(per_pos)

    def on_token(self, record: RequestMetrics, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)
        times = record.token_times
        if len(times) == 1:
            self._prompt_tokens.inc(record.num_prompt_tokens)
            self._ttft.observe(times[0] - record.arrival_time)
        else:
            self._itl.observe(times[-1] - times[-2])

    def on_finish(self, record: RequestMetrics) -> None:
        reason = record.finish_reason or "abort"
        self._success[reason if reason in self._success else "abort"].inc()
        self._e2e.observe(record.finished_time - record.arrival_time)
        if record.first_scheduled_time is not None:
            self._queue_time.observe(record.first_scheduled_time - record.arrival_time)

    # ---- readers (any thread) --------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (`GET /metrics`)."""
        return generate_latest(self.registry)

    def snapshot(self) -> list:
        """The registry as vLLM's `LLM.get_metrics()` returns it (see minillm.server.metrics_reader)."""
        return read_metrics(self.registry)
