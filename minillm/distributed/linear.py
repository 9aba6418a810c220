"""Tensor parallelism (Megatron-LM): column- and row-parallel layers on torch.distributed (chapter 12).

A linear layer y = x Wᵀ + b, W of shape [out, in], splits over `size` ranks in two ways:

- **column-parallel**: rank r holds rows [r·out/size, (r+1)·out/size) of W, a slice of the output
  features, and the same slice of b. Its output is that slice of y, computed from the whole x:
  no communication. A merged weight (gate_up = [gate; up], qkv = [q; k; v]) is sliced part by
  part, so that every rank holds its share of each part (not rank 0 all of gate, rank 1 all of up).
- **row-parallel**: rank r holds columns [r·in/size, (r+1)·in/size) of W, a slice of the input
  features, which is exactly the slice of x a column-parallel layer before it left on that rank.
  Its output is a partial sum over its features: one all-reduce adds the ranks' parts, and the
  bias is added once, after it (added on every rank before it, it would count `size` times).

Column then row: an MLP (gate_up, down) or an attention block (qkv by heads, o_proj) costs ONE
all-reduce of [tokens, hidden], two per transformer layer. Attention splits by heads: rank r keeps
its query heads and the KV heads they read; with fewer KV heads than ranks, each KV head is
replicated on the ranks whose query heads share it. A vocab-parallel embedding holds a slice of the
vocabulary's rows; each rank looks up the tokens it owns, zeros for the others, and an all-reduce
puts every row together. One process is `ParallelState()`: size 1, no communication.

These layers are the ones the engine's decoder is built from (minillm/model/llama.py): at size 1
each is the plain operation (`F.linear`, `F.embedding`), with no collective. Built from a whole
weight (`ColumnParallelLinear(weight, bias, tp)`) they cut their share themselves, as exercise 12
does; the engine's loader reads each rank's share from the checkpoint and hands it over with
`from_shard`. `forward` takes the matmul to run (`F.linear`, or the fused CPU path's oneDNN one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CommCounter:
    """Collectives a rank called, the bytes it handed them and the wall time it spent in them, over its
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


@dataclass(frozen=True)
class ParallelState:
    """Which rank of how many, and the process group the collectives run on (None: the default one);
    `comm`, when given, counts the all-reduces."""

    rank: int = 0
    size: int = 1
    group: Any = None
    comm: CommCounter | None = field(default=None, compare=False)

    @classmethod
    def of(cls, group: Any = None) -> ParallelState:
        """This process's place in `group` (one process when torch.distributed is not initialised)."""
        if not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; nothing to do on one rank."""
        if self.size > 1:
            if self.comm is None:
                dist.all_reduce(tensor, group=self.group)
            else:
                with self.comm.timed("all_reduce", tensor):
                    dist.all_reduce(tensor, group=self.group)
        return tensor


def divide(total: int, size: int, what: str) -> int:
    """total / size, or a ValueError naming both when it does not divide."""
    if size < 1 or total % size:
        raise ValueError(f"{what}={total} cannot be split evenly over {size} rank(s)")
    return total // size


def _check_rank(rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} must be in [0, {size})")


def column_shard(weight: torch.Tensor, rank: int, size: int, part_sizes: list[int] | None = None) -> torch.Tensor:
    """Rank's slice of the output features (dim 0) of a weight or bias; a merged weight whose dim 0
    stacks parts of `part_sizes` is sliced part by part. A copy: a view would keep the whole alive."""
    _check_rank(rank, size)
    parts = list(part_sizes) if part_sizes is not None else [weight.shape[0]]
    if sum(parts) != weight.shape[0]:
        raise ValueError(f"part_sizes {parts} add up to {sum(parts)}, not the weight's {weight.shape[0]} rows")
    pieces, start = [], 0
    for part in parts:
        per_rank = divide(part, size, "output features")
        pieces.append(weight[start + rank * per_rank:start + (rank + 1) * per_rank])
        start += part
    return torch.cat(pieces).clone(memory_format=torch.contiguous_format)


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's slice of the input features (dim 1) of a weight, as its own contiguous copy."""
    _check_rank(rank, size)
    per_rank = divide(weight.shape[1], size, "input features")
    return weight[:, rank * per_rank:(rank + 1) * per_rank].clone(memory_format=torch.contiguous_format)


Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class _LinearShard:
    tp: ParallelState
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_shard(cls, weight: torch.Tensor, bias: torch.Tensor | None, tp: ParallelState):
        """The layer on this rank's share, already cut (as the engine's loader reads it); for a
        row-parallel layer `bias` is whole."""
        layer = cls.__new__(cls)
        layer.tp, layer.weight, layer.bias = tp, weight, bias
        return layer


class ColumnParallelLinear(_LinearShard):
    """y[:, this rank's slice] = x Wᵀ + b for this rank's rows of W (and of b). No communication."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: ParallelState,
                 part_sizes: list[int] | None = None) -> None:
        self.tp = tp
        self.weight = column_shard(weight, tp.rank, tp.size, part_sizes)
        self.bias = None if bias is None else column_shard(bias, tp.rank, tp.size, part_sizes)

    def forward(self, x: torch.Tensor, matmul: Matmul = F.linear) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)

    __call__ = forward


class RowParallelLinear(_LinearShard):
    """y = all_reduce(x_slice W_sliceᵀ) + b: the ranks' partial sums added, the bias added once.
    On one rank: x Wᵀ + b, one matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: ParallelState) -> None:
        self.tp = tp
        self.weight = row_shard(weight, tp.rank, tp.size)
        self.bias = None if bias is None else bias.clone()

    def forward(self, x: torch.Tensor, matmul: Matmul = F.linear) -> torch.Tensor:
        if self.tp.size == 1:
            return matmul(x, self.weight, self.bias)
        y = self.tp.all_reduce(matmul(x, self.weight, None))
        return y if self.bias is None else y + self.bias

    __call__ = forward


class VocabParallelEmbedding:
    """Rank r holds rows [r·V/size, (r+1)·V/size) of the table; every rank gets every token's row."""

    def __init__(self, table: torch.Tensor, tp: ParallelState) -> None:
        self.tp = tp
        per_rank = divide(table.shape[0], tp.size, "vocab_size")
        self.start, self.stop = tp.rank * per_rank, (tp.rank + 1) * per_rank
        self.weight = table[self.start:self.stop].clone()

    @classmethod
    def from_shard(cls, rows: torch.Tensor, start: int, tp: ParallelState) -> VocabParallelEmbedding:
        """The rows [start, start + len(rows)) already read for this rank (the last one's zero-padded)."""
        layer = cls.__new__(cls)
        layer.tp, layer.weight, layer.start, layer.stop = tp, rows, start, start + rows.shape[0]
        return layer

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.start) & (token_ids < self.stop)
        rows = F.embedding(torch.where(mine, token_ids - self.start, 0), self.weight)
        return self.tp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    __call__ = forward


# --- the MLP: gate_up column-parallel, down row-parallel --------------------------------------------


@dataclass
class MLPWeights:
    """A SiLU-gated MLP, y = down(silu(gate x) · up x): the whole layer, or one rank's share of it."""

    gate_up: torch.Tensor  # [2·I, H]: gate's I rows, then up's I rows (I / size each on a rank)
    gate_up_bias: torch.Tensor | None  # [2·I] (sliced like gate_up)
    down: torch.Tensor  # [H, I] (I / size columns on a rank)
    down_bias: torch.Tensor | None  # [H], whole on every rank: added once, after the all-reduce


def shard_mlp(weights: MLPWeights, rank: int, size: int) -> MLPWeights:
    """Rank's share of an MLP: column-parallel gate_up (gate and up sliced alike), row-parallel down."""
    intermediate = weights.down.shape[1]
    parts = [intermediate, intermediate]
    return MLPWeights(
        gate_up=column_shard(weights.gate_up, rank, size, parts),
        gate_up_bias=None if weights.gate_up_bias is None else column_shard(weights.gate_up_bias, rank, size, parts),
        down=row_shard(weights.down, rank, size),
        down_bias=None if weights.down_bias is None else weights.down_bias.clone())


def mlp_forward(x: torch.Tensor, shard: MLPWeights, tp: ParallelState) -> torch.Tensor:
    """The MLP on every token of x [T, H] on this rank, whole output [T, H] on every rank: the
    engine's layers, gate|up column-parallel, down row-parallel (its all-reduce, then the bias)."""
    gate, up = ColumnParallelLinear.from_shard(shard.gate_up, shard.gate_up_bias, tp)(x).chunk(2, dim=-1)
    return RowParallelLinear.from_shard(shard.down, shard.down_bias, tp)(F.silu(gate) * up)


# --- attention: q, k, v column-parallel by heads, o_proj row-parallel ------------------------------


@dataclass
class AttentionShard:
    """One rank's heads of an attention block (no bias, no rotary: what the split is about)."""

    q: torch.Tensor  # [heads_here · D, H]
    k: torch.Tensor  # [kv_heads_here · D, H]
    v: torch.Tensor  # [kv_heads_here · D, H]
    o: torch.Tensor  # [H, heads_here · D]
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, size: int) -> range:
    """The KV heads rank's query heads read: its own 1/size of them, or, when there are fewer KV heads
    than ranks, the one KV head its query heads share (replicated on size / num_kv_heads ranks)."""
    _check_rank(rank, size)
    divide(num_heads, size, "num_heads")
    divide(num_heads, num_kv_heads, "num_heads (query heads per KV head)")
    if num_kv_heads >= size:
        per_rank = divide(num_kv_heads, size, "num_kv_heads")
        return range(rank * per_rank, (rank + 1) * per_rank)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} is not a multiple of num_kv_heads={num_kv_heads}: a rank's "
                         "query heads would read parts of two KV heads")
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def shard_attention(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, num_heads: int,
                    num_kv_heads: int, rank: int, size: int) -> AttentionShard:
    """Rank's heads: q rows and o columns of its query heads, k and v rows of the KV heads they read."""
    head_dim = wq.shape[0] // num_heads
    heads_here = divide(num_heads, size, "num_heads")
    kv = kv_heads_of_rank(num_heads, num_kv_heads, rank, size)
    q_rows = slice(rank * heads_here * head_dim, (rank + 1) * heads_here * head_dim)
    kv_rows = slice(kv.start * head_dim, kv.stop * head_dim)
    return AttentionShard(q=wq[q_rows].clone(), k=wk[kv_rows].clone(), v=wv[kv_rows].clone(),
                          o=wo[:, q_rows].clone(memory_format=torch.contiguous_format),
                          num_heads=heads_here, num_kv_heads=len(kv))


def attention_forward(x: torch.Tensor, shard: AttentionShard, tp: ParallelState) -> torch.Tensor:
    """Causal self-attention of one sequence x [T, H] with this rank's heads, whole output on every rank."""
    tokens, head_dim = x.shape[0], shard.q.shape[0] // shard.num_heads
    q = F.linear(x, shard.q).view(tokens, shard.num_heads, head_dim).transpose(0, 1)
    k = F.linear(x, shard.k).view(tokens, shard.num_kv_heads, head_dim).transpose(0, 1)
    v = F.linear(x, shard.v).view(tokens, shard.num_kv_heads, head_dim).transpose(0, 1)
    group = shard.num_heads // shard.num_kv_heads
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [heads_here, T, D]
    return RowParallelLinear.from_shard(shard.o, None, tp)(heads.transpose(0, 1).reshape(tokens, -1))  # o_proj


def all_reduce_bytes_per_token(hidden_size: int, dtype_bytes: int, num_layers: int = 1) -> int:
    """Bytes each rank hands to all-reduces per token: [hidden] after attention and after the MLP,
    per layer (what moves over the link is about 2·(size − 1)/size of it, for a ring)."""
    return 2 * num_layers * hidden_size * dtype_bytes
