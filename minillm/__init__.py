"""minillm: a small, complete LLM serving engine, built chapter by chapter."""

from minillm.llm import LLM
from minillm.request import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
