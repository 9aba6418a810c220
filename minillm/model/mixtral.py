"""Mixtral (chapter 12): Mistral whose MLPs are mixtures of experts — `num_local_experts` SwiGLU
experts and a router that sends each token to `num_experts_per_tok` of them, their probabilities
renormalised (minillm/model/moe.py)."""

from __future__ import annotations

from minillm.model.config import expert_counts
from minillm.model.mistral import MistralModel
from minillm.model.moe import MIXTRAL_EXPERT_NAMES


class MixtralModel(MistralModel):
    is_moe_family = True
    expert_names = MIXTRAL_EXPERT_NAMES

    @classmethod
    def hf_config_fields(cls, cfg: dict, num_layers: int) -> dict:
        return {**super().hf_config_fields(cfg, num_layers), **expert_counts(cfg, "num_local_experts")}
