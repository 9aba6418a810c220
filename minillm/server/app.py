"""The OpenAI-compatible HTTP routes, on FastAPI (chapter 11).

    POST /v1/completions        text or token-id prompts (one, or a batch), n samples each
    POST /v1/chat/completions   messages rendered with the tokenizer's chat template
    GET  /v1/models             the model, once per name it is served under (the first is the one answers carry)
    GET  /health                200 while the engine thread (and its worker processes) are alive, else 503
    GET  /metrics               Prometheus text format, vLLM V1's metric names

Streaming is server-sent events: one `data: {json}` chunk per engine step that produced text for
a choice, the finish reason in that choice's last chunk, with `stream_options.include_usage` one
more chunk with `choices: []` and the usage, then `data: [DONE]`. A chat choice's
`{"role": "assistant", "content": ""}` chunk goes out with its first engine output. Non-streamed answers are the
same deltas gathered (the engine sends them FINAL_ONLY), so for greedy requests the streamed text
equals the non-streamed text.

Routes only translate: HTTP fields → `SamplingParams` and token ids (the tokenizer runs here, on
the event loop), outputs → OpenAI's JSON. The engine runs on its own thread (`engine_client`).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from minillm.engine import SERVER_FAULTS
from minillm.executor.abstract import EngineDeadError
from minillm.llm import chat_prompt_ids
from minillm.request import RequestOutput
from minillm.server.engine_client import EngineClient, EngineOverloaded, RequestTooLarge, Stream
from minillm.server.errors import (
    APIError,
    api_error_handler,
    error_body,
    error_response,
    unexpected_error_handler,
    validation_error_handler,
)
from minillm.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

RETRY_AFTER_S = 1


def create_app(llm, *, served_model_name: str | Sequence[str] = "minillm", api_key: str | None = None,
               max_num_queued_reqs: int | None = None, on_started: Callable[[], None] | None = None) -> FastAPI:
    """The app over an `LLM` (its engine runs on a thread the app starts and stops with itself).

    `served_model_name`: the name, or names, a request's `model` may give (vLLM's `--served-model-name`);
    answers carry the first. `on_started()` runs once the engine thread runs, before the port is bound
    (`minillm serve` prints its start-up line there).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name must be a non-empty name or list of names, got {served_model_name!r}")
    prometheus = llm.attach_prometheus()  # /metrics counts from the start, whatever the LLM was built with
    client = EngineClient(llm, max_num_queued_reqs)
    server = _Server(llm, client, names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import asyncio

        client.start(asyncio.get_running_loop())
        if on_started is not None:
            on_started()
        yield
        client.shutdown()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.client, app.state.server = client, server
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        if not client.is_alive:
            return error_response(503, "the engine thread is not running")
        try:
            llm.engine.check_health()  # worker processes (tensor/pipeline parallel): alive and answering
        except EngineDeadError as err:
            return error_response(503, f"the engine cannot run: {err}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": server.created, "owned_by": "minillm",
            "root": server.model_name, "parent": None, "max_model_len": server.max_model_len}
            for name in server.model_names]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    return app


class APIKeyMiddleware:
    """401 on /v1/* without `Authorization: Bearer <key>` (/health and /metrics stay open, as in vLLM).
    Plain ASGI rather than `@app.middleware("http")`, which would wrap every stream in another task."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key: send the header "
                                          "'Authorization: Bearer <key>' (the server's --api-key)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _request_id(request: Request) -> str:
    """The answer's id: the client's `X-Request-Id` header if it sent one (vLLM's; the PD router sends the same
    one to its prefill and decode instance, so both answers carry one id), else a fresh one."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _error_status(error: str) -> int:
    """A failed engine step (or add) is the server's fault (500); a prompt the engine refused is the client's (400)."""
    return 500 if error.startswith(SERVER_FAULTS) else 400


class _Server:
    """The route logic: validation beyond the schema, fan-in of choices, OpenAI's JSON shapes."""

    def __init__(self, llm, client: EngineClient, model_names: list[str]) -> None:
        self.llm, self.client = llm, client
        self.model_names = list(dict.fromkeys(model_names))  # accepted in a request's `model`
        self.model_name = self.model_names[0]  # what answers and the start-up line report (vLLM: the first)
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.engine.config.max_model_len
        self.vocab_size = llm.model_config.vocab_size
        self.speculative = llm.engine.config.speculative_config is not None
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}  # id -> its text alone (logprobs), at most vocab entries

    # ---- shared checks ---------------------------------------------------------------------------
    def _check_model(self, body: SamplingFields) -> None:
        if body.model is not None and body.model not in self.model_names:
            accepted = ", ".join(f"`{n}`" for n in self.model_names)
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves one model, under the "
                                f"name(s) {accepted} (GET /v1/models lists them; `minillm serve "
                                f"--served-model-name NAME ...` chooses them)", "model")

    def _max_tokens(self, requested: int | None, prompt_lens: list[int], field: str) -> int:
        """max_tokens, checked against max_model_len for the longest prompt (vLLM's message)."""
        longest = max(prompt_lens)
        limit = self.max_model_len
        if longest >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens (max_model_len). "
                                f"However, your {field} has {longest} tokens, which leaves no room for output. "
                                f"Please shorten the {field}.", field)
        if requested is None:
            return limit - longest
        if longest + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens (max_model_len). However, "
                                f"you requested {longest + requested} tokens ({longest} in the {field}, {requested} "
                                f"in the completion): max_tokens must be at most {limit - longest}.", "max_tokens")
        return requested

    def _encode(self, prompt: str | list[int], field: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{field} is empty: give at least one character or token id", field)
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids as the prompt", field)
            return list(self.tokenizer(prompt).input_ids)
        if not prompt:
            raise APIError(400, f"{field} is empty: give at least one character or token id", field)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{field} token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           field)
        return list(prompt)

    def _params(self, body: SamplingFields, max_tokens: int, logprobs: int | None):
        try:
            params = body.sampling_params(max_tokens, logprobs)
        except ValueError as err:  # SamplingParams' own checks: the message starts with the field
            msg = str(err)
            raise APIError(400, msg, msg.split(" ", 1)[0]) from None
        if self.speculative:  # the engine would refuse these only once queued (a 200 stream, then an error)
            unsupported = [name for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                                  ("repetition_penalty", 1.0), ("min_tokens", 0))
                           if getattr(params, name) != off]
            if unsupported:
                raise APIError(400, f"{', '.join(unsupported)} cannot be used on this server: it runs with "
                                    "--speculative-config, whose rejection sampler does not apply penalties or "
                                    "min_tokens", unsupported[0])
        return params

    def _submit(self, prompts: list[list[int]], params) -> Stream:
        try:
            return self.client.submit(prompts, params)
        except EngineOverloaded as err:
            raise APIError(503, str(err), None, {"Retry-After": str(RETRY_AFTER_S)}) from None
        except RequestTooLarge as err:  # retrying cannot help: the client's to change (400, not 503)
            raise APIError(400, str(err), "n") from None

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._token_text[token_id] = text
        return text

    @staticmethod
    def _usage(prompt_lens: list[int], completion_tokens: int) -> dict:
        p = sum(prompt_lens)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    # ---- /v1/completions -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body)
        prompts = [self._encode(p) for p in body.prompts()]
        max_tokens = self._max_tokens(body.max_tokens, [len(p) for p in prompts], "prompt")
        params = self._params(body, max_tokens, body.logprobs)
        stream = self._submit(prompts, params)
        rid, created = f"cmpl-{_request_id(request)}", int(time.time())
        lens = [len(p) for p in prompts]  # usage counts each prompt once, not once per sample (OpenAI's)
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

        def choice(index: int, text: str, out: RequestOutput, offset: int) -> dict:
            c = out.outputs[0]
            logprobs = None
            if body.logprobs is not None and c.logprobs is not None:
                logprobs = self._completion_logprobs(c.token_ids, c.logprobs, offset)
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}

        if body.stream:
            return self._sse(stream, base, lens, body, choice)
        return await self._gather(stream, base, lens, choice, request)

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict], offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            s = self._token_str(tid)
            tokens.append(s)
            token_logprobs.append(entry[tid])
            top.append({self._token_str(t): lp for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # ---- /v1/chat/completions --------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = chat_prompt_ids(self.tokenizer, messages, body.add_generation_prompt)
        except ValueError as err:
            raise APIError(400, f"messages: {err}", "messages") from None
        max_tokens = self._max_tokens(body.requested_max_tokens(), [len(ids)], "messages")
        top = body.top_logprobs or 0
        params = self._params(body, max_tokens, top if body.logprobs else None)
        stream = self._submit([ids], params)
        rid, created = f"chatcmpl-{_request_id(request)}", int(time.time())
        streaming = body.stream

        def choice(index: int, text: str, out: RequestOutput, _offset: int) -> dict:
            c = out.outputs[0]
            logprobs = None
            if body.logprobs and c.logprobs is not None:
                logprobs = {"content": [self._chat_logprob(t, e, top) for t, e in zip(c.token_ids, c.logprobs)]}
            key, msg = ("delta", {"content": text}) if streaming else ("message", {"role": "assistant",
                                                                                  "content": text})
            return {"index": index, key: msg, "logprobs": logprobs, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}

        if streaming:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
            return self._sse(stream, base, [len(ids)], body, choice, chat_roles=True)
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        return await self._gather(stream, base, [len(ids)], choice, request)

    def _chat_logprob(self, token_id: int, entry: dict, top: int) -> dict:
        def one(t: int, lp: float) -> dict:
            s = self._token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        return {**one(token_id, entry[token_id]), "top_logprobs": [one(t, lp) for t, lp in best]}

    # ---- answers ---------------------------------------------------------------------------------
    async def _gather(self, stream: Stream, base: dict, prompt_lens: list[int], choice, request: Request):
        """The non-streamed answer: wait for every choice's final output. A client that hangs up
        meanwhile gets its choices aborted (checked every 0.5 s without output)."""
        finals: dict[int, RequestOutput] = {}
        try:
            while len(finals) < stream.num_choices:
                got = await stream.next(timeout=0.5)
                if got is None:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                index, out = got
                if out.error is not None:
                    raise APIError(_error_status(out.error), out.error)
                finals[index] = out
        finally:
            stream.close()
        choices = [choice(i, finals[i].outputs[0].text, finals[i], 0) for i in sorted(finals)]
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
        return JSONResponse({**base, "choices": choices, "usage": self._usage(prompt_lens, completion_tokens)})

    def _sse(self, stream: Stream, base: dict, prompt_lens: list[int], body: SamplingFields, choice,
             chat_roles: bool = False) -> StreamingResponse:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        num_choices = stream.num_choices

        def frame(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def events():
            generated = [0] * num_choices
            offsets = [0] * num_choices
            role_sent = [not chat_roles] * num_choices
            try:
                async for index, out in stream:
                    if out.error is not None:
                        yield frame(error_body(_error_status(out.error), out.error))
                        break
                    if not role_sent[index]:
                        # OpenAI's first chunk of each choice carries the role. It goes out with the
                        # choice's first engine output (after prefill), as vLLM's server sends it: sent
                        # on arrival it would let a client clock TTFT before the prompt was even read.
                        role_sent[index] = True
                        first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}
                        yield frame({**base, "choices": [first], **({"usage": None} if include_usage else {})})
                    c = out.outputs[0]
                    generated[index] += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not (body_logprobs and c.token_ids):
                        continue  # tokens whose text is held back (half a character, a possible stop string)
                    payload = {**base, "choices": [choice(index, c.text, out, offsets[index])]}
                    offsets[index] += sum(len(self._token_str(t)) for t in c.token_ids) if body_logprobs else 0
                    if continuous:
                        payload["usage"] = self._usage(prompt_lens, sum(generated))
                    elif include_usage:
                        payload["usage"] = None
                    yield frame(payload)
                else:
                    if include_usage:
                        yield frame({**base, "choices": [], "usage": self._usage(prompt_lens, sum(generated))})
                yield "data: [DONE]\n\n"
            finally:
                stream.close()

        body_logprobs = getattr(body, "logprobs", None) not in (None, False)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
