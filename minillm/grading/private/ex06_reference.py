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

from minillm.request import RequestStatus
from minillm.scheduler.base import ScheduledBatch
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


class RetractScheduler(AgingScheduler):
    """The step with a bulk retraction: room for every running request first, then the plan."""

    def schedule(self, now, more_arrivals=True):
        plan = ScheduledBatch([], [])

        def shortfall():
            need = sum(self.kv.num_blocks_needed(r, r.num_tokens - r.num_computed_tokens + LOOKAHEAD)
                       for r in self.running)
            return need - self.kv.num_free_blocks

        while len(self.running) > 1 and shortfall() > 0:  # the last one runs on what the pool has
            self._preempt(self._pick_victim(), plan)
        rows, left = [], self.config.max_num_batched_tokens
        for req in list(self.running):
            n = req.num_tokens - req.num_computed_tokens
            if n > left:
                break
            if not self.kv.allocate(req, n):
                raise RuntimeError("the retraction left too few blocks")
            rows.append((req, n))
            left -= n
        while not plan.preempted and self.waiting and len(self.running) < self.config.max_num_seqs and left > 0:
            head = self.waiting.peek()
            n = head.num_tokens - head.num_computed_tokens
            if n > left or not self.kv.allocate(head, n):
                break
            self.waiting.remove(head)
            plan.admitted.append((head, head.status))
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            rows.append((head, n))
            left -= n
        if not rows:
            return None
        decode = [row for row in rows if row[1] == 1 and row[0].num_computed_tokens]
        plan.requests = [r for r, _ in decode] + [r for r, n in rows if (r, n) not in decode]
        plan.num_new_tokens = [n for _, n in decode] + [n for r, n in rows if (r, n) not in decode]
        return plan
