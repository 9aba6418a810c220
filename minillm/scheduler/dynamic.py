"""Dynamic batching, as Triton's dynamic batcher does it (chapter 03).

Still batch-synchronous — a batch runs to its end before the next starts — but a batch fires as
soon as `max_num_seqs` requests wait *or* the oldest has waited `max_queue_delay_ms`: a bounded
wait for company instead of waiting for a full batch.
"""

from __future__ import annotations

from minillm.scheduler.static import StaticScheduler


class DynamicScheduler(StaticScheduler):
    @property
    def timeout_s(self) -> float:
        return self.config.max_queue_delay_ms / 1000

    def should_fire(self, now: float, more_arrivals: bool) -> bool:
        if not self.waiting:
            return False
        full = len(self.waiting) >= self.config.max_num_seqs
        return full or now >= self.waiting[0].arrival_time + self.timeout_s
