"""A stub OpenAI-compatible server with KNOWN timings, to check a load generator (chapter 11).

It runs no model: every streamed completion waits `--ttft-ms` before its first chunk and
`--tpot-ms` between chunks, one word per chunk, and reports `usage` when asked. The waits are
`asyncio.sleep`s, so many requests overlap without using the CPU, and any load generator pointed
at it should report TTFT ≈ ttft_ms and TPOT ≈ ITL ≈ tpot_ms, plus its own overhead. Two tools
that disagree here disagree about measuring, not about the server.

    python -m minillm.benchmark.stub_server --port 8100 --ttft-ms 50 --tpot-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def create_stub_app(ttft_ms: float, tpot_ms: float, model: str = "stub") -> FastAPI:
    app = FastAPI(title="minillm stub server")

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "minillm"}]}

    async def events(body: dict, chat: bool):
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        await asyncio.sleep(ttft_ms / 1000)
        for i in range(n):
            if i:
                await asyncio.sleep(tpot_ms / 1000)
            last = i == n - 1
            choice = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": " word"}} if chat else {"text": " word"})
            yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def answer(request: Request, chat: bool):
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the stub server only streams: set stream=true",
                                           "type": "BadRequestError", "param": "stream", "code": 400}}, 400)
        return StreamingResponse(events(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--tpot-ms", type=float, default=10.0)
    parser.add_argument("--model", default="stub")
    args = parser.parse_args(argv)
    uvicorn.run(create_stub_app(args.ttft_ms, args.tpot_ms, args.model), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
