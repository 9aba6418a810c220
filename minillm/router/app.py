"""The router: one OpenAI-compatible endpoint in front of several `minillm serve` workers (chapter 13).

    POST /v1/completions, /v1/chat/completions   proxied to the worker the policy picks
    GET  /v1/models                              proxied to a healthy worker
    GET  /health                                 200 while at least one worker is healthy
    GET  /metrics                                the router's own Prometheus metrics

The body goes to the worker byte for byte and the answer comes back as it is: a server-sent-event
stream is passed through chunk by chunk as the worker writes it (no re-framing, no buffering), so
a client measures the worker's timing plus one loopback hop. Bad input is the worker's to judge,
so the router's errors for it are the server's own.

The hop is kept cheap, because on a few cores the router's CPU is taken from the engines: the two
proxied routes are plain ASGI (`RouterApp`: no request model, no validation, no response class, one
task per request that notices a client hanging up), the request goes out through the router's own
kept-alive HTTP/1.1 connections (`minillm.router.upstream`), the body is parsed only by a policy
that reads text (`cache_aware`), and each chunk of the answer is written to the client as received,
several at once if several arrived. The other routes are a small FastAPI app.

Health: every `health_check_interval_secs` each worker's /health is asked (SGLang's flag names);
`health_failure_threshold` failures in a row mark it unhealthy (no traffic; its part of the
cache-aware tree is forgotten), `health_success_threshold` successes mark it healthy again. A
refused connection (or one closed before any answer) marks a worker unhealthy at once, and the
request, of which the client has seen nothing, goes to another worker. A worker that dies while
answering is not retried (the client may hold part of the answer): a plain request gets 502, a
stream gets an error event and `data: [DONE]`, so no client hangs. A client that hangs up closes
the router's connection to the worker, which then aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from minillm.router.metrics import RouterMetrics
from minillm.router.policies import Policy
from minillm.router.upstream import (
    ClosedBeforeAnswer,
    ConnectFailed,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)
from minillm.server.errors import error_body, error_response, unexpected_error_handler

# Not passed on, either way: the connection's own (each side of the router has its own connection), and
# `expect` (the router has the whole body already; a worker's `100 Continue` would be an extra answer).
HOP_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive",
                         b"expect", b"upgrade", b"te", b"trailer", b"proxy-connection"})
# Nor, from a worker's answer, its `date` and `server`: uvicorn writes the router's own on every answer (nginx's
# proxy drops the upstream's likewise), and passed on they reached the client twice.
ANSWER_DROPPED = HOP_HEADERS | {b"date", b"server"}


@dataclass
class HealthConfig:
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    request_timeout_secs: float = 600.0


class Worker:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = True  # until a check or a refused connection says otherwise
        self.in_flight = 0
        self.failures = self.successes = 0
        self.pool = UpstreamPool(self.url)
        self.series = None  # its metrics (RouterMetrics.of), set by the router


class ErrorAnswer(Exception):
    """The router's own error answer (no worker's), raised before the client's response has started."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


class Call:
    """One proxied request's state: whether its response has started, has ended, or its client has left."""

    __slots__ = ("started", "finished", "gone")

    def __init__(self) -> None:
        self.started = self.finished = self.gone = False


def stream_error(status: int, message: str) -> bytes:
    """The end of a stream that failed after its start: an error event, then `[DONE]`, so no client hangs."""
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


def routing_text(body: bytes, chat: bool) -> str:
    """The text the policy matches on: the prompt, or the messages' contents in order. A body
    that is not the expected JSON gives "" (the worker will answer it with the proper error)."""
    try:
        data = json.loads(body)
        if chat:
            parts = []
            for m in data.get("messages") or []:
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role', '')}:{content or ''}\n")
            return "".join(parts)
        prompt = data.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    except (ValueError, AttributeError, TypeError):
        return ""


def forwarded(headers: list[tuple[bytes, bytes]],
              dropped: frozenset[bytes] = HOP_HEADERS) -> list[tuple[bytes, bytes]]:
    """The headers passed on, less `dropped` (names as ASGI and httptools give them; the router's side
    lower-cases). A worker's answer passes `ANSWER_DROPPED`."""
    return [(k, v) for k, v in headers if k.lower() not in dropped]


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


async def read_body(receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError  # (the client left while sending; `handle` ends quietly)
        parts.append(message.get("body", b""))
    return b"".join(parts)


async def send_answer(call: Call, send, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
    """A whole answer: status, headers (plus its length), body."""
    call.started = True
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(content))]})
    await send({"type": "http.response.body", "body": content})


async def send_error(call: Call, send, err: ErrorAnswer) -> None:
    headers = [(b"content-type", b"application/json")] + ([(b"retry-after", b"1")] if err.retry_after else [])
    await send_answer(call, send, err.status, headers, json.dumps(error_body(err.status, err.message, err.param)).encode())


class Router:
    def __init__(self, worker_urls: list[str], policy: Policy, health: HealthConfig | None = None) -> None:
        if not worker_urls:
            raise ValueError("the router needs at least one --worker URL")
        bad = [u for u in worker_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"--worker must be a URL starting with http:// or https://, got {bad[0]!r}")
        if len(set(u.rstrip("/") for u in worker_urls)) != len(worker_urls):
            raise ValueError(f"--worker URLs must differ, got {worker_urls}")
        self.workers = [Worker(u) for u in worker_urls]
        self.policy = policy
        self.uses_text = getattr(policy, "uses_text", True)  # (a policy that does not say is given the text)
        self.health = health or HealthConfig()
        self.timeout_s = self.health.request_timeout_secs
        self.metrics = RouterMetrics(self.workers, policy)
        for w in self.workers:
            w.series = self.metrics.of(w.url)

    def describe(self) -> str:
        """What the start-up line says the router does."""
        return f"{len(self.workers)} workers ({', '.join(w.url for w in self.workers)}), policy {self.policy.name}"

    # ---- health --------------------------------------------------------------------------------
    def healthy_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def mark_unhealthy(self, worker: Worker) -> None:
        if worker.healthy:
            worker.healthy = False
            self.policy.remove_worker(worker.url)
        worker.successes = 0

    async def get(self, worker: Worker, path: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A GET to `worker` (its /health, /v1/models): status, headers, body; UpstreamError if it fails."""
        response = await worker.pool.request(b"GET", path, [], b"", self.health.health_check_timeout_secs)
        try:
            return response.status, response.headers, await response.read_all()
        finally:
            response.close()

    async def check(self, worker: Worker) -> None:
        try:
            ok = (await self.get(worker, b"/health"))[0] == 200
        except UpstreamError:
            ok = False
        if ok:
            worker.failures, worker.successes = 0, worker.successes + 1
            if not worker.healthy and worker.successes >= self.health.health_success_threshold:
                worker.healthy = True
        else:
            worker.failures += 1
            if worker.failures >= self.health.health_failure_threshold:
                self.mark_unhealthy(worker)
            worker.successes = 0

    async def background(self) -> None:
        """Health checks, and the policy's eviction when its interval has passed."""
        interval = self.policy.eviction_interval_secs
        last_eviction = time.monotonic()
        while True:
            await asyncio.gather(*(self.check(w) for w in self.workers))
            if interval is not None and time.monotonic() - last_eviction >= interval:
                self.policy.evict()
                last_eviction = time.monotonic()
            await asyncio.sleep(self.health.health_check_interval_secs)

    def close(self) -> None:
        for w in self.workers:
            w.pool.close()

    # ---- proxy ---------------------------------------------------------------------------------
    async def handle(self, scope, receive, send, path: bytes, chat: bool) -> None:
        """One proxied request, from the client's ASGI scope to the last byte of its answer. A task waits
        for the client to hang up meanwhile: then this one is cancelled, which closes the worker's
        connection (`forward`'s `finally`), and the worker aborts the request."""
        arrival = time.perf_counter()
        call, task = Call(), asyncio.current_task()
        watch = None
        try:
            body = await read_body(receive)
            watch = asyncio.ensure_future(receive())

            def hung_up(done: asyncio.Future) -> None:
                if call.finished or done.cancelled() or done.exception() is not None:
                    return
                if done.result()["type"] == "http.disconnect":
                    call.gone = True
                    task.cancel()

            watch.add_done_callback(hung_up)
            await self.forward(call, scope, body, send, path, chat, arrival)
        except ErrorAnswer as err:
            await send_error(call, send, err)
        except asyncio.CancelledError:
            if not call.gone and watch is not None:
                raise  # (not the client: the server is stopping)
        except Exception as err:  # a bug: answer 500 if the answer has not started; the router lives on
            if call.started:
                raise
            await send_error(call, send, ErrorAnswer(500, f"internal error: {type(err).__name__}: {err}"))
        finally:
            call.finished = True
            if watch is not None and not watch.done():
                watch.cancel()

    async def forward(self, call: Call, scope, body: bytes, send, path: bytes, chat: bool, arrival: float) -> None:
        # no JSON parse where the policy reads no text
        text = routing_text(body, chat) if self.uses_text else ""
        headers = forwarded(scope["headers"])
        tried: set[str] = set()
        while True:
            candidates = [w for w in self.workers if w.healthy and w.url not in tried]
            if not candidates:
                raise ErrorAnswer(503, f"no healthy worker to take the request (workers: "
                                       f"{', '.join(w.url for w in self.workers)}); retry later", retry_after=True)
            url = self.policy.choose(text, [w.url for w in candidates], {w.url: w.in_flight for w in candidates})
            worker = next(w for w in candidates if w.url == url)
            tried.add(url)
            series = worker.series
            worker.in_flight += 1
            try:
                sent = time.perf_counter()
                series.routing.observe(sent - arrival)
                try:
                    response = await worker.pool.request(b"POST", path, headers, body, self.timeout_s)
                except (ConnectFailed, ClosedBeforeAnswer):
                    # Refused, or closed without a byte of answer (a worker dying while accepting): the
                    # client has seen nothing and generation changes no state, so another worker takes it.
                    series.errors.inc()
                    self.mark_unhealthy(worker)
                    continue
                except UpstreamError as err:  # a timeout: the worker may still be working on it
                    series.errors.inc()
                    raise ErrorAnswer(504 if isinstance(err, UpstreamTimeout) else 502,
                                      f"worker {worker.url} failed before answering: {type(err).__name__}: {err}") \
                        from None
                series.routed.inc()
                try:
                    await self.relay(call, worker, response, send, arrival, sent)
                finally:
                    response.close()  # (a client gone: the connection is closed, and the worker aborts)
                return
            finally:
                worker.in_flight -= 1

    async def relay(self, call: Call, worker: Worker, response, send, arrival: float, sent: float) -> None:
        """The worker's answer as the client's: read whole if plain, else each chunk written as it arrives
        (the bytes as the worker wrote them, less the chunked framing both sides redo)."""
        series = worker.series
        headers = forwarded(response.headers, ANSWER_DROPPED)
        if not is_event_stream(response.headers):
            try:
                content = await response.read_all()
            except UpstreamError as err:
                series.errors.inc()
                raise ErrorAnswer(502, f"worker {worker.url} died while answering: {type(err).__name__}: {err}") \
                    from None
            series.worker_ttft.observe(time.perf_counter() - sent)
            await send_answer(call, send, response.status, headers, content)
            series.e2e.observe(time.perf_counter() - arrival)
            return
        call.started = True
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        try:
            chunk = await response.read_chunk()  # the first bytes (b"" only if the answer is empty)
            if chunk:
                series.worker_ttft.observe(time.perf_counter() - sent)
            last = response.at_end  # the worker's answer is complete: this chunk also ends the client's
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if chunk:
                series.ttft.observe(time.perf_counter() - arrival)
            while not last:  # the rest: per chunk one read, one write, nothing else
                chunk = await response.read_chunk()
                last = response.at_end
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        except UpstreamError as err:
            series.errors.inc()
            await send({"type": "http.response.body", "body": stream_error(
                502, f"worker {worker.url} died while streaming: {type(err).__name__}: {err}")})
        finally:
            series.e2e.observe(time.perf_counter() - arrival)

    async def models(self) -> Response:
        for worker in self.healthy_workers():
            try:
                status, headers, content = await self.get(worker, b"/v1/models")
            except UpstreamError:
                continue
            media = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), None)
            return Response(content, status_code=status, media_type=media)
        return error_response(503, "no healthy worker to list the models")


PROXIED = {"/v1/completions": (b"/v1/completions", False), "/v1/chat/completions": (b"/v1/chat/completions", True)}


class RouterApp:
    """The router's ASGI app: a POST to a proxied route goes straight to `Router.handle`; anything else
    (health, metrics, models, a wrong path or method, the lifespan) to a small FastAPI app."""

    def __init__(self, router: Router, fallback: FastAPI) -> None:
        self.router, self.fallback, self.state = router, fallback, fallback.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = PROXIED.get(scope["path"])
            if route is not None:
                await self.router.handle(scope, receive, send, *route)
                return
        await self.fallback(scope, receive, send)


def create_router_app(router: Router) -> RouterApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(router.background())
        yield
        task.cancel()
        router.close()

    app = FastAPI(title="minillm router", lifespan=lifespan)
    app.state.router = router
    app.add_exception_handler(Exception, unexpected_error_handler)  # a bug answers 500; the router lives on

    @app.get("/v1/models")
    async def models():
        return await router.models()

    @app.get("/health")
    async def health():
        if not router.healthy_workers():
            return error_response(503, "no healthy worker")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return RouterApp(router, app)
