"""The Llama-family decoder that minillm runs, on one process or one rank of many (chapters 00, 12).

The forward pass takes a *flattened ragged batch*: the new tokens of every sequence in the step
laid end to end (`input_ids[T]`, `positions[T]`), never padded. Token-wise work (norms,
projections, MLP) runs once on the whole `[T, hidden]` matrix; only attention needs to know
where one sequence ends and the next begins, so it is delegated to an `attention` object that
owns the KV cache and the per-sequence layout. Swapping that object (contiguous slabs, pages,
a CUDA kernel) is how later chapters change the engine without touching this file.
This is Orca's "selective batching".

Weights are stored fused (q|k|v in one matrix, gate|up in another) so that a decode step issues
as few small operations as possible: on a tiny model the step time is mostly per-op overhead.

One forward for every layout (chapter 12). The model is built from the parallel layers of
`minillm.distributed.linear`, which are the plain operation on one rank: q|k|v and gate|up are
column-parallel, o and down row-parallel (an all-reduce after each when tp > 1, the bias added
once), the embedding vocab-parallel, the lm_head column-parallel over the vocabulary (its pieces
gathered on TP rank 0). A pipeline stage is a range of layers: a stage that is not the first
receives the residual stream [tokens, hidden] from its peer in the previous stage, one that is not
the last sends it on and returns no hidden states. An MoE layer runs `moe_forward`: every expert
(sliced tensor-parallel, then one all-reduce), or, under expert parallelism, the all-to-alls of
`minillm.distributed.moe` (which swaps it in). What the forward computes with is a choice of
operations: `TorchOps` (HF's, op for op: float64 is exact against transformers) or the numba-fused
`minillm.model.fused.FusedOps` (float32 on a CPU, one process).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minillm.attention.select import numba_installed
from minillm.distributed.layout import RankLayout
from minillm.distributed.linear import (
    ColumnParallelLinear,
    CommCounter,
    ParallelState,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minillm.model.config import ModelConfig
from minillm.model.fused import FusedOps
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


@dataclass
class DecoderLayer:
    """One layer as the forward runs it: its weights inside the parallel layers that use them."""

    input_norm: torch.Tensor
    qkv: ColumnParallelLinear  # by heads: this rank's query heads, the KV heads they read
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: RowParallelLinear
    post_attention_norm: torch.Tensor
    gate_up: ColumnParallelLinear | None  # a dense MLP (None in an MoE layer)
    down: RowParallelLinear | None
    moe: MoEWeights | None  # an MoE layer's router and experts (an ExpertShard under expert parallelism)

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.input_norm, self.q_norm, self.k_norm, self.post_attention_norm]
        for linear in (self.qkv, self.o, self.gate_up, self.down):
            if linear is not None:
                parts += [linear.weight, linear.bias]
        if self.moe is not None:
            parts += [self.moe.router, self.moe.gate_up, self.moe.down]
        return [t for t in parts if t is not None]


@dataclass
class DecoderOutput:
    """What one forward returns: the final hidden states (None on a pipeline stage that is not the
    last) and, for an MoE model, `expert_load[layer][e]`, the rows expert e computed in each of this
    rank's layers (every token's top-k slots; the last layer: `output_rows`')."""

    hidden: torch.Tensor | None
    expert_load: list[list[int]] | None = None


def column_major(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] with the storage of w.T (see LlamaModel.__init__)."""
    return w.t().contiguous().t()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight, computed in float32 as HF transformers does (even for float64 models)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class TorchOps:
    """The forward's operations as HF transformers computes them, op for op (float64 parity rests on it)."""

    def __init__(self, eps: float, rope: RotaryTable) -> None:
        self.eps, self.rope = eps, rope

    linear = staticmethod(F.linear)

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                 x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual add, then the next norm (none after a stage's last layer): (h, rms_norm(h))."""
        h = h + delta
        return h, (None if weight is None else rms_norm(h, weight, self.eps))

    def rotation(self, positions: torch.Tensor):
        """rotate(qkv, n): the first n heads of qkv [T, heads, D] rotated by RoPE (q and k in one go)."""
        cos, sin = self.rope.lookup(positions)
        return lambda qkv, n: apply_rotary(qkv[:, :n], cos, sin)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class LlamaModel:
    """A Llama-family decoder over flattened batches, whole or one rank's share. Not an nn.Module:
    inference only.

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

    def __init__(self, config: ModelConfig, weights, max_positions: int, layout: RankLayout | None = None,
                 tp: ParallelState | None = None) -> None:
        """`weights`: a `minillm.model.loader.ModelWeights` (this rank's, read for `layout`); one
        process when `layout` is None. `tp` is the stage's tensor-parallel group."""
        c = config
        self.layout = layout or RankLayout(0, 1, 1)
        self.comm = CommCounter()  # this rank's collectives (chapter 12 reads them)
        self.tp = dataclasses.replace(tp or ParallelState(), comm=self.comm)
        self.full_config = c
        own = self.layout.layers(c.num_layers)
        # The config of what this rank holds: its heads, its stage's layers (one process: the model's).
        self.config = c if self.layout.world_size == 1 else dataclasses.replace(
            c, num_heads=len(self.layout.q_heads(c)), num_kv_heads=len(self.layout.kv_heads(c)), num_layers=len(own),
            sliding_windows=tuple(c.sliding_windows[own.start:own.stop]) if c.sliding_windows else ())
        # Weights are kept [out, in] as HF stores them, but laid out column-major (the storage of
        # W.T): F.linear then hands the BLAS an untransposed [in, out] matrix, measured 5-25 % faster
        # for the few-row matmuls of a decode step on this CPU, and bit-identical.
        self.layers = [self._layer(lw) for lw in weights.layers]
        self.embed = weights.embed  # (None off the first stage)
        self.embed_tokens = None if weights.embed is None else VocabParallelEmbedding.from_shard(
            weights.embed, weights.vocab_start, self.tp)
        self.final_norm = weights.final_norm  # (None off the last stage, as the lm_head)
        self.tied_embeddings = weights.lm_head is not None and weights.lm_head is weights.embed
        # a tied head becomes its own copy; the embedding keeps rows
        self.lm_head = None if weights.lm_head is None else ColumnParallelLinear.from_shard(
            column_major(weights.lm_head), None, self.tp)
        first = weights.layers[0].input_norm
        self.dtype, self.device = first.dtype, first.device
        self.rope = RotaryTable(c.head_dim, c.rope_theta, max_positions, self.dtype, self.device, c.rope_scaling)
        self._torch_ops = TorchOps(c.rms_norm_eps, self.rope)
        self._fused_ops: FusedOps | None = None
        # float32 on a CPU, one process: the small ops between the matmuls run fused by numba
        # (minillm/model/fused.py, measured faster there); float64 keeps HF's ops, op for op. Ranks of
        # a parallel layout run the torch ops (each spawned rank would load numba's kernels for it).
        self.fused_ops = (self.dtype == torch.float32 and self.device.type == "cpu" and numba_installed()
                          and self.layout.world_size == 1)
        # An MoE layer's block, (layer, x, weights) -> .hidden, .tokens_per_expert; expert parallelism
        # swaps in minillm.distributed.moe's.
        self.moe_forward = self._tensor_parallel_moe

    def _layer(self, lw) -> DecoderLayer:
        tp = self.tp

        def cm(w):
            return None if w is None else column_major(w)
        dense = lw.gate_up is not None
        return DecoderLayer(
            input_norm=lw.input_norm, q_norm=lw.q_norm, k_norm=lw.k_norm, post_attention_norm=lw.post_attention_norm,
            qkv=ColumnParallelLinear.from_shard(cm(lw.qkv), lw.qkv_bias, tp),
            o=RowParallelLinear.from_shard(cm(lw.o), lw.o_bias, tp),
            gate_up=ColumnParallelLinear.from_shard(cm(lw.gate_up), lw.gate_up_bias, tp) if dense else None,
            down=RowParallelLinear.from_shard(cm(lw.down), lw.down_bias, tp) if dense else None,
            moe=lw.moe)

    @property
    def fused_ops(self) -> bool:
        """Whether the forward runs `FusedOps` (settable: tests compare one against the other)."""
        return self.ops is self._fused_ops

    @fused_ops.setter
    def fused_ops(self, on: bool) -> None:
        if on and self._fused_ops is None:
            self._fused_ops = FusedOps(self.config.rms_norm_eps, self.rope.cos, self.rope.sin)
        self.ops = self._fused_ops if on else self._torch_ops

    @property
    def num_params(self) -> int:
        tensors = [t for t in (self.embed, self.final_norm) if t is not None]
        if self.lm_head is not None and not self.tied_embeddings:
            tensors.append(self.lm_head.weight)
        return sum(t.numel() for t in tensors) + sum(t.numel() for layer in self.layers for t in layer.tensors())

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight a decode step reads (the embedding table is gathered, not read)."""
        tensors = [t for layer in self.layers for t in layer.tensors()]
        tensors += [t for t in (self.final_norm, None if self.lm_head is None else self.lm_head.weight) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _tensor_parallel_moe(self, layer: int, x: torch.Tensor, weights: MoEWeights):
        """Every expert on this rank's slice of their MLPs; the ranks' shares added (one rank: the whole)."""
        out = sparse_moe(x, weights)
        out.hidden = self.tp.all_reduce(out.hidden)
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                output_rows: torch.Tensor | None = None) -> DecoderOutput:
        """Hidden states [T, hidden] after the final norm, for every token in the flattened batch —
        or only for `output_rows` (the rows whose logits are needed); with an MoE model's expert load.

        With `output_rows`, the last layer still computes every token's K/V (later steps read them)
        and its attention, but its output projection and MLP run on those rows only: nothing else
        would ever read the other rows' results. A prefill of n tokens samples from one row, so this
        skips ~90 % of the last layer's matmuls for n-1 of them (llama.cpp does the same)."""
        ops, c, layout = self.ops, self.config, self.layout
        num_tokens = input_ids.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        if layout.is_first_stage:
            h = self.embed_tokens(input_ids)
        else:  # the residual stream from the previous stage
            h = torch.empty(num_tokens, c.hidden_size, dtype=self.dtype, device=self.device)
            with self.comm.timed("recv", h):
                dist.recv(h, src=layout.prev_rank)
        rotate = ops.rotation(positions)
        layers = self.layers
        last = len(layers) - 1 if layout.is_last_stage else -1
        x = ops.norm(h, layers[0].input_norm)
        loads = []
        for i, layer in enumerate(layers):
            qkv = layer.qkv(x, ops.linear).view(num_tokens, hq + 2 * hkv, d)
            if layer.q_norm is not None:  # Qwen3: each query and key head RMS-normalised before RoPE
                qkv[:, :hq] = rms_norm(qkv[:, :hq], layer.q_norm, c.rms_norm_eps)
                qkv[:, hq : hq + hkv] = rms_norm(qkv[:, hq : hq + hkv], layer.k_norm, c.rms_norm_eps)
            qk = rotate(qkv, hq + hkv)  # q and k in one go
            out = attention(i, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :])
            if i == last and output_rows is not None:
                out, h = out.index_select(0, output_rows), h.index_select(0, output_rows)
            h, x = ops.add_norm(h, layer.o(out.reshape(h.shape[0], hq * d), ops.linear), layer.post_attention_norm, x)
            if layer.moe is not None:  # a mixture-of-experts layer (minillm/model/moe.py)
                moe = self.moe_forward(i, x, layer.moe)
                mlp = moe.hidden
                loads.append(moe.tokens_per_expert)
            else:
                gate, up = layer.gate_up(x, ops.linear).chunk(2, dim=-1)
                mlp = layer.down(ops.silu_mul(gate, up), ops.linear)
            next_norm = layers[i + 1].input_norm if i < len(layers) - 1 else self.final_norm
            h, x = ops.add_norm(h, mlp, next_norm, x)  # the residual add, then the next layer's norm
        load = torch.stack(loads).tolist() if loads else None
        if not layout.is_last_stage:
            with self.comm.timed("send", h):
                dist.send(h.contiguous(), dst=layout.next_rank)
            return DecoderOutput(None, load)
        return DecoderOutput(x, load)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Next-token logits [N, vocab] for the rows of `hidden` that need sampling (on the rank that
        samples; None on the other ranks, after their part of the gather)."""
        if hidden is None:
            return None
        part = self.lm_head(hidden, self.ops.linear)  # [N, this rank's vocabulary rows]
        if self.tp.size == 1:
            return part
        dst = self.layout.tp_group_ranks()[0]
        pieces = [torch.empty_like(part) for _ in range(self.tp.size)] if self.layout.tp_rank == 0 else None
        with self.comm.timed("gather", part):
            dist.gather(part, pieces, dst=dst, group=self.tp.group)
        return None if pieces is None else torch.cat(pieces, dim=1)[:, : self.full_config.vocab_size]
