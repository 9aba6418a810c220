"""The connector's Prometheus series, in the server's registry beside vLLM's (chapter 13).

    minillm:kv_transfer_requests_total{role,result}   ok | unknown (no such transfer id) | failed | expired
    minillm:kv_transfer_blocks_total{role}            blocks sent (producer) or received (consumer)
    minillm:kv_transfer_bytes_total{role}             their K/V bytes
    minillm:kv_transfer_seconds_total{role}           time spent moving them (header to acknowledgement)
    minillm:kv_transfer_pinned_requests{role}         producer: finished prefills whose blocks wait for a pull
    minillm:kv_transfer_held_requests{role}           consumer: requests waiting for their K/V
    minillm:kv_transfer_link_up{role}                 1 while the pair's process group works
    minillm:kv_transfer_external_prompt_tokens_total  consumer: prompt tokens loaded instead of computed
    minillm:prompt_tokens_computed_total              prompt tokens this engine's steps computed
                                                      (a decode instance: 0 unless it had to recompute)
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class KVTransferCollector(Collector):
    def __init__(self, connector) -> None:
        self.connector = connector

    def collect(self):
        c, s = self.connector, self.connector.stats
        role = [c.role]
        requests = CounterMetricFamily("minillm:kv_transfer_requests", "KV transfers by result.",
                                       labels=["role", "result"])
        for result in ("ok", "unknown", "failed", "expired"):
            requests.add_metric([c.role, result], getattr(s, result))
        yield requests
        for name, doc, value in (("blocks", "KV blocks moved.", s.blocks), ("bytes", "KV bytes moved.", s.bytes),
                                 ("seconds", "Time moving KV.", s.seconds)):
            fam = CounterMetricFamily(f"minillm:kv_transfer_{name}", doc, labels=["role"])
            fam.add_metric(role, value)
            yield fam
        for name, doc, value in (("pinned_requests", "Finished prefills whose blocks wait for a pull.", len(c.pinned)),
                                 ("held_requests", "Requests waiting for their remote KV.", len(c.held)),
                                 ("link_up", "1 while the KV link works.",
                                  int(c.link_up.is_set() and c.link_error is None))):
            fam = GaugeMetricFamily(f"minillm:kv_transfer_{name}", doc, labels=["role"])
            fam.add_metric(role, value)
            yield fam
        yield CounterMetricFamily("minillm:kv_transfer_external_prompt_tokens",
                                  "Prompt tokens loaded from the prefill instance instead of computed.",
                                  value=s.external_prompt_tokens)
        yield CounterMetricFamily("minillm:prompt_tokens_computed", "Prompt tokens this engine's steps computed.",
                                  value=s.prompt_tokens_computed)


def read_transfer_stats(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """One instance's transfer counters from its /metrics (for chapter 13 and bench/pd.py): requests
    moved, blocks, bytes, seconds, bytes per request, and the prompt tokens it computed or loaded."""
    import httpx

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    m = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
         if line and not line.startswith("#")}
    roles = [r for r in ("kv_producer", "kv_consumer") if f'minillm:kv_transfer_link_up{{role="{r}"}}' in m]
    if not roles:
        raise ValueError(f"{url} reports no minillm:kv_transfer_* series: read_transfer_stats needs a server "
                         "started with --kv-transfer-config (a prefill or decode instance), not a plain one or a router")
    role = roles[0]
    out = {"role": role, "requests": m[f'minillm:kv_transfer_requests_total{{result="ok",role="{role}"}}']}
    for name in ("blocks", "bytes", "seconds"):
        out[name] = m[f'minillm:kv_transfer_{name}_total{{role="{role}"}}']
    out["bytes_per_request"] = out["bytes"] / out["requests"] if out["requests"] else 0.0
    out["prompt_tokens_computed"] = m["minillm:prompt_tokens_computed_total"]
    out["external_prompt_tokens"] = m["minillm:kv_transfer_external_prompt_tokens_total"]
    return out
