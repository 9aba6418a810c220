"""Exercise 06's references (chapter 06: preemption), private to its grader (see the package docstring).

Variants chapter 06 does not show: the victim is the request whose preemption loses the least work
(fewest computed tokens; under "priority", the least important first), a preempted request comes
back one priority level more important (aging, so it cannot be preempted forever), and the step
makes room for every running request, and `LOOKAHEAD` tokens more each, before planning any of them
(a bulk retraction, as SGLang does for its decode batch) instead of preempting one victim per
refused allocation. Written unlike a
learner's answer on purpose: the copy detector compares learner code with them.
"""

from __future__ import annotations

from itertools import accumulate

from minillm.request import RequestStatus
from minillm.scheduler.base import SchedulerPlan
from minillm.scheduler.continuous import ContinuousScheduler

LOOKAHEAD = 4  # tokens of room the retraction keeps for every running request beyond this step's


def least_work_victim(running, policy):
    """Largest priority value (under "priority"), then fewest computed tokens, then latest admitted."""
    ranked = [((r.priority if policy == "priority" else 0), -r.num_computed_tokens, index, r)
              for index, r in enumerate(running)]
    return max(ranked, key=lambda item: item[:3])[3]


class AgingScheduler(ContinuousScheduler):
    """minillm's continuous scheduler with the least-work victim and preemption with aging."""

    def _pick_victim(self):
        return least_work_victim(self.running, self.config.scheduling_policy)

    def _preempt(self, req, plan):
        self.running = [r for r in self.running if r is not req]
        self.kv.free(req)
        req.num_computed_tokens, req.status = 0, RequestStatus.PREEMPTED
        req.num_preemptions, self.num_preemptions = req.num_preemptions + 1, self.num_preemptions + 1
        req.priority = req.priority - 1  # aging: back in the queue one level more important
        plan.preempted.append(req)
        self.waiting.push(req)


def _retract(scheduler, plan):
    """Preempt victims until every running request has room for its missing tokens and LOOKAHEAD more
    (never the last one)."""
    def shortfall():
        kv = scheduler.kv
        return sum(kv.num_blocks_needed(r, r.num_tokens - r.num_computed_tokens + LOOKAHEAD)
                   for r in scheduler.running) - kv.num_free_blocks

    while len(scheduler.running) > 1 and shortfall() > 0:
        scheduler._preempt(scheduler._pick_victim(), plan)


def _admissions(scheduler, plan, left):
    """Newcomers from the head of the queue while a seat, the budget and the pool allow."""
    out = []
    while scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs and left > 0:
        head = scheduler.waiting.peek()
        need = head.num_tokens - head.num_computed_tokens
        if need > left or not scheduler.kv.allocate(head, need):
            return out
        scheduler.waiting.remove(head)
        plan.admitted.append((head, head.status))
        head.status = RequestStatus.RUNNING
        scheduler.running.append(head)
        out.append((head, need))
        left -= need
    return out


class RetractScheduler(AgingScheduler):
    """The step with a bulk retraction: room for every running request first, then the plan."""

    def schedule(self, now, more_arrivals=True):
        plan, budget = SchedulerPlan([], []), self.config.max_num_batched_tokens
        _retract(self, plan)
        wants = [(r, r.num_tokens - r.num_computed_tokens) for r in self.running]
        rows = [row for row, used in zip(wants, accumulate(n for _, n in wants)) if used <= budget]
        if not all(self.kv.allocate(r, n) for r, n in rows):
            raise RuntimeError("the retraction left too few blocks")
        if not plan.preempted:
            rows += _admissions(self, plan, budget - sum(n for _, n in rows))
        if not rows:
            return None
        decode = {id(r) for r, n in rows if n == 1 and r.num_computed_tokens}
        ordered = [row for row in rows if id(row[0]) in decode] + [row for row in rows if id(row[0]) not in decode]
        plan.requests, plan.num_new_tokens = [r for r, _ in ordered], [n for _, n in ordered]
        return plan
