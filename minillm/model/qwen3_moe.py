"""Qwen3-MoE (chapter 12): Qwen3 whose MLPs are mixtures of experts — `num_experts` SwiGLU experts of
`moe_intermediate_size` and a router that sends each token to `num_experts_per_tok` of them, their
probabilities renormalised to sum to 1 only when `norm_topk_prob` (HF's default: not). minillm runs
the configs whose every layer is an MoE one (`mlp_only_layers` empty, `decoder_sparse_step` 1, as the
released models are)."""

from __future__ import annotations

from minillm.model.config import expert_counts, sliding_windows
from minillm.model.moe import ExpertNames
from minillm.model.qwen3 import Qwen3Model

QWEN3_MOE_EXPERT_NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                                     "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")


class Qwen3MoeModel(Qwen3Model):
    is_moe_family = True
    expert_names = QWEN3_MOE_EXPERT_NAMES

    @classmethod
    def hf_config_fields(cls, cfg: dict, num_layers: int) -> dict:
        step, dense_only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        dense = [i for i in range(num_layers) if i in dense_only or (i + 1) % step]
        if dense:
            raise ValueError(f"qwen3_moe config: layers {dense} have a dense MLP (mlp_only_layers={dense_only}, "
                             f"decoder_sparse_step={step}); minillm runs Qwen3-MoE models whose every layer is "
                             "MoE (mlp_only_layers=[], decoder_sparse_step=1)")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        # (Qwen's config.json says num_experts; transformers 5 writes it back as num_local_experts)
        experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        return {**super().hf_config_fields(cfg, num_layers), **expert_counts(cfg, experts_key),
                "intermediate_size": cfg["moe_intermediate_size"], "moe_renormalize": bool(cfg.get("norm_topk_prob")),
                "sliding_windows": sliding_windows(cfg, num_layers, window)}
