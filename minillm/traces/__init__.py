"""Request traces: what arrives when, with which prompt and output length (chapters 02-04, 13).

- `trace`: the `Trace` / `TraceRequest` data every trace maker returns;
- `synthetic`: seeded synthetic traces (chat, code, heavy-tailed lengths, Poisson arrivals);
- `azure`: Azure's 2023 production traces, as shipped in data/traces;
- `tenant`: a multi-tenant trace whose apps share system prompts (prefix caching, chapter 13);
- `course`: the one course trace that chapters 02-09 climb the feature ladder on.
"""
