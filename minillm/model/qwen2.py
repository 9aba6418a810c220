"""Qwen2 (chapter 00): Llama with biases on q, k and v (none on o), and a sliding window only when
`use_sliding_window` is set, on the layers from `max_window_layers` on."""

from __future__ import annotations

from minillm.model.config import sliding_windows
from minillm.model.llama import LlamaModel


class Qwen2Model(LlamaModel):
    @classmethod
    def hf_config_fields(cls, cfg: dict, num_layers: int) -> dict:
        return {**super().hf_config_fields(cfg, num_layers), "qkv_bias": True, "o_bias": False,
                "sliding_windows": qwen_sliding_windows(cfg, num_layers)}


def qwen_sliding_windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Qwen's rule: no window unless `use_sliding_window`; then `layer_types`, or the layers from
    `max_window_layers` on."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    if window is None or cfg.get("layer_types"):
        return sliding_windows(cfg, num_layers, window)
    first = cfg.get("max_window_layers", num_layers)
    return tuple(window if i >= first else None for i in range(num_layers))
