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
    vllm:cache_config_info{block_size, cache_dtype, num_gpu_blocks}   1, the pool's settings as labels (vLLM's)
    minillm:kv_cache_bytes_per_token, minillm:kv_cache_used_bytes      gauges: K and V of one token over every
                                                layer, and of the tokens held now, in the pool's storage
                                                (they follow kv_cache_dtype, chapter 14)

Each exporter has its own `CollectorRegistry` (not prometheus_client's global one), so one
process can run several servers or `LLM`s. The engine thread updates plain Python numbers (a
bucket lookup and an add per token: prometheus_client's own `Histogram.observe` takes a lock and
costs ~10 µs, a millisecond per step at batch 64 on this CPU); a scrape turns them into metric
families (`collect`). A scrape may see a step half-counted, never a broken value. Everything here has a fixed number of series (labels
are the model name, three finish reasons, k speculative positions), and the engine's own
per-request records are dropped once folded in (`MetricsCollector.retain`), so nothing grows
with uptime. Latency buckets are vLLM's TTFT bounds with finer ones between them down to 0.5 ms
(`LATENCY_BUCKETS`): this CPU toy's steps take milliseconds, and a percentile is only as sharp as
its bucket (vLLM's ITL buckets start at 10 ms).

`LLM.get_metrics()` reads the same registry back as vLLM's `Counter`/`Gauge`/`Histogram`/`Vector`
(an `LLM` feeds it only when built with `disable_log_stats=False`, vLLM's default being True; the
server's `create_app` attaches it always).
"""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from minillm.metrics import RequestMetrics, StepRecord
from minillm.server.metrics_reader import read_metrics

# vLLM's TTFT bounds (1, 5, 10, 20, 40, 60, 80, 100, 250 ms, ...) with finer ones between them: a step here
# takes milliseconds, and Prometheus interpolates a quantile linearly inside one bucket, so a 20 ms wide
# bucket would smear every percentile between 20 and 40 ms. Steps of 0.5 ms to 3 ms, 1 ms to 10 ms, 2.5 ms
# to 20 ms, 5 ms to 50 ms, 10 ms to 100 ms, 25 ms to 200 ms, then 250, 300, 400 ms and vLLM's own.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009,
                   0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.07,
                   0.08, 0.09, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")

GAUGES = {"num_requests_running": "Requests in the running batch.",
          "num_requests_waiting": "Requests waiting (incl. preempted).",
          "kv_cache_usage_perc": "KV-cache usage, 1 means 100 percent."}
COUNTERS = {"num_preemptions": "Cumulative preemptions.", "prompt_tokens": "Prefill tokens processed.",
            "generation_tokens": "Generation tokens produced.",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
            "spec_decode_num_drafts": "Speculative rows verified.",
            "spec_decode_num_draft_tokens": "Draft tokens verified.",
            "spec_decode_num_accepted_tokens": "Draft tokens accepted."}
HISTOGRAMS = {"time_to_first_token_seconds": ("Time to first token.", LATENCY_BUCKETS),
              "inter_token_latency_seconds": ("Time between consecutive token chunks.", LATENCY_BUCKETS),
              "e2e_request_latency_seconds": ("Arrival to finish.", E2E_BUCKETS),
              "request_queue_time_seconds": ("Arrival to first scheduled.", LATENCY_BUCKETS),
              "iteration_tokens_total": ("Tokens computed per engine step.", ITERATION_TOKEN_BUCKETS)}


class _Histogram:
    """Bucket counts (not cumulative), sum and count: what `observe` costs is one bisect and two adds."""

    def __init__(self, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, labels: dict) -> HistogramMetricFamily:
        counts = list(self.counts)
        cumulative, total = [], 0
        for bound, c in zip([*map(str, map(float, self.bounds)), "+Inf"], counts):
            total += c
            cumulative.append((bound, total))
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        fam.add_metric(list(labels.values()), cumulative, self.sum)
        return fam


class PrometheusMetrics(Collector):
    """Attach to an engine once: `PrometheusMetrics(engine, "minillm")`; serve `exposition()`.

    Its callbacks run on the engine thread, the only writer; `collect` runs on whichever thread
    scrapes (GET /metrics, `LLM.get_metrics()`)."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.gauges = dict.fromkeys(GAUGES, 0.0)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.accepted_per_pos: list[int] = []
        self.histograms = {name: _Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
        self._ttft, self._itl = self.histograms["time_to_first_token_seconds"], \
            self.histograms["inter_token_latency_seconds"]
        spec = engine.kv.cache_spec  # the pool's shape and storage (minillm.kv.base.KVCacheSpec)
        self.cache_config = {"block_size": str(spec.block_size), "cache_dtype": spec.kv_cache_dtype,
                             "num_gpu_blocks": str(spec.num_slots // spec.block_size)}
        self.kv_bytes_per_token = spec.bytes_per_token
        self.kv_used_bytes = 0
        self.registry = CollectorRegistry()
        self.registry.register(self)
        if engine.kv_connector is not None:  # one half of a prefill/decode pair: its minillm:kv_transfer_* series
            from minillm.kv_transfer.metrics import KVTransferCollector

            self.registry.register(KVTransferCollector(engine.kv_connector))
        engine.metrics.add_observer(self.on_step)
        engine.metrics.add_request_observer(self)
        engine.command_observers.append(self.refresh)
        self.refresh()

    # ---- engine-thread callbacks ---------------------------------------------------------------
    def refresh(self) -> None:
        """The gauges, from the engine's state now (after a step, or after commands changed it)."""
        g = self.gauges
        try:
            load = self.engine.load_snapshot()
        except (AttributeError, NotImplementedError):  # an unfinished learner's scheduler (the exercises plug theirs in)
            return
        g["num_requests_running"] = load.num_running
        g["num_requests_waiting"] = load.num_waiting + load.num_not_arrived
        usage = load.kv_usage
        g["kv_cache_usage_perc"] = usage.reserved_tokens / usage.total_tokens if usage.total_tokens else 0.0
        self.kv_used_bytes = usage.used_tokens * self.kv_bytes_per_token

    def on_step(self, step: StepRecord) -> None:
        self.refresh()
        c = self.counters
        self.histograms["iteration_tokens_total"].observe(step.num_prefill_tokens + step.num_decode_tokens)
        c["num_preemptions"] += step.num_preemptions
        c["prefix_cache_queries"] += step.num_prefix_queried_tokens
        c["prefix_cache_hits"] += step.num_prefix_hit_tokens
        spec = self.engine.metrics.spec_decode
        c["spec_decode_num_drafts"] = spec.num_drafts
        c["spec_decode_num_draft_tokens"] = spec.num_draft_tokens
        c["spec_decode_num_accepted_tokens"] = spec.num_accepted_tokens
        if spec.num_drafts:
            self.accepted_per_pos = list(spec.num_accepted_tokens_per_pos)

    def on_token(self, record: RequestMetrics, num_tokens: int) -> None:
        c = self.counters
        c["generation_tokens"] += num_tokens
        times = record.token_times
        if len(times) == 1:
            c["prompt_tokens"] += record.num_prompt_tokens
            self._ttft.observe(times[0] - record.arrival_time)
        else:
            self._itl.observe(times[-1] - times[-2])

    def on_finish(self, record: RequestMetrics) -> None:
        reason = record.finish_reason if record.finish_reason in self.success else "abort"
        self.success[reason] += 1
        self.histograms["e2e_request_latency_seconds"].observe(record.finished_time - record.arrival_time)
        if record.first_scheduled_time is not None:
            self.histograms["request_queue_time_seconds"].observe(record.first_scheduled_time - record.arrival_time)

    # ---- readers (any thread) --------------------------------------------------------------------
    def collect(self):
        labels = {"model_name": self.model_name}
        for name, doc in GAUGES.items():
            yield self._gauge(name, doc)
        for name, doc in COUNTERS.items():
            fam = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            fam.add_metric([self.model_name], self.counters[name])
            yield fam
        fam = CounterMetricFamily("vllm:request_success", "Finished requests, by finish reason.",
                                  labels=["model_name", "finished_reason"])
        for reason, n in self.success.items():
            fam.add_metric([self.model_name, reason], n)
        yield fam
        fam = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                  labels=["model_name", "position"])
        for pos, n in enumerate(list(self.accepted_per_pos)):
            fam.add_metric([self.model_name, str(pos)], n)
        yield fam
        for name, (doc, _) in HISTOGRAMS.items():
            yield self.histograms[name].family(f"vllm:{name}", doc, labels)
        fam = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's settings.",
                                labels=["model_name", *self.cache_config])
        fam.add_metric([self.model_name, *self.cache_config.values()], 1)
        yield fam
        for name, value, doc in (("kv_cache_bytes_per_token", self.kv_bytes_per_token,
                                  "K and V of one token over every layer, as the pool stores them (bytes)."),
                                 ("kv_cache_used_bytes", self.kv_used_bytes, "Bytes of the tokens the pool holds.")):
            fam = GaugeMetricFamily(f"minillm:{name}", doc, labels=["model_name"])
            fam.add_metric([self.model_name], value)
            yield fam

    def _gauge(self, name: str, doc: str) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
        fam.add_metric([self.model_name], self.gauges[name])
        return fam

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (`GET /metrics`)."""
        return generate_latest(self.registry)

    def snapshot(self) -> list:
        """The registry as vLLM's `LLM.get_metrics()` returns it (see minillm.server.metrics_reader)."""
        return read_metrics(self.registry)
