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

import json
import time
import uuid

from fastapi.responses import Response

from minillm.request import MAX_LOGPROBS
from minillm.router.app import (
    ANSWER_DROPPED,
    Call,
    ErrorAnswer,
    HealthConfig,
    Router,
    forwarded,
    is_event_stream,
    send_answer,
    stream_error,
)
from minillm.router.pd_first_token import FirstTokenSplice, SpliceMismatch, first_token_events
from minillm.router.policies import make_policy
from minillm.router.upstream import ConnectFailed, UpstreamError, UpstreamTimeout
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

    async def forward(self, call: Call, scope, body: bytes, send, path: bytes, chat: bool, arrival: float) -> None:
        headers = forwarded(scope["headers"])
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):  # not a JSON object: the prefill server answers with its own error
            await send_answer(call, send, *await self._exchange(self.prefill, path, headers, body, arrival))
            return
        refusal = pd_refusal(data, chat)
        if refusal is not None:
            raise ErrorAnswer(400, *refusal)
        for worker in (self.prefill, self.decode):
            if not worker.healthy:
                raise ErrorAnswer(503, f"the {'prefill' if worker is self.prefill else 'decode'} instance "
                                       f"{worker.url} is unhealthy; retry later", retry_after=True)
        transfer_id = uuid.uuid4().hex
        if not any(k == b"x-request-id" for k, _ in headers):  # (ASGI header names are lower case)
            headers.append((b"x-request-id", transfer_id.encode()))
        prefill_body = dict(data, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
        if data.get("stream") is True:  # one answer, not a stream (a malformed stream field stays: the server's error)
            prefill_body["stream"] = False
            prefill_body.pop("stream_options", None)
        status, answer_headers, answer = await self._exchange(self.prefill, path, headers,
                                                              json.dumps(prefill_body).encode(), arrival)
        if status != 200:
            await send_answer(call, send, status, answer_headers, answer)
            return
        first = first_token_events(data, chat, answer)
        decode_request = dict(data, kv_transfer_params={"do_remote_prefill": True, "transfer_id": transfer_id})
        if first is None:
            await self._relay_decode(call, send, path, headers, json.dumps(decode_request).encode(), arrival)
        else:
            await self._first_token_then_decode(call, send, *first, chat, path, headers, decode_request, arrival)

    async def _exchange(self, worker, path: bytes, headers: list, body: bytes, arrival: float):
        """One non-streamed exchange with `worker`: (status, headers to pass on, body); a failure as the router's
        own error answer (503 refused, 504 timed out, 502 otherwise)."""
        series = worker.series
        worker.in_flight += 1
        sent = time.perf_counter()
        series.routing.observe(sent - arrival)
        try:
            response = await worker.pool.request(b"POST", path, headers, body, self.timeout_s)
            try:
                content = await response.read_all()
            finally:
                response.close()
        except ConnectFailed as err:
            series.errors.inc()
            self.mark_unhealthy(worker)
            raise ErrorAnswer(503, f"worker {worker.url} refused the connection: {err}", retry_after=True) from None
        except UpstreamError as err:
            series.errors.inc()
            raise ErrorAnswer(504 if isinstance(err, UpstreamTimeout) else 502,
                              f"worker {worker.url} failed: {type(err).__name__}: {err}") from None
        finally:
            worker.in_flight -= 1
        series.worker_ttft.observe(time.perf_counter() - sent)
        series.routed.inc()
        return response.status, forwarded(response.headers, ANSWER_DROPPED), content

    async def _relay_decode(self, call: Call, send, path: bytes, headers: list, body: bytes, arrival: float) -> None:
        """The decode instance's answer relayed as the plain router relays it."""
        decode = self.decode
        decode.in_flight += 1
        try:
            sent = time.perf_counter()
            try:
                response = await decode.pool.request(b"POST", path, headers, body, self.timeout_s)
            except UpstreamError as err:
                self._decode_failed(err)
                raise ErrorAnswer(502, f"decode instance {decode.url} failed before answering: "
                                       f"{type(err).__name__}: {err}") from None
            decode.series.routed.inc()
            try:
                await self.relay(call, decode, response, send, arrival, sent)
            finally:
                response.close()
        finally:
            decode.in_flight -= 1

    def _decode_failed(self, err: UpstreamError) -> None:
        self.decode.series.errors.inc()
        if isinstance(err, ConnectFailed):
            self.mark_unhealthy(self.decode)

    async def _first_token_then_decode(self, call: Call, send, first_events: bytes, first_text: str, chat: bool,
                                       path: bytes, headers: list, decode_request: dict, arrival: float) -> None:
        """The client's stream: the prefill's first token at once, then the decode instance's stream less what
        the client already has. The decode request is encoded and sent once the first token is written."""
        decode, series = self.decode, self.decode.series
        decode.in_flight += 1
        response = None
        try:
            call.started = True
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await send({"type": "http.response.body", "body": first_events, "more_body": True})
            self.prefill.series.ttft.observe(time.perf_counter() - arrival)
            body = json.dumps(decode_request).encode()
            sent = time.perf_counter()
            try:
                try:
                    response = await decode.pool.request(b"POST", path, headers, body, self.timeout_s)
                except UpstreamError as err:
                    self._decode_failed(err)
                    tail = stream_error(502, f"decode instance {decode.url} failed before answering: "
                                             f"{type(err).__name__}: {err}")
                else:
                    series.routed.inc()
                    if response.status != 200 or not is_event_stream(response.headers):
                        # refused (overloaded, the link down): its error, as an event
                        tail = decode_error_event(await response.read_all(), response.status, decode.url)
                    else:
                        splice, first = FirstTokenSplice(first_text, chat), True
                        while True:
                            chunk = await response.read_chunk()
                            last = response.at_end
                            if first and chunk:
                                first = False
                                series.worker_ttft.observe(time.perf_counter() - sent)
                            out = splice.feed(chunk) if chunk else b""
                            if out or last:
                                await send({"type": "http.response.body", "body": out, "more_body": not last})
                            if last:
                                return
            except UpstreamError as err:
                series.errors.inc()
                tail = stream_error(502, f"decode instance {decode.url} died while streaming: "
                                         f"{type(err).__name__}: {err}")
            except SpliceMismatch as err:
                tail = stream_error(502, str(err))
            await send({"type": "http.response.body", "body": tail})
        finally:
            decode.in_flight -= 1
            if response is not None:
                response.close()  # (a client gone: the decode's connection closes, and the decode aborts)
            series.e2e.observe(time.perf_counter() - arrival)

    async def models(self) -> Response:
        try:
            status, headers, content = await self.get(self.decode, b"/v1/models")
        except UpstreamError:
            return error_response(503, f"the decode instance {self.decode.url} does not answer")
        media = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), None)
        return Response(content, status_code=status, media_type=media)

    def healthy_workers(self):
        """Both halves or nothing: /health is 200 only while prefill and decode are healthy."""
        return self.workers if all(w.healthy for w in self.workers) else []


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def decode_error_event(content: bytes, status: int, url: str) -> bytes:
    """A decode instance's error answer, as the event that ends a stream the client has started reading."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and "error" in body):
        body = error_body(502, f"decode instance {url} answered {status}: {content[:200]!r}")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
