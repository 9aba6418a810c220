"""The router: one OpenAI-compatible endpoint in front of several `minillm serve` workers (chapter 13).

    POST /v1/completions, /v1/chat/completions   proxied to the worker the policy picks
    GET  /v1/models                              proxied to a healthy worker
    GET  /health                                 200 while at least one worker is healthy
    GET  /metrics                                the router's own Prometheus metrics

The body goes to the worker byte for byte and the answer comes back as it is: a server-sent-event
stream is passed through chunk by chunk as the worker writes it (no re-framing, no buffering), so
a client measures the worker's timing plus one loopback hop. Bad input is the worker's to judge,
so the router's errors for it are the server's own.

Health: every `health_check_interval_secs` each worker's /health is asked (SGLang's flag names);
`health_failure_threshold` failures in a row mark it unhealthy (no traffic; its part of the
cache-aware tree is forgotten), `health_success_threshold` successes mark it healthy again. A
refused connection (or one closed before any answer) marks a worker unhealthy at once, and the
request, of which the client has seen nothing, goes to another worker. A worker that dies while
answering is not retried (the client may hold part of the answer): a plain request gets 502, a
stream gets an error event and `data: [DONE]`, so no client hangs.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from minillm.router.metrics import RouterMetrics
from minillm.router.policies import Policy
from minillm.server.errors import error_body, error_response, unexpected_error_handler

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


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
        self.health = health or HealthConfig()
        self.metrics = RouterMetrics(self.workers, policy)
        self.client: httpx.AsyncClient | None = None

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

    async def check(self, worker: Worker) -> None:
        try:
            r = await self.client.get(worker.url + "/health", timeout=self.health.health_check_timeout_secs)
            ok = r.status_code == 200
        except httpx.HTTPError:
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

    # ---- proxy ---------------------------------------------------------------------------------
    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        arrival = time.perf_counter()
        body = await request.body()
        # no JSON parse where the policy reads no text (a policy that does not say is given the text)
        text = routing_text(body, chat) if getattr(self.policy, "uses_text", True) else ""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        tried: set[str] = set()
        while True:
            candidates = [w for w in self.healthy_workers() if w.url not in tried]
            if not candidates:
                return error_response(503, f"no healthy worker to take the request (workers: "
                                           f"{', '.join(w.url for w in self.workers)}); retry later",
                                      None, {"Retry-After": "1"})
            loads = {w.url: w.in_flight for w in candidates}
            url = self.policy.choose(text, [w.url for w in candidates], loads)
            worker = next(w for w in candidates if w.url == url)
            tried.add(url)
            upstream = self.client.build_request("POST", worker.url + path, content=body, headers=headers,
                                                 timeout=self.health.request_timeout_secs)
            worker.in_flight += 1
            sent = time.perf_counter()
            self.metrics.routing.labels(worker.url).observe(sent - arrival)
            try:
                response = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                    httpx.WriteError):
                # Refused, or closed without a byte of answer (a worker dying while accepting): the
                # client has seen nothing and generation changes no state, so another worker takes it.
                worker.in_flight -= 1
                self.metrics.errors.labels(worker.url).inc()
                self.mark_unhealthy(worker)
                continue
            except httpx.HTTPError as err:  # a timeout: the worker may still be working on it
                worker.in_flight -= 1
                self.metrics.errors.labels(worker.url).inc()
                return error_response(504 if isinstance(err, httpx.TimeoutException) else 502,
                                      f"worker {worker.url} failed before answering: {type(err).__name__}: {err}")
            self.metrics.routed.labels(worker.url).inc()
            return await self._relay(worker, response, arrival, sent)

    def _finished(self, worker: Worker, arrival: float) -> BackgroundTask:
        """Observes the end-to-end latency once the answer has been written (Starlette runs it after the body)."""
        return BackgroundTask(lambda: self.metrics.e2e.labels(worker.url).observe(time.perf_counter() - arrival))

    async def _relay(self, worker: Worker, response: httpx.Response, arrival: float, sent: float) -> Response:
        """The worker's answer as the client's: read whole if plain, else passed through chunk by chunk as
        it arrives (`aiter_raw`: the bytes as the worker wrote them, no decoding, no re-framing)."""
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as err:
                self.metrics.errors.labels(worker.url).inc()
                return error_response(502, f"worker {worker.url} died while answering: {type(err).__name__}: {err}")
            finally:
                await response.aclose()
                worker.in_flight -= 1
            self.metrics.worker_ttft.labels(worker.url).observe(time.perf_counter() - sent)
            return Response(content, status_code=response.status_code, headers=out_headers,
                            background=self._finished(worker, arrival))

        counted = True

        async def release() -> None:  # however the stream ends; the count drops once
            nonlocal counted
            if counted:
                counted = False
                worker.in_flight -= 1
            with anyio.CancelScope(shield=True):  # also when the client's hang-up cancels us
                await response.aclose()  # closing the worker's connection makes the worker abort

        async def relay():
            first = True
            try:
                async for chunk in response.aiter_raw():
                    if first:
                        self.metrics.worker_ttft.labels(worker.url).observe(time.perf_counter() - sent)
                    yield chunk  # (returns once the chunk is handed to the client's transport)
                    if first:
                        first = False
                        self.metrics.ttft.labels(worker.url).observe(time.perf_counter() - arrival)
            except httpx.HTTPError as err:
                self.metrics.errors.labels(worker.url).inc()
                yield stream_error(502, f"worker {worker.url} died while streaming: {type(err).__name__}: {err}")
            finally:
                self.metrics.e2e.labels(worker.url).observe(time.perf_counter() - arrival)
                await release()

        return RelayResponse(relay(), release, status_code=response.status_code, headers=out_headers)

    async def models(self) -> Response:
        for worker in self.healthy_workers():
            try:
                r = await self.client.get(worker.url + "/v1/models", timeout=self.health.health_check_timeout_secs)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no healthy worker to list the models")


class RelayResponse(StreamingResponse):
    """A stream that also releases the worker's response when the client leaves before the first
    chunk (the generator's own `finally` never runs if it never started)."""

    def __init__(self, content, release, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def create_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=router.health.request_timeout_secs) as client:
            router.client = client
            task = asyncio.create_task(router.background())
            yield
            task.cancel()

    app = FastAPI(title="minillm router", lifespan=lifespan)
    app.state.router = router
    app.add_exception_handler(Exception, unexpected_error_handler)  # a bug answers 500; the router lives on

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.forward(request, "/v1/chat/completions", chat=True)

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

    return app
