"""A Prometheus registry read back as vLLM's `LLM.get_metrics()` list (chapter 11).

vLLM's `vllm.v1.metrics.reader` gives one object per series: `Counter(name, labels, value)`,
`Gauge(name, labels, value)`, `Histogram(name, labels, count, sum, buckets)` and `Vector(name,
labels, values)` for a counter indexed by position (accepted draft tokens per position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

VECTOR_COUNTERS = {"vllm:spec_decode_num_accepted_tokens_per_pos": "position"}


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound ("0.1", …, "+Inf") -> cumulative count


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    out: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            totals = [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")]
            index_label = VECTOR_COUNTERS.get(family.name)
            if index_label is not None:
                by_pos = {int(labels[index_label]): int(v) for labels, v in totals}
                rest = {k: v for k, v in (totals[0][0].items() if totals else ()) if k != index_label}
                out.append(Vector(family.name, rest, [by_pos.get(i, 0) for i in range(max(by_pos, default=-1) + 1)]))
            else:
                out.extend(Counter(family.name, dict(labels), int(v)) for labels, v in totals)
        elif family.type == "gauge":
            out.extend(Gauge(family.name, dict(s.labels), s.value) for s in family.samples)
        elif family.type == "histogram":
            groups: dict[tuple, Histogram] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                h = groups.setdefault(tuple(sorted(labels.items())), Histogram(family.name, labels))
                if s.name.endswith("_bucket"):
                    h.buckets[s.labels["le"]] = int(s.value)
                elif s.name.endswith("_count"):
                    h.count = int(s.value)
                elif s.name.endswith("_sum"):
                    h.sum = s.value
            out.extend(groups.values())
    return out
