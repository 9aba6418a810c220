"""Loading weights: one loader for one process and for every rank of TP × PP × EP (chapters 00, 12).

A table says, once, which HF tensors make each of the decoder's parameters (q|k|v fused from three,
gate|up from two) and the shape of each, its axes named. Those names are how a tensor is sharded:

    by rows      the first axis is one the ranks split (q_proj's `q`, gate_proj's `mlp`, the
                 embedding's `vocab`): a column-parallel weight, each rank its rows
    by columns   the second axis is (o_proj's `q`, down_proj's `mlp`): row-parallel, each rank its columns
    replicated   no axis is split (norms, o_proj's and down_proj's biases): every rank the whole
    by expert    an MoE layer's experts: a rank holds its range of them whole (expert parallelism),
                 or every expert cut by rows/columns of `expert_mlp` like a dense MLP

A `Placement` says which rows of each split axis a rank holds and which layers (its pipeline
stage); `Placement.whole(config)` is one process: every axis whole, every layer. The same code then
reads 1 rank or N: each tensor's piece comes from `Checkpoint.read(name, index)`, which on a
safetensors file reads only that piece (`get_slice`). Every tensor's full shape is checked against
the config before it is read, and a checkpoint tensor no rule names is refused.

The vocabulary is split in equal rows per rank, the last rank's short slice padded with zero rows
(vLLM's padded vocab); the lm_head is split alike, or is the embedding's rows when they are tied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minillm.distributed.moe import ExpertShard
from minillm.model.checkpoint import SafetensorsCheckpoint, StateDictCheckpoint, read_safetensors
from minillm.model.config import ModelConfig
from minillm.model.llama import LayerWeights, LlamaModel
from minillm.model.moe import MoEWeights, expert_ranges, read_experts, unfuse_experts
from minillm.model.registry import model_class

__all__ = ["Placement", "ModelWeights", "build_model", "load_hf_model", "load_model_dir", "load_weights",
           "read_hf_config", "read_safetensors"]

# Per layer, under `model.layers.{i}.`: parameter -> the HF tensors fused into it, in order, each with
# its shape by axis name. A bias is its weight's names with ".bias" and its weight's first axis.
LAYER_TENSORS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "input_norm": [("input_layernorm.weight", ("hidden",))],
    "qkv": [("self_attn.q_proj.weight", ("q", "hidden")), ("self_attn.k_proj.weight", ("kv", "hidden")),
            ("self_attn.v_proj.weight", ("kv", "hidden"))],
    "q_norm": [("self_attn.q_norm.weight", ("head",))],
    "k_norm": [("self_attn.k_norm.weight", ("head",))],
    "o": [("self_attn.o_proj.weight", ("hidden", "q"))],
    "post_attention_norm": [("post_attention_layernorm.weight", ("hidden",))],
    "gate_up": [("mlp.gate_proj.weight", ("mlp", "hidden")), ("mlp.up_proj.weight", ("mlp", "hidden"))],
    "down": [("mlp.down_proj.weight", ("hidden", "mlp"))],
}
BIASES = {"qkv_bias": "qkv", "o_bias": "o", "gate_up_bias": "gate_up", "down_bias": "down"}
EMBED, FINAL_NORM, LM_HEAD = ("model.embed_tokens.weight", ("vocab", "hidden")), ("model.norm.weight", ("hidden",)), \
    ("lm_head.weight", ("vocab", "hidden"))


def _tensors(param: str) -> list[tuple[str, tuple[str, ...]]]:
    if param in BIASES:
        return [(name.replace(".weight", ".bias"), axes[:1]) for name, axes in LAYER_TENSORS[BIASES[param]]]
    return LAYER_TENSORS[param]


def _layer_params(c: ModelConfig) -> list[str]:
    """The parameters a layer of this config has (the others stay None)."""
    wanted = {"input_norm": True, "qkv": True, "qkv_bias": c.qkv_bias, "q_norm": c.qk_norm, "k_norm": c.qk_norm,
              "o": True, "o_bias": c.o_bias, "post_attention_norm": True, "gate_up": not c.is_moe,
              "gate_up_bias": not c.is_moe and c.mlp_bias, "down": not c.is_moe, "down_bias": not c.is_moe and c.mlp_bias}
    return [p for p, on in wanted.items() if on]


def axis_sizes(c: ModelConfig) -> dict[str, int]:
    return {"q": c.num_heads * c.head_dim, "kv": c.num_kv_heads * c.head_dim, "mlp": c.intermediate_size,
            "expert_mlp": c.intermediate_size, "hidden": c.hidden_size, "head": c.head_dim, "vocab": c.vocab_size,
            "experts": c.num_experts}


@dataclass(frozen=True)
class Placement:
    """What one rank holds: `cuts[axis]` the rows of that axis (an axis not named: whole), the
    `layers` of its stage, the `experts` of each MoE layer (None: all, as one `MoEWeights`; a range:
    an expert-parallel shard), and `vocab_rows`, the padded rows per rank of the vocabulary."""

    layers: range
    cuts: dict[str, range] = field(default_factory=dict)
    experts: range | None = None
    vocab_rows: int = 0
    first_stage: bool = True
    last_stage: bool = True

    @classmethod
    def whole(cls, c: ModelConfig) -> Placement:
        return cls(range(c.num_layers), vocab_rows=c.vocab_size)

    @classmethod
    def of_rank(cls, c: ModelConfig, layout: Any, expert_parallel: bool = False) -> Placement:
        """Rank `layout` (a `minillm.distributed.layout.RankLayout`): its query heads and the KV heads
        they read, its 1/tp of the MLP and of the vocabulary, its stage's layers; with
        `expert_parallel`, its 1/tp of the experts, whole."""
        d, tp, r = c.head_dim, layout.tp, layout.tp_rank
        q, kv = layout.q_heads(c), layout.kv_heads(c)
        mlp_per, vocab_per = c.intermediate_size // tp, -(-c.vocab_size // tp)
        vocab_start = min(r * vocab_per, c.vocab_size)
        cuts = {"q": range(q.start * d, q.stop * d), "kv": range(kv.start * d, kv.stop * d),
                "mlp": range(r * mlp_per, (r + 1) * mlp_per),
                "vocab": range(vocab_start, min(vocab_start + vocab_per, c.vocab_size))}
        experts = None
        if c.is_moe and expert_parallel:
            experts = expert_ranges(c.num_experts, tp)[r]
        elif c.is_moe:
            cuts["expert_mlp"] = cuts["mlp"]
        return cls(layout.layers(c.num_layers), cuts, experts, vocab_per, layout.is_first_stage, layout.is_last_stage)


@dataclass
class ModelWeights:
    """One rank's weights (one process: all of them). `embed` is None off the first stage, `lm_head`
    and `final_norm` off the last; `vocab_start` is the first vocabulary row this rank holds."""

    layers: list[LayerWeights]
    embed: torch.Tensor | None
    final_norm: torch.Tensor | None
    lm_head: torch.Tensor | None
    vocab_start: int = 0
    bytes_read: int = 0


def load_weights(checkpoint, c: ModelConfig, placement: Placement, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> ModelWeights:
    """The weights `placement` holds, read from `checkpoint` (a `SafetensorsCheckpoint` or a
    `StateDictCheckpoint`), cast to `dtype` on `device`."""
    family = model_class(c.model_type)
    names = checkpoint.names
    _refuse_unused(names, c, family)
    sizes = axis_sizes(c)

    def read(name: str, axes: tuple[str, ...]) -> torch.Tensor:
        if name not in names:
            raise KeyError(f"checkpoint has no tensor {name!r} (config {c.model_type}, {c.num_layers} layers)")
        want = tuple(sizes[a] for a in axes)
        if checkpoint.shape(name) != want:
            raise ValueError(f"tensor {name!r} has shape {checkpoint.shape(name)}, the config implies {want}")
        index = tuple(slice(placement.cuts[a].start, placement.cuts[a].stop) if a in placement.cuts else slice(None)
                      for a in axes)
        return checkpoint.read(name, index).to(device=device, dtype=dtype)

    def fused(prefix: str, param: str) -> torch.Tensor:
        parts = [read(prefix + name, axes) for name, axes in _tensors(param)]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts).contiguous()

    def vocab_rows(tensor: tuple[str, tuple[str, ...]]) -> torch.Tensor:
        rows = read(*tensor)
        if rows.shape[0] < placement.vocab_rows:  # the last rank's short slice, padded with zero rows
            rows = torch.cat((rows, rows.new_zeros(placement.vocab_rows - rows.shape[0], rows.shape[1])))
        return rows

    layers = []
    for i in placement.layers:
        prefix = f"model.layers.{i}."
        lw = LayerWeights(**{p: fused(prefix, p) for p in _layer_params(c)})
        if c.is_moe:
            experts = placement.experts if placement.experts is not None else range(c.num_experts)
            router, gate_up, down = read_experts(read, i, family.expert_names, experts)
            lw.moe = (MoEWeights(router, gate_up, down, c.num_experts_per_tok, c.moe_renormalize)
                      if placement.experts is None else
                      ExpertShard(router, gate_up, down, experts, c.num_experts_per_tok, c.moe_renormalize))
        layers.append(lw)
    embed = vocab_rows(EMBED) if placement.first_stage else None
    final_norm = lm_head = None
    if placement.last_stage:
        final_norm = read(*FINAL_NORM)
        if c.tie_word_embeddings:
            lm_head = embed if embed is not None else vocab_rows(EMBED)
        else:
            lm_head = vocab_rows(LM_HEAD)
    vocab_start = placement.cuts["vocab"].start if "vocab" in placement.cuts else 0
    return ModelWeights(layers, embed, final_norm, lm_head, vocab_start, checkpoint.bytes_read)


def _refuse_unused(names: set[str], c: ModelConfig, family: type) -> None:
    """A tensor of the checkpoint that no rule of this config names is refused, naming it."""
    used = {EMBED[0], FINAL_NORM[0], LM_HEAD[0]}  # (a tied lm_head is often saved anyway, as the embedding's alias)
    for i in range(c.num_layers):
        used.update(f"model.layers.{i}.{name}" for p in _layer_params(c) for name, _ in _tensors(p))
        if c.is_moe:
            n = family.expert_names
            used.add(f"model.layers.{i}.{n.router}")
            used.update(f"model.layers.{i}.{t.format(e=e)}" for e in range(c.num_experts) for t in (n.gate, n.up, n.down))
    unexpected = sorted(n for n in names if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"checkpoint has tensors this {c.model_type} config does not use: {unexpected[:5]}")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF model directory)")
    return json.loads(path.read_text())


def load_model_dir(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   max_positions: int | None = None) -> LlamaModel:
    config = ModelConfig.from_hf_dict(read_hf_config(model_dir))
    with SafetensorsCheckpoint(model_dir) as checkpoint:
        weights = load_weights(checkpoint, config, Placement.whole(config), dtype, device)
    return _model(config, weights, max_positions)


def load_hf_model(hf_model: Any, dtype: torch.dtype | None = None, device: str | None = None,
                  max_positions: int | None = None) -> LlamaModel:
    """Take the weights of an in-memory transformers `*ForCausalLM` (no copy of its forward)."""
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    state = hf_model.state_dict()
    first = next(iter(state.values()))
    return build_model(config, state, dtype or first.dtype, device or str(first.device), max_positions)


def build_model(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str,
                max_positions: int | None = None) -> LlamaModel:
    """The whole model from a state dict (safetensors names, or a transformers model's own)."""
    if config.is_moe:
        state = unfuse_experts(state, model_class(config.model_type).expert_names)
    weights = load_weights(StateDictCheckpoint(state), config, Placement.whole(config), dtype, device)
    return _model(config, weights, max_positions)


def _model(config: ModelConfig, w: ModelWeights, max_positions: int | None) -> LlamaModel:
    return model_class(config.model_type)(config, w, max_positions or config.max_position_embeddings)
