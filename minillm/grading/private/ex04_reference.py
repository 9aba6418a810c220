"""Exercise 04's references (chapter 04: continuous batching with fixed seats), private to its grader.

The exercise's scheduler keeps a batch of `max_num_seqs` fixed seats instead of chapter 04's list in
admission order: a request keeps its seat from admission to the end, a newcomer takes the lowest free
seat, and running requests are planned in seat order. `SeatScheduler` is that scheduler (tasks 2 and
3 compare plans with it); `AdmitHarness` is all of it but `admit` (task 2 grades the learner's
`admit` inside it); `retired` is what task 1's `retire` leaves in the seats.
"""

from __future__ import annotations

from collections import deque

from minillm.request import RequestStatus
from minillm.scheduler.base import SchedulerBase, SchedulerPlan

LEARNER_TOOLS = {"AdmitHarness": (2,)}  # task 2 runs the learner's admit inside it: its methods are lent then


def retired(seats):
    """The seats after a step: a finished request's seat is empty (None), every other one unchanged."""
    return [None if req is not None and req.status.finished else req for req in seats]


class AdmitHarness(SchedulerBase):
    """The seat scheduler without `admit`."""

    def __init__(self, config, kv):
        self.config, self.kv = config, kv
        self.waiting = deque()
        self.seats = [None] * config.max_num_seqs

    def add_request(self, request):
        self.waiting.append(request)

    @property
    def num_waiting(self):
        return len(self.waiting)

    @property
    def num_running(self):
        return sum(req is not None for req in self.seats)

    def next_wakeup(self, now):
        return None

    def has_request(self, request_id):
        return any(r is not None and r.request_id == request_id for r in (*self.waiting, *self.seats))

    def finish(self, request):
        for req in self.seats:
            if req is not None and req.status.finished:
                self.kv.free(req)
        self.seats = retired(self.seats)

    def rollback(self, plan):
        raise RuntimeError("the stand-in executor never fails a step")

    def abort(self, request_id):
        return None

    def schedule(self, now, more_arrivals=True):
        # Written unlike a learner's loop on purpose: the copy detector compares learner code with it.
        live = [req for req in self.seats if req is not None]
        wants = [req.num_tokens - req.num_computed_tokens for req in live]
        fits, spent = 0, 0
        while fits < len(live) and spent + wants[fits] <= self.config.max_num_batched_tokens:
            spent, fits = spent + wants[fits], fits + 1
        for req, n in zip(live[:fits], wants[:fits]):
            self.kv.allocate(req, n)
        admitted = list(self.admit(self.config.max_num_batched_tokens - spent))
        rows = list(zip(live[:fits], wants[:fits])) + admitted
        if not rows:
            return None
        is_decode = [n == 1 and bool(req.num_computed_tokens) for req, n in rows]
        rows = [row for row, d in zip(rows, is_decode) if d] + [row for row, d in zip(rows, is_decode) if not d]
        return SchedulerPlan([req for req, _ in rows], [n for _, n in rows],
                              admitted=[(req, RequestStatus.WAITING) for req, _ in admitted])


class SeatScheduler(AdmitHarness):
    """The whole seat scheduler: oldest first, into the lowest free seat, while seat, budget and KV allow."""

    def admit(self, budget):
        out = []
        for seat in [i for i, req in enumerate(self.seats) if req is None]:  # lowest free seat first
            head = self.waiting[0] if self.waiting else None
            need = None if head is None else head.num_tokens - head.num_computed_tokens
            if head is None or need > budget or not self.kv.allocate(head, need):
                return out  # no overtaking: the head does not fit, nobody behind it is looked at
            self.seats[seat] = self.waiting.popleft()
            head.status = RequestStatus.RUNNING
            out.append((head, need))
            budget -= need
        return out
