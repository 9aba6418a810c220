"""Attention through minillm's numba.cuda kernels: the GPU backend (chapter 10).

The step's flat metadata (`minillm.attention.metadata.AttentionMetadata`, no row groups), handed
to the kernels as it is: `reshape_and_cache` writes the step's K/V through `slot_mapping`;
`paged_attention_decode` serves the decode rows (the first `num_decode` sequences, one query each)
and `prefill_attention` the rest, both reading K/V through `block_tables` with an online softmax
— no gathers, no padded key runs. Chosen with `attention_backend="numba"` (the default on CUDA);
on a CPU it runs only under numba's simulator, which is how the tests check it. A quantized pool
(`kv_cache_dtype`, chapter 14) goes to the same three kernels in their quantized form
(`kernels/quantized_kv.py`): the write quantizes, the attention kernels decode each byte they read.
"""

from __future__ import annotations

import math

import torch

from minillm.attention.metadata import AttentionMetadata, StepLayout


class NumbaPagedAttention:
    @staticmethod
    def check(device: torch.device, dtype: torch.dtype) -> None:
        """CUDA, or a CPU under numba's simulator (NUMBA_ENABLE_CUDASIM=1): the kernels check the rest."""

    @staticmethod
    def build_metadata(layout: StepLayout) -> AttentionMetadata:
        """The flat layout as it is: the kernels read block tables directly, each key once."""
        return layout.flat_metadata()

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                 sliding_windows: tuple[int | None, ...] = (), kv_cache_dtype: str = "auto") -> None:
        if any(w is not None for w in sliding_windows):
            raise ValueError("the numba kernels have no sliding-window mask: use attention_backend='torch'")
        from minillm import kernels

        self.kernels = kernels
        self.k_pool, self.v_pool, self.meta = k_pool, v_pool, meta
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_dtype == "auto" and k_pool.dtype == torch.uint8:  # e.g. CUDA graphs handed a quantized pool
            raise ValueError("this KV pool holds quantized bytes (uint8): pass its kv_cache_dtype ('int8' or "
                             "'fp8_e4m3') so the quantized kernels read it")
        m = meta
        nd = m.num_decode
        self.decode_tables, self.decode_lens = m.block_tables[:nd].contiguous(), m.seq_lens[:nd].contiguous()
        self.prefill_tables, self.prefill_lens = m.block_tables[nd:].contiguous(), m.seq_lens[nd:].contiguous()
        self.prefill_starts = (m.query_start_loc[nd:] - m.query_start_loc[nd]).contiguous()
        self.first_prefill_row = int(m.query_start_loc[nd]) if nd < len(m.seq_lens) else m.num_tokens

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m, kern = self.meta, self.kernels
        bs = m.block_size
        k_cache = self.k_pool[layer].view(-1, bs, *self.k_pool.shape[2:])
        v_cache = self.v_pool[layer].view(-1, bs, *self.v_pool.shape[2:])
        scale = 1.0 / math.sqrt(q.shape[-1])
        q = q.contiguous()
        if self.kv_cache_dtype == "auto":
            write, decode, prefill, extra = (kern.reshape_and_cache, kern.paged_attention_decode,
                                             kern.prefill_attention, ())
        else:  # the pool holds bytes: the same kernels, quantizing and decoding (kernels/quantized_kv.py)
            write, decode, prefill, extra = (kern.reshape_and_cache_quantized, kern.paged_attention_decode_quantized,
                                             kern.prefill_attention_quantized, (self.kv_cache_dtype,))
        write(k.contiguous(), v.contiguous(), k_cache, v_cache, m.slot_mapping, *extra)
        nd = m.num_decode
        parts = []
        if nd:
            parts.append(decode(q[:nd].contiguous(), k_cache, v_cache, self.decode_tables, self.decode_lens, scale,
                                *extra))
        if self.first_prefill_row < q.shape[0]:
            parts.append(prefill(q[self.first_prefill_row :].contiguous(), k_cache, v_cache, self.prefill_tables,
                                 self.prefill_starts, self.prefill_lens, scale, *extra))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
