"""The model's shape, read from an HF ``config.json`` (chapter 00).

minillm runs the Llama family itself. Llama, Mistral and Qwen2 differ only in a few switches
(q/k/v bias, tied embeddings, sliding windows, RoPE scaling), so one dataclass describes them all.
Mixtral is Mistral with a mixture-of-experts MLP (chapter 12): `num_experts` SwiGLU experts of
`intermediate_size` each and a router that picks `num_experts_per_tok` of them per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
# Mixture-of-experts families minillm does not run: their routers differ from Mixtral's (shared
# experts, grouped or biased top-k, no renormalisation...), so they are refused by name.
OTHER_MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "olmoe",
                         "granitemoe", "phimoe", "llama4", "gpt_oss")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None  # llama3-style scaling, or None
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0  # Mixtral's num_local_experts; 0 = a dense MLP
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers: 2 · L · H_kv · D · bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        expert_keys = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)]
        if model_type in OTHER_MOE_MODEL_TYPES or (expert_keys and model_type != "mixtral"):
            raise ValueError(
                f"unsupported model_type {model_type!r}: a mixture-of-experts family minillm does not run; "
                "of MoE models minillm runs only 'mixtral' (softmax router, top-k renormalised, no shared experts)"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; minillm runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")

        # transformers 5 nests RoPE settings in `rope_parameters`; older files use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; minillm supports 'default' and 'llama3'")
        rope_scaling = dict(scaling) if rope_type == "llama3" else None

        num_layers = cfg["num_hidden_layers"]
        num_experts, top_k = _experts(cfg, model_type)
        windows = _sliding_windows(cfg, model_type, num_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            sliding_windows=windows,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
        )


def _experts(cfg: dict[str, Any], model_type: str) -> tuple[int, int]:
    """(num_experts, experts per token) of a Mixtral config; (0, 0) for the dense families."""
    if model_type != "mixtral":
        return 0, 0
    num_experts, top_k = cfg.get("num_local_experts"), cfg.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"mixtral config: num_local_experts={num_experts!r}, num_experts_per_tok={top_k!r}; expected integers "
            "with 1 <= num_experts_per_tok <= num_local_experts"
        )
    return num_experts, top_k


def _sliding_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Which layers look only at the last `sliding_window` tokens (Mistral; Qwen2 when enabled)."""
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if model_type == "llama" or window is None:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type == "qwen2":
        first = cfg.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers
