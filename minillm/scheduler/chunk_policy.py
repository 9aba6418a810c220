"""How many tokens one chunked-prefill step holds: Sarathi-Serve's fixed budget or DeepSpeed-FastGen's
Dynamic SplitFuse (chapter 08).

With `enable_chunked_prefill=True`, `ContinuousScheduler.schedule` asks its chunk policy once per step
for the step's token budget, then fills it in the stall-free order (decodes, partly prefilled
requests, new ones), each request cut by `ContinuousScheduler._chunk`. The policies differ only in
that budget:

- `SarathiChunking` (`chunk_policy="sarathi"`, the default): every step may hold
  `max_num_batched_tokens`, whatever is queued. A pool of prompt tokens a little larger than one
  budget runs as one full step and a small remainder step.
- `SplitFuseChunking` (`chunk_policy="splitfuse"`): `max_num_batched_tokens` is the *target*
  forward size, the token count at which the hardware's throughput saturates (the "sweet spot";
  `minillm.sim.chunking.sweet_spot_tokens` finds it on the simulator's roofline). DeepSpeed-FastGen
  observes that a step's time depends on its token count, not on how the tokens are composed, and
  that throughput is concave in that count, so a pool of P tokens that needs F passes runs fastest
  split into F equal passes. The budget is therefore chosen from the queue: the decode tokens
  (one per decoding request, always first), plus the pending prompt tokens (running prefills and
  the waiting requests that have a seat) split evenly over the passes they need. Enough queued
  work gives steps of nearly the target size (at least target·(F-1)/F), and never more.

Pending prompt tokens of waiting requests are counted without their cached prefix (the prefix cache
is only looked up at admission), so with prefix caching the split can be a little too coarse.
"""

from __future__ import annotations

from collections.abc import Iterable

from minillm.config import EngineConfig
from minillm.request import Request


class SarathiChunking:
    """A fixed token budget per step (Sarathi-Serve; vLLM's chunked prefill)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def step_budget(self, running: list[Request], waiting) -> int:
        return self.config.max_num_batched_tokens


class SplitFuseChunking(SarathiChunking):
    """Dynamic SplitFuse: decodes first, the queued prompt tokens split evenly over the passes they
    need, every pass at most `target` tokens."""

    def step_budget(self, running: list[Request], waiting) -> int:
        target = self.config.max_num_batched_tokens
        decodes, pending = 0, 0
        for r in running:
            missing = r.num_tokens - r.num_computed_tokens
            if missing == 1 and r.num_computed_tokens:
                decodes += 1
            else:
                pending += missing
        seats = self.config.max_num_seqs - len(running)
        if seats > 0 and waiting:
            pending += sum(r.num_tokens - r.num_computed_tokens for r in _head(waiting, seats))
        return decodes + even_share(pending, target - decodes) if decodes < target else target


def even_share(pending: int, room: int) -> int:
    """Tokens per pass when `pending` tokens are split evenly over the fewest passes of at most
    `room` tokens each (all of them if they fit in one)."""
    if pending <= room:
        return room  # everything fits: the budget is no constraint
    passes = -(-pending // room)
    return -(-pending // passes)


def _head(waiting, k: int) -> Iterable[Request]:
    """The first `k` waiting requests in queue order (the ones that could take a seat this step)."""
    head = getattr(waiting, "head", None)
    return head(k) if head is not None else list(waiting)[:k]


def make_chunk_policy(config: EngineConfig) -> SarathiChunking:
    """The policy `config.chunk_policy` names (EngineConfig has checked the name)."""
    return (SplitFuseChunking if config.chunk_policy == "splitfuse" else SarathiChunking)(config)
