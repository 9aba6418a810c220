"""paged_attention_decode: one query per sequence against its paged K/V (chapter 10; vLLM's shapes).

    query            [B, H_q, D]
    key_cache, value_cache [NB, block_size, H_kv, D]
    block_tables     [B, max_blocks] int32, -1 after a sequence's last block (never read)
    seq_lens         [B] int32: keys of sequence b are its positions 0 … seq_lens[b]-1
    scale            1 / sqrt(D)
    → out            [B, H_q, D]

One thread per (sequence, query head). It walks the sequence's block table block by block — the
last block only as far as the sequence goes — and keeps an *online softmax*: the running max m,
the running sum l of exp(s - m) and the running weighted sum of values, rescaled by exp(m_old - m)
whenever a larger score appears. One pass over K and V, no [B, H, K] score matrix, and each key is
read straight from the pool through the block table: no gather, no padding. GQA: query head h reads
KV head h // (H_q / H_kv), as HF's repeat_kv pairs them.

This is the simulatable reference kernel (no warp shuffles, no shared memory). A faster variant
would split a sequence's keys over a warp and reduce the partial softmaxes with shuffles.
"""

from __future__ import annotations

import math

import torch
from minillm.kernels._launch import device_array, launch
from numba import cuda, float32

MAX_HEAD_DIM = 256


def paged_attention_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    bs = key_cache.shape[1]
    out = torch.empty_like(query)
    group = query.shape[1] // key_cache.shape[2]
    for b in range(query.shape[0]):
        n = int(seq_lens[b])
        blocks = block_tables[b, : -(-n // bs)].long()
        keys = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:n].repeat_interleave(group, 1)  # [n, H_q, D]
        values = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:n].repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", query[b].float(), keys.float()) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.float()).to(query.dtype)
    return out


def _kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b = i // q_heads
    h = i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    block_size = key_cache.shape[1]
    n = seq_lens[b]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m = -math.inf
    total = 0.0
    for p in range(n):  # position p lives in block table[b, p // bs] at offset p % bs
        block = block_tables[b, p // block_size]
        off = p % block_size
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m_new = max(m, s)
        correction = math.exp(m - m_new)
        weight = math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


kernel = cuda.jit(_kernel)
python_function = _kernel


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {query.shape[-1]} > {MAX_HEAD_DIM}, the kernel's per-thread accumulator")
    out = torch.empty_like(query)
    launch(kernel, query.shape[0] * query.shape[1], device_array(query), device_array(key_cache),
           device_array(value_cache), device_array(block_tables), device_array(seq_lens), float(scale),
           device_array(out))
    return out
