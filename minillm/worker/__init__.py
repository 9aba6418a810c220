"""The worker side of the plan boundary: a persistent input batch, the model runner and its sampler.

- `input_batch.InputBatch` — rows per request (token ids, block table, sampling parameters), updated by plan diffs.
- `model_runner.ModelRunner` — the KV pool, the forward pass, `execute_model(plan) -> ModelRunnerOutput`.
- `sampler.sample` — the step's rows sampled together from the input batch's arrays.
"""

from minillm.worker.model_runner import ModelRunner, StepInputs, group_by_length

__all__ = ["ModelRunner", "StepInputs", "group_by_length"]
