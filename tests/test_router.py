"""The router in front of real `minillm serve` processes on loopback ports (issue 17, points 1, 4, 5).

One `minillm serve --data-parallel-size 2` is started for the module (the real command: 2 replica
processes and its own router); the replicas' URLs are read from its output. In front of the same
replicas each test starts routers in this process (one per policy; no model, cheap). Checked:
greedy outputs through every policy equal a plain server's (streamed and not, completions and
chat, the official `openai` client); bad input gets the server's own errors; a worker that comes
back gets traffic again; a replica killed mid-load (last test): streams on it end with an error
event, requests not yet started go to the survivor, later requests succeed, and the survivor is
left with nothing running, waiting or holding KV. Every process started here is stopped here
(counted with psutil). CI cost: ~40-60 s on 2 shared cores, most of it the two replicas' start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from test_server_errors import BAD_INPUT

from minillm.router.app import HealthConfig, Router
from minillm.router.launch import free_port, listening_socket
from minillm.router.policies import POLICIES, make_policy

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("router")]

MAX_MODEL_LEN = 256


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@contextlib.contextmanager
def launched(argv: list[str], what: str):
    """`python -m minillm serve ARGV`, a launcher (replicas or a PD pair behind its router), until its router
    is up; yields (the launcher, its output lines); then SIGTERM (kill after 30 s), and no child is left."""
    before = _children()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("minillm router:") for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, f"{what} did not come up:\n" + "".join(lines)
            time.sleep(0.2)
        yield proc, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(5)
    time.sleep(0.5)
    assert _children() == before, "a process started by the test is still running"


@pytest.fixture(scope="module")
def replicas():
    """(launcher process, [replica URLs], {URL: pid}) of one `minillm serve --data-parallel-size 2`."""
    port = free_port()
    argv = ["--data-parallel-size", "2", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
            "8", "--enable-prefix-caching", "--policy", "round_robin", "--health-check-interval-secs", "0.5"]
    with launched(argv, "minillm serve --data-parallel-size 2") as (proc, lines):
        urls = [m.group(1) for line in lines if (m := re.match(r"minillm serve: (http://[\d.:]+)/v1", line))]
        assert len(urls) == 2
        pids = {}
        for child in psutil.Process(proc.pid).children():
            port_arg = child.cmdline()[child.cmdline().index("--port") + 1]
            pids[next(u for u in urls if u.endswith(":" + port_arg))] = child.pid
        # The launcher's own router answers too.
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "minillm", "prompt": "In the beginning", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        yield proc, urls, pids


@contextlib.contextmanager
def running_router(urls: list[str], policy: str, **health):
    """A router in a thread of this process on a free port; yields (base URL, Router)."""
    import uvicorn

    from minillm.router.app import create_router_app

    router = Router(urls, make_policy(policy), HealthConfig(**{"health_check_interval_secs": 0.3, **health}))
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", router
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _openai(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _four_answers(client) -> list:
    """Greedy completions and chat, streamed and not: the texts and finish reasons."""
    messages = [{"role": "user", "content": "Who made light?"}]
    out = []
    for prompt in ("And God said, Let there be light", "In the beginning"):
        c = client.completions.create(model="minillm", prompt=prompt, max_tokens=12, temperature=0.0)
        out.append((c.choices[0].text, c.choices[0].finish_reason))
        chunks = list(client.completions.create(model="minillm", prompt=prompt, max_tokens=12, temperature=0.0,
                                                stream=True))
        out.append(("".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].choices[0].finish_reason,
                    len(chunks)))  # the same number of events: passed through, not re-chunked
    c = client.chat.completions.create(model="minillm", messages=messages, max_tokens=10, temperature=0.0)
    out.append((c.choices[0].message.content, c.choices[0].finish_reason))
    chunks = list(client.chat.completions.create(model="minillm", messages=messages, max_tokens=10, temperature=0.0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    out.append(("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                chunks[-1].choices[0].finish_reason, len(chunks)))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_a_plain_servers_greedy_outputs(replicas, policy):
    _, urls, _ = replicas
    expected = _four_answers(_openai(urls[0]))
    assert all(answer[0] for answer in expected)
    with running_router(urls, policy) as (url, router):
        for _ in range(2):  # twice: round_robin and least_load then send to both replicas
            assert _four_answers(_openai(url)) == expected
        metrics = scrape(url)
        routed = {u: metrics[f'minillm_router_requests_total{{worker="{u}"}}'] for u in urls}
        assert sum(routed.values()) == 12
        if policy == "round_robin":
            assert routed == {urls[0]: 6, urls[1]: 6}
        if policy == "cache_aware":  # the second round repeats the first: the tree saw every text before
            assert metrics["minillm_router_prefix_match_rate"] >= 0.5
            assert metrics['minillm_router_decisions_total{decision="cache_hit",policy="cache_aware"}'] >= 6
        assert all(metrics[f'minillm_router_worker_healthy{{worker="{u}"}}'] == 1 for u in urls)
        assert all(metrics[f'minillm_router_worker_in_flight_requests{{worker="{u}"}}'] == 0 for u in urls)
        models = httpx.get(url + "/v1/models", timeout=30).json()
        assert models == httpx.get(urls[0] + "/v1/models", timeout=30).json()
        assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_bad_input_gets_the_servers_own_errors_and_the_router_lives_on(replicas):
    _, urls, _ = replicas
    with running_router(urls, "cache_aware") as (url, _):
        compared = 0
        for case, path, body, _, _, _ in BAD_INPUT:
            if "queue cap" in case:
                continue  # these replicas have no --max-num-queued-reqs: the request is fine here
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            direct = httpx.post(f"{urls[0]}/v1/{path}", timeout=60, **kw)
            routed = httpx.post(f"{url}/v1/{path}", timeout=60, **kw)
            assert routed.status_code == direct.status_code, case
            if direct.status_code != 200:  # an answer has its own id and time; an error is the same bytes
                assert routed.json() == direct.json(), case
            compared += direct.status_code != 200
        assert compared >= 30  # most of the server's bad-input cases are bad here too (no queue cap)
        assert httpx.post(url + "/v1/completions", content=b"\xff\xfe", timeout=30).status_code == 400
        assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_a_worker_that_comes_back_gets_traffic_again():
    """Stub workers (no model): one is down at first, gets nothing, then comes up and gets its turn."""
    import uvicorn

    from minillm.benchmark.stub_server import create_stub_app

    def start_stub(sock):
        server = uvicorn.Server(uvicorn.Config(create_stub_app(1, 1), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        return server, thread

    up_sock, down_port = listening_socket("127.0.0.1", 0), free_port()
    up_url, down_url = f"http://127.0.0.1:{up_sock.getsockname()[1]}", f"http://127.0.0.1:{down_port}"
    servers = [start_stub(up_sock)]
    body = {"model": "stub", "prompt": "x", "max_tokens": 2, "stream": True}
    try:
        with running_router([up_url, down_url], "round_robin", health_failure_threshold=1) as (url, router):
            for _ in range(4):  # the down worker refuses: each request goes to the other, none fails
                assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
            assert not router.workers[1].healthy
            metrics = scrape(url)
            assert metrics[f'minillm_router_requests_total{{worker="{up_url}"}}'] == 4
            assert metrics[f'minillm_router_worker_healthy{{worker="{down_url}"}}'] == 0
            servers.append(start_stub(listening_socket("127.0.0.1", down_port)))
            deadline = time.monotonic() + 30
            while not router.workers[1].healthy:
                assert time.monotonic() < deadline, "the recovered worker was never marked healthy"
                time.sleep(0.1)
            for _ in range(4):
                assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
            assert scrape(url)[f'minillm_router_requests_total{{worker="{down_url}"}}'] == 2
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(15)


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, started: asyncio.Event | None = None) -> str:
    body = {"model": "minillm", "prompt": "And the LORD spake unto Moses", "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return "done" if chunks else "empty"
            chunk = json.loads(data)
            if "error" in chunk:
                return "error: " + chunk["error"]["message"]
            chunks += 1
            if started is not None and chunks == 2:
                started.set()
    return "cut off"


def _worker_gauges(url: str, deadline_s: float = 30) -> list[float]:
    """running, waiting, KV usage of a worker, once all are 0 (or at the deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        values = scrape(url)
        gauges = [values[f'vllm:{g}{{model_name="minillm"}}']
                  for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if gauges == [0, 0, 0] or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def test_a_client_hanging_up_through_the_router_aborts_on_the_worker(replicas):
    _, urls, _ = replicas
    def aborted() -> float:
        return sum(v for k, v in scrape(urls[0]).items()
                   if k.startswith("vllm:request_success_total") and 'finished_reason="abort"' in k)

    before = aborted()
    with running_router(urls[:1], "round_robin") as (url, router):
        body = {"model": "minillm", "prompt": "In the beginning", "max_tokens": 200, "temperature": 0.0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # hang up mid-stream
        assert _worker_gauges(urls[0]) == [0, 0, 0]
        assert aborted() == before + 1  # stopped by the hang-up, not run to its 200 tokens
        deadline = time.monotonic() + 10
        while router.workers[0].in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.workers[0].in_flight == 0


def test_a_replica_killed_mid_load(replicas):
    """Runs last in the module: it kills one of the module's replicas."""
    _, urls, pids = replicas
    victim, survivor = urls[1], urls[0]
    # No periodic check during the test (only the one at start): the refused request alone must
    # take the dead replica out, so the count below does not depend on when a check runs.
    with running_router(urls, "round_robin", health_check_interval_secs=60) as (url, router):

        async def load():
            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                started = [asyncio.Event() for _ in range(6)]
                first = [asyncio.create_task(_stream(client, url, 200, e)) for e in started]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                on_victim = router.workers[1].in_flight
                os.kill(pids[victim], signal.SIGKILL)
                # Sent right after the kill, before any health check can notice: round robin picks the
                # dead replica for some of these, whose connection is refused, and they go to the survivor.
                later = [asyncio.create_task(_stream(client, url, 8)) for _ in range(6)]
                return on_victim, await asyncio.wait_for(asyncio.gather(*first), 120), \
                    await asyncio.wait_for(asyncio.gather(*later), 120)

        on_victim, first, later = asyncio.run(load())
        assert on_victim == 3
        died = [r for r in first if r.startswith("error:")]
        assert len(died) == 3 and all(victim in r and "died while streaming" in r for r in died), first
        assert first.count("done") == 3 and later == ["done"] * 6, (first, later)
        assert not router.workers[1].healthy
        metrics = scrape(url)
        assert metrics[f'minillm_router_request_errors_total{{worker="{victim}"}}'] >= 4  # 3 streams + a refusal
        assert metrics[f'minillm_router_worker_in_flight_requests{{worker="{survivor}"}}'] == 0
        assert httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": "minillm", "prompt": "In", "max_tokens": 3}).status_code == 200
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert _worker_gauges(survivor) == [0, 0, 0]  # nothing running, waiting or holding KV
