"""The simulator's stand-in for the model: it charges each step the roofline cost model's time.

Chapters 02–08 run the real scheduler and KV manager on a simulated clock with it, so a laptop can
show what a 7B model on an A100 would do. It follows the same contract as `ModelRunner`
(`execute(batch) -> ModelRunnerOutput` and `step_duration_s()`) but computes nothing: every row that
needs a next token gets `token_id`, and the trace's output lengths are enforced by
`SamplingParams(max_tokens=..., ignore_eos=True)`. What it does compute is how long the step would
have taken (`minillm.sim.cost_model.step_time`), which the engine adds to its clock.

Chunked prefill (chapter 08) needs nothing special: a chunk is a prefill row of `n` tokens after
`start` computed ones, and a step mixing decodes with a chunk is costed as one batch, so its
arithmetic intensity lies between a pure decode step's and a pure prefill's. Speculative decoding
(chapter 09): a row of 1 + k tokens is costed as a small prefill (the verification), and with
`draft_shape` the draft model's k forward passes are added to the step (`spec_cost.draft_time_s`;
n-gram lookup, `draft_shape=None`, is free).
"""

from __future__ import annotations

import dataclasses

from minillm.executor.abstract import ExecutorBase
from minillm.scheduler.base import ModelRunnerOutput, SchedulerPlan
from minillm.sim.cost_model import StepCost, step_time
from minillm.sim.hardware import Hardware
from minillm.sim.instance_layout import InstanceLayout
from minillm.sim.model_shapes import ModelShape
from minillm.sim.spec_cost import draft_time_s


class SimExecutor(ExecutorBase):
    def __init__(self, hw: Hardware, shape: ModelShape, token_id: int = 0, block_size: int = 16,
                 draft_shape: ModelShape | None = None, layout: InstanceLayout | None = None) -> None:
        """`token_id`: the dummy token every sampled row receives (keep it a non-EOS id);
        `block_size`: the KV block size, to size swap copies; `draft_shape`: the speculative draft
        model, whose forward passes each step's guesses cost (None: guesses are free, as n-gram's);
        `layout`: the engine's TP x PP over several GPUs (chapter 13; None: one GPU)."""
        self.layout = layout
        self.block_size = block_size
        self.draft_shape = draft_shape
        self.draft_s: list[float] = []  # per executed step: time the draft spent guessing (aligned with costs)
        self.hw = hw
        self.shape = shape
        self.token_id = token_id
        self.costs: list[StepCost] = []  # one per executed step, for inspection and plots

    def execute(self, batch: SchedulerPlan) -> ModelRunnerOutput:
        """Cost the step; every request that gets a next token gets `token_id`.

        Rows are classified as the real runner does: one new token after a computed context is a
        decode (it reads `start + 1` keys); anything else is a prefill of `n` tokens after `start`
        cached ones (a whole prompt, a chunk, a recompute after preemption, or 1+k speculated).
        A padded batch (static/dynamic batching) is costed as the full rectangle it computes.
        Swap copies are charged at the hardware's host link bandwidth (PCIe), on top of the step.
        """
        # The scheduler advances num_computed_tokens after execute(): here it is each row's start.
        sampled = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            guesses = batch.spec_token_ids.get(req.request_id, [])
            if req.num_computed_tokens + n != req.num_tokens + len(guesses):
                sampled.append([])  # a prefill chunk short of its prompt's end: nothing to sample
                continue
            # The simulated model always says `token_id`: a guess (speculative decoding) is accepted
            # while it says the same, then the model's own token follows.
            accepted = 0
            while accepted < len(guesses) and guesses[accepted] == self.token_id:
                accepted += 1
            sampled.append([self.token_id] * (accepted + 1))
        if batch.padded is not None:
            cost = self._padded_cost(batch)
        else:
            prefill_tokens: list[int] = []
            prefill_context: list[int] = []
            decode_context_lens: list[int] = []
            for req, n in zip(batch.requests, batch.num_new_tokens):
                start = req.num_computed_tokens
                if n == 1 and start > 0:
                    decode_context_lens.append(start + 1)
                else:
                    prefill_tokens.append(n)
                    prefill_context.append(start)
            cost = self.step_cost(prefill_tokens=prefill_tokens, prefill_context=prefill_context,
                                  decode_context_lens=decode_context_lens, padding_tokens=batch.num_padding_tokens)
        swapped_blocks = sum(len(b) for _, b in batch.blocks_to_swap_out) + sum(len(b) for _, b in batch.blocks_to_swap_in)
        if swapped_blocks:
            block_bytes = self.shape.kv_bytes_per_token(self.hw.dtype_bytes) * self.block_size
            swap_s = swapped_blocks * block_bytes / self.hw.host_link_bytes_per_s
            cost = dataclasses.replace(cost, swap_s=swap_s)
        self.costs.append(cost)
        guessing = [(req.num_computed_tokens + 1, len(batch.spec_token_ids[req.request_id]))
                    for req in batch.requests if batch.spec_token_ids.get(req.request_id)]
        self.draft_s.append(draft_time_s(self.hw, self.draft_shape, [c for c, _ in guessing],
                                         [g for _, g in guessing]))
        return ModelRunnerOutput(sampled)

    def step_cost(self, *, prefill_tokens: list[int], prefill_context: list[int] | None = None,
                  decode_context_lens: list[int], padding_tokens: int = 0) -> StepCost:
        """The cost model's price of one step: one GPU's roofline, or the layout's (`InstanceLayout.step_cost`)."""
        if self.layout is not None:
            return self.layout.step_cost(self.hw, self.shape, prefill_tokens=prefill_tokens,
                                         prefill_context=prefill_context, decode_context_lens=decode_context_lens,
                                         padding_tokens=padding_tokens)
        return step_time(self.hw, self.shape, prefill_tokens=prefill_tokens, prefill_context=prefill_context,
                         decode_context_lens=decode_context_lens, padding_tokens=padding_tokens)

    def _padded_cost(self, batch: SchedulerPlan) -> StepCost:
        """A static/dynamic step computes the whole rectangle, as the padded runner does.

        Every row of the batch, finished ones included, runs `width` query tokens (the padded prompt
        on the first step, then 1), and attention covers the padded keys too: the mask hides pads
        but does not skip their work. Pads thus cost linear FLOPs, attention FLOPs and KV traffic,
        which `padding_tokens` alone would undercount (it charges only the linear layers and KV write).
        """
        step = batch.padded
        num_rows = len(step.rows)
        if step.is_prefill:
            return self.step_cost(prefill_tokens=[step.num_new] * num_rows, decode_context_lens=[])
        # All rows advance together: the padded length is the prompt width plus the decode steps so
        # far, which any live row tells (its outputs so far, minus the one this step consumes).
        prompt_width = max(r.num_prompt_tokens for r in step.rows)
        live = batch.requests[0]
        decodes_done = live.num_computed_tokens - live.num_prompt_tokens
        return self.step_cost(prefill_tokens=[], decode_context_lens=[prompt_width + decodes_done + 1] * num_rows)

    def step_duration_s(self) -> float:
        """Predicted time of the last executed step, drafting included: the simulated clock advances by it."""
        return self.costs[-1].time_s + self.draft_s[-1] if self.costs else 0.0
