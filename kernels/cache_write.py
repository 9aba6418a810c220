"""reshape_and_cache: write this step's K and V into the paged cache (chapter 10; vLLM's name).

    key, value          [T, H_kv, D]             this step's new keys and values
    key_cache, value_cache [NB, block_size, H_kv, D]  the pool, in place
    slot_mapping        [T]                      slot of token t = block * block_size + offset; < 0: skip

One thread per (token, head, dimension): thread i copies one number. Nothing is read twice, nothing
depends on another thread: the simplest kernel of the chapter.
"""

from __future__ import annotations

import torch
from minillm.kernels._launch import device_array, launch
from numba import cuda


def reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping) -> None:
    bs = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // bs, slots % bs] = key[keep]
    value_cache[slots // bs, slots % bs] = value[keep]


def _kernel(key, value, key_cache, value_cache, slot_mapping):
    i = cuda.grid(1)
    num_tokens, heads, dim = key.shape
    if i >= num_tokens * heads * dim:
        return
    t = i // (heads * dim)
    h = (i // dim) % heads
    d = i % dim
    slot = slot_mapping[t]
    if slot < 0:
        return
    block_size = key_cache.shape[1]
    key_cache[slot // block_size, slot % block_size, h, d] = key[t, h, d]
    value_cache[slot // block_size, slot % block_size, h, d] = value[t, h, d]


kernel = cuda.jit(_kernel)
python_function = _kernel


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    launch(kernel, key.numel(), device_array(key), device_array(value), device_array(key_cache),
           device_array(value_cache), device_array(slot_mapping))
