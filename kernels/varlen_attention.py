"""prefill_attention: varlen causal attention over paged K/V, cached prefix included (chapter 10).

    query            [T, H_q, D]      the step's queries, sequences laid end to end
    key_cache, value_cache [NB, block_size, H_kv, D]  (this step's K/V already written)
    block_tables     [B, max_blocks] int32, -1 padded
    query_start_loc  [B+1] int32: sequence b's queries are rows query_start_loc[b] … [b+1]-1
    seq_lens         [B] int32: its length including the new tokens
    scale
    → out            [T, H_q, D]

Sequence b's queries are its last q_len_b positions: query i sits at position
seq_len_b - q_len_b + i and attends to keys 0 … that position (causal), whether they were computed
this step or long ago (a cached prefix, an earlier prefill chunk, the accepted tokens before a
speculative row). One thread per (query, head), one pass with an online softmax, as FlashAttention
does per tile; the tiled version loads blocks of K/V into shared memory once for many queries.
"""

from __future__ import annotations

import math

import torch
from minillm.kernels._launch import device_array, launch
from numba import cuda, float32

MAX_HEAD_DIM = 256


def prefill_attention_reference(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                scale, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bs = key_cache.shape[1]
    out = torch.empty_like(query)
    group = query.shape[1] // key_cache.shape[2]
    for b in range(len(seq_lens)):
        start, end, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        blocks = block_tables[b, : -(-n // bs)].long()
        keys = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:n].repeat_interleave(group, 1).to(compute_dtype)
        values = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:n].repeat_interleave(group, 1).to(compute_dtype)
        q = query[start:end].to(compute_dtype)
        scores = torch.einsum("qhd,nhd->hqn", q, keys) * scale
        q_pos = torch.arange(n - (end - start), n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out


def _kernel(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out):
    i = cuda.grid(1)
    num_tokens, q_heads, dim = query.shape
    if i >= num_tokens * q_heads:
        return
    t = i // q_heads
    h = i % q_heads
    b = 0
    while query_start_loc[b + 1] <= t:  # which sequence this query belongs to
        b += 1
    q_len = query_start_loc[b + 1] - query_start_loc[b]
    position = seq_lens[b] - q_len + (t - query_start_loc[b])
    kv_head = h // (q_heads // key_cache.shape[2])
    block_size = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m = -math.inf
    total = 0.0
    for p in range(position + 1):
        block = block_tables[b, p // block_size]
        off = p % block_size
        s = 0.0
        for d in range(dim):
            s += query[t, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m_new = max(m, s)
        correction = math.exp(m - m_new)
        weight = math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[t, h, d] = acc[d] / total


kernel = cuda.jit(_kernel)
python_function = _kernel


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {query.shape[-1]} > {MAX_HEAD_DIM}, the kernel's per-thread accumulator")
    out = torch.empty_like(query)
    launch(kernel, query.shape[0] * query.shape[1], device_array(query), device_array(key_cache),
           device_array(value_cache), device_array(block_tables), device_array(query_start_loc),
           device_array(seq_lens), float(scale), device_array(out))
    return out
