"""A multi-tenant shared-prefix trace: many apps, each with its own system prompt (chapter 13).

Tenant k has a fixed system prompt of `system_prompt_len` tokens; each request is one tenant's
system prompt followed by a question of its own (`question_len` tokens, the first token distinct
within a tenant, so two requests of a tenant share exactly the system prompt). Tenants are not
equally popular: tenant k (0-based) is picked with probability proportional to 1 / (k + 1)^zipf_s,
so with zipf_s = 1 and 8 tenants the hottest sends ~37 % of the traffic. That skew is what a
router must survive: pure prefix affinity would pile the hot tenant onto one worker.

The trace is a `minillm.traces.synthetic.Trace` (`prefix_id` = tenant), so it saves as JSONL and
`minillm bench serve --dataset-name jsonl --dataset-path FILE` replays it (prompts become words
there; a shared token prefix stays a shared text prefix).
"""

from __future__ import annotations

import math

import numpy as np

from minillm.traces.synthetic import Trace, TraceRequest, gamma_arrivals


def tenant_weights(num_tenants: int, zipf_s: float) -> np.ndarray:
    """Each tenant's share of the requests: proportional to 1 / (rank + 1)^zipf_s (0 gives equal shares)."""
    if num_tenants < 1:
        raise ValueError(f"num_tenants must be >= 1, got {num_tenants}")
    if zipf_s < 0:
        raise ValueError(f"zipf_s must be >= 0, got {zipf_s}")
    w = 1.0 / np.arange(1, num_tenants + 1, dtype=np.float64) ** zipf_s
    return w / w.sum()


def make_tenant_trace(num_requests: int, *, num_tenants: int = 8, system_prompt_len: int = 96,
                      question_len: int = 16, output_len: int = 16, zipf_s: float = 1.0, seed: int = 0,
                      vocab_size: int = 1 << 20, rate_per_s: float = math.inf, burstiness: float = 1.0) -> Trace:
    """`num_requests` requests over `num_tenants` tenants (see the module docstring); seeded."""
    if num_requests < 1 or system_prompt_len < 0 or question_len < 1 or output_len < 1:
        raise ValueError("num_requests, question_len and output_len must be >= 1 and system_prompt_len >= 0, got "
                         f"{num_requests}, {question_len}, {output_len}, {system_prompt_len}")
    if num_requests > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for {num_requests} distinct questions")
    arrival_rng, tenant_rng, token_rng = np.random.default_rng(seed).spawn(3)
    arrivals = gamma_arrivals(num_requests, rate_per_s, burstiness, arrival_rng)
    tenants = tenant_rng.choice(num_tenants, size=num_requests, p=tenant_weights(num_tenants, zipf_s))
    system = token_rng.integers(0, vocab_size, size=(num_tenants, system_prompt_len))
    if system_prompt_len:  # different tenants differ from their first token on
        system[:, 0] = token_rng.choice(vocab_size, size=num_tenants, replace=False)
    firsts = token_rng.choice(vocab_size, size=num_requests, replace=False)  # questions differ at once
    requests = []
    for i in range(num_requests):
        question = token_rng.integers(0, vocab_size, size=question_len)
        question[0] = firsts[i]
        k = int(tenants[i])
        requests.append(TraceRequest(f"req-{i}", float(arrivals[i]), system[k].tolist() + question.tolist(),
                                     output_len, prefix_id=k))
    meta = dict(kind="tenants", num_requests=num_requests, num_tenants=num_tenants,
                system_prompt_len=system_prompt_len, question_len=question_len, output_len=output_len,
                zipf_s=zipf_s, seed=seed, vocab_size=vocab_size, rate_per_s=rate_per_s, burstiness=burstiness)
    return Trace(requests, meta)
