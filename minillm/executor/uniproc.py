"""One worker in the engine's own process (vLLM's `UniProcExecutor`).

The executor is where the plan becomes data: `SchedulerOutputBuilder` turns the scheduler's
`ScheduledBatch` into a `SchedulerOutput` (ids and plain values only), and the worker sees nothing
else — exactly what a worker in another process would receive, pickled (tests/test_worker_subprocess.py
runs one). If the step fails, the builder forgets what the failed plan told the worker, so the
next plan sends those requests whole.
"""

from __future__ import annotations

import torch

from minillm.scheduler.base import ModelRunnerOutput, ScheduledBatch
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder
from minillm.worker.model_runner import ModelRunner


class UniProcExecutor:
    def __init__(self, worker: ModelRunner, kv) -> None:
        """`kv`: the scheduler's KV manager, whose block tables the plans describe."""
        self.worker = worker
        self.plans = SchedulerOutputBuilder(kv)

    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        plan = self.plans.build(batch)
        try:
            return self.execute_model(plan)
        except BaseException:
            self.plans.invalidate(plan)
            raise

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(plan)

    def step_duration_s(self) -> float:
        """Real time passes by itself: nothing to charge a clock."""
        return 0.0

    # ---- looking inside one step (chapter 04 prints these) -----------------------------------------
    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, object, list[int]]:
        """(input_ids [T], positions [T], attention metadata, flattened rows whose logits are computed)
        of `batch`, without running the model."""
        plan = self.plans.build(batch)
        self.worker.update_state(plan)
        inputs = self.worker.prepare(plan)
        return inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows

    def compute_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[str]]:
        """Run the model on `batch` without sampling: logits of the rows that sample, and their request ids."""
        plan = self.plans.build(batch)
        self.worker.update_state(plan)
        logits, inputs = self.worker.compute_logits(plan)
        return logits, [plan.req_ids[i] for i in inputs.sampled]
