"""Issue 17, point 9: a chat stream's role chunk waits for the engine, and `minillm bench serve`
times TTFT from the first content.

An independent load tester found that the server sent `{"role": "assistant", "content": ""}` the
moment a chat request arrived (before prefill) and that the bench clocked TTFT at that chunk, so
its chat TTFT came out below the server's own and the prefill wait landed in ITL.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from test_server import running_server

from minillm.benchmark.client import RequestSettings, send_request
from minillm.benchmark.dataset import BenchRequest


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_bench_ttft_starts_at_first_content_not_at_the_role_chunk() -> None:
    """Role chunk, then three content chunks: TTFT is the first content, so two gaps, not three."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "In"}}]},
              {"choices": [{"index": 0, "delta": {"content": " the"}}]},
              {"choices": [{"index": 0, "delta": {"content": " beginning"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}]

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=_sse(chunks)))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/chat/completions", BenchRequest("hi", [1], 3),
                                      RequestSettings("m", backend="openai-chat"), run_start=0.0)

    out = asyncio.run(go())
    assert out.success and out.generated_text == "In the beginning" and out.output_tokens == 3
    assert len(out.itl_s) == 2  # the role chunk is neither the first token nor a gap


@pytest.fixture(scope="module")
def server():
    with running_server(max_num_seqs=4, max_model_len=256) as (url, app):
        yield url, app


@pytest.mark.parametrize("n", [1, 2])
def test_chat_role_chunk_waits_for_the_engines_first_output(server, n) -> None:
    """With the engine thread held, a streamed chat request gets its headers but no chunk at all;
    once released, each choice's first chunk is its role, before any of its content."""
    url, app = server
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # runs on the engine thread between steps
        held.set()
        release.wait(30)

    async def go() -> tuple[list[str], list[str]]:
        lines: list[str] = []
        body = {"model": "minillm", "messages": [{"role": "user", "content": "Who made light?"}],
                "max_tokens": 4, "temperature": 0.0, "stream": True, "n": n}
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200

                async def read() -> None:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            lines.append(line[5:].strip())

                reader = asyncio.create_task(read())
                await asyncio.sleep(1.0)  # ample time for a chunk sent on arrival to reach us
                before_release = list(lines)
                release.set()
                await asyncio.wait_for(reader, 30)
        return before_release, lines

    app.state.client.engine.call_soon(hold)
    assert held.wait(30), "the engine thread did not run the hold"
    try:
        before_release, lines = asyncio.run(go())
    finally:
        release.set()
    assert before_release == []  # today's server sent the role chunk here, before prefill
    assert lines[-1] == "[DONE]"
    deltas = [c for c in (json.loads(x) for x in lines[:-1]) if c["choices"]]
    for index in range(n):
        mine = [c["choices"][0]["delta"] for c in deltas if c["choices"][0]["index"] == index]
        assert mine[0] == {"role": "assistant", "content": ""}
        assert all("role" not in d for d in mine[1:]) and "".join(d.get("content") or "" for d in mine)
