"""Static batching: collect a batch, run it to the end, only then start the next (chapter 02).

The batch is fixed when it starts. Prompts are left-padded to the longest; every step computes
every row, including rows that already finished, until the slowest row is done. Requests that
arrive meanwhile wait for the whole batch (head-of-line blocking). A batch starts when
`max_num_seqs` requests wait, when the oldest waited `static_batch_timeout_ms`, or when no more
requests are coming.

Orca (Yu et al., OSDI 2022) names two wastes of request-level batching: finished rows computed
until the batch ends, and finished *results* held back until the batch ends (the server returns
the batch's answers together, as `generate()` on a padded batch does). minillm returns each request
at its own last token by default; `static_hold_finished=True` holds them instead: a finished
request's last token and its completion are delivered in the step that ends its batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minillm.config import EngineConfig
from minillm.kv.padded import PaddedKVManager
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ModelRunnerOutput, RequestUpdate, SchedulerBase, SchedulerPlan


@dataclass
class PaddedStep:
    """What the padded runner needs: every row of the batch (finished ones too) and the width."""

    rows: list[Request]
    num_new: int  # the padded prompt length on the first step, then 1
    is_prefill: bool


class StaticScheduler(SchedulerBase):
    def __init__(self, config: EngineConfig, kv: PaddedKVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.rows: list[Request] = []  # the batch now running, fixed until it ends
        self.held: list[RequestUpdate] = []  # static_hold_finished: finished, not yet returned

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.rows if not r.status.finished)

    @property
    def timeout_s(self) -> float:
        return self.config.static_batch_timeout_ms / 1000

    def should_fire(self, now: float, more_arrivals: bool) -> bool:
        if not self.waiting:
            return False
        full = len(self.waiting) >= self.config.max_num_seqs
        # Compared as `now >= arrival + timeout`, the very sum next_wakeup() returns, so a clock
        # that jumps to the wakeup time always fires (a difference can round just below the timeout).
        return full or not more_arrivals or now >= self.waiting[0].arrival_time + self.timeout_s

    def next_wakeup(self, now: float) -> float | None:
        if self.rows or not self.waiting:
            return None
        return self.waiting[0].arrival_time + self.timeout_s

    def schedule(self, now: float, more_arrivals: bool = True) -> SchedulerPlan | None:
        if self.rows and all(r.status.finished for r in self.rows):
            self.rows = []
            self.kv.end_batch()
        if not self.rows:
            return self._start_batch() if self.should_fire(now, more_arrivals) else None
        live = [r for r in self.rows if not r.status.finished]
        return SchedulerPlan(live, [1] * len(live), num_padding_tokens=len(self.rows) - len(live),
                              padded=PaddedStep(self.rows, 1, is_prefill=False))

    def _start_batch(self) -> SchedulerPlan:
        n = min(len(self.waiting), self.config.max_num_seqs)
        rows = [self.waiting.popleft() for _ in range(n)]
        width = max(r.num_prompt_tokens for r in rows)
        self.kv.start_batch(rows, width + max(r.params.max_tokens for r in rows))
        for r in rows:
            r.status = RequestStatus.RUNNING
        self.rows = rows
        return SchedulerPlan(rows, [r.num_prompt_tokens for r in rows],
                              num_padding_tokens=n * width - sum(r.num_prompt_tokens for r in rows),
                              padded=PaddedStep(rows, width, is_prefill=True),
                              admitted=[(r, RequestStatus.WAITING) for r in rows])

    def update_from_output(self, plan: SchedulerPlan, output: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = super().update_from_output(plan, output)
        if not self.config.static_hold_finished:
            return updates
        # Hold each finishing update (its last token and its status) until no row is live.
        self.held += [u for u in updates if u.finished]
        updates = [u for u in updates if not u.finished]
        if self.rows and all(r.status.finished for r in self.rows):
            updates, self.held = updates + self.held, []
        return updates

    def finish(self, request: Request) -> None:
        """The row stays in the batch (and keeps being computed) until the batch ends."""

    def rollback(self, plan: SchedulerPlan) -> None:
        """A failed first step un-starts the batch (its rows wait again, first in line); a failed
        decode step changed nothing (the padded cache advances only once the forward ends)."""
        if plan.padded is not None and plan.padded.is_prefill:
            for req in plan.padded.rows:
                req.status = RequestStatus.WAITING
            self.waiting.extendleft(reversed(plan.padded.rows))
            self.rows = []
            self.kv.end_batch()

    def has_request(self, request_id: str) -> bool:
        return any(r.request_id == request_id and not r.status.finished for r in list(self.waiting) + self.rows) \
            or any(u.request.request_id == request_id for u in self.held)

    def abort(self, request_id: str) -> Request | None:
        for update in self.held:  # finished but held: aborting it drops what was held
            if update.request.request_id == request_id:
                self.held.remove(update)
                update.request.status = RequestStatus.FINISHED_ABORTED
                return update.request
        for req in list(self.waiting) + self.rows:
            if req.request_id == request_id and not req.status.finished:
                if req in self.waiting:
                    self.waiting.remove(req)
                req.status = RequestStatus.FINISHED_ABORTED
                return req
        return None
