"""Continuous (iteration-level) batching, Orca-style (chapter 04).

Every step the batch is rebuilt: requests that finished last step are already gone, running
requests each get their next token(s), and waiting requests join while the token budget
(`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and the KV pool allow. Nobody
waits for the slowest member of a batch.

If the KV pool cannot hold a running request's next token, the most recently admitted request is
preempted: its KV is freed and it goes back to the front of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque

from minillm.config import EngineConfig
from minillm.kv.base import KVManager
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ScheduledBatch


class ContinuousScheduler:
    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

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
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was the victim
            scheduled.append(req)
            counts.append(n)
            budget -= n
            i += 1

        # 2. Then admit waiting requests, oldest first, while there is room.
        while self.waiting and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            req.num_computed_tokens = self.kv.get_computed_tokens(req)  # a cached prefix is not recomputed
            n = req.num_tokens - req.num_computed_tokens
            if n > budget or not self.kv.can_admit(req, n) or not self.kv.allocate(req, n):
                self.kv.free(req)  # let go of any cached prefix blocks it had attached
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
            counts.append(n)
            budget -= n

        if not scheduled:
            return None
        # Decode rows (one token after a prefill) first: the attention backend batches them.
        order = sorted(range(len(scheduled)), key=lambda j: not (counts[j] == 1 and scheduled[j].num_computed_tokens))
        return ScheduledBatch([scheduled[j] for j in order], [counts[j] for j in order], preempted=preempted)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
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
                    req.status = RequestStatus.FINISHED_ABORTED
                    return req
        return None
