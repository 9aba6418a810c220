"""What a router hop costs, checked by structure rather than by the clock (issue 29, item 5).

Stub workers (plain ASGI apps in threads of this process, no model) that record what they receive
and hold their answers until the test releases them:

- the plain router keeps one connection to a worker for sequential requests (the stub counts its
  peers' addresses; a client without a pool is seen to open one per request, so the count can fail),
  passes a stream's bytes through unmodified (non-ASCII, an event split across chunks) and does not
  buffer them: the client reads the first chunk while the stub still holds the second;
- its answers (plain, streamed, PD) carry one `date` and one `server` header, its own: the worker's are
  not passed on;
- its histograms on /metrics count every request, and TTFT as the client sees it contains the
  worker's own (arrival -> written encloses sent -> received, request by request);
- the PD router (a real `minillm router --pd` process) sends the prefill's first token to the client
  while the decode stub has not answered at all, then the decode's stream less what the client has:
  the same text and events as the decode's stream alone, one id throughout; with `stop` it relays
  the decode's stream byte for byte; its start-up line names no routing policy.
CI cost: a few seconds plus one router process's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from test_router import running_router, scrape

from minillm.router.launch import free_port, listening_socket, stop_replicas
from minillm.router.pd_first_token import FirstTokenSplice, SpliceMismatch, first_token_events

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("router")]

GATE_S = 30  # how long a stub holds its answer for the test at most


class Stub:
    """A worker that records (peer, path, headers, body) per request and answers with `handler`."""

    def __init__(self, handler) -> None:
        self.handler, self.seen, self.gate = handler, [], threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["client"], scope["path"], headers, body))
        await self.handler(self, headers, json.loads(body), send)

    async def hold(self) -> None:
        """Wait until the test sets the gate (a worker still computing)."""
        assert await asyncio.to_thread(self.gate.wait, GATE_S), "the test never released the stub"


@contextlib.contextmanager
def serving(app):
    import uvicorn

    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the stub did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def sse(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


# ---- the plain router ------------------------------------------------------------------------------
FIRST = sse({"id": "cmpl-1", "choices": [{"index": 0, "text": " héllo ✓", "finish_reason": None}]})
REST = sse({"id": "cmpl-1", "choices": [{"index": 0, "text": " wörld", "finish_reason": "length"}]}) + sse("[DONE]")
SPLIT = 7  # the second event goes out in two pieces, cut inside its JSON


async def streaming_worker(stub: Stub, headers: dict, body: dict, send) -> None:
    if not body.get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"echo": body}).encode()})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": FIRST, "more_body": True})
    if body.get("hold"):
        await stub.hold()
    await send({"type": "http.response.body", "body": REST[:SPLIT], "more_body": True})
    await send({"type": "http.response.body", "body": REST[SPLIT:]})


def one_date_and_server(r: httpx.Response) -> None:
    """The router's own `date` and `server` only: the stub (uvicorn) sends its own too, which are not passed on."""
    assert len(r.headers.get_list("date")) == 1 and len(r.headers.get_list("server")) == 1, r.headers


def _first_then_rest(url: str, stub: Stub) -> bytes:
    """Read the first event through `url` while the stub holds the rest, then release it; all bytes read."""
    stub.gate.clear()
    got = b""
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True, "hold": True},
                      timeout=GATE_S / 2) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        one_date_and_server(r)
        chunks = r.iter_raw()
        while len(got) < len(FIRST):
            got += next(chunks)  # (a router that buffered would time out here: the stub holds the rest)
        assert got == FIRST
        stub.gate.set()
        for chunk in chunks:
            got += chunk
    return got


def test_one_kept_alive_connection_and_a_stream_passed_through_unbuffered_byte_for_byte():
    stub = Stub(streaming_worker)
    with serving(stub) as worker:
        for _ in range(3):  # the control: a client that keeps no pool opens a connection per request
            httpx.post(worker + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert len({peer for peer, *_ in stub.seen}) == 3
        stub.seen.clear()
        with running_router([worker], "round_robin", health_check_interval_secs=60) as (url, router):
            n = 4
            for _ in range(n):
                assert _first_then_rest(url, stub) == FIRST + REST
            metrics, w = scrape(url), f'worker="{worker}"'
            # arrival -> first bytes written encloses request sent -> first bytes back, request by request
            assert metrics[f"minillm_router_time_to_first_token_seconds_sum{{{w}}}"] >= \
                metrics[f"minillm_router_worker_time_to_first_token_seconds_sum{{{w}}}"] > 0
            plain = httpx.post(url + "/v1/completions", content=b'{"prompt": "\xc3\xa9", "max_tokens": 2}',
                               headers={"content-type": "application/json", "x-custom": "kept"}, timeout=30)
            assert plain.json() == {"echo": {"prompt": "é", "max_tokens": 2}}
            one_date_and_server(plain)
            posts = [s for s in stub.seen if s[1] == "/v1/completions"]
            assert len(posts) == n + 1 and posts[-1][3] == b'{"prompt": "\xc3\xa9", "max_tokens": 2}'  # as sent
            assert posts[-1][2]["x-custom"] == "kept"
            assert len({peer for peer, *_ in posts}) == 1, "the router opened more than one connection"

            metrics = scrape(url)
            assert metrics[f"minillm_router_time_to_first_token_seconds_count{{{w}}}"] == n  # streams only
            for name in ("e2e_request_latency", "worker_time_to_first_token", "routing_latency"):
                assert metrics[f"minillm_router_{name}_seconds_count{{{w}}}"] == n + 1, name
            assert f'minillm_router_time_to_first_token_seconds_bucket{{le="0.0005",{w}}}' in metrics
            assert f'minillm_router_time_to_first_token_seconds_bucket{{le="0.0125",{w}}}' in metrics
            assert router.workers[0].in_flight == 0


def test_paired_bench_serve_sends_every_prompt_through_the_router_and_directly():
    """`bench/router.py hops`'s measure, on a stub: `minillm bench serve --paired-base-url` with the router as
    --base-url and its worker as the paired URL. Every prompt reaches the worker twice, once through the router;
    the pairs' TTFT difference is computed over all of them."""
    from minillm.benchmark.serve import BenchConfig, run_benchmark

    stub = Stub(streaming_worker)
    with serving(stub) as worker:
        with running_router([worker], "round_robin", health_check_interval_secs=60) as (url, router):
            cfg = BenchConfig(base_url=url, model="stub", paired_base_urls=[worker], num_prompts=6,
                              random_input_len=8, random_output_len=2, request_rate=50.0, disable_tqdm=True)
            result = run_benchmark(cfg)
            routed = scrape(url)[f'minillm_router_requests_total{{worker="{worker}"}}']
            assert router.workers[0].in_flight == 0
    assert result.metrics.completed == 6 and all(o.success for o in result.paired_outcomes)
    assert result.paired.pairs == 6 and len(result.paired.diffs_ms) == 6
    assert routed == 6 + 1  # the routed half and its initial test request
    prompts = [json.loads(body)["prompt"] for _, path, _, body in stub.seen if path == "/v1/completions"]
    assert len(prompts) == 2 * (6 + 1)
    assert sorted(set(prompts)) == sorted({r.prompt for r in result.requests})
    assert all(prompts.count(p) == 2 for p in set(prompts) - {result.requests[0].prompt})  # (the first: 4, tests)
    # both halves read the same answer
    assert [o.generated_text for o in result.outcomes] == [o.generated_text for o in result.paired_outcomes]


# ---- the PD router ---------------------------------------------------------------------------------
def _text_chunk(rid: str, chat: bool, text: str, finish: str | None) -> dict:
    choice = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": 2,
            "model": "stub", "choices": [choice]}


WORDS = [" Hello", " wide", " world"]


async def prefill_worker(stub: Stub, headers: dict, body: dict, send) -> None:
    assert body["stream"] is False and body["kv_transfer_params"]["do_remote_decode"]
    chat = "messages" in body
    rid = ("chatcmpl-" if chat else "cmpl-") + headers["x-request-id"]
    choice = {"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    choice.update({"message": {"role": "assistant", "content": WORDS[0]}} if chat else {"text": WORDS[0]})
    answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": 1, "model": "stub",
              "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def decode_events(rid: str, chat: bool) -> list[bytes]:
    """What the decode instance streams: (chat: the role chunk), token 1 again, the rest, [DONE]."""
    out = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        out.append(sse({"id": rid, "object": "chat.completion.chunk", "created": 2, "model": "stub",
                        "choices": [role]}))
    for i, word in enumerate(WORDS):
        out.append(sse(_text_chunk(rid, chat, word, "length" if i == len(WORDS) - 1 else None)))
    return out + [sse("[DONE]")]


async def decode_worker(stub: Stub, headers: dict, body: dict, send) -> None:
    assert body["kv_transfer_params"]["do_remote_prefill"]
    await stub.hold()  # pulling the K/V: nothing sent, not even the status line
    rid = ("chatcmpl-" if "messages" in body else "cmpl-") + headers["x-request-id"]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    events = decode_events(rid, "messages" in body)
    for i, event in enumerate(events):  # (the first two events in three pieces: the splice reassembles them)
        pieces = [event[:5], event[5:]] if i < 2 else [event]
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@contextlib.contextmanager
def pd_router(prefill: str, decode: str):
    """`python -m minillm router --pd` on a free port; yields (URL, its start-up line)."""
    before = _children()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "router", "--pd", "--prefill", prefill, "--decode",
                             decode, "--port", str(port), "--health-check-interval-secs", "60"],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()  # printed once the socket listens
        assert line.startswith("minillm router:"), line + proc.stdout.read()
        yield f"http://127.0.0.1:{port}", line
    finally:
        stop_replicas([(proc, "router")], 30)  # SIGTERM, then SIGKILL after 30 s
        proc.stdout.close()
    assert _children() == before


def _events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def _pd_stream(url: str, chat: bool, decode: Stub, **extra) -> tuple[bytes, bytes]:
    """(bytes read before the decode stub was released, all bytes read)."""
    body = {"model": "stub", "max_tokens": 3, "stream": True, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    early, sent_early = b"", "stop" not in extra
    if sent_early:
        decode.gate.clear()
    else:
        decode.gate.set()  # (the router waits for the decode's status line before its own)
    with httpx.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                      timeout=GATE_S / 2) as r:
        assert r.status_code == 200
        one_date_and_server(r)
        chunks = r.iter_raw()
        if sent_early:
            while early.count(b"\n\n") < (2 if chat else 1):  # the first token's event(s), decode still held
                early += next(chunks)
        decode.gate.set()
        got = early + b"".join(chunks)
    return early, got


def test_pd_router_sends_the_first_token_before_the_decode_instance_answers():
    prefill, decode = Stub(prefill_worker), Stub(decode_worker)
    with serving(prefill) as prefill_url, serving(decode) as decode_url, \
            pd_router(prefill_url, decode_url) as (url, line):
        assert "policy" not in line and prefill_url in line and decode_url in line, line
        for chat in (False, True):
            early, got = _pd_stream(url, chat, decode, stream_options={"include_usage": False})
            rid = json.loads(_events(got)[0][6:])["id"]
            expected = decode_events(rid, chat)
            events = _events(got)
            assert len(events) == len(expected) and events[-1] == b"data: [DONE]\n\n"  # as many events
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert {c["id"] for c in chunks} == {rid} and rid.endswith(prefill.seen[-1][2]["x-request-id"])
            key = (lambda c: c["choices"][0]["delta"].get("content", "")) if chat else \
                (lambda c: c["choices"][0]["text"])
            assert "".join(map(key, chunks)) == "".join(WORDS)
            assert events[len(events) - 3:] == expected[len(expected) - 3:]  # after token 1: the decode's bytes
            assert json.loads(early.split(b"\n\n")[-2][6:])["choices"][0]["finish_reason"] is None
            if chat:
                assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            (_, _, p_headers, p_body), (_, _, d_headers, d_body) = prefill.seen[-1], decode.seen[-1]
            transfer = json.loads(p_body)["kv_transfer_params"]["transfer_id"]
            assert json.loads(d_body)["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": transfer}
            assert p_headers["x-request-id"] == d_headers["x-request-id"]
        # With stop strings the first token is not sent early: the decode's stream, byte for byte.
        _, got = _pd_stream(url, False, decode, stop=["\n\n"])
        assert got == b"".join(decode_events(json.loads(_events(got)[0][6:])["id"], False))
        metrics = scrape(url)
        assert metrics[f'minillm_router_time_to_first_token_seconds_count{{worker="{prefill_url}"}}'] == 2
        assert metrics[f'minillm_router_time_to_first_token_seconds_count{{worker="{decode_url}"}}'] == 1
        assert metrics[f'minillm_router_worker_in_flight_requests{{worker="{decode_url}"}}'] == 0


# ---- the splice alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_the_splice_drops_exactly_what_the_client_has_however_the_bytes_are_cut(chat):
    stream = b"".join(decode_events("x", chat))
    expected = None
    for cut in range(1, len(stream)):
        splice = FirstTokenSplice(WORDS[0], chat)
        out = splice.feed(stream[:cut]) + splice.feed(stream[cut:])
        expected = expected or out
        assert out == expected, cut
    assert expected == b"".join(decode_events("x", chat)[2 if chat else 1:])
    # max_tokens=1: token 1 is also the last; its finish reason still reaches the client, with no text
    last = sse(_text_chunk("x", chat, WORDS[0], "length"))
    out = FirstTokenSplice(WORDS[0], chat).feed(last)
    assert json.loads(out[6:])["choices"][0]["finish_reason"] == "length" and WORDS[0].encode() not in out
    with pytest.raises(SpliceMismatch):
        FirstTokenSplice(" Bye", chat).feed(stream)


def test_first_token_is_sent_early_only_where_one_servers_stream_would_match():
    answer = json.dumps({"id": "cmpl-1", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": " Hi", "finish_reason": "length"}]}).encode()
    events, text = first_token_events({"stream": True}, False, answer)
    assert text == " Hi" and json.loads(events[6:])["choices"][0]["finish_reason"] is None
    assert first_token_events({"stream": True, "stream_options": {"include_usage": True}}, False, answer)[0] \
        .count(b'"usage": null') == 1
    for request in ({"stream": False}, {}, {"stream": True, "stop": "\n"},
                    {"stream": True, "stream_options": {"continuous_usage_stats": True}}):
        assert first_token_events(request, False, answer) is None, request
    for text, finish in ((" Hi", "stop"), ("", "length"), ("\ufffd", "length")):
        other = json.dumps({"id": "c", "created": 1, "model": "m",
                            "choices": [{"text": text, "finish_reason": finish}]}).encode()
        assert first_token_events({"stream": True}, False, other) is None, (text, finish)
