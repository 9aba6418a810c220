"""Seat utilisation: the share of a batch's seats doing useful work over a run (chapter 04).

The seeds say continuous batching raises "GPU utilisation" from the 10-20 % typical of static
batching to 60-80 % (a 70B model on real long-tailed traffic). Chapter 04 measures the same idea on
the simulator: a batch has `max_num_seqs` seats; a seat is *useful* during a step when it holds a
request that is still prefilling or generating, and *wasted* when it is empty or holds a row that
already finished (static and dynamic batching compute such rows until the batch's longest ends).
Time with no step at all (a batcher waiting for company) counts as empty seats. So

    seat utilisation = sum over steps of (useful rows x step time) / (seats x wall time of the run)

where the wall time runs from the start of the first step to the end of the last.
"""

from __future__ import annotations

from collections.abc import Sequence

from minillm.metrics import StepRecord


def useful_rows(step: StepRecord) -> int:
    """Rows of `step` holding a request that is still working: every row of a step with a prefill
    (prompt pads sit inside rows), the decoding rows otherwise (finished rows are padding)."""
    return step.num_seqs if step.num_prefill_tokens > 0 else step.num_decode_tokens


def seat_utilisation(steps: Sequence[StepRecord], seats: int) -> float:
    """Useful seat-seconds over all seat-seconds of the run (0 to 1)."""
    if seats < 1:
        raise ValueError(f"seats must be at least 1 (the engine's max_num_seqs), got {seats}")
    if not steps:
        raise ValueError("seat_utilisation needs the steps of a run, got none")
    wall_s = steps[-1].start_time + steps[-1].duration_s - steps[0].start_time
    if wall_s <= 0:
        raise ValueError(f"the run's steps span {wall_s} s; a utilisation needs a positive wall time")
    return sum(useful_rows(s) * s.duration_s for s in steps) / (seats * wall_s)
