"""Loading weights: an HF model directory (or an in-memory transformers model) → `LlamaModel`.

safetensors only: a `.bin` checkpoint is a pickle, and unpickling runs arbitrary code.
Taught in chapter 00.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from minillm.model.config import ModelConfig
from minillm.model.llama import LayerWeights, LlamaModel
from minillm.model.moe import MoEWeights, moe_tensor_names, moe_weights_from_state


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF model directory)")
    return json.loads(path.read_text())


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint."""
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in shard_names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards named in the index are missing: {missing}")
    else:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {pickles}: pickled checkpoints are refused, convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model_dir(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   max_positions: int | None = None) -> LlamaModel:
    config = ModelConfig.from_hf_dict(read_hf_config(model_dir))
    return build_model(config, read_safetensors(model_dir), dtype, device, max_positions)


def load_hf_model(hf_model: Any, dtype: torch.dtype | None = None, device: str | None = None,
                  max_positions: int | None = None) -> LlamaModel:
    """Take the weights of an in-memory transformers `*ForCausalLM` (no copy of its forward)."""
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    state = hf_model.state_dict()
    first = next(iter(state.values()))
    return build_model(config, state, dtype or first.dtype, device or str(first.device), max_positions)


def build_model(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str,
                max_positions: int | None = None, moe_shards: list | None = None) -> LlamaModel:
    """Check every tensor's shape against the config, fuse q|k|v and gate|up (per expert for a
    Mixtral), and build the model. `moe_shards` (expert parallelism: one `ExpertShard` per layer, from
    `minillm.distributed.moe.read_expert_shards`) stand in for the experts, which `state` may then omit."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], required: bool = True) -> torch.Tensor | None:
        if name not in state:
            if required:
                raise KeyError(f"checkpoint has no tensor {name!r} (config {c.model_type}, {c.num_layers} layers)")
            return None
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}")
        used.add(name)
        return tensor.to(device=device, dtype=dtype)

    def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts, dim=0).contiguous()

    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        moe = _take_moe(c, state, i, dtype, device, used, moe_shards) if c.is_moe else None
        dense = moe is None
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=cat(take(attn + "q_proj.weight", (q_dim, c.hidden_size)),
                    take(attn + "k_proj.weight", (kv_dim, c.hidden_size)),
                    take(attn + "v_proj.weight", (kv_dim, c.hidden_size))),
            qkv_bias=cat(take(attn + "q_proj.bias", (q_dim,), c.qkv_bias),
                         take(attn + "k_proj.bias", (kv_dim,), c.qkv_bias),
                         take(attn + "v_proj.bias", (kv_dim,), c.qkv_bias)),
            o=take(attn + "o_proj.weight", (c.hidden_size, q_dim)),
            o_bias=take(attn + "o_proj.bias", (c.hidden_size,), c.o_bias),
            post_attention_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=cat(take(mlp + "gate_proj.weight", (c.intermediate_size, c.hidden_size), dense),
                        take(mlp + "up_proj.weight", (c.intermediate_size, c.hidden_size), dense)),
            gate_up_bias=cat(take(mlp + "gate_proj.bias", (c.intermediate_size,), dense and c.mlp_bias),
                             take(mlp + "up_proj.bias", (c.intermediate_size,), dense and c.mlp_bias)),
            down=take(mlp + "down_proj.weight", (c.hidden_size, c.intermediate_size), dense),
            down_bias=take(mlp + "down_proj.bias", (c.hidden_size,), dense and c.mlp_bias),
            moe=moe,
        ))
    embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    final_norm = take("model.norm.weight", (c.hidden_size,))
    if c.tie_word_embeddings:
        lm_head = embed
        used.add("lm_head.weight")  # often saved anyway, as an alias of the embedding
    else:
        lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))
    unexpected = sorted(n for n in state if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"checkpoint has tensors this {c.model_type} config does not use: {unexpected[:5]}")
    return LlamaModel(c, embed, layers, final_norm, lm_head, max_positions or c.max_position_embeddings)


def _take_moe(c: ModelConfig, state: Mapping[str, torch.Tensor], layer: int, dtype: torch.dtype, device: str,
              used: set[str], moe_shards: list | None) -> MoEWeights:
    """Layer `layer`'s router and experts (each expert's gate|up fused, gate rows first), shapes checked;
    or, under expert parallelism, the rank's shard (then any expert tensor in `state` counts as used)."""
    if moe_shards is not None:
        used.update(moe_tensor_names(state, layer, c.num_experts))
        return moe_shards[layer]
    weights = moe_weights_from_state(state, layer, c.num_experts, c.num_experts_per_tok, dtype=dtype, device=device)
    e, i, h = c.num_experts, c.intermediate_size, c.hidden_size
    for name, tensor, shape in (("router", weights.router, (e, h)), ("experts' gate|up", weights.gate_up, (e, 2 * i, h)),
                                ("experts' down", weights.down, (e, h, i))):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"layer {layer}: the {name} weights have shape {tuple(tensor.shape)}, the config "
                             f"implies {shape}")
    used.update(moe_tensor_names(state, layer, c.num_experts))
    return weights
