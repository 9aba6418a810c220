"""One worker in the engine's own process (vLLM's `UniProcExecutor`).

The executor is where the plan becomes data: `SchedulerOutputBuilder` turns the scheduler's
`SchedulerPlan` into a `SchedulerOutput` (ids and plain values only), and the worker sees nothing
else — exactly what a worker in another process would receive, pickled (tests/test_worker_subprocess.py
runs one). `execute(batch)` and the rollback of a failed plan come from `abstract.WorkerExecutor`,
shared with the multi-process executor.
"""

from __future__ import annotations

import torch

from minillm.executor.abstract import WorkerExecutor
from minillm.scheduler.base import ModelRunnerOutput, SchedulerPlan
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder
from minillm.worker.model_runner import ModelRunner, StepInputs, WorkerStats


class UniProcExecutor(WorkerExecutor):
    def __init__(self, worker: ModelRunner, kv) -> None:
        """`kv`: the scheduler's KV manager, whose block tables the plans describe."""
        self.worker = worker
        self.plans = SchedulerOutputBuilder(kv)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(plan)

    def stats(self, reset: bool = False) -> WorkerStats:
        """The worker's counters (bench/ladder.py reads them, zeroed after its warm-up)."""
        return self.worker.stats(reset)

    @property
    def attention_backend(self) -> str:
        """The backend the worker resolved ("auto" → what this device and dtype use)."""
        return self.worker.attention_backend

    @property
    def model(self):
        """The worker's model (in this process, one can look at it)."""
        return self.worker.model

    # ---- looking inside one step (chapter 04 prints these) -----------------------------------------
    def prepare(self, batch: SchedulerPlan) -> StepInputs:
        """The model inputs of `batch` without running the model: unpacks as (input_ids [T],
        positions [T], attention metadata, flattened rows whose logits are computed); `.order`
        gives the plan row of each flattened sequence."""
        plan = self.plans.build(batch)
        self.worker.update_state(plan)
        return self.worker.prepare(plan)

    def compute_logits(self, batch: SchedulerPlan) -> tuple[torch.Tensor, list[str]]:
        """Run the model on `batch` without sampling: logits of the rows that sample, and their request ids."""
        plan = self.plans.build(batch)
        self.worker.update_state(plan)
        logits, inputs = self.worker.compute_logits(plan)
        return logits, [plan.req_ids[i] for i in inputs.sampled]
