"""The worker side of the plan boundary: a persistent input batch and the model runner.

- `input_batch.InputBatch` — rows per request (token ids, block table, sampling parameters), updated by plan diffs.
- `model_runner.ModelRunner` — the KV pool, the forward pass, `execute_model(plan) -> ModelRunnerOutput`;
  it samples with `minillm.sampling` and asks its attention backend for the step's metadata; a small
  decode step runs compiled instead (`minillm.model.decode_step`).
- `threads` — how many torch threads a step uses, by its size and dtype.
- `step_counts` — one step's Python calls and torch ops, per piece (bench/step_profile.py, tests).
"""

from minillm.worker.model_runner import ModelRunner, StepInputs, WorkerStats

__all__ = ["ModelRunner", "StepInputs", "WorkerStats"]
