"""A request trace: what arrives when, with which prompt and output length (chapters 02-04).

`Trace` and `TraceRequest` are the data every trace maker returns: the synthetic ones in
minillm.traces.synthetic, Azure's real ones in minillm.traces.azure and the tenants' in
minillm.traces.tenant. A trace saves as JSONL and loads back, so the engine, the simulator and a
benchmark client replay the same requests. They live in a module of their own so that the trace
makers import them without importing each other; `from minillm.traces.synthetic import Trace` still works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TraceRequest:
    request_id: str
    arrival_time_s: float  # offset from the start of the trace
    prompt_token_ids: list[int]
    max_tokens: int  # exact output length: the engine runs traces with ignore_eos
    prefix_id: int | None = None  # which shared prefix the prompt starts with, if any
    priority: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Trace:
    requests: list[TraceRequest]
    meta: dict = field(default_factory=dict)  # the parameters that generated it (JSON-able)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def save_jsonl(self, path: str | Path) -> None:
        """One `{"meta": ...}` header line, then one request per line."""
        with open(path, "w") as f:
            f.write(json.dumps({"meta": self.meta}) + "\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def load_jsonl(cls, path: str | Path) -> Trace:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        meta = json.loads(lines[0])["meta"]
        return cls([TraceRequest(**json.loads(line)) for line in lines[1:]], meta)
