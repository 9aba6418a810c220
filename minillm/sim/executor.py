"""The simulator's stand-in for the model: it charges each step the roofline cost model's time.

Chapters 02–08 run the real scheduler and KV manager on a simulated clock with it, so a laptop can
show what a 7B model on an A100 would do. It follows the same contract as `ModelRunner`
(`execute(batch) -> (rows, tokens)` and `step_duration_s()`) but computes nothing: every row that
needs a next token gets `token_id`, and the trace's output lengths are enforced by
`SamplingParams(max_tokens=..., ignore_eos=True)`. What it does compute is how long the step would
have taken (`minillm.sim.cost_model.step_time`), which the engine adds to its clock.
"""

from __future__ import annotations

from minillm.request import Request
from minillm.scheduler.base import ScheduledBatch
from minillm.sim.cost_model import StepCost, step_time
from minillm.sim.hardware import Hardware
from minillm.sim.model_shapes import ModelShape


class SimExecutor:
    def __init__(self, hw: Hardware, shape: ModelShape, token_id: int = 0) -> None:
        """`token_id`: the dummy token every sampled row receives (keep it a non-EOS id)."""
        self.hw = hw
        self.shape = shape
        self.token_id = token_id
        self.costs: list[StepCost] = []  # one per executed step, for inspection and plots

    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], list[int]]:
        """Cost the step and return the requests that get a next token, each with `token_id`.

        Rows are classified as the real runner does: one new token after a computed context is a
        decode (it reads `start + 1` keys); anything else is a prefill of `n` tokens after `start`
        cached ones (a whole prompt, a chunk, a recompute after preemption, or 1+k speculated).
        """
        rows: list[Request] = []
        prefill_tokens: list[int] = []
        prefill_context: list[int] = []
        decode_context_lens: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens  # the engine increments it after execute()
            if n == 1 and start > 0:
                decode_context_lens.append(start + 1)
            else:
                prefill_tokens.append(n)
                prefill_context.append(start)
            if start + n == req.num_tokens:  # caught up with its known tokens: sample one more
                rows.append(req)
        cost = step_time(self.hw, self.shape, prefill_tokens=prefill_tokens, prefill_context=prefill_context,
                         decode_context_lens=decode_context_lens, padding_tokens=batch.num_padding_tokens)
        self.costs.append(cost)
        return rows, [self.token_id] * len(rows)

    def step_duration_s(self) -> float:
        """Predicted time of the last executed step: the simulated clock advances by it."""
        return self.costs[-1].time_s if self.costs else 0.0
