"""The OpenAI-compatible toy server (chapter 11): `minillm serve`.

- `engine_client` — the engine thread and the asyncio side that talks to it
- `protocol` — the request bodies (pydantic), OpenAI's and vLLM's fields
- `errors` — vLLM's error body and the HTTP statuses
- `metrics` — Prometheus metrics with vLLM V1's names (`metrics_reader`: `LLM.get_metrics()`)
- `app` — the FastAPI routes; `serve` — flags and uvicorn

Importing this package loads neither FastAPI nor uvicorn (`LLM` imports `minillm.server.metrics`).
"""
