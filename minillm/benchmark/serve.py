"""`minillm bench serve`: play a seeded load against an OpenAI-compatible URL (chapter 11).

    minillm bench serve --base-url http://127.0.0.1:8000 --model minillm-target \\
        --num-prompts 200 --request-rate 8 --random-input-len 64 --random-output-len 64 \\
        --goodput ttft:500 tpot:50 --save-result bench/results/result.json --plot bench/results/result.png

The arrival process is vLLM's: gaps between requests are Gamma(shape=burstiness, mean=1/rate), so
`--burstiness 1` (the default) is a Poisson process, smaller is burstier, and `--request-rate inf`
sends everything at once. `--max-concurrency N` additionally caps the requests in flight; a request
that waits for a free slot starts its clock only when it is sent. Before the run, one request
checks that the server answers (as vLLM's initial test run), so a wrong URL fails in a second with
the server's reason rather than after a whole run of failures.

`--paired-base-url B` makes the run a paired A/B test (`minillm.benchmark.paired`): every prompt
goes to `--base-url` and to B (several B flags are used in turn), the two halves at neighbouring
arrival times in a seeded random order, so `--num-prompts N` sends 2N requests at `--request-rate`
in all. The report's metrics are the `--base-url` half's; a last line gives the per-pair TTFT
difference (base minus paired) with a bootstrap interval of its median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from minillm.benchmark.client import BACKENDS, RequestSettings, send_request
from minillm.benchmark.dataset import DATASETS, BenchRequest, load_tokenizer, make_requests
from minillm.benchmark.paired import PairedDifference, pair_order, paired_difference
from minillm.benchmark.results import (
    METRIC_NAMES,
    BenchmarkMetrics,
    RequestOutcome,
    calculate_metrics,
    parse_goodput,
)
from minillm.traces.synthetic import gamma_arrivals

DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "minillm-target"


@dataclass
class BenchConfig:
    """Everything one run needs; the command line fills it, a notebook can build one directly."""

    base_url: str
    model: str
    backend: str = "openai"
    endpoint: str | None = None  # default: /v1/completions or /v1/chat/completions
    api_key: str | None = None
    tokenizer: str | Path = BUNDLED_TOKENIZER
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    random_input_len: int = 128
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    max_input_len: int = 1024
    max_output_len: int = 1024
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    prompt_format: str = "text"
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft / tpot / e2el
    percentiles: tuple[float, ...] = (99,)
    initial_test: bool = True
    request_timeout_s: float = 600.0
    disable_tqdm: bool = False
    paired_base_urls: list[str] = field(default_factory=list)  # a paired A/B run: each prompt also sent here

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.prompt_format not in ("text", "ids"):
            raise ValueError(f"--prompt-format {self.prompt_format!r}: accepted are text and ids")
        if self.prompt_format == "ids" and self.backend == "openai-chat":
            raise ValueError("--prompt-format ids needs --backend openai: chat messages are text")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 requests/s (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be ≥ 1, got {self.max_concurrency}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        for url in self.paired_base_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--paired-base-url must start with http:// or https://, got {url!r}")
        for p in self.percentiles:
            if not 0 < p < 100:
                raise ValueError(f"--metric-percentiles: {p} is not strictly between 0 and 100")

    @property
    def url(self) -> str:
        return self.url_at(self.base_url)

    def url_at(self, base_url: str) -> str:
        return base_url.rstrip("/") + (self.endpoint or DEFAULT_ENDPOINTS[self.backend])


@dataclass
class BenchmarkResult:
    config: BenchConfig
    metrics: BenchmarkMetrics
    outcomes: list[RequestOutcome]
    requests: list[BenchRequest]
    paired_outcomes: list[RequestOutcome] | None = None  # prompt by prompt, the --paired-base-url half
    paired: PairedDifference | None = None

    def to_dict(self) -> dict:
        """vLLM's result JSON: the run's settings, the metrics, then per-request lists."""
        cfg = asdict(self.config)
        cfg["tokenizer"] = str(cfg["tokenizer"])
        cfg.pop("api_key")
        ok = [o for o in self.outcomes if o.success]
        return {
            "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
            "backend": self.config.backend, "model_id": self.config.model,
            "num_prompts": self.config.num_prompts,
            "request_rate": "inf" if math.isinf(self.config.request_rate) else self.config.request_rate,
            "burstiness": self.config.burstiness, "max_concurrency": self.config.max_concurrency,
            "config": cfg,
            **self.metrics.to_dict(),
            "input_lens": [o.prompt_len for o in ok],
            "output_lens": [o.output_tokens for o in ok],
            "ttfts": [o.ttft_s for o in ok],
            "itls": [o.itl_s for o in ok],
            "start_times": [o.start_time_s for o in ok],
            "errors": [o.error for o in self.outcomes if not o.success],
            **({} if self.paired_outcomes is None else {
                "paired_ttft_ms": None if self.paired is None else self.paired.to_dict(),
                "paired_ttfts": [o.ttft_s if o.success else None for o in self.paired_outcomes]}),
        }

    def save_json(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=True))


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from the run's start): the first at 0, then gamma gaps of mean 1/rate."""
    return gamma_arrivals(num_requests, request_rate, burstiness, np.random.default_rng([seed, 1]))


def paired_sends(cfg: BenchConfig, requests: list[BenchRequest]) -> list[tuple[int, BenchRequest, str]]:
    """The run's sends in arrival order, as (side, request, URL): side 0 is --base-url, 1 a --paired-base-url
    (pair k's B half goes to the k-th in turn). Without paired URLs, every request once to --base-url."""
    if not cfg.paired_base_urls:
        return [(0, req, cfg.url) for req in requests]
    sends = []
    for k, (req, b_first) in enumerate(zip(requests, pair_order(len(requests), cfg.seed))):
        halves = [(0, req, cfg.url), (1, req, cfg.url_at(cfg.paired_base_urls[k % len(cfg.paired_base_urls)]))]
        sends += halves[::-1] if b_first else halves
    return sends


async def _run(cfg: BenchConfig, requests: list[BenchRequest], tokenizer,
               transport: httpx.AsyncBaseTransport | None) -> tuple[list[list[RequestOutcome]], float]:
    """The outcomes per side (--base-url's, then the paired URLs' if any, each in prompt order), and the
    run's duration."""
    settings = RequestSettings(cfg.model, cfg.backend, cfg.prompt_format, cfg.temperature, cfg.ignore_eos,
                               cfg.extra_body)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    sends = paired_sends(cfg, requests)
    limits = httpx.Limits(max_connections=cfg.max_concurrency or len(sends) + 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s), limits=limits,
                                 transport=transport) as client:
        if cfg.initial_test:
            for url in dict.fromkeys(url for _, _, url in sends):  # each URL once, in order
                test = await send_request(client, url, requests[0], settings, run_start=time.perf_counter(),
                                          tokenizer=tokenizer, headers=headers)
                if not test.success:
                    raise ValueError(f"the initial test request to {url} failed: {test.error}")
        offsets = arrival_offsets(len(sends), cfg.request_rate, cfg.burstiness, cfg.seed)
        limiter = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(sends), disable=cfg.disable_tqdm, desc="bench serve", unit="req")
        run_start = time.perf_counter()

        async def one(req: BenchRequest, url: str, offset_s: float) -> RequestOutcome:
            await asyncio.sleep(max(0.0, run_start + offset_s - time.perf_counter()))
            if limiter is None:
                outcome = await send_request(client, url, req, settings, run_start=run_start,
                                             tokenizer=tokenizer, headers=headers)
            else:
                async with limiter:
                    outcome = await send_request(client, url, req, settings, run_start=run_start,
                                                 tokenizer=tokenizer, headers=headers)
            bar.update(1)
            return outcome

        outcomes = await asyncio.gather(*(one(req, url, float(t)) for (_, req, url), t in zip(sends, offsets)))
        duration_s = time.perf_counter() - run_start
        bar.close()
    sides = [[o for (side, _, _), o in zip(sends, outcomes) if side == s] for s in (0, 1)]
    return sides if cfg.paired_base_urls else sides[:1], duration_s


def run_benchmark(cfg: BenchConfig, requests: list[BenchRequest] | None = None, *,
                  transport: httpx.AsyncBaseTransport | None = None) -> BenchmarkResult:
    """Run one benchmark to the end and return its metrics. Works inside Jupyter too (whose own
    event loop is running): the run then gets a fresh loop in a helper thread. `transport`
    replaces the network (tests pass an `httpx.MockTransport`)."""
    cfg.validate()
    tokenizer = load_tokenizer(cfg.tokenizer)
    if requests is None:
        requests = make_requests(cfg.dataset_name, cfg.num_prompts, tokenizer, seed=cfg.seed,
                                 input_len=cfg.random_input_len, output_len=cfg.random_output_len,
                                 range_ratio=cfg.random_range_ratio, prefix_len=cfg.random_prefix_len,
                                 max_input_len=cfg.max_input_len, max_output_len=cfg.max_output_len,
                                 dataset_path=cfg.dataset_path)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        sides, duration_s = asyncio.run(_run(cfg, requests, tokenizer, transport))
    else:
        box: dict[str, Any] = {}

        def worker() -> None:
            try:
                box["value"] = asyncio.run(_run(cfg, requests, tokenizer, transport))
            except BaseException as err:  # handed back to the caller's thread below
                box["error"] = err

        thread = threading.Thread(target=worker, name="bench-serve")
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        sides, duration_s = box["value"]
    outcomes = sides[0]
    metrics = calculate_metrics(outcomes, duration_s, goodput_slos_ms=cfg.goodput, percentiles=cfg.percentiles)
    if len(sides) == 1:
        return BenchmarkResult(cfg, metrics, outcomes, requests)
    ttfts = [[o.ttft_s if o.success else None for o in side] for side in sides]
    both_ok = sum(a is not None and b is not None for a, b in zip(*ttfts))
    paired = paired_difference(*ttfts, seed=cfg.seed) if both_ok >= 2 else None  # (else: failures, reported)
    return BenchmarkResult(cfg, metrics, outcomes, requests, sides[1], paired)


# --------------------------------------------------------------------------- command line


def _rate(text: str) -> float:
    try:
        return float(text)  # float("inf") included
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of requests per second or inf, not {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `minillm bench serve`, with `vllm bench serve`'s names."""
    add = parser.add_argument
    add("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    add("--model", required=True, help="the model name the server expects in requests")
    add("--backend", default="openai", choices=BACKENDS, help="openai: /v1/completions; openai-chat: chat")
    add("--endpoint", default=None, help="path under --base-url (default: by backend)")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token (env OPENAI_API_KEY)")
    add("--tokenizer", default=str(BUNDLED_TOKENIZER), help="model directory or tokenizer.json (default: bundled)")
    add("--dataset-name", default="random", choices=DATASETS)
    add("--dataset-path", default=None, help="a trace saved by minillm.traces.synthetic (for --dataset-name jsonl)")
    add("--num-prompts", type=int, default=100)
    add("--random-input-len", type=int, default=128)
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len·[1−r, 1+r]")
    add("--random-prefix-len", type=int, default=0, help="tokens of one prefix shared by every prompt")
    add("--max-input-len", type=int, default=1024, help="clip for sharegpt-like prompts")
    add("--max-output-len", type=int, default=1024, help="clip for sharegpt-like outputs")
    add("--request-rate", type=_rate, default=math.inf, help="requests per second; inf sends all at once")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    add("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    add("--seed", type=int, default=0)
    add("--prompt-format", default="text", choices=["text", "ids"],
        help="send text (the server tokenizes: its cost is in TTFT) or token ids")
    add("--temperature", type=float, default=0.0)
    add("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM extension)")
    add("--extra-body", default=None, help="JSON object merged into every request body")
    add("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    add("--percentile-metrics", default="ttft,tpot,itl,e2el", help="which latencies the report shows")
    add("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    add("--request-timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    add("--disable-tqdm", action="store_true")
    add("--save-result", default=None, metavar="FILE.json", help="write vLLM-style result JSON")
    add("--plot", default=None, metavar="FILE.png", help="write latency distributions and load over time")
    add("--plot-title", default=None, help="title above the plot (say what was measured where)")
    add("--paired-base-url", action="append", default=None, metavar="URL",
        help="a paired A/B run: every prompt is sent to --base-url and to this URL (repeat the flag for several, "
             "used in turn), at neighbouring arrival times in a seeded order; the report adds the per-pair TTFT "
             "difference, --base-url minus this, with a bootstrap interval of its median")


def config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, list[str]]:
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in shown if m not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; accepted: {', '.join(METRIC_NAMES)}")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers such as 50,90,99, got {args.metric_percentiles!r}") from None
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as err:
            raise ValueError(f"--extra-body is not valid JSON: {err}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object, e.g. '{\"top_k\": 20}'")
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, backend=args.backend, endpoint=args.endpoint,
        api_key=args.api_key, tokenizer=args.tokenizer, dataset_name=args.dataset_name,
        dataset_path=args.dataset_path, num_prompts=args.num_prompts, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, prompt_format=args.prompt_format,
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=extra,
        goodput=parse_goodput(args.goodput), percentiles=percentiles, request_timeout_s=args.request_timeout,
        disable_tqdm=args.disable_tqdm, paired_base_urls=args.paired_base_url or [])
    return cfg, shown


def main(args: argparse.Namespace) -> int:
    """Run from parsed arguments, print the report, write the JSON and the plot if asked."""
    cfg, shown = config_from_args(args)
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    paired = f", each also to {', '.join(cfg.paired_base_urls)} (paired)" if cfg.paired_base_urls else ""
    print(f"Traffic request rate: {rate} req/s, burstiness {cfg.burstiness:g}, "
          f"max concurrency {cfg.max_concurrency or 'unlimited'}; {cfg.num_prompts} prompts to {cfg.url}{paired}")
    result = run_benchmark(cfg)
    print(result.metrics.table(cfg.max_concurrency, shown))
    if result.paired is not None:
        print(f"Paired TTFT, --base-url minus --paired-base-url, {result.paired.line()}")
    failures = [o.error for o in result.outcomes if not o.success]
    if failures:
        print(f"first failure: {failures[0]}")
    if args.save_result:
        result.save_json(args.save_result)
        print(f"result JSON: {args.save_result}")
    if args.plot:
        from minillm.benchmark.plot import plot_result

        plot_result(result, args.plot, title=args.plot_title)
        print(f"plot: {args.plot}")
    return 0 if result.metrics.completed else 1
