"""The Llama-family decoder that minillm runs itself (chapter 00; KV cache in chapter 01).

The forward pass takes a *flattened ragged batch*: the new tokens of every sequence in the step
laid end to end (`input_ids[T]`, `positions[T]`), never padded. Token-wise work (norms,
projections, MLP) runs once on the whole `[T, hidden]` matrix; only attention needs to know
where one sequence ends and the next begins, so it is delegated to an `attention` object that
owns the KV cache and the per-sequence layout. Swapping that object (contiguous slabs, pages,
a CUDA kernel) is how later chapters change the engine without touching this file.
This is Orca's "selective batching".

Weights are stored fused (q|k|v in one matrix, gate|up in another) so that a decode step issues
as few small operations as possible: on a tiny model the step time is mostly per-op overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from minillm.attention.select import numba_installed
from minillm.model.config import ModelConfig
from minillm.model.fused import fused_forward, linear
from minillm.model.moe import MoEWeights, sparse_moe
from minillm.model.rope import RotaryTable, apply_rotary


class Attention(Protocol):
    """What the model needs from the attention backend for one step."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [T, H_kv, D] in the cache and return attention output [T, H_q, D]."""
        ...


@dataclass
class LayerWeights:
    """One decoder layer's weights (one rank's share of them under tensor parallelism); a part the
    family does not have is None."""

    input_norm: torch.Tensor | None = None
    qkv: torch.Tensor | None = None  # [(H_q + 2·H_kv)·D, hidden]
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D]: per-head RMSNorm of the queries before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None
    o: torch.Tensor | None = None  # [hidden, H_q·D]
    o_bias: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None  # [2·intermediate, hidden]
    gate_up_bias: torch.Tensor | None = None
    down: torch.Tensor | None = None  # [hidden, intermediate]
    down_bias: torch.Tensor | None = None
    moe: MoEWeights | None = None  # an MoE family: router + experts in place of the MLP (gate_up, down are None)


def column_major(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] with the storage of w.T (see LlamaModel.__init__)."""
    return w.t().contiguous().t()


def lay_out_column_major(layers: list[LayerWeights]) -> None:
    """Every dense matmul weight of `layers` laid out column-major, in place."""
    for lw in layers:
        for name in ("qkv", "o", "gate_up", "down"):
            if getattr(lw, name) is not None:  # (an MoE layer has no dense gate_up/down)
                setattr(lw, name, column_major(getattr(lw, name)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight, computed in float32 as HF transformers does (even for float64 models)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    """A Llama-family decoder over flattened batches. Not an nn.Module: inference only.

    Registered for `llama` (minillm/model/registry.py); the other families subclass it and say, in
    `hf_config_fields`, what their config.json switches on."""

    is_moe_family = False  # a family whose MLPs are mixtures of experts (Mixtral)
    expert_names = None  # an MoE family: where its checkpoint keeps the experts (minillm.model.moe.ExpertNames)

    @classmethod
    def hf_config_fields(cls, cfg: dict, num_layers: int) -> dict:
        """The `ModelConfig` fields this family reads its own way. Llama: q/k/v and o biases when
        `attention_bias`, full attention on every layer, a dense MLP."""
        expert_keys = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)]
        if expert_keys and not cls.is_moe_family:
            raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}: a mixture-of-experts family minillm "
                             f"does not run (a dense family's name, with experts: {expert_keys})")
        bias = bool(cfg.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "sliding_windows": (None,) * num_layers}

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, max_positions: int) -> None:
        self.config = config
        self.embed = embed
        # Weights are kept [out, in] as HF stores them, but laid out column-major (the storage of
        # W.T): F.linear then hands the BLAS an untransposed [in, out] matrix, measured 5-25 % faster
        # for the few-row matmuls of a decode step on this CPU, and bit-identical.
        lay_out_column_major(layers)
        self.layers = layers
        self.final_norm = final_norm
        self.tied_embeddings = lm_head is embed
        self.lm_head = column_major(lm_head)  # a tied head becomes its own copy; the embedding keeps rows
        self.dtype = embed.dtype
        self.device = embed.device
        self.rope = RotaryTable(config.head_dim, config.rope_theta, max_positions, self.dtype,
                                self.device, config.rope_scaling)
        c = config
        self._q_heads, self._kv_heads, self._head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self._eps = c.rms_norm_eps
        # float32 on a CPU: the small ops between the matmuls run fused by numba (minillm/model/fused.py,
        # measured faster there); float64 keeps the torch ops below, HF's own op for op.
        # MoE models (chapter 12) run the torch ops below: fused.py has no MoE block.
        self.fused_ops = (self.dtype == torch.float32 and self.device.type == "cpu" and numba_installed()
                          and not config.is_moe)
        # MoE: the MoE block each layer runs, (layer, x, weights) -> .hidden, .tokens_per_expert; expert
        # parallelism swaps in minillm.distributed.moe's. After each forward, `expert_load[layer][e]` is
        # the number of rows expert e computed (every token's top-k slots; the last layer: `output_rows`').
        self.moe_forward = _single_process_moe
        self.expert_load: list[list[int]] | None = None
        self._fused_views = None  # numpy views of the norm weights and RoPE table, made on first use
        self._packed_weights: dict = {}  # the matmul weights in oneDNN's layout (fused.linear fills it)

    @property
    def num_params(self) -> int:
        tensors = [self.embed, self.final_norm]
        if not self.tied_embeddings:
            tensors.append(self.lm_head)
        for lw in self.layers:
            tensors += _layer_tensors(lw)
        return sum(t.numel() for t in tensors)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight a decode step reads (the embedding table is gathered, not read)."""
        total = sum(t.numel() * t.element_size() for lw in self.layers for t in _layer_tensors(lw))
        return total + self.lm_head.numel() * self.lm_head.element_size() + self.final_norm.numel() * self.final_norm.element_size()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token in the flattened batch —
        or only for `output_rows` (the rows whose logits are needed).

        With `output_rows`, the last layer still computes every token's K/V (later steps read them)
        and its attention, but its output projection and MLP run on those rows only: nothing else
        would ever read the other rows' results. A prefill of n tokens samples from one row, so this
        skips ~90 % of the last layer's matmuls for n-1 of them (llama.cpp does the same)."""
        if self.fused_ops:
            return fused_forward(self, input_ids, positions, attention, output_rows)
        num_tokens = input_ids.shape[0]
        hq, hkv, d, eps = self._q_heads, self._kv_heads, self._head_dim, self._eps
        cos, sin = self.rope.lookup(positions)
        h = F.embedding(input_ids, self.embed)
        last = len(self.layers) - 1
        loads = []
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias).view(num_tokens, hq + 2 * hkv, d)
            qk = apply_rotary(qkv[:, : hq + hkv], cos, sin)  # rotate q and k in one go
            out = attention(i, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :])
            if i == last and output_rows is not None:
                out, h = out.index_select(0, output_rows), h.index_select(0, output_rows)
            h = h + F.linear(out.reshape(h.shape[0], hq * d), lw.o, lw.o_bias)
            x = rms_norm(h, lw.post_attention_norm, eps)
            if lw.moe is not None:  # a mixture-of-experts layer (minillm/model/moe.py)
                moe = self.moe_forward(i, x, lw.moe)
                h = h + moe.hidden
                loads.append(moe.tokens_per_expert)
                continue
            gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down, lw.down_bias)
        if loads:
            self.expert_load = torch.stack(loads).tolist()
        return rms_norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [N, vocab] for the rows of `hidden` that need sampling."""
        if self.fused_ops:
            return linear(hidden, self.lm_head, None, self._packed_weights)
        return F.linear(hidden, self.lm_head)


def _single_process_moe(layer: int, x: torch.Tensor, weights: MoEWeights):
    return sparse_moe(x, weights)


def _layer_tensors(lw: LayerWeights) -> list[torch.Tensor]:
    tensors = [t for t in vars(lw).values() if isinstance(t, torch.Tensor)]
    if lw.moe is not None:
        tensors += [lw.moe.router, lw.moe.gate_up, lw.moe.down]
    return tensors
