"""`minillm bench serve`: a load generator for any OpenAI-compatible server (chapter 11).

It plays a seeded trace against a URL the way `vllm bench serve` does, streams every response, and
reports the same numbers with the same definitions:

- `dataset.py`  prompts of an exact token count, built from a tokenizer's whole-word tokens;
- `client.py`   one streamed request over HTTP, timed chunk by chunk;
- `results.py`  the metric math (TTFT, TPOT, ITL, E2EL, throughputs, goodput) and the report;
- `plot.py`     a PNG of the latency distributions and of the load over time;
- `serve.py`    the command line and the driver (arrival process, max concurrency, progress bar);
- `paired.py`   a paired A/B run's statistic: per-pair TTFT differences, their median and its interval.
"""

from minillm.benchmark.results import BenchmarkMetrics, RequestOutcome, calculate_metrics, parse_goodput
from minillm.benchmark.serve import BenchConfig, BenchmarkResult, run_benchmark

__all__ = [
    "BenchConfig",
    "BenchmarkMetrics",
    "BenchmarkResult",
    "RequestOutcome",
    "calculate_metrics",
    "parse_goodput",
    "run_benchmark",
]
