"""Mistral (chapter 00): Llama with a sliding attention window on every layer (or on the layers
`layer_types` names)."""

from __future__ import annotations

from minillm.model.config import sliding_windows
from minillm.model.llama import LlamaModel


class MistralModel(LlamaModel):
    @classmethod
    def hf_config_fields(cls, cfg: dict, num_layers: int) -> dict:
        return {**super().hf_config_fields(cfg, num_layers),
                "sliding_windows": sliding_windows(cfg, num_layers, cfg.get("sliding_window"))}
