"""The model's shape, read from an HF ``config.json`` (chapter 00).

minillm runs the Llama family itself. Llama, Mistral and Qwen2 differ only in a few switches
(q/k/v bias, tied embeddings, sliding windows, RoPE scaling), so one dataclass describes them all.
Mixtral is Mistral with a mixture-of-experts MLP (chapter 12): `num_experts` SwiGLU experts of
`intermediate_size` each and a router that picks `num_experts_per_tok` of them per token.

What is common to every family is read here; what a family's config.json means beyond it (which
switches it sets, how it names its experts' count) is asked of the family's class through the
registry (`minillm.model.registry`): no model type is compared by name in this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    moe_renormalize: bool = True  # the top-k probabilities renormalised to sum to 1 (Mixtral; Qwen3-MoE: norm_topk_prob)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """K and V for one token across all layers: 2 · L · H_kv · D · bytes (a quantized `kv_cache_dtype`,
        chapter 14: 2 · L · H_kv · its bytes per (token, head) row, scales included)."""
        if kv_cache_dtype == "auto":
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
        from minillm.kv.quant import kv_row_bytes

        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(kv_cache_dtype, self.head_dim, dtype_bytes)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        from minillm.model.registry import model_class

        model_type = cfg.get("model_type")
        family = model_class(model_type)  # raises, listing the supported types, for any other
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
        fields = family.hf_config_fields(cfg, num_layers)  # biases, windows, experts, q/k norms: the family's
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        common = dict(
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
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        return cls(**{**common, **fields})  # a family's reading wins over the common one


def expert_counts(cfg: dict[str, Any], experts_key: str) -> dict[str, int]:
    """num_experts and num_experts_per_tok of an MoE config whose expert count is `experts_key`, checked."""
    num_experts, top_k = cfg.get(experts_key), cfg.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{cfg.get('model_type')} config: {experts_key}={num_experts!r}, num_experts_per_tok={top_k!r}; expected "
            f"integers with 1 <= num_experts_per_tok <= {experts_key}"
        )
    return {"num_experts": num_experts, "num_experts_per_tok": top_k}


def sliding_windows(cfg: dict[str, Any], num_layers: int, window: int | None) -> tuple[int | None, ...]:
    """Per layer, the window it attends over (None: every earlier token): `layer_types` when the config
    lists them, else `window` on every layer."""
    if window is None:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * num_layers
