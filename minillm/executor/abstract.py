"""What the engine asks of an executor (chapter 04)."""

from __future__ import annotations

from typing import Protocol

from minillm.scheduler.base import ModelRunnerOutput, ScheduledBatch


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
