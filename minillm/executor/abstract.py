"""What the engine asks of an executor (chapter 04).

`Executor` lists every method the engine calls; nothing is probed for. `ExecutorBase` gives a
stand-in the defaults of an executor with nothing to watch (no processes, no counters), so a
driver-side stand-in (the simulator's, a test's or an exercise's) writes `execute` and, if its
clock is simulated, `step_duration_s`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from minillm.scheduler.base import ModelRunnerOutput, SchedulerPlan
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder

if TYPE_CHECKING:
    from minillm.worker.model_runner import WorkerStats


class EngineDeadError(RuntimeError):
    """The executor can run no more steps (a worker process died, hung or failed): vLLM's name."""


class Executor(Protocol):
    def execute(self, batch: SchedulerPlan) -> ModelRunnerOutput:
        """Run the scheduler's plan for one step; per planned request, the tokens it sampled.
        Raises if the step failed (the engine then rolls the plan back)."""
        ...

    def step_duration_s(self) -> float:
        """Time to charge a simulated clock for the last step (0: real time passes by itself)."""
        ...

    def check_health(self) -> None:
        """Raise `EngineDeadError` if no more steps can run (a worker process died or hung)."""
        ...

    def shutdown(self) -> None:
        """Stop the worker processes, if any (idempotent)."""
        ...

    def stats(self, reset: bool = False) -> WorkerStats | None:
        """The (sampling) worker's counters since start or the last reset, in one value; None for a
        stand-in without a worker. `reset=True` zeroes them after reading (a benchmark's warm-up)."""
        ...


class ExecutorBase:
    """Defaults of an executor with nothing to watch: real time, always healthy, nothing to stop, no counters."""

    def step_duration_s(self) -> float:
        return 0.0

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def stats(self, reset: bool = False) -> WorkerStats | None:
        return None


class WorkerExecutor(ExecutorBase):
    """An executor whose workers see only data: `execute(batch)` turns the scheduler's plan into a
    `SchedulerOutput` (`self.plans`, a `SchedulerOutputBuilder` over the scheduler's KV manager) and
    hands it to `execute_model`. If the step fails, the builder forgets what the failed plan told
    the workers, so the next plan sends those requests whole."""

    plans: SchedulerOutputBuilder

    def execute(self, batch: SchedulerPlan) -> ModelRunnerOutput:
        plan = self.plans.build(batch)
        try:
            return self.execute_model(plan)
        except BaseException:
            self.plans.invalidate(plan)
            raise

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError
