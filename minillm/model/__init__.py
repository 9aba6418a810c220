"""The Llama-family model that minillm runs itself, and how it is loaded."""

from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaModel
from minillm.model.loader import load_hf_model, load_model_dir

__all__ = ["LlamaModel", "ModelConfig", "load_hf_model", "load_model_dir"]
