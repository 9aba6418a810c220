"""The Llama decoder on one rank of tensor × pipeline parallelism (chapter 12).

The same computation as `minillm.model.llama.LlamaModel.forward` (read that first), on this rank's
shard (`minillm.model.loader`), with the communication Megatron-LM and vLLM put in it:

    embedding   vocab-parallel: each rank looks up the tokens of its vocabulary slice, zeros for the
                others; one all-reduce puts every row together            (first stage only)
    per layer   q|k|v column-parallel by heads → attention on this rank's heads and KV pool →
                o_proj row-parallel → all-reduce → residual, norm → gate|up column-parallel →
                SiLU·mul → down_proj row-parallel → all-reduce → residual: 2 all-reduces of
                [tokens, hidden] per layer, biases of o and down added once, after them
    stages      a stage that is not the first receives the residual stream [tokens, hidden] from
                its peer rank of the previous stage (`recv`); one that is not the last sends it on
                (`send`) and returns None
    MoE layer   (Mixtral) expert parallel: each rank routes a slice of the tokens to the experts'
                owners and back with all-to-alls, then all-gathers the slices: the output is
                whole on every rank, no all-reduce after it (`minillm.distributed.moe.ep_moe_layer`);
                without EP every expert is sliced like the dense MLP and one all-reduce follows
    lm_head     column-parallel over the vocabulary: each rank's [rows, vocab/tp] logits are
                gathered on TP rank 0 of the last stage, which alone samples

It runs the torch ops (not `minillm.model.fused`): the fused CPU path of one process is left as it
is, and on one rank this class is never used. Float64 gives the single process's greedy tokens;
in float32 the all-reduce adds the ranks' partial sums in another order than one matmul does, so
logits differ in the last bits (a near-tie can flip: the tests report the margin).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minillm.distributed.layout import RankLayout
from minillm.distributed.linear import ParallelState
from minillm.model.config import ModelConfig
from minillm.model.llama import LayerWeights, column_major, lay_out_column_major, rms_norm
from minillm.model.moe import sparse_moe
from minillm.model.rope import RotaryTable, apply_rotary


class CommCounter:
    """Collectives this rank called, the bytes it handed them and the wall time it spent in them, over its
    life (chapter 12 reads them). Time in a recv is mostly waiting for the previous stage: the bubble."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, kind: str, tensor: torch.Tensor):
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start


class ParallelLlamaModel:
    """One rank's share of a Llama-family decoder. Exposes what `ModelRunner` uses: `config` (this
    rank's heads and layers), `dtype`, `device`, `forward`, `compute_logits`."""

    def __init__(self, full_config: ModelConfig, layout: RankLayout, weights, tp: ParallelState,
                 max_positions: int, device: str = "cpu") -> None:
        c = full_config
        self.full_config, self.layout, self.tp = c, layout, tp
        layers: list[LayerWeights] = weights.layers
        lay_out_column_major(layers)
        self.layers = layers
        own = layout.layers(c.num_layers)
        self.config = dataclasses.replace(
            c, num_heads=len(layout.q_heads(c)), num_kv_heads=len(layout.kv_heads(c)), num_layers=len(own),
            sliding_windows=tuple(c.sliding_windows[own.start:own.stop]) if c.sliding_windows else ())
        self.embed, self.final_norm = weights.embed, weights.final_norm
        self.lm_head = None if weights.lm_head is None else column_major(weights.lm_head)
        self.vocab_start = weights.vocab_start
        self.vocab_rows = -(-c.vocab_size // layout.tp)  # (padded) rows per rank
        self.dtype = layers[0].qkv.dtype
        self.device = torch.device(device)
        self.rope = RotaryTable(c.head_dim, c.rope_theta, max_positions, self.dtype, self.device, c.rope_scaling)
        self.comm = CommCounter()
        self.fused_ops = False  # see the module docstring
        # Mixtral under expert parallelism: minillm.distributed.moe.shard_model_experts sets moe_forward
        # (its all-to-alls); after each forward expert_load[layer][e] = rows expert e computed, all ranks'.
        self.moe_forward = None
        self.expert_load: list[list[int]] | None = None

    @property
    def weight_bytes(self) -> int:
        tensors = [t for lw in self.layers for t in vars(lw).values() if isinstance(t, torch.Tensor)]
        tensors += [t for lw in self.layers if lw.moe is not None for t in (lw.moe.router, lw.moe.gate_up, lw.moe.down)]
        tensors += [t for t in (self.lm_head, self.final_norm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            with self.comm.timed("all_reduce", x):
                dist.all_reduce(x, group=self.tp.group)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        rows = F.embedding(torch.where(mine, local, 0), self.embed)
        return self._all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                output_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """This stage's part of `LlamaModel.forward`: final hidden states on the last stage, None elsewhere."""
        layout, c = self.layout, self.config
        num_tokens = input_ids.shape[0]
        hq, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        if layout.is_first_stage:
            h = self._embed(input_ids)
        else:
            h = torch.empty(num_tokens, c.hidden_size, dtype=self.dtype, device=self.device)
            with self.comm.timed("recv", h):
                dist.recv(h, src=layout.prev_rank)
        cos, sin = self.rope.lookup(positions)
        last = len(self.layers) - 1 if layout.is_last_stage else -1
        loads = []
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias).view(num_tokens, hq + 2 * hkv, d)
            qk = apply_rotary(qkv[:, : hq + hkv], cos, sin)
            out = attention(i, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :])
            if i == last and output_rows is not None:  # as LlamaModel.forward: only the rows sampled
                out, h = out.index_select(0, output_rows), h.index_select(0, output_rows)
            o = self._all_reduce(F.linear(out.reshape(h.shape[0], hq * d), lw.o))
            h = h + (o if lw.o_bias is None else o + lw.o_bias)
            x = rms_norm(h, lw.post_attention_norm, eps)
            if lw.moe is not None:
                if self.moe_forward is not None:  # expert parallel: all-to-alls return the whole output everywhere
                    moe = self.moe_forward(i, x, lw.moe)
                    h = h + moe.hidden
                else:  # every expert sliced tensor-parallel: this rank's share of the sum, then one all-reduce
                    moe = sparse_moe(x, lw.moe)
                    h = h + self._all_reduce(moe.hidden)
                loads.append(moe.tokens_per_expert)
                continue
            gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
            down = self._all_reduce(F.linear(F.silu(gate) * up, lw.down))
            h = h + (down if lw.down_bias is None else down + lw.down_bias)
        if loads:
            self.expert_load = torch.stack(loads).tolist()
        if not layout.is_last_stage:
            with self.comm.timed("send", h):
                dist.send(h.contiguous(), dst=layout.next_rank)
            return None
        return rms_norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Logits [N, vocab] on the rank that samples; None on the others (after their part)."""
        if hidden is None:
            return None
        part = F.linear(hidden, self.lm_head)  # [N, vocab rows of this rank]
        vocab = self.full_config.vocab_size
        if self.tp.size == 1:
            return part[:, :vocab]
        dst = self.layout.tp_group_ranks()[0]
        pieces = [torch.empty_like(part) for _ in range(self.tp.size)] if self.layout.tp_rank == 0 else None
        with self.comm.timed("gather", part):
            dist.gather(part, pieces, dst=dst, group=self.tp.group)
        return None if pieces is None else torch.cat(pieces, dim=1)[:, :vocab]
