"""minillm: a small, complete LLM serving engine, built chapter by chapter."""

import os

# Idle OpenMP threads sleep instead of spinning. On a small shared CPU, spinning threads of one
# process slow every other process's torch ops many times over. Only effective if set before
# torch is first imported, so notebooks and tests set it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from minillm.llm import LLM  # noqa: E402
from minillm.request import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
