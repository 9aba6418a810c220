"""Small ragged paged-KV inputs for the kernels' checks, chapter 10 and exercise ex10.

A scenario is what one decode step hands `paged_attention_decode`: sequences of different lengths
whose KV blocks are scattered over a shuffled pool, block tables padded with -1, and every pool slot
that no sequence owns filled with NaN, so a kernel that reads a slot it should not (past a partial
last block, through a -1 entry) returns NaN instead of a plausible number. Imports neither numba
nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedScenario:
    query: torch.Tensor  # [B, H_q, D]
    key_cache: torch.Tensor  # [NB, block_size, H_kv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor  # [B] int32
    scale: float

    def args(self) -> tuple:
        """The arguments of paged_attention_decode, in its order."""
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.scale

    def to(self, device: str) -> PagedScenario:
        move = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return PagedScenario(**move, scale=self.scale)


def paged_scenario(seq_lens: list[int], block_size: int, num_blocks: int, kv_heads: int, q_heads: int,
                   head_dim: int, seed: int, logit_scale: float = 1.0, extra_table_width: int = 1) -> PagedScenario:
    """Sequences of `seq_lens` tokens on a pool of `num_blocks` blocks handed out in a seeded random order.

    `logit_scale` multiplies the queries: at 1000 some attention logits exceed 709, where exp()
    overflows even in float64 unless the running max is subtracted. `extra_table_width` adds -1
    columns to every block table, as a runner's persistent table is wider than the longest sequence
    of a step. The pool's last block is never handed out, so it always holds NaN: a kernel that
    indexes block -1 (numpy wraps it around to the last block) reads NaN, not a neighbour's keys.
    """
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens must be a non-empty list of lengths >= 1, got {seq_lens}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for GQA")
    need = [-(-n // block_size) for n in seq_lens]
    if sum(need) > num_blocks - 1:
        raise ValueError(f"num_blocks={num_blocks} is too small: the sequences need {sum(need)} blocks, "
                         "plus the last block, which is kept free")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(need) + extra_table_width), -1, dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    for b, (n, blocks) in enumerate(zip(seq_lens, need)):
        tables[b, :blocks] = torch.tensor([order.pop() for _ in range(blocks)], dtype=torch.int32)
        for p in range(n):
            slot = (int(tables[b, p // block_size]), p % block_size)
            key_cache[slot] = torch.randn(kv_heads, head_dim, generator=g)
            value_cache[slot] = torch.randn(kv_heads, head_dim, generator=g)
    query = torch.randn(len(seq_lens), q_heads, head_dim, generator=g) * logit_scale
    return PagedScenario(query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                         head_dim**-0.5)
