"""Executors: who runs the plan (chapter 04; more processes come with the parallelism chapters).

- `abstract.Executor` — the protocol the engine calls: `execute(batch)`, `step_duration_s()`, `check_health()`,
  `shutdown()`, `stats()`; `abstract.ExecutorBase` — their defaults for a stand-in;
  `abstract.WorkerExecutor` — `execute(batch)` for executors with workers: the plan built as data, forgotten if the step fails.
- `uniproc.UniProcExecutor` — one worker in this process.
- `multiproc.MultiprocExecutor` — one process per tensor/pipeline-parallel rank (chapter 12; forked where
  safe, see `start_method`),
  built by `LLM(tensor_parallel_size=..., pipeline_parallel_size=...)`; a failed rank raises
  `abstract.EngineDeadError`.
- `external_launcher.ExternalLauncherExecutor` — under torchrun, this process's one rank; every process
  is an engine with its own scheduler, planning the same steps (`distributed_executor_backend="external_launcher"`).

A driver-side stand-in (the simulator's `SimExecutor`, tests' and graders' fakes) implements the
same protocol and reads the scheduler's plan directly; an executor with workers turns it into the
data that crosses, `SchedulerOutput`, and calls `execute_model(plan)` on each worker.
"""

from minillm.executor.abstract import Executor, ExecutorBase
from minillm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "ExecutorBase", "UniProcExecutor"]
