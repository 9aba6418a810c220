"""Paged decode attention on a CPU through chapter 10's kernel compiled by numba @njit (chapter 10).

`attention_backend="numba_cpu"` (what `"auto"` picks on a CPU, see `minillm.attention.select`):
the decode rows — the first `num_decode` sequences, one query each — go to
`kernels/cpu_decode_attention.py`, which reads every key and value once straight from the pool
through the block table (online softmax, the G query heads of a KV head sharing each read). The
torch backend instead gathers each length group's blocks into a padded run and calls SDPA on it:
two extra passes over the keys and values, and one call per group. A speculative row (1 + k new
tokens after a cached context, chapter 09) is k + 1 decode rows in disguise: query i sits at
position ctx + i and sees keys 0 … ctx + i, all written before any layer reads. When every
multi-token row of a step is that short (`MAX_QUERIES_AS_DECODE`), the metadata builder splits
each into one kernel row per query token (`as_decode_rows`), and the whole verify step is one
kernel call per layer: no gather, no mask, no SDPA. Other multi-token rows (prefill chunks,
recomputes) stay on the torch backend's batched SDPA, which measures faster for them here. Everything else (the K/V write, the prefill groups) is shared with
`FlatPoolAttention`; its metadata builder puts every decode row in one group (the kernel's one
call; a torch backend handed this metadata would still compute the same result, padded) and counts
each key read once. A quantized pool (`kv_cache_dtype`, chapter 14) goes to
`kernels/cpu_quantized_decode.py`, which decodes each sequence's bytes once, then runs the same loops.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from minillm.attention.flat_pool import FlatPoolAttention, build_row_groups
from minillm.attention.metadata import AttentionMetadata, StepLayout
from minillm.kv.quant import head_dim_of

KERNEL_DTYPES = (torch.float32, torch.float64)
# Multi-token rows after a cached context up to this many new tokens run as one decode row per
# token (a speculative row has 1 + k; k is rarely above 8): each query re-reads the row's keys.
MAX_QUERIES_AS_DECODE = 16


def as_decode_rows(layout: StepLayout) -> StepLayout | None:
    """The same step with every query token its own decode row (its own length, its row's block
    table), when every multi-token row is short and follows a cached context; else None."""
    nd, q_lens, seq_lens = layout.num_decode, layout.query_lens, layout.seq_lens
    if nd == len(seq_lens):
        return None  # already all decode
    rest_q, rest_len = q_lens[nd:], seq_lens[nd:]
    if rest_q.max() > MAX_QUERIES_AS_DECODE or (rest_len <= rest_q).any():  # long, or nothing cached yet
        return None
    row_of_token = np.repeat(np.arange(len(seq_lens)), q_lens)
    token = np.arange(len(row_of_token))
    offset = token - layout.query_start_loc[row_of_token]  # the token's place in its row
    lens = (seq_lens[row_of_token] - q_lens[row_of_token] + offset + 1).astype(np.int32)
    return dataclasses.replace(layout, seq_lens=lens, query_lens=np.ones(len(token), dtype=q_lens.dtype),
                               query_start_loc=np.arange(len(token) + 1, dtype=np.int32),
                               block_tables=layout.block_tables[row_of_token], num_decode=len(token))


class NumbaCpuAttention(FlatPoolAttention):
    @staticmethod
    def check(device: torch.device, dtype: torch.dtype) -> None:
        if torch.device(device).type == "cuda" or dtype not in KERNEL_DTYPES:
            raise ValueError(f"attention_backend='numba_cpu' runs on a CPU in float32 or float64, not on "
                             f"{torch.device(device)} in {dtype}: use 'torch' or 'auto'")

    @staticmethod
    def build_metadata(layout: StepLayout) -> AttentionMetadata:
        layout = as_decode_rows(layout) or layout
        meta = build_row_groups(layout, decode_slack=math.inf)
        meta.keys_read = int(layout.seq_lens[: layout.num_decode].sum())  # the kernel walks each row to its length
        return meta

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                 sliding_windows: tuple[int | None, ...] = (), kv_cache_dtype: str = "auto") -> None:
        super().__init__(k_pool, v_pool, meta, sliding_windows, kv_cache_dtype)
        from minillm.kernels import cpu_decode_attention

        self.kernel = None
        if self.kv_format is None:
            self.kernel = cpu_decode_attention.kernel_for(k_pool.dtype)  # looked up each step (profilers wrap it)
        nd = meta.num_decode
        # numpy views (zero-copy) made once per step and shared by every layer
        self.decode_tables = meta.block_tables[:nd].contiguous().numpy()
        self.decode_lens = meta.seq_lens[:nd].contiguous().numpy()
        self.scale = 1.0 / math.sqrt(head_dim_of(k_pool.shape[-1], self.kv_format))
        bs = meta.block_size  # the pools as numpy [L, num_blocks, block_size, H_kv, D], one view per step
        self.k_blocks = k_pool.numpy().reshape(k_pool.shape[0], -1, bs, *k_pool.shape[2:])
        self.v_blocks = v_pool.numpy().reshape(v_pool.shape[0], -1, bs, *v_pool.shape[2:])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = self.windows[layer]
        k_blocks, v_blocks = self.write(layer, k, v)
        nd = self.meta.num_decode
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd and self.kernel is None:  # a quantized pool: its bytes decoded inside the kernel
            self._quantized_decode(layer, q[:nd].contiguous(), window, out[:nd])
        elif nd:
            self.kernel(q[:nd].contiguous().numpy(), self.k_blocks[layer], self.v_blocks[layer], self.decode_tables,
                        self.decode_lens, self.scale, window or 0, out[:nd].numpy())
        if self.meta.prefill_groups:
            self.multi_token(out, q, self.as_stored(k), self.as_stored(v), k_blocks, v_blocks, window)
        return out

    def _quantized_decode(self, layer: int, q: torch.Tensor, window: int | None, out: torch.Tensor) -> None:
        from minillm.kernels.cpu_quantized_decode import quantized_kernel_for, scale_view
        from minillm.kv.quant import decode_table

        fmt, k_np, v_np = self.kv_format, self.k_blocks[layer], self.v_blocks[layer]
        has_scale = fmt.per_token_scale
        quantized_kernel_for(q.dtype)(q.numpy(), k_np, v_np, scale_view(k_np, has_scale), scale_view(v_np, has_scale),
                                      decode_table(fmt, q.dtype).numpy(), has_scale, self.decode_tables,
                                      self.decode_lens, self.scale, window or 0, out.numpy())
