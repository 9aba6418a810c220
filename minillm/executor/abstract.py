"""What the engine asks of an executor (chapter 04)."""

from __future__ import annotations

from typing import Protocol

from minillm.scheduler.base import ModelRunnerOutput, ScheduledBatch
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder


class EngineDeadError(RuntimeError):
    """The executor can run no more steps (a worker process died, hung or failed): vLLM's name."""


class Executor(Protocol):
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run the scheduler's plan for one step; per planned request, the tokens it sampled.
        Raises if the step failed (the engine then rolls the plan back)."""
        ...

    def step_duration_s(self) -> float:
        """Time to charge a simulated clock for the last step (0: real time passes by itself)."""
        ...


class WorkerExecutor:
    """An executor whose workers see only data: `execute(batch)` turns the scheduler's plan into a
    `SchedulerOutput` (`self.plans`, a `SchedulerOutputBuilder` over the scheduler's KV manager) and
    hands it to `execute_model`. If the step fails, the builder forgets what the failed plan told
    the workers, so the next plan sends those requests whole."""

    plans: SchedulerOutputBuilder

    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        plan = self.plans.build(batch)
        try:
            return self.execute_model(plan)
        except BaseException:
            self.plans.invalidate(plan)
            raise

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError
