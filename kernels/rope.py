"""rotary_embedding: rotate queries and keys in place by their positions' angles (chapter 10).

    positions [T], query [T, H_q, D], key [T, H_kv, D], cos_sin_cache [max_positions, D]
    (vLLM's layout: the first D/2 columns are cos, the last D/2 sin, of each frequency), is_neox

NeoX style (Llama, HF's rotate_half) pairs dimension i with i + D/2; GPT-J style pairs 2i with 2i+1.
One thread per (token, head, pair) rotates one pair of one head — of a query head or, after the
query heads, a key head.
"""

from __future__ import annotations

import torch
from minillm.kernels._launch import device_array, launch
from numba import cuda


def rotary_embedding_reference(positions, query, key, cos_sin_cache, is_neox: bool = True) -> None:
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions.long(), :half][:, None], cos_sin_cache[positions.long(), half:][:, None]
    for x in (query, key):
        if is_neox:
            a, b = x[..., :half].clone(), x[..., half:].clone()
            x[..., :half], x[..., half:] = a * cos - b * sin, b * cos + a * sin
        else:
            a, b = x[..., 0::2].clone(), x[..., 1::2].clone()
            x[..., 0::2], x[..., 1::2] = a * cos - b * sin, b * cos + a * sin


def _kernel(positions, query, key, cos_sin_cache, is_neox):
    i = cuda.grid(1)
    num_tokens, q_heads, dim = query.shape
    kv_heads = key.shape[1]
    half = dim // 2
    if i >= num_tokens * (q_heads + kv_heads) * half:
        return
    t = i // ((q_heads + kv_heads) * half)
    h = (i // half) % (q_heads + kv_heads)
    j = i % half
    pos = positions[t]
    c = cos_sin_cache[pos, j]
    s = cos_sin_cache[pos, half + j]
    if is_neox:
        a_idx, b_idx = j, j + half
    else:
        a_idx, b_idx = 2 * j, 2 * j + 1
    if h < q_heads:
        a = query[t, h, a_idx]
        b = query[t, h, b_idx]
        query[t, h, a_idx] = a * c - b * s
        query[t, h, b_idx] = b * c + a * s
    else:
        k = h - q_heads
        a = key[t, k, a_idx]
        b = key[t, k, b_idx]
        key[t, k, a_idx] = a * c - b * s
        key[t, k, b_idx] = b * c + a * s


kernel = cuda.jit(_kernel)
python_function = _kernel


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> None:
    num = query.shape[0] * (query.shape[1] + key.shape[1]) * (query.shape[2] // 2)
    launch(kernel, num, device_array(positions), device_array(query), device_array(key), device_array(cos_sin_cache),
           bool(is_neox))
