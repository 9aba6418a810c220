"""Clients that hang up mid-stream, and a server that must not grow with uptime.

64 concurrent streaming requests (more than max_num_seqs=16, so some wait), a third of them
disconnecting at seeded random points: afterwards vllm:num_requests_running and
vllm:kv_cache_usage_perc read 0, every disconnected request was aborted, and the server answers.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from test_server import running_server


@pytest.fixture(scope="module")
def server():
    with running_server(max_num_seqs=16, max_model_len=256) as (url, app):
        yield url, app


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def gauge(values: dict, name: str) -> float:
    return values[f'{name}{{model_name="minillm"}}']


async def one_stream(http: httpx.AsyncClient, url: str, max_tokens: int, hang_up_after: int | None) -> str:
    """Stream a completion; with `hang_up_after`, close the connection after that many chunks."""
    body = {"model": "minillm", "prompt": "And the LORD spake", "max_tokens": max_tokens, "temperature": 0.8,
            "seed": max_tokens, "stream": True, "ignore_eos": True}
    chunks = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return "hung up"
            elif line == "data: [DONE]":
                return f"done after {chunks}"
    return "closed by server"


@pytest.mark.slow
def test_64_streams_a_third_hanging_up_leave_nothing_behind(server):
    url, app = server
    rng = random.Random(11)
    plan = []
    for i in range(64):
        max_tokens = rng.randint(20, 60)
        hang = rng.randint(1, max_tokens - 5) if i % 3 == 0 else None
        plan.append((max_tokens, hang))
    before = scrape(url)

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one_stream(http, url, m, h) for m, h in plan))

    results = asyncio.run(main())
    hung = [r for r in results if r == "hung up"]
    assert len(hung) == sum(1 for _, h in plan if h is not None) == 22
    # Every stream that stayed read to the end, `data: [DONE]` included.
    assert all(r.startswith("done after") for r, (_, h) in zip(results, plan) if h is None)

    # The engine applies the aborts at its next step; give it that long (not a timing assertion).
    deadline = time.monotonic() + 30
    while True:
        after = scrape(url)
        if gauge(after, "vllm:num_requests_running") == 0 and gauge(after, "vllm:num_requests_waiting") == 0:
            break
        assert time.monotonic() < deadline, "requests still running 30 s after every client left"
        time.sleep(0.05)
    assert gauge(after, "vllm:kv_cache_usage_perc") == 0.0
    engine, client = app.state.client.engine, app.state.client
    assert engine.kv.usage().reserved_tokens == 0 and not engine.requests
    assert client.num_in_flight == 0 and client.snapshot()["num_streams"] == 0

    def delta(reason):
        key = f'vllm:request_success_total{{finished_reason="{reason}",model_name="minillm"}}'
        return after[key] - before[key]

    # Every request ended exactly once. A client reads behind the server (chunks wait in socket
    # buffers), so a hang-up can come after its request already finished there: then it counts as
    # "length", not "abort". The hang-ups here come at least 5 chunks early, so most are aborts.
    assert delta("abort") + delta("length") == 64
    assert 0 < delta("abort") <= len(hung)
    r = httpx.post(url + "/v1/completions", json={"prompt": "In the beginning", "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_nothing_grows_with_uptime(server):
    """Finished requests leave no state: the engine's per-request records, the client's streams,
    the step records (capped) and the Prometheus series count stay put however many requests ran."""
    url, app = server
    engine, client = app.state.client.engine, app.state.client
    body = {"prompt": "In the beginning", "max_tokens": 4, "temperature": 0.0}

    def burst(n):
        with httpx.Client(timeout=30) as http:
            for _ in range(n):
                assert http.post(url + "/v1/completions", json=body).status_code == 200

    burst(5)
    series_before = len(scrape(url))
    burst(60)
    series_after = len(scrape(url))
    assert series_after == series_before
    assert len(engine.metrics.requests) == 0 and not engine.requests
    assert len(engine.metrics.steps) <= 256
    assert client.snapshot() == {"num_in_flight": 0, "num_streams": 0}
    assert len(engine.scheduler.waiting) == 0 and len(engine.scheduler.running) == 0


def test_a_non_streamed_request_whose_client_left_is_aborted(server):
    """The engine thread is held (a command waiting on an event) so the request cannot finish
    before its client gives up; the server notices the hang-up and aborts it."""
    import threading

    url, app = server
    client = app.state.client
    before = scrape(url)
    gate = threading.Event()
    client.engine.call_soon(lambda: gate.wait(60))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "In the beginning", "max_tokens": 200,
                                                      "ignore_eos": True}, timeout=0.3)
        # The handler polls for a hang-up every 0.5 s while it has no output; then it queues the
        # abort behind the add, both waiting in the held engine's inbox.
        deadline = time.monotonic() + 30
        while client.engine.inbox.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.engine.inbox.qsize() == 2
    finally:
        gate.set()
    deadline = time.monotonic() + 30
    while client.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(url)
    key = 'vllm:request_success_total{{finished_reason="{}",model_name="minillm"}}'
    assert after[key.format("abort")] - before[key.format("abort")] == 1
    assert after[key.format("length")] == before[key.format("length")]
    assert client.num_in_flight == 0
