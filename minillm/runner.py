"""Where the model runner used to live: it is the worker's now (`minillm.worker.model_runner`).

Kept so that `from minillm.runner import ModelRunner, group_by_length` goes on working.
"""

from minillm.worker.model_runner import KEY_READ_SLACK, ModelRunner, StepInputs, group_by_length

__all__ = ["KEY_READ_SLACK", "ModelRunner", "StepInputs", "group_by_length"]
