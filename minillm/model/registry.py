"""Which class runs which HF `model_type` (chapter 00): vLLM's `ModelRegistry`, at minillm's size.

A model family is one file in `minillm/model/` with one class, registered here by one line. The
class is the decoder (`minillm.model.llama.LlamaModel`, or a subclass of it) and says, in
`hf_config_fields`, what its config.json means: biases, sliding windows, experts, q/k norms. Every
other part of minillm asks `model_class(config.model_type)` instead of comparing names.

The entries are "module:Class" strings, imported on first use (as vLLM does): the registry is read
while a config is parsed, before any model module needs to be.
"""

from __future__ import annotations

import importlib

MODELS = {  # model_type -> the class that runs it
    "llama": "minillm.model.llama:LlamaModel",
    "mistral": "minillm.model.mistral:MistralModel",
    "qwen2": "minillm.model.qwen2:Qwen2Model",
    "mixtral": "minillm.model.mixtral:MixtralModel",
    "qwen3": "minillm.model.qwen3:Qwen3Model",
    "qwen3_moe": "minillm.model.qwen3_moe:Qwen3MoeModel",
}

# Mixture-of-experts families minillm does not run: their routers differ from the ones it has
# (shared experts, grouped or biased top-k...), so they are refused by name.
REFUSED_MOE_MODEL_TYPES = ("qwen2_moe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "olmoe", "granitemoe",
                           "phimoe", "llama4", "gpt_oss")


def supported_model_types() -> tuple[str, ...]:
    return tuple(MODELS)


def model_class(model_type: str | None) -> type:
    """The class registered for `model_type`; a ValueError listing what is supported otherwise."""
    if model_type in REFUSED_MOE_MODEL_TYPES:
        moe = [t for t in MODELS if model_class(t).is_moe_family]
        raise ValueError(f"unsupported model_type {model_type!r}: a mixture-of-experts family minillm does not run; "
                         f"of MoE families minillm runs {', '.join(moe)}")
    if model_type not in MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; minillm runs {', '.join(MODELS)}")
    module, _, name = MODELS[model_type].partition(":")
    return getattr(importlib.import_module(module), name)
