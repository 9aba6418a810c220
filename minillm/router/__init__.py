"""Replicas behind one endpoint (chapter 13): `minillm router` and `minillm serve --data-parallel-size N`.

- `radix` — the approximate radix tree over request text: which worker saw which prefix
- `policies` — round_robin, least_load, cache_aware (SGLang's match-or-balance)
- `app` — the proxy: routing (plain ASGI), SSE passed through, health checks, /metrics
- `upstream` — its HTTP/1.1 client: kept-alive connections to the workers, answers as raw bytes
- `metrics` — the router's own Prometheus series: counts, and what each hop cost (histograms)
- `pd`, `pd_first_token`, `pd_launch` — prefill/decode mode: the two hops, the first token sent from
  the prefill's answer, the pair's launcher
- `launch` — flags, replica processes, uvicorn

Importing this package loads neither FastAPI nor httpx.
"""
