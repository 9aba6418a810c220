"""Serving metrics: per-request timestamps, per-step records, and a `vllm bench serve`-style summary.

Chapter 03 defines the latency metrics, chapter 04 adds goodput; later chapters read the
per-step fields (padding, KV occupancy, preemptions, prefix-cache hits). Names and definitions
follow `vllm bench serve`:

- TTFT  = first token − arrival (queueing + prefill).
- TPOT  = (finish − first token) / (output tokens − 1): the decode pace, EXCLUDING the first token;
          undefined for single-token outputs.
- ITL   = gaps between consecutive chunks of tokens, pooled over all requests (so long outputs
          weigh more). Several tokens emitted in one step (speculative decoding) are one chunk, as
          a streaming client — and `vllm bench serve` — sees them.
- E2EL  = finish − arrival.
- goodput = completed requests per second that met EVERY given SLO (Zhong et al., DistServe).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from minillm.report import LATENCY_METRICS, LatencyStats, Report, format_value, latency_keys, ratio


@dataclass
class RequestMetrics:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that produced tokens (a chunk)
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    output_tokens: int | None = None  # tokens received; None: one per entry of token_times
    finish_reason: str | None = None  # "stop", "length" or "abort"

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times) if self.output_tokens is None else self.output_tokens

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        """vLLM's RequestMetrics name for the time from arrival to first scheduled."""
        return self.queue_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        if n <= 1 or self.finished_time is None or self.first_token_time is None:
            return None
        return (self.finished_time - self.first_token_time) / (n - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class StepRecord:
    step: int
    start_time: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padding_tokens: int  # slots computed for pads or already-finished rows (static/dynamic batching)
    num_seqs: int  # rows in the batch
    num_waiting: int
    kv_used_tokens: int  # KV slots holding real tokens
    kv_reserved_tokens: int  # KV slots reserved / allocated (≥ used)
    kv_total_tokens: int  # KV capacity
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_prefix_queried_tokens: int = 0  # tokens looked up in the prefix cache by admissions this step
    num_prefix_hit_tokens: int = 0  # of those, found cached
    kv_swapped_tokens: int = 0  # tokens held in host memory after the step
    num_swapped_blocks: int = 0  # blocks copied between device and host this step
    prefill_chunk_sizes: tuple[int, ...] = ()  # new tokens of each row that is (re)filling a prompt
    expert_load: list[list[int]] | None = None  # MoE models: rows each expert computed, [layer][expert]

    @property
    def num_computed_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_padding_tokens


@dataclass
class SLO:
    """Service-level objectives in ms; None means "not checked"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


@dataclass
class Summary:
    completed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    request_goodput: float | None  # req/s meeting every SLO; None without an SLO
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    padding_waste: float  # padding tokens / all computed tokens, over steps
    mean_kv_occupancy: float  # mean over steps of kv_used / kv_total
    kv_reservation_waste: float  # 1 − Σ kv_used / Σ kv_reserved, over steps
    num_preemptions: int
    prefix_cache_hit_rate: float  # vLLM's: hit tokens / queried tokens over every admission
    num_steps: int = 0

    def to_dict(self) -> dict:
        """Flat dict; latency keys as in vllm's result JSON (mean_ttft_ms, p99_tpot_ms, …)."""
        d = {k: v for k, v in asdict(self).items() if k not in LATENCY_METRICS}
        for name in LATENCY_METRICS:
            d.update(latency_keys(name, getattr(self, name)))
        return d

    def table(self, title: str = "Serving Benchmark Result") -> str:
        """An aligned text block laid out like `vllm bench serve`'s."""
        report = Report(title)
        report.row("Successful requests:", self.completed)
        report.run_totals(self.duration_s, self.total_input_tokens, self.total_output_tokens,
                          self.request_throughput, self.request_goodput, self.output_throughput)
        report.row("Total token throughput (tok/s):", self.total_token_throughput)
        for name in LATENCY_METRICS:
            report.latency(name, getattr(self, name), skip_percentiles=(50,))
        report.section("Engine")
        report.row("Steps:", self.num_steps)
        report.row("Padding waste (%):", 100 * self.padding_waste)
        report.row("Mean KV occupancy (%):", 100 * self.mean_kv_occupancy)
        report.row("KV reservation waste (%):", 100 * self.kv_reservation_waste)
        report.row("Preemptions:", self.num_preemptions)
        report.row("Prefix cache hit rate (%):", 100 * self.prefix_cache_hit_rate)
        return report.render()

    def __str__(self) -> str:
        return self.table()


def summarize(
    requests: Sequence[RequestMetrics],
    steps: Sequence[StepRecord] = (),
    *,
    duration_s: float | None = None,
    slo: SLO | None = None,
    percentiles: Sequence[float] = (50, 99),
) -> Summary:
    """Aggregate finished requests and engine steps into a Summary.

    Only finished requests count (as vllm counts only successful ones). `duration_s` defaults to
    last finish − first arrival. Preemptions are counted by both requests and steps; the summary
    takes whichever source recorded more, so an engine that fills only one is still counted.
    """
    done = [r for r in requests if r.finished_time is not None and r.finish_reason != "abort"]
    if duration_s is None:
        duration_s = max(r.finished_time for r in done) - min(r.arrival_time for r in requests) if done else 0.0
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    itls = [gap for r in done for gap in r.itls]
    e2els = [r.e2e_latency for r in done]
    total_in = sum(r.num_prompt_tokens for r in done)
    total_out = sum(r.num_output_tokens for r in done)

    goodput = None
    if slo is not None:
        def good(r: RequestMetrics) -> bool:
            # vllm treats a single-token output's TPOT as 0 for goodput.
            checks = ((slo.ttft_ms, r.ttft), (slo.tpot_ms, r.tpot or 0.0), (slo.e2el_ms, r.e2e_latency))
            return all(limit is None or (v is not None and v <= limit / 1000) for limit, v in checks)
        goodput = ratio(sum(good(r) for r in done), duration_s)

    computed = sum(s.num_computed_tokens for s in steps)
    occupancy = [s.kv_used_tokens / s.kv_total_tokens for s in steps if s.kv_total_tokens > 0]
    reserved = sum(s.kv_reserved_tokens for s in steps)
    return Summary(
        completed=len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration_s=float(duration_s),
        request_throughput=ratio(len(done), duration_s),
        output_throughput=ratio(total_out, duration_s),
        total_token_throughput=ratio(total_in + total_out, duration_s),
        request_goodput=goodput,
        ttft=LatencyStats.of(ttfts, percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of(itls, percentiles),
        e2el=LatencyStats.of(e2els, percentiles),
        padding_waste=ratio(sum(s.num_padding_tokens for s in steps), computed),
        mean_kv_occupancy=float(np.mean(occupancy)) if occupancy else float("nan"),
        kv_reservation_waste=1.0 - ratio(sum(s.kv_used_tokens for s in steps), reserved),
        num_preemptions=max(sum(r.num_preemptions for r in requests), sum(s.num_preemptions for s in steps)),
        prefix_cache_hit_rate=_prefix_hit_rate(done, steps, total_in),
        num_steps=len(steps),
    )


def _prefix_hit_rate(done: Sequence[RequestMetrics], steps: Sequence[StepRecord], total_in: int) -> float:
    """vLLM's prefix-cache hit rate: tokens found ÷ tokens looked up, over every admission (a
    request admitted again after a preemption is looked up again). Without per-step lookup counts
    (an engine that records none), cached prompt tokens ÷ prompt tokens of the finished requests."""
    queried = sum(s.num_prefix_queried_tokens for s in steps)
    if queried:
        return sum(s.num_prefix_hit_tokens for s in steps) / queried
    return ratio(sum(r.num_cached_prompt_tokens for r in done), total_in) if total_in else 0.0


# (label, getter) pairs shown by compare(); ratios > 1 mean "more than the baseline".
_COMPARE_ROWS: list[tuple[str, Callable[[Summary], float | None]]] = [
    ("request throughput (req/s)", lambda s: s.request_throughput),
    ("output throughput (tok/s)", lambda s: s.output_throughput),
    ("request goodput (req/s)", lambda s: s.request_goodput),
    ("mean TTFT (ms)", lambda s: s.ttft.mean_ms),
    ("P99 TTFT (ms)", lambda s: s.ttft.percentiles_ms.get(99)),
    ("mean TPOT (ms)", lambda s: s.tpot.mean_ms),
    ("P99 TPOT (ms)", lambda s: s.tpot.percentiles_ms.get(99)),
    ("P99 ITL (ms)", lambda s: s.itl.percentiles_ms.get(99)),
    ("mean E2EL (ms)", lambda s: s.e2el.mean_ms),
    ("padding waste (%)", lambda s: 100 * s.padding_waste),
    ("mean KV occupancy (%)", lambda s: 100 * s.mean_kv_occupancy),
    ("preemptions", lambda s: s.num_preemptions),
]


def compare(summaries: dict[str, Summary], baseline: str) -> str:
    """A text table of key metrics, one column per system, each value with its ratio to `baseline`."""
    base = summaries[baseline]
    names = list(summaries)
    width = max(18, *(len(n) + 2 for n in names))
    lines = [f"{'metric':<28}" + "".join(f"{n:>{width}}" for n in names)]
    for label, get in _COMPARE_ROWS:
        b = get(base)
        if b is None or all(get(s) is None for s in summaries.values()):
            continue
        cells = []
        for name in names:
            v = get(summaries[name])
            text = format_value(v)
            if v is not None and name != baseline:
                text += f" ({ratio(v, b):.2f}x)"
            cells.append(f"{text:>{width}}")
        lines.append(f"{label:<28}" + "".join(cells))
    return "\n".join(lines)


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters, named as vLLM exports them (vllm:spec_decode_num_drafts, …)."""

    num_drafts: int = 0  # rows that carried guesses
    num_draft_tokens: int = 0  # guesses verified
    num_accepted_tokens: int = 0  # guesses accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # accepted at position 0, 1, …

    @property
    def acceptance_rate(self) -> float:
        return ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per speculative row: 1 (the target's own) + accepted guesses, on average."""
        return 1 + ratio(self.num_accepted_tokens, self.num_drafts) if self.num_drafts else float("nan")

    def record(self, num_guesses: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_guesses
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_guesses:
            self.num_accepted_tokens_per_pos += [0] * (num_guesses - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1


class MetricsCollector:
    """Collects timestamps from the engine's hot path; each call is a dict lookup and an append.

    Offline (`LLM.generate`, the benchmarks) everything is kept for the summary. A server that runs
    for days must not grow: `retain(finished_requests=False, max_steps=N)` drops a request's record
    as it finishes (after the request observers saw it) and keeps only the last N step records;
    the Prometheus exporter (minillm.server.metrics) has folded them into its counters by then."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestMetrics] = {}
        self.steps: list[StepRecord] | deque[StepRecord] = []
        self.spec_decode = SpecDecodeStats()
        self.observers: list[Callable[[StepRecord], None]] = []
        self.request_observers: list = []
        self.keep_finished = True

    def retain(self, finished_requests: bool, max_steps: int | None) -> None:
        self.keep_finished = finished_requests
        if max_steps is not None:
            self.steps = deque(self.steps, maxlen=max_steps)
        if not finished_requests:
            self.requests = {k: r for k, r in self.requests.items() if r.finished_time is None}

    def add_observer(self, fn: Callable[[StepRecord], None]) -> None:
        """`fn(step_record)` is called after every step (live plots, Prometheus)."""
        self.observers.append(fn)

    def add_request_observer(self, observer) -> None:
        """`observer.on_token(record, num_tokens)` after each chunk of tokens a request receives,
        `observer.on_finish(record)` when it finishes (any reason, abort included)."""
        self.request_observers.append(observer)

    def on_arrival(self, request_id: str, t: float, num_prompt_tokens: int) -> None:
        self.requests[request_id] = RequestMetrics(request_id, t, num_prompt_tokens)

    def on_scheduled(self, request_id: str, t: float) -> None:
        r = self.requests[request_id]
        if r.first_scheduled_time is None:
            r.first_scheduled_time = t

    def on_token(self, request_id: str, t: float, num_tokens: int = 1) -> None:
        """One step delivered `num_tokens` tokens (> 1 when speculating): one chunk, one timestamp."""
        r = self.requests[request_id]
        if r.first_token_time is None:
            r.first_token_time = t
        r.token_times.append(t)
        if num_tokens != 1 or r.output_tokens is not None:
            r.output_tokens = (len(r.token_times) - 1 if r.output_tokens is None else r.output_tokens) + num_tokens
        for obs in self.request_observers:
            obs.on_token(r, num_tokens)

    def on_cached(self, request_id: str, num_cached_prompt_tokens: int) -> None:
        self.requests[request_id].num_cached_prompt_tokens += num_cached_prompt_tokens

    def on_preempted(self, request_id: str) -> None:
        self.requests[request_id].num_preemptions += 1

    def on_finish(self, request_id: str, t: float, reason: str | None = None) -> None:
        r = self.requests[request_id]
        r.finished_time = t
        r.finish_reason = reason
        for obs in self.request_observers:
            obs.on_finish(r)
        if not self.keep_finished:
            del self.requests[request_id]

    def record_step(self, step: StepRecord) -> None:
        self.steps.append(step)
        for fn in self.observers:
            fn(step)

    def summary(self, **kwargs) -> Summary:
        """`summarize()` over everything collected; kwargs as for summarize."""
        return summarize(list(self.requests.values()), self.steps, **kwargs)
