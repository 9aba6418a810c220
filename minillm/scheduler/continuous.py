"""Continuous (iteration-level) batching, Orca-style (chapter 04), with preemption (chapter 06).

Every step the batch is rebuilt: requests that finished last step are already gone, running
requests each get their next token(s), and waiting requests join while the token budget
(`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and the KV pool allow. Nobody
waits for the slowest member of a batch.

When the KV pool cannot hold a running request's next token, a victim is preempted — the most
recently admitted one under `scheduling_policy="fcfs"`, the lowest-priority one under
`"priority"` — and goes back to the front of the queue. With `preemption_mode="recompute"` its
K/V are dropped and recomputed when it returns; with `"swap"` they are copied to host memory
and copied back.

With prefix caching, `scheduling_policy="lpm"` (SGLang's longest prefix match, chapter 07) admits
first the waiting request with the most tokens already cached (ties: earliest arrival), so requests
that share a prefix run while it is still cached instead of being evicted by requests in between.
"""

from __future__ import annotations

from collections import deque

from minillm.config import EngineConfig
from minillm.kv.base import KVManager
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ScheduledBatch

# Beyond this many waiting requests LPM falls back to queue order, as SGLang does: ranking costs a
# prefix-cache walk per waiting request per step.
LPM_MAX_WAITING = 128


class ContinuousScheduler:
    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        if self.config.scheduling_policy == "priority":  # lower value first, then arrival (stable sort)
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.priority))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def next_wakeup(self, now: float) -> float | None:
        return None

    def schedule(self, now: float, more_arrivals: bool = True) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []

        # 1. Running requests first: each wants the rest of its known tokens (1 when decoding).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                break
            while not self.kv.allocate(req, n):
                victim = self._pick_victim(exclude=scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req itself was the victim: the next running request now sits at index i
            scheduled.append(req)
            counts.append(n)
            budget -= n
            i += 1

        # 2. Then admit waiting requests in queue order while there is room (LPM reorders it first).
        if self.config.scheduling_policy == "lpm" and self.waiting and not preempted:
            self._sort_by_cached_prefix()
        while self.waiting and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._try_admit(req, budget):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = req.num_tokens - req.num_computed_tokens
            scheduled.append(req)
            counts.append(n)
            budget -= n

        if not scheduled:
            return None
        # Decode rows (one token after a prefill) first: the attention backend batches them.
        order = sorted(range(len(scheduled)), key=lambda j: not (counts[j] == 1 and scheduled[j].num_computed_tokens))
        return ScheduledBatch([scheduled[j] for j in order], [counts[j] for j in order], preempted=preempted)

    def _sort_by_cached_prefix(self) -> None:
        """LPM: longest cached prefix first, then earliest arrival (stable for equal arrival times)."""
        cached = getattr(self.kv, "cached_prefix_tokens", None)
        if cached is None or len(self.waiting) > LPM_MAX_WAITING:
            return
        self.waiting = deque(sorted(self.waiting, key=lambda r: (-cached(r), r.arrival_time)))

    def _try_admit(self, req: Request, budget: int) -> bool:
        """Reserve KV for a waiting request (swapped back in, or with any cached prefix attached)."""
        swapped = getattr(self.kv, "is_swapped", None)
        if swapped is not None and swapped(req):
            n = req.num_tokens - req.num_computed_tokens
            return n <= budget and self.kv.swap_in(req, n)
        req.num_computed_tokens = self.kv.get_computed_tokens(req)  # a cached prefix is not recomputed
        n = req.num_tokens - req.num_computed_tokens
        if n <= budget and self.kv.can_admit(req, n) and self.kv.allocate(req, n):
            return True
        self.kv.free(req)  # let go of any cached prefix blocks it had attached
        req.num_computed_tokens = 0
        return False

    def _pick_victim(self, exclude: list[Request]) -> Request:
        """FCFS and LPM: the most recently admitted. Priority: the lowest priority (largest value), latest first.
        Requests already planned for this step are kept if anyone else can go."""
        candidates = [r for r in self.running if r not in exclude] or self.running
        if self.config.scheduling_policy == "priority":
            return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self.config.preemption_mode == "swap" and hasattr(self.kv, "swap_out"):
            self.kv.swap_out(req)  # keeps num_computed_tokens: nothing is recomputed
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.kv.free(req)
                    if hasattr(self.kv, "drop_swapped"):
                        self.kv.drop_swapped(req)
                    req.status = RequestStatus.FINISHED_ABORTED
                    return req
        return None
