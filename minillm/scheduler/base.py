"""The plan a scheduler hands the engine each step, and the protocol every scheduler follows.

A plan names the requests that run and how many new tokens each brings: 1 for a decode, the
whole prompt (or a chunk of it) for a prefill, and later 1+k for speculative decoding. Decode rows
come first, so the attention backend can batch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from minillm.request import Request


@dataclass
class ScheduledBatch:
    requests: list[Request]  # decode rows first, then prefill rows
    num_new_tokens: list[int]
    num_padding_tokens: int = 0  # slots computed for nothing (static/dynamic batching only)
    preempted: list[Request] = field(default_factory=list)
    padded: Any = None  # a static.PaddedStep when the step computes a padded rectangle

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def num_prefill_and_decode_tokens(self) -> tuple[int, int]:
        """Tokens that fill in a prompt (prefill) vs tokens that follow a sampled token (decode)."""
        prefill = decode = 0
        for req, n in zip(self.requests, self.num_new_tokens):
            in_prompt = max(0, min(req.num_prompt_tokens - req.num_computed_tokens, n))
            prefill += in_prompt
            decode += n - in_prompt
        return prefill, decode


class Scheduler(Protocol):
    def add_request(self, request: Request) -> None: ...

    def schedule(self, now: float, more_arrivals: bool = True) -> ScheduledBatch | None:
        """The next step's plan, or None if nothing can run now. `more_arrivals=False` tells a
        batch-synchronous scheduler that waiting for a fuller batch is pointless."""
        ...

    def finish(self, request: Request) -> None:
        """`request` just finished: release it and its KV."""
        ...

    def abort(self, request_id: str) -> Request | None: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def next_wakeup(self, now: float) -> float | None:
        """When an idle scheduler will fire next without new arrivals (timers), or None."""
        ...
