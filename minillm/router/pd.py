"""The router's PD mode: prefill on one instance, decode on another (chapter 13).

    minillm router --pd --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Each completion or chat request is sent twice, with vLLM's `kv_transfer_params` and a fresh
transfer id:

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

One request, one transfer: `n` > 1, a batch of prompts and `logprobs` are refused with 400 (the
first token's logprobs stay on the prefill side). /health is 200 while both instances are
healthy; /v1/models asks the decode instance; /metrics is the router's own.
"""

from __future__ import annotations

import json
import uuid

import httpx
from fastapi import Request
from fastapi.responses import Response

from minillm.request import MAX_LOGPROBS
from minillm.router.app import HOP_HEADERS, HealthConfig, Router
from minillm.router.policies import make_policy
from minillm.server.errors import error_response


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

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):  # not a JSON object: the prefill server answers with its own error
            return await self._plain(self.prefill, path, body, headers)
        refusal = pd_refusal(data, chat)
        if refusal is not None:
            return error_response(400, *refusal)
        for worker in (self.prefill, self.decode):
            if not worker.healthy:
                return error_response(503, f"the {'prefill' if worker is self.prefill else 'decode'} instance "
                                           f"{worker.url} is unhealthy; retry later", None, {"Retry-After": "1"})
        transfer_id = uuid.uuid4().hex
        prefill_body = dict(data, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
        if data.get("stream") is True:  # one answer, not a stream (a malformed stream field stays: the server's error)
            prefill_body["stream"] = False
            prefill_body.pop("stream_options", None)
        answer = await self._plain(self.prefill, path, json.dumps(prefill_body).encode(), headers)
        if answer.status_code != 200:
            return answer
        decode_body = dict(data, kv_transfer_params={"do_remote_prefill": True, "transfer_id": transfer_id})
        return await self._stream(self.decode, path, json.dumps(decode_body).encode(), headers)

    async def _plain(self, worker, path: str, body: bytes, headers: dict) -> Response:
        """One non-streamed exchange with `worker`; its answer as a Response (errors as the router's 502/503/504)."""
        worker.in_flight += 1
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
        self.metrics.routed.labels(worker.url).inc()
        out_headers = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
        return Response(r.content, status_code=r.status_code, headers=out_headers)

    async def _stream(self, worker, path: str, body: bytes, headers: dict) -> Response:
        upstream = self.client.build_request("POST", worker.url + path, content=body, headers=headers,
                                             timeout=self.health.request_timeout_secs)
        worker.in_flight += 1
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as err:
            worker.in_flight -= 1
            self.metrics.errors.labels(worker.url).inc()
            if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
                self.mark_unhealthy(worker)
            return error_response(502, f"decode instance {worker.url} failed before answering: "
                                       f"{type(err).__name__}: {err}")
        self.metrics.routed.labels(worker.url).inc()
        return await self._relay(worker, response)

    async def models(self) -> Response:
        try:
            r = await self.client.get(self.decode.url + "/v1/models", timeout=self.health.health_check_timeout_secs)
        except httpx.HTTPError:
            return error_response(503, f"the decode instance {self.decode.url} does not answer")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    def healthy_workers(self):
        """Both halves or nothing: /health is 200 only while prefill and decode are healthy."""
        return self.workers if all(w.healthy for w in self.workers) else []
