"""Replicas behind one endpoint (chapter 13): `minillm router` and `minillm serve --data-parallel-size N`.

- `radix` — the approximate radix tree over request text: which worker saw which prefix
- `policies` — round_robin, least_load, cache_aware (SGLang's match-or-balance)
- `app` — the FastAPI proxy: routing, SSE passed through, health checks, /metrics
- `launch` — flags, replica processes, uvicorn

Importing this package loads neither FastAPI nor httpx.
"""
