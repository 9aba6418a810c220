"""One streamed request to an OpenAI-compatible server, timed chunk by chunk (chapter 11).

The request goes out over `httpx` and the server-sent events are read line by line: the client's
clock starts just before the POST and stamps every `data:` line that carries a choice, which is
exactly what a user watching the stream would see. TTFT ends at the first chunk with content
(as aiperf and guidellm time it): a chat stream's `{"role": "assistant", "content": ""}` chunk carries no
token, and a server that sends it before prefill would otherwise move the prefill into ITL. `stream_options.include_usage` asks the server
for a last chunk with the token counts; servers that send none get their text re-tokenized.
A status other than 200, a broken stream or a timeout is a failed request, with the reason kept.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tokenizers import Tokenizer

from minillm.benchmark.dataset import BenchRequest
from minillm.benchmark.results import RequestOutcome

BACKENDS = ("openai", "openai-chat")  # /v1/completions and /v1/chat/completions, vLLM's names


@dataclass
class RequestSettings:
    model: str
    backend: str = "openai"
    prompt_format: str = "text"  # "text" (the server tokenizes) or "ids" (token ids, completions only)
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(req: BenchRequest, settings: RequestSettings) -> dict[str, Any]:
    """The JSON body: streaming with usage, `max_tokens` from the trace, plus any extra fields."""
    body: dict[str, Any] = {"model": settings.model, "max_tokens": req.max_tokens,
                            "temperature": settings.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if settings.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt_token_ids if settings.prompt_format == "ids" else req.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: every request generates exactly max_tokens
    body.update(settings.extra_body)
    return body


def _chunk_text(choice: dict, backend: str) -> str:
    if backend == "openai-chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, req: BenchRequest, settings: RequestSettings,
                       *, run_start: float, tokenizer: Tokenizer | None = None,
                       headers: dict[str, str] | None = None) -> RequestOutcome:
    """POST one streaming request and time it; never raises for what the server or network did."""
    outcome = RequestOutcome(success=False, prompt_len=req.prompt_len)
    payload = build_payload(req, settings)
    start = time.perf_counter()
    outcome.start_time_s = start - run_start
    last = start
    first_seen = False
    text_parts: list[str] = []
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {body[:500]}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    outcome.error = f"error in stream: {chunk['error']}"
                    return outcome
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    text = _chunk_text(choice, settings.backend)
                    if not first_seen:
                        if not text and choice.get("finish_reason") is None:
                            continue  # a chat role chunk carries no token yet
                        outcome.ttft_s = now - start
                        first_seen = True
                    else:
                        outcome.itl_s.append(now - last)
                    last = now
                    text_parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    outcome.prompt_len = usage.get("prompt_tokens", outcome.prompt_len)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as err:
        outcome.error = f"{type(err).__name__}: {err}"
        return outcome
    if not first_seen:
        outcome.error = "the stream ended without a single chunk carrying content or a finish reason"
        return outcome
    outcome.generated_text = "".join(text_parts)
    outcome.latency_s = last - start
    if usage_tokens is not None:
        outcome.output_tokens = int(usage_tokens)
    elif tokenizer is not None:
        outcome.output_tokens = len(tokenizer.encode(outcome.generated_text, add_special_tokens=False).ids)
    else:
        outcome.output_tokens = 1 + len(outcome.itl_s)  # one per chunk: the best a client can guess
    outcome.success = True
    return outcome
