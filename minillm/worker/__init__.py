"""The worker side of the plan boundary: a persistent input batch and the model runner.

- `input_batch.InputBatch` — rows per request (token ids, block table, sampling parameters), updated by plan diffs.
- `model_runner.ModelRunner` — the KV pool, the forward pass, `execute_model(plan) -> ModelRunnerOutput`;
  it samples with `minillm.sampling` and asks its attention backend for the step's metadata.
"""

from minillm.worker.model_runner import ModelRunner, StepInputs, WorkerStats

__all__ = ["ModelRunner", "StepInputs", "WorkerStats"]
