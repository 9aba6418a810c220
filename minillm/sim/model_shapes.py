"""Model shapes: parameter counts, weight bytes and KV-cache bytes of Llama-family decoders.

Chapter 01 (kv cache) teaches the KV formula with these presets: every layer stores one key and
one value vector per KV head for every token, so

    KV bytes = 2 (K and V) * num_layers * num_kv_heads * head_dim * seq_len * batch * dtype_bytes

Llama-2-7B in fp16 keeps 0.5 MiB per token, 2 GiB for one 4096-token sequence. Grouped-query
attention (GQA) shares each K/V head among several query heads: `llama-7b-gqa` keeps 8 KV heads
instead of 32 and so needs 4x less KV memory. Chapter 00 uses the weight bytes for the decode bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder: enough to count FLOPs and bytes, no weights."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False  # lm_head reuses the embedding matrix (small models often do)
    qkv_bias: bool = False  # Qwen2 adds a bias to the q, k and v projections
    # how the KV pool stores K/V (chapter 14, minillm.kv.quant): "auto" (dtype_bytes per number), "int8" (1 byte
    # per number + a 4-byte scale per token and head) or "fp8_e4m3" (1 byte)
    kv_cache_dtype: str = "auto"

    @property
    def params_per_layer(self) -> int:
        """Attention (q, k, v, o projections), SwiGLU MLP (gate, up, down) and two RMSNorms."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        return attention + mlp + norms

    @property
    def num_layer_params(self) -> int:
        """Parameters every token is multiplied through: all decoder layers plus the final norm."""
        return self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def embedding_params(self) -> int:
        """The token-embedding table (vocab x hidden); the lm_head has the same shape."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, and lm_head unless tied to the embedding."""
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + self.num_layer_params + lm_head

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes the weights occupy in memory."""
        return self.num_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) * layers * KV heads * head_dim * dtype_bytes (a quantized `kv_cache_dtype`: * its
        bytes per (token, head) row instead of head_dim * dtype_bytes)."""
        if self.kv_cache_dtype == "auto":
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
        from minillm.kv.quant import kv_row_bytes

        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(self.kv_cache_dtype, self.head_dim, dtype_bytes)

    def kv_bytes(self, seq_len: int, batch: int, dtype_bytes: int) -> int:
        """KV-cache bytes of `batch` sequences of `seq_len` tokens each."""
        return self.kv_bytes_per_token(dtype_bytes) * seq_len * batch


# Llama-2 shapes from the published config.json files (Touvron et al., 2023, "Llama 2", Table 1;
# https://huggingface.co/meta-llama/Llama-2-7b-hf and Llama-2-70b-hf).
LLAMA_7B = ModelShape("llama-7b", 32, 4096, 32, 32, 128, 11008, 32000)
# The same model with grouped-query attention, 4 query heads per KV head (not a released model:
# a what-if that isolates GQA's 4x KV saving).
LLAMA_7B_GQA = ModelShape("llama-7b-gqa", 32, 4096, 32, 8, 128, 11008, 32000)
LLAMA_70B = ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672, 32000)

MODEL_PRESETS: dict[str, ModelShape] = {m.name: m for m in (LLAMA_7B, LLAMA_7B_GQA, LLAMA_70B)}


def get_model_shape(name: str) -> ModelShape:
    """A preset by name, e.g. `get_model_shape("llama-7b")`."""
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model shape {name!r}; presets: {', '.join(MODEL_PRESETS)} (or from_hf_config())"
        )
    return MODEL_PRESETS[name]


def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelShape:
    """A `ModelShape` from a Hugging Face config: a dict, a config.json path, or a model directory."""
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        config = json.loads(path.read_text())
        name = name or path.parent.name
    num_heads = config["num_attention_heads"]
    # head_dim is absent (or null) in most Llama configs: then it is hidden / heads
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    return ModelShape(
        name=name or config.get("_name_or_path") or config.get("model_type", "hf-model"),
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,  # absent = plain MHA
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=_has_qkv_bias(config),
    )


def _has_qkv_bias(config: dict[str, Any]) -> bool:
    """What the registered family reads from its config (Qwen2: always); an unregistered one: `attention_bias`."""
    from minillm.model.registry import model_class, supported_model_types

    if config.get("model_type") in supported_model_types():
        family = model_class(config["model_type"])
        return bool(family.hf_config_fields(config, config["num_hidden_layers"]).get("qkv_bias", False))
    return bool(config.get("attention_bias", False))
