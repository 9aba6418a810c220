"""`minillm bench serve`: the metric math on hand-made timings, the arrival process, the prompts,
the streaming client and the driver on a fake transport, and one run against the real server."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from minillm.benchmark.client import RequestSettings, build_payload, send_request
from minillm.benchmark.dataset import BenchRequest, load_tokenizer, make_requests, word_token_ids
from minillm.benchmark.results import RequestOutcome, calculate_metrics, parse_goodput
from minillm.benchmark.serve import BUNDLED_TOKENIZER, BenchConfig, arrival_offsets, run_benchmark
from minillm.cli import build_parser

# ----------------------------------------------------------------------------- metric math

# Three successful requests and one failure over a 2-second run.
#   A: sent at 0.0, TTFT 100 ms, 5 tokens, gaps 20/30/20/30 ms, E2EL 200 ms → TPOT 100/4 = 25 ms
#   B: sent at 0.1, TTFT 300 ms, 3 tokens, gaps 50/50 ms,       E2EL 400 ms → TPOT 100/2 = 50 ms
#   C: sent at 1.0, TTFT 250 ms, 1 token,  no gaps,             E2EL 250 ms → no TPOT
OUTCOMES = [
    RequestOutcome(True, prompt_len=10, output_tokens=5, ttft_s=0.1, itl_s=[0.02, 0.03, 0.02, 0.03],
                   latency_s=0.2, start_time_s=0.0),
    RequestOutcome(True, prompt_len=20, output_tokens=3, ttft_s=0.3, itl_s=[0.05, 0.05], latency_s=0.4,
                   start_time_s=0.1),
    RequestOutcome(True, prompt_len=7, output_tokens=1, ttft_s=0.25, latency_s=0.25, start_time_s=1.0),
    RequestOutcome(False, prompt_len=99, error="HTTP 503"),
]


def test_counts_and_throughputs() -> None:
    m = calculate_metrics(OUTCOMES, 2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (37, 9)  # the failed request counts for nothing
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(23.0)
    assert m.request_goodput is None  # no SLO given
    assert m.peak_concurrent_requests == 2  # A and B overlap in [0.1, 0.2]
    assert m.peak_output_throughput == pytest.approx(8.0)  # A's 5 chunks and B's 3 land in second 0


def test_latency_statistics_follow_vllm_definitions() -> None:
    m = calculate_metrics(OUTCOMES, 2.0, percentiles=(50, 99))
    # TTFT over every successful request.
    assert m.ttft.mean_ms == pytest.approx((100 + 300 + 250) / 3)
    assert m.ttft.median_ms == pytest.approx(250)
    assert m.ttft.percentiles_ms[99] == pytest.approx(250 + 0.98 * 50)  # numpy's linear interpolation
    # TPOT = (E2EL − TTFT) / (tokens − 1), only for outputs longer than one token.
    assert m.tpot.mean_ms == pytest.approx(37.5)
    assert m.tpot.percentiles_ms[99] == pytest.approx(25 + 0.99 * 25)
    # ITL pooled over all gaps of all requests: [20, 30, 20, 30, 50, 50].
    assert m.itl.mean_ms == pytest.approx(200 / 6)
    assert m.itl.median_ms == pytest.approx(30)
    assert m.itl.percentiles_ms[50] == pytest.approx(30)
    # E2EL = last chunk − send.
    assert m.e2el.mean_ms == pytest.approx((200 + 400 + 250) / 3)
    assert m.e2el.percentiles_ms[99] == pytest.approx(250 + 0.98 * 150)
    d = m.to_dict()
    assert d["p99_tpot_ms"] == pytest.approx(49.75) and d["median_ttft_ms"] == pytest.approx(250)
    assert d["completed"] == 3 and d["duration"] == 2.0


def test_goodput_needs_every_slo_and_is_inclusive() -> None:
    # ttft ≤ 250 ms and tpot ≤ 30 ms: A (100, 25) and C (250, one token → TPOT 0) pass, B (300) fails.
    assert calculate_metrics(OUTCOMES, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 30}).request_goodput == 1.0
    assert calculate_metrics(OUTCOMES, 2.0, goodput_slos_ms={"ttft": 249, "tpot": 30}).request_goodput == 0.5
    # tpot ≤ 30 alone lets C through (TPOT 0) but not B (50 ms).
    assert calculate_metrics(OUTCOMES, 2.0, goodput_slos_ms={"tpot": 30}).request_goodput == 1.0
    assert calculate_metrics(OUTCOMES, 2.0, goodput_slos_ms={"e2el": 300}).request_goodput == 1.0
    assert calculate_metrics(OUTCOMES, 2.0, goodput_slos_ms={"e2el": 199}).request_goodput == 0.0


def test_report_has_vllm_lines() -> None:
    table = calculate_metrics(OUTCOMES, 2.0, goodput_slos_ms={"ttft": 250}).table(max_concurrency=4)
    rows = dict(line.rsplit(maxsplit=1) for line in table.splitlines() if line.endswith(tuple("0123456789")))
    rows = {label.strip(): value for label, value in rows.items()}
    assert rows["Successful requests:"] == "3" and rows["Failed requests:"] == "1"
    assert rows["Maximum request concurrency:"] == "4" and rows["Request goodput (req/s):"] == "1.00"
    assert rows["Mean TTFT (ms):"] == "216.67" and rows["P99 TPOT (ms):"] == "49.75"
    assert rows["Median ITL (ms):"] == "30.00" and rows["Mean E2EL (ms):"] == "283.33"
    assert rows["Output token throughput (tok/s):"] == "4.50" and rows["Benchmark duration (s):"] == "2.00"


def test_no_success_gives_nan_not_a_crash() -> None:
    m = calculate_metrics([RequestOutcome(False, error="refused")], 1.0)
    assert m.completed == 0 and m.failed == 1 and math.isnan(m.ttft.mean_ms)
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics(OUTCOMES, 0.0)


@pytest.mark.parametrize("items, message", [
    (["ttft"], "KEY:MILLISECONDS"),
    (["itl:5"], "unknown metric 'itl'"),
    (["ttft:fast"], "number of milliseconds"),
    (["tpot:-1"], "≥ 0"),
])
def test_bad_goodput_is_named(items, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_goodput(items)


def test_goodput_parses_like_vllm() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000.5"]) == {"ttft": 500, "tpot": 50, "e2el": 2000.5}


# ----------------------------------------------------------------------------- arrivals


def test_arrivals_are_seeded_and_have_the_asked_mean_rate() -> None:
    a, b = arrival_offsets(20000, 4.0, 1.0, seed=0), arrival_offsets(20000, 4.0, 1.0, seed=0)
    assert np.array_equal(a, b) and a[0] == 0.0
    assert not np.array_equal(a, arrival_offsets(20000, 4.0, 1.0, seed=1))
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.var(gaps) / np.mean(gaps) ** 2 == pytest.approx(1.0, rel=0.08)  # Poisson: CV² = 1


def test_burstiness_changes_spread_not_mean() -> None:
    for burstiness in (0.25, 4.0):
        gaps = np.diff(arrival_offsets(20000, 2.0, burstiness, seed=3))
        assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)
        assert np.var(gaps) / np.mean(gaps) ** 2 == pytest.approx(1 / burstiness, rel=0.15)
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, seed=0), np.zeros(5))


# ----------------------------------------------------------------------------- prompts


def test_prompts_have_exact_token_counts_and_are_seeded() -> None:
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    reqs = make_requests("random", 12, tok, seed=5, input_len=32, output_len=16, range_ratio=0.5)
    for r in reqs:
        assert tok.encode(r.prompt, add_special_tokens=False).ids == r.prompt_token_ids
        assert 16 <= r.prompt_len <= 48 and 8 <= r.max_tokens <= 24
    assert len({r.prompt_len for r in reqs}) > 1
    again = make_requests("random", 12, tok, seed=5, input_len=32, output_len=16, range_ratio=0.5)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = make_requests("random", 12, tok, seed=6, input_len=32, output_len=16, range_ratio=0.5)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_fixed_lengths_and_shared_prefix() -> None:
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    reqs = make_requests("random", 6, tok, seed=0, input_len=20, output_len=7, prefix_len=16)
    assert all(r.prompt_len == 36 and r.max_tokens == 7 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[16:]) for r in reqs}) == 6
    words = set(word_token_ids(tok).tolist())
    assert all(set(r.prompt_token_ids) <= words for r in reqs)


def test_sharegpt_like_is_heavy_tailed_and_clipped() -> None:
    reqs = make_requests("sharegpt-like", 200, load_tokenizer(BUNDLED_TOKENIZER), seed=0,
                         max_input_len=512, max_output_len=2048)
    outs = np.array([r.max_tokens for r in reqs])
    assert outs.max() <= 2048 and np.median(outs) < outs.mean()
    assert max(r.prompt_len for r in reqs) <= 512


@pytest.mark.parametrize("kwargs, message", [
    (dict(dataset="nope"), "not one of random, sharegpt-like, jsonl"),
    (dict(dataset="random", range_ratio=1.0), "random-range-ratio"),
    (dict(dataset="random", input_len=0), "random-input-len"),
    (dict(dataset="jsonl"), "dataset-path"),
])
def test_bad_dataset_settings_are_named(kwargs, message) -> None:
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    with pytest.raises(ValueError, match=message):
        make_requests(kwargs.pop("dataset"), 3, tok, **kwargs)


@pytest.mark.parametrize("changes, message", [
    (dict(request_rate=0.0), "request-rate"),
    (dict(burstiness=-1.0), "burstiness"),
    (dict(max_concurrency=0), "max-concurrency"),
    (dict(backend="grpc"), "backend"),
    (dict(base_url="127.0.0.1:8000"), "http://"),
    (dict(backend="openai-chat", prompt_format="ids"), "prompt-format ids"),
    (dict(percentiles=(100.0,)), "metric-percentiles"),
])
def test_bad_config_is_named(changes, message) -> None:
    cfg = BenchConfig(**{"base_url": "http://127.0.0.1:1", "model": "m", **changes})
    with pytest.raises(ValueError, match=message):
        cfg.validate()


# ----------------------------------------------------------------------------- client on a fake wire


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _completion_chunks(texts: list[str], prompt_tokens: int | None = None, completion_tokens: int | None = None):
    chunks = [{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": t}]} for t in texts]
    if completion_tokens is not None:
        chunks.append({"id": "c", "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                            "completion_tokens": completion_tokens}})
    return chunks


def _send(handler, req: BenchRequest, settings: RequestSettings, tokenizer=None) -> RequestOutcome:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, "http://test/v1/completions", req, settings, run_start=0.0,
                                      tokenizer=tokenizer)
    return asyncio.run(go())


REQ = BenchRequest(" morning camels", [11, 12], max_tokens=4)


def test_client_reads_chunks_and_usage() -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=_sse(_completion_chunks([" a", " b", "", " c"], 3, 4)))

    out = _send(handler, REQ, RequestSettings("m", ignore_eos=True))
    assert out.success and out.generated_text == " a b c"
    assert out.output_tokens == 4 and out.prompt_len == 3  # the server's usage wins over our count
    assert len(out.itl_s) == 3  # four chunks with a choice (an empty text is still a chunk) → three gaps
    assert out.latency_s >= out.ttft_s >= 0
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert seen["prompt"] == " morning camels" and seen["max_tokens"] == 4 and seen["ignore_eos"] is True


def test_client_counts_tokens_itself_without_usage() -> None:
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    text = tok.decode(word_token_ids(tok)[:5].tolist())

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(_completion_chunks([text])))

    out = _send(handler, REQ, RequestSettings("m"), tokenizer=tok)
    assert out.success and out.output_tokens == 5 and out.prompt_len == 2


def test_client_reports_http_errors_and_empty_streams() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "queue full", "type": "overloaded"}})

    out = _send(refuse, REQ, RequestSettings("m"))
    assert not out.success and out.error.startswith("HTTP 503") and "queue full" in out.error

    def empty(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: [DONE]\n\n")

    assert "without a single chunk" in _send(empty, REQ, RequestSettings("m")).error


def test_payloads_for_ids_and_chat() -> None:
    assert build_payload(REQ, RequestSettings("m", prompt_format="ids"))["prompt"] == [11, 12]
    chat = build_payload(REQ, RequestSettings("m", backend="openai-chat", extra_body={"top_k": 3}))
    assert chat["messages"] == [{"role": "user", "content": " morning camels"}] and chat["top_k"] == 3
    assert "prompt" not in chat and "ignore_eos" not in chat


def test_chat_deltas_are_read() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}]
        return httpx.Response(200, content=_sse(chunks))

    out = _send(handler, REQ, RequestSettings("m", backend="openai-chat"))
    assert out.success and out.generated_text == "Hi" and out.output_tokens == 1


# ----------------------------------------------------------------------------- driver on a fake server


class FakeServer:
    """Streams `max_tokens` one-token chunks with a small pause each; notes the most in flight."""

    def __init__(self, fail_every: int = 0) -> None:
        self.in_flight = self.peak = self.calls = 0
        self.fail_every = fail_every

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            return httpx.Response(429, json={"error": {"message": "too many"}})
        server = self

        async def stream():
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' x'}]})}\n\n".encode()
            # Counted out before the last chunk: the client stops reading at [DONE], so code after
            # the last yield would never run.
            server.in_flight -= 1
            usage = {"prompt_tokens": 5, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, content=stream())


def _cfg(**changes) -> BenchConfig:
    base = dict(base_url="http://fake", model="m", num_prompts=12, random_input_len=8, random_output_len=4,
                disable_tqdm=True)
    return BenchConfig(**{**base, **changes})


def test_max_concurrency_caps_requests_in_flight() -> None:
    server = FakeServer()
    result = run_benchmark(_cfg(max_concurrency=3), transport=httpx.MockTransport(server))
    assert server.peak == 3
    assert server.calls == 13  # the initial test request, then 12
    m = result.metrics
    assert (m.completed, m.failed, m.total_output_tokens) == (12, 0, 48)
    assert m.peak_concurrent_requests <= 3
    assert len(m.to_dict()) > 20 and result.to_dict()["output_lens"] == [4] * 12


def test_rate_inf_sends_everything_at_once_and_failures_are_counted() -> None:
    server = FakeServer(fail_every=4)
    result = run_benchmark(_cfg(initial_test=False), transport=httpx.MockTransport(server))
    assert server.peak > 3  # no cap: 9 streams overlap
    assert (result.metrics.completed, result.metrics.failed) == (9, 3)
    assert all("HTTP 429" in o.error for o in result.outcomes if not o.success)


def test_initial_test_failure_stops_the_run_with_the_reason() -> None:
    server = FakeServer(fail_every=1)
    with pytest.raises(ValueError, match="initial test request .* failed: HTTP 429"):
        run_benchmark(_cfg(), transport=httpx.MockTransport(server))
    assert server.calls == 1


def test_cli_flags_build_the_config(tmp_path) -> None:
    from minillm.benchmark.serve import config_from_args

    args = build_parser().parse_args([
        "bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--request-rate", "inf",
        "--burstiness", "0.5", "--max-concurrency", "4", "--goodput", "ttft:500", "tpot:50",
        "--metric-percentiles", "50,90,99", "--extra-body", '{"top_k": 5}', "--ignore-eos"])
    cfg, shown = config_from_args(args)
    assert math.isinf(cfg.request_rate) and cfg.burstiness == 0.5 and cfg.max_concurrency == 4
    assert cfg.goodput == {"ttft": 500.0, "tpot": 50.0} and cfg.percentiles == (50.0, 90.0, 99.0)
    assert cfg.extra_body == {"top_k": 5} and cfg.ignore_eos and shown == ["ttft", "tpot", "itl", "e2el"]
    bad = build_parser().parse_args(["bench", "serve", "--base-url", "http://x", "--model", "m",
                                     "--extra-body", "[1]"])
    with pytest.raises(ValueError, match="JSON object"):
        config_from_args(bad)


# ----------------------------------------------------------------------------- paired A/B runs


def test_paired_difference_is_a_minus_b_pair_by_pair_with_an_interval() -> None:
    from minillm.benchmark.paired import paired_difference

    # A - B per pair: 1, 2, 3, 4, 10 ms; the third pair's A failed and is left out. The medians of A and
    # B alone (21 and 10 ms) are not what is asked: the pairs' own median is 3 ms.
    a = [0.011, 0.022, None, 0.013, 0.034, 0.050, 0.021]
    b = [0.010, 0.020, 0.005, 0.010, 0.030, 0.040, 0.019]
    pairs = paired_difference(a, b, seed=0)
    assert pairs.pairs == 6
    assert pairs.diffs_ms == pytest.approx([1, 2, 3, 4, 10, 2])
    assert pairs.median_ms == pytest.approx(2.5) and pairs.mean_ms == pytest.approx(22 / 6)
    assert 1 <= pairs.low_ms <= pairs.median_ms <= pairs.high_ms <= 10  # medians of resamples stay in range
    assert (pairs.p25_ms, pairs.p75_ms) == pytest.approx((2.0, 3.75))
    assert paired_difference(a, b, seed=0) == pairs  # seeded
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference(a, b[:-1])
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_difference([0.01, None], [0.01, 0.01])


def test_paired_verdict_reads_the_interval() -> None:
    from minillm.benchmark.paired import PairedDifference

    def pairs(low: float, median: float, high: float) -> PairedDifference:
        return PairedDifference(10, median, low, high, low, high, median, 0.95, 5.0, 4.0, [])

    assert pairs(0.5, 1.0, 1.9).verdict(2).startswith("met: at most 2 ms")
    assert pairs(2.1, 3.0, 4.0).verdict(2).startswith("missed: above 2 ms")
    assert pairs(0.5, 1.5, 2.5).verdict(2).startswith("met at the median, not shown at 95%")
    assert pairs(1.5, 2.5, 3.5).verdict(2).startswith("missed at the median, not shown at 95%")


class TwoHostServer:
    """Streams like FakeServer; host `slow` waits 40 ms more before its first chunk. Notes (host, prompt)
    in arrival order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.host, body["prompt"]))

        async def stream():
            await asyncio.sleep(0.040 if request.url.host == "slow" else 0.0)
            for _ in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' x'}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream())


def test_paired_run_sends_each_prompt_to_both_in_a_seeded_order() -> None:
    from minillm.benchmark.paired import pair_order
    from minillm.benchmark.serve import paired_sends

    server = TwoHostServer()
    cfg = _cfg(base_url="http://slow", paired_base_urls=["http://fast1", "http://fast2"], num_prompts=8,
               request_rate=1000.0)
    result = run_benchmark(cfg, transport=httpx.MockTransport(server))
    prompts = [r.prompt for r in result.requests]
    # The plan: pair k's two sends are neighbours with the same prompt, the B half to fast1 / fast2 in turn,
    # first where the seeded coin says so.
    plan = [(side, url.split("/")[2], req.prompt) for side, req, url in paired_sends(cfg, result.requests)]
    for k, b_first in enumerate(pair_order(8, cfg.seed)):
        a, b = (0, "slow", prompts[k]), (1, f"fast{k % 2 + 1}", prompts[k])
        assert plan[2 * k: 2 * k + 2] == ([b, a] if b_first else [a, b])
    assert len({bool(b) for b in pair_order(8, cfg.seed)}) == 2  # (both orders occur in this run)
    # What the server saw: every URL once first (the initial test), then each prompt once on each side.
    initial, sends = server.seen[:3], server.seen[3:]
    assert sorted(host for host, _ in initial) == ["fast1", "fast2", "slow"]
    assert sorted(sends) == sorted((host, prompt) for _, host, prompt in plan)
    assert result.metrics.completed == 8 and len(result.paired_outcomes) == 8
    assert result.paired.pairs == 8 and result.paired.median_ms > 20  # slow minus fast: the 40 ms wait
    saved = result.to_dict()
    assert saved["paired_ttft_ms"]["pairs"] == 8 and len(saved["paired_ttfts"]) == 8


def test_paired_flag_builds_the_config() -> None:
    from minillm.benchmark.serve import config_from_args

    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                                      "--paired-base-url", "http://127.0.0.1:10", "--paired-base-url",
                                      "http://127.0.0.1:11"])
    assert config_from_args(args)[0].paired_base_urls == ["http://127.0.0.1:10", "http://127.0.0.1:11"]
    with pytest.raises(ValueError, match="--paired-base-url must start with http"):
        _cfg(paired_base_urls=["127.0.0.1:10"]).validate()


# ----------------------------------------------------------------------------- against the real server


def _scrape(url: str, name: str) -> float:
    """Sum of one metric's samples on the server's /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


@pytest.mark.slow
def test_bench_serve_against_minillm_serve(tmp_path, capsys) -> None:
    from test_server import running_server

    from minillm.cli import main

    with running_server(max_num_seqs=4) as (url, _app):
        generated_before = _scrape(url, "vllm:generation_tokens_total")
        rc = main(["bench", "serve", "--base-url", url, "--model", "minillm", "--num-prompts", "12",
                   "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "6",
                   "--goodput", "ttft:600000", "tpot:600000", "--metric-percentiles", "50,99", "--disable-tqdm",
                   "--save-result", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
        generated = _scrape(url, "vllm:generation_tokens_total") - generated_before
        chat = run_benchmark(BenchConfig(base_url=url, model="minillm", backend="openai-chat", num_prompts=3,
                                         random_input_len=8, random_output_len=5, ignore_eos=True, disable_tqdm=True))
        ids = run_benchmark(BenchConfig(base_url=url, model="minillm", prompt_format="ids", num_prompts=3,
                                        random_input_len=8, random_output_len=5, ignore_eos=True, disable_tqdm=True))
        wrong_model = BenchConfig(base_url=url, model="no-such-model", num_prompts=2, disable_tqdm=True)
        with pytest.raises(ValueError, match="initial test request .* failed: HTTP 404"):
            run_benchmark(wrong_model)
        assert _scrape(url, "vllm:num_requests_running") == 0
    assert rc == 0
    report = capsys.readouterr().out
    for label in ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                  "Request goodput (req/s):", "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P50 E2EL (ms):"):
        assert label in report, label
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (12, 0)
    assert result["output_lens"] == [8] * 12  # ignore_eos: exactly max_tokens, as the server's usage says
    # The server counted the same tokens: 12 requests and the initial test request, 8 each.
    assert generated == 13 * 8
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs nobody misses
    assert result["max_concurrent_requests"] <= 6
    assert all(1 <= len(gaps) <= 7 for gaps in result["itls"])  # at most one gap per token after the first
    assert all(t > 0 for t in result["ttfts"]) and result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert chat.metrics.completed == 3 and chat.metrics.total_output_tokens == 15
    assert ids.metrics.completed == 3 and all(o.generated_text for o in ids.outcomes)


@pytest.mark.slow
def test_stub_server_timings_are_what_the_client_reads() -> None:
    """The stub sleeps 40 ms before the first chunk and 15 ms between chunks. Whatever the machine's
    load, no chunk can be read before it was sent: TTFT ≥ 40 ms and E2EL ≥ 40 + 4·15 ms. (A single
    gap may read shorter, when a stalled client reads two chunks at once, so gaps are only counted.)"""
    import socket
    import threading
    import time

    import uvicorn

    from minillm.benchmark.stub_server import create_stub_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_stub_app(ttft_ms=40, tpot_ms=15), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        result = run_benchmark(BenchConfig(base_url=url, model="stub", num_prompts=8, random_input_len=4,
                                           random_output_len=5, disable_tqdm=True))
        chat = run_benchmark(BenchConfig(base_url=url, model="stub", backend="openai-chat", num_prompts=2,
                                         random_input_len=4, random_output_len=3, disable_tqdm=True))
        refused = httpx.post(url + "/v1/completions", json={"model": "stub", "prompt": "x"})
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert result.metrics.completed == 8 and result.metrics.total_output_tokens == 40
    assert all(o.ttft_s >= 0.040 and o.latency_s >= 0.100 and len(o.itl_s) == 4 for o in result.outcomes)
    assert chat.metrics.completed == 2 and all(o.generated_text == " word" * 3 for o in chat.outcomes)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
