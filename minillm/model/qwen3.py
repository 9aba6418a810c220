"""Qwen3 (chapter 00): Llama with an RMSNorm over each query and key head before RoPE (`q_norm`,
`k_norm`, weights of `head_dim`), biases on q/k/v/o only when `attention_bias` (off in the released
models), `head_dim` read from the config (not hidden ÷ heads), and Qwen's sliding-window rule."""

from __future__ import annotations

from minillm.model.llama import LlamaModel
from minillm.model.qwen2 import qwen_sliding_windows


class Qwen3Model(LlamaModel):
    @classmethod
    def hf_config_fields(cls, cfg: dict, num_layers: int) -> dict:
        return {**super().hf_config_fields(cfg, num_layers), "qk_norm": True,
                "sliding_windows": qwen_sliding_windows(cfg, num_layers)}
