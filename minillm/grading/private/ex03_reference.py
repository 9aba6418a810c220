"""Exercise 03's references (chapter 03: dynamic batching with a deadline per request), private to its grader.

Chapter 03's rule has one delay for everyone, counted from the oldest request. The exercise gives
each request its own longest wait (interactive requests, priority 0, a tenth of the delay): a batch
fires when it is full or when *any* waiting request has reached its deadline, and the engine must
wake at the earliest deadline. Written unlike a learner's answer on purpose: the copy detector
compares learner code with it.
"""

from __future__ import annotations

from minillm.scheduler.dynamic import DynamicScheduler


def fires(now, waiting, max_batch_size):
    """`waiting`: (arrival time, longest wait) pairs, oldest first."""
    deadlines = sorted(arrival + wait for arrival, wait in waiting)
    return bool(deadlines) and (len(deadlines) >= max_batch_size or deadlines[0] <= now)


def longest_wait_s(priority, delay_s):
    return delay_s / 10 if priority == 0 else delay_s


class DeadlineScheduler(DynamicScheduler):
    """minillm's dynamic batcher with a deadline per request."""

    def _deadlines(self):
        return [r.arrival_time + longest_wait_s(r.priority, self.timeout_s) for r in self.waiting]

    def should_fire(self, now, more_arrivals):
        return fires(now, [(r.arrival_time, longest_wait_s(r.priority, self.timeout_s)) for r in self.waiting],
                     self.config.max_num_seqs)

    def next_wakeup(self, now):
        return None if self.rows or not self.waiting else min(self._deadlines())
