"""The router's PD mode: prefill on one instance, decode on another (chapter 13).

    minillm router --pd --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Each completion or chat request is sent twice, with vLLM's `kv_transfer_params` and a fresh
transfer id (also the `X-Request-Id` of both requests, as vLLM's proxy sets it, so that both answers
carry the same id):

1. to the prefill instance (`kv_role: kv_producer`), not streamed, with
   `{"do_remote_decode": true, "transfer_id": T}`: it computes the prompt and samples the first
   token only (vLLM's proxy asks for that with max_tokens=1; here the prefill server caps it
   itself, so it judges the client's max_tokens exactly as the decode server will, and a request
   the decode side would refuse never leaves K/V pinned), then pins the prompt's blocks under T.
   An error answer (bad input) goes back to the client as it is: the server's own error.
2. to the decode instance (`kv_role: kv_consumer`), as the client sent it (streamed or not), with
   `{"do_remote_prefill": true, "transfer_id": T}`: it pulls T's blocks and the first token over the
   pair's torch.distributed link, emits that token, and decodes the rest without computing any
   prompt token. Its answer is relayed as the plain router relays (SSE chunk by chunk).

A streamed request does not wait for step 2 to see its first token: the prefill's token goes to the
client at once, while the decode request is sent, and the decode's stream follows without what the
client already has (`minillm.router.pd_first_token`, which says where this is not done). A decode
instance that fails after that ends the stream with an error event (the client's status was 200).

One request, one transfer: `n` > 1, a batch of prompts and `logprobs` are refused with 400 (the
first token's logprobs stay on the prefill side). /health is 200 while both instances are
healthy; /v1/models asks the decode instance; /metrics is the router's own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response

from minillm.request import MAX_LOGPROBS
from minillm.router.app import HOP_HEADERS, HealthConfig, RelayResponse, Router, stream_error
from minillm.router.pd_first_token import FirstTokenSplice, SpliceMismatch, first_token_events
from minillm.router.policies import make_policy
from minillm.server.errors import error_body, error_response


def pd_refusal(data: dict, chat: bool) -> tuple[str, str] | None:
    """(message, field) if a well-formed request cannot go through one prefill/decode transfer; else
    None. Malformed fields are left to the prefill server, whose errors the client then gets."""

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    n = data.get("n")
    if is_int(n) and 1 < n <= 128:  # (beyond the server's bounds: the server's own error)
        return f"n must be 1 behind a prefill/decode router (one KV transfer per request), got {n}", "n"
    logprobs = data.get("logprobs")
    if (chat and logprobs is True) or (not chat and is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        return ("logprobs are not supported behind a prefill/decode router (the first token is sampled on the "
                "prefill instance, and its logprobs stay there)", "logprobs")
    prompt = data.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) and p for p in prompt):
        return (f"prompt must be one prompt behind a prefill/decode router (one KV transfer per request), got a "
                f"batch of {len(prompt)}", "prompt")
    if "kv_transfer_params" in data:
        return "kv_transfer_params is set by the prefill/decode router; leave it out", "kv_transfer_params"
    return None


class PDRouter(Router):
    """Workers [prefill, decode]; `forward` sends each request through both."""

    def __init__(self, prefill_url: str, decode_url: str, health: HealthConfig | None = None) -> None:
        super().__init__([prefill_url, decode_url], make_policy("round_robin"), health)
        self.prefill, self.decode = self.workers

    def describe(self) -> str:
        return (f"prefill {self.prefill.url}, then decode {self.decode.url} (prefill/decode disaggregation; "
                f"a stream's first token is sent from the prefill's answer)")

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        arrival = time.perf_counter()
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):  # not a JSON object: the prefill server answers with its own error
            return await self._plain(self.prefill, path, body, headers, arrival)
        refusal = pd_refusal(data, chat)
        if refusal is not None:
            return error_response(400, *refusal)
        for worker in (self.prefill, self.decode):
            if not worker.healthy:
                return error_response(503, f"the {'prefill' if worker is self.prefill else 'decode'} instance "
                                           f"{worker.url} is unhealthy; retry later", None, {"Retry-After": "1"})
        transfer_id = uuid.uuid4().hex
        headers.setdefault("x-request-id", transfer_id)  # (Starlette's header names are lower case)
        prefill_body = dict(data, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
        if data.get("stream") is True:  # one answer, not a stream (a malformed stream field stays: the server's error)
            prefill_body["stream"] = False
            prefill_body.pop("stream_options", None)
        answer = await self._plain(self.prefill, path, json.dumps(prefill_body).encode(), headers, arrival)
        if answer.status_code != 200:
            return answer
        decode_body = json.dumps(dict(data, kv_transfer_params={"do_remote_prefill": True,
                                                                "transfer_id": transfer_id})).encode()
        first = first_token_events(data, chat, answer.body)
        if first is None:
            return await self._stream(self.decode, path, decode_body, headers, arrival)
        return self._first_token_then_decode(*first, chat, path, decode_body, headers, arrival)

    async def _plain(self, worker, path: str, body: bytes, headers: dict, arrival: float) -> Response:
        """One non-streamed exchange with `worker`; its answer as a Response (errors as the router's 502/503/504)."""
        worker.in_flight += 1
        sent = time.perf_counter()
        self.metrics.routing.labels(worker.url).observe(sent - arrival)
        try:
            r = await self.client.post(worker.url + path, content=body, headers=headers,
                                       timeout=self.health.request_timeout_secs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            self.metrics.errors.labels(worker.url).inc()
            self.mark_unhealthy(worker)
            return error_response(503, f"worker {worker.url} refused the connection: {type(err).__name__}",
                                  None, {"Retry-After": "1"})
        except httpx.HTTPError as err:
            self.metrics.errors.labels(worker.url).inc()
            return error_response(504 if isinstance(err, httpx.TimeoutException) else 502,
                                  f"worker {worker.url} failed: {type(err).__name__}: {err}")
        finally:
            worker.in_flight -= 1
        self.metrics.worker_ttft.labels(worker.url).observe(time.perf_counter() - sent)
        self.metrics.routed.labels(worker.url).inc()
        out_headers = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
        return Response(r.content, status_code=r.status_code, headers=out_headers)

    async def _stream(self, worker, path: str, body: bytes, headers: dict, arrival: float) -> Response:
        upstream = self.client.build_request("POST", worker.url + path, content=body, headers=headers,
                                             timeout=self.health.request_timeout_secs)
        worker.in_flight += 1
        sent = time.perf_counter()
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as err:
            worker.in_flight -= 1
            self._decode_failed(err)
            return error_response(502, f"decode instance {worker.url} failed before answering: "
                                       f"{type(err).__name__}: {err}")
        self.metrics.routed.labels(worker.url).inc()
        return await self._relay(worker, response, arrival, sent)

    def _decode_failed(self, err: httpx.HTTPError) -> None:
        self.metrics.errors.labels(self.decode.url).inc()
        if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
            self.mark_unhealthy(self.decode)

    def _first_token_then_decode(self, first_events: bytes, first_text: str, chat: bool, path: str, body: bytes,
                                 headers: dict, arrival: float) -> Response:
        """The client's stream: the prefill's first token at once, then the decode instance's stream less what
        the client already has. The decode request goes out as the first token is written."""
        decode = self.decode
        decode.in_flight += 1
        counted, task = True, None

        async def open_decode() -> httpx.Response:
            upstream = self.client.build_request("POST", decode.url + path, content=body, headers=headers,
                                                 timeout=self.health.request_timeout_secs)
            return await self.client.send(upstream, stream=True)

        async def release() -> None:  # however the stream ends (a client hanging up included); once
            nonlocal counted
            if counted:
                counted = False
                decode.in_flight -= 1
            if task is None:
                return
            task.cancel()  # (nothing if it has answered)
            with anyio.CancelScope(shield=True):
                try:
                    response = await task
                except (asyncio.CancelledError, Exception):
                    return
                await response.aclose()  # closing the decode's connection makes it abort the request

        async def events():
            nonlocal task
            task = asyncio.create_task(open_decode())
            sent = time.perf_counter()
            try:
                yield first_events
                self.metrics.ttft.labels(self.prefill.url).observe(time.perf_counter() - arrival)
                try:
                    response = await task
                except httpx.HTTPError as err:
                    self._decode_failed(err)
                    yield stream_error(502, f"decode instance {decode.url} failed before answering: "
                                            f"{type(err).__name__}: {err}")
                    return
                self.metrics.routed.labels(decode.url).inc()
                if response.status_code != 200 or not response.headers.get("content-type", "").startswith(
                        "text/event-stream"):  # refused (overloaded, the link down): its error, as an event
                    yield decode_error_event(await response.aread(), response.status_code, decode.url)
                    return
                splice, first = FirstTokenSplice(first_text, chat), True
                async for chunk in response.aiter_raw():
                    if first:
                        first = False
                        self.metrics.worker_ttft.labels(decode.url).observe(time.perf_counter() - sent)
                    out = splice.feed(chunk)
                    if out:
                        yield out
            except httpx.HTTPError as err:
                self.metrics.errors.labels(decode.url).inc()
                yield stream_error(502, f"decode instance {decode.url} died while streaming: "
                                        f"{type(err).__name__}: {err}")
            except SpliceMismatch as err:
                yield stream_error(502, str(err))
            finally:
                self.metrics.e2e.labels(decode.url).observe(time.perf_counter() - arrival)
                await release()

        return RelayResponse(events(), release, status_code=200, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def models(self) -> Response:
        try:
            r = await self.client.get(self.decode.url + "/v1/models", timeout=self.health.health_check_timeout_secs)
        except httpx.HTTPError:
            return error_response(503, f"the decode instance {self.decode.url} does not answer")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    def healthy_workers(self):
        """Both halves or nothing: /health is 200 only while prefill and decode are healthy."""
        return self.workers if all(w.healthy for w in self.workers) else []


def decode_error_event(content: bytes, status: int, url: str) -> bytes:
    """A decode instance's error answer, as the event that ends a stream the client has started reading."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and "error" in body):
        body = error_body(502, f"decode instance {url} answered {status}: {content[:200]!r}")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
