"""How many torch threads a step runs on: as many as pay for its size (chapter 04; issue 29).

A small model's step is a few hundred small ops; splitting each over two threads adds a hand-off per
op that costs more than the half of the work it saves, and on a machine whose cores are shared
(this course's 2-core VM) a thread that waits for a core stalls every op it takes part in. Measured
on that VM at batch 1 (issue 29): llama.cpp 794–822 tok/s on 1 thread, 186–196 on 2; minillm
491–520 and 218–227. A big step (a long prefill) has enough work per op for a second thread to pay
— on a machine where that thread gets a core of its own.

So the worker picks the thread count per step from its number of tokens and the model's dtype,
with `THREADS_BY_TOKENS`: per dtype, (fewest tokens, threads) steps, ascending. `python
bench/threads.py` measures a forward pass of each size on 1 … N threads (interleaved rounds,
ratios with their spread) and prints the table for the machine it runs on: a count pays where its
worst round is ≥ 1.10× one thread, there and at every larger size. On the course's 2-core VM,
quiet (2026-12-02 14:00 UTC, load average 1.0, 5 rounds of 20 steps; 2 threads ÷ 1, median (range)):

    float32   decode    8 / 16 / 64 rows     0.89 (0.87–1.14)  1.26 (0.86–1.63)  1.43 (1.26–1.49)
    float32   prefill  64 / 256 / 1024 tok   1.07 (0.74–1.09)  1.25 (1.07–1.43)  1.61 (1.52–1.99)
    bfloat16  decode    8 / 16 / 64 rows     0.95 (0.92–1.02)  1.02 (0.93–1.04)  0.97 (0.97–1.02)
    bfloat16  prefill  64 / 256 tok          0.99 (0.92–1.06)  1.00 (0.93–1.04)   (1024: not finished)

so float32 steps of 1024 tokens or more take a second thread and everything smaller keeps one (a
64-token prefill once ran at 0.74× on two); bfloat16 (no native bf16 matmul on this CPU) and float64
(the parity tests' dtype) keep one thread for every step. The engine never uses more threads than
torch had when it started (`torch.get_num_threads()`, i.e. `OMP_NUM_THREADS` or the core count), and
`num_threads=` (`LLM(num_threads=2)`, `minillm serve --num-threads 2`) fixes the count instead.

The compiled decode step (minillm/model/decode_step.py) runs on one thread whatever this says:
numba's loops are not split.
"""

from __future__ import annotations

import bisect

import torch

# dtype -> [(fewest tokens in the step, threads), ...], ascending; a dtype not listed runs on 1 thread.
THREADS_BY_TOKENS: dict[torch.dtype, list[tuple[int, int]]] = {
    torch.float32: [(1, 1), (1024, 2)],
    torch.bfloat16: [(1, 1)],
    torch.float64: [(1, 1)],
}


def threads_for(num_tokens: int, dtype: torch.dtype, available: int,
                table: dict[torch.dtype, list[tuple[int, int]]] | None = None) -> int:
    """Threads for a step of `num_tokens` tokens in `dtype`, at most `available`."""
    steps = (THREADS_BY_TOKENS if table is None else table).get(dtype) or [(1, 1)]
    i = bisect.bisect_right([tokens for tokens, _ in steps], num_tokens) - 1
    return max(1, min(available, steps[max(i, 0)][1]))


class StepThreads:
    """The worker's thread setter. A fixed count, or a table with one row for the dtype, is set once,
    here (`per_step` False: the worker then calls nothing per step); otherwise `apply(num_tokens)`
    before a step's forward sets torch's count when it changes."""

    def __init__(self, dtype: torch.dtype, num_threads: int | None = None) -> None:
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1 or None (the step's rule), got {num_threads!r}")
        self.dtype = dtype
        self.fixed = num_threads
        self.available = torch.get_num_threads()
        self.current = self.available
        steps = THREADS_BY_TOKENS.get(dtype) or [(1, 1)]
        # one row in the table: the same count for every step, found once
        self.constant = min(self.available, steps[0][1]) if len(steps) == 1 else None
        self.per_step = self.fixed is None and self.constant is None
        if not self.per_step:
            self.apply(0)

    def apply(self, num_tokens: int) -> int:
        n = self.fixed or self.constant or threads_for(num_tokens, self.dtype, self.available)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
        return n
