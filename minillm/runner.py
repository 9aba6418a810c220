"""Where the model runner used to live: it is the worker's now (`minillm.worker.model_runner`), and the
length groups are the torch attention backend's (`minillm.attention.flat_pool`).

Kept so that `from minillm.runner import ModelRunner, group_by_length` goes on working.
"""

from minillm.attention.flat_pool import KEY_READ_SLACK, group_by_length
from minillm.worker.model_runner import ModelRunner, StepInputs

__all__ = ["KEY_READ_SLACK", "ModelRunner", "StepInputs", "group_by_length"]
