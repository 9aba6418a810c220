"""One worker in the engine's own process (vLLM's `UniProcExecutor`).

The executor is where the plan becomes data: `SchedulerOutputBuilder` turns the scheduler's
`ScheduledBatch` into a `SchedulerOutput` (ids and plain values only), and the worker sees nothing
else — exactly what a worker in another process would receive, pickled (tests/test_worker_subprocess.py
runs one). `execute(batch)` and the rollback of a failed plan come from `abstract.WorkerExecutor`,
shared with the multi-process executor.
"""

from __future__ import annotations

import torch

from minillm.executor.abstract import WorkerExecutor
from minillm.scheduler.base import ModelRunnerOutput, ScheduledBatch
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder
from minillm.worker.model_runner import ModelRunner, StepInputs


class UniProcExecutor(WorkerExecutor):
    def __init__(self, worker: ModelRunner, kv) -> None:
        """`kv`: the scheduler's KV manager, whose block tables the plans describe."""
        self.worker = worker
        self.plans = SchedulerOutputBuilder(kv)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(plan)

    def step_duration_s(self) -> float:
        """Real time passes by itself: nothing to charge a clock."""
        return 0.0

    # The worker's counters, read (and zeroed) by bench/ladder.py through the engine's executor.
    @property
    def model_time_s(self) -> float:
        return self.worker.model_time_s

    @model_time_s.setter
    def model_time_s(self, value: float) -> None:
        self.worker.model_time_s = value

    @property
    def keys_read(self) -> int:
        return self.worker.keys_read

    @keys_read.setter
    def keys_read(self, value: int) -> None:
        self.worker.keys_read = value

    @property
    def keys_exist(self) -> int:
        return self.worker.keys_exist

    @keys_exist.setter
    def keys_exist(self, value: int) -> None:
        self.worker.keys_exist = value

    @property
    def attention_backend(self) -> str:
        """The backend the worker resolved ("auto" → what this device and dtype use)."""
        return self.worker.attention_backend

    @property
    def model(self):
        """The worker's model (in this process, one can look at it)."""
        return self.worker.model

    # ---- looking inside one step (chapter 04 prints these) -----------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The model inputs of `batch` without running the model: unpacks as (input_ids [T],
        positions [T], attention metadata, flattened rows whose logits are computed); `.order`
        gives the plan row of each flattened sequence."""
        plan = self.plans.build(batch)
        self.worker.update_state(plan)
        return self.worker.prepare(plan)

    def compute_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[str]]:
        """Run the model on `batch` without sampling: logits of the rows that sample, and their request ids."""
        plan = self.plans.build(batch)
        self.worker.update_state(plan)
        logits, inputs = self.worker.compute_logits(plan)
        return logits, [plan.req_ids[i] for i in inputs.sampled]
