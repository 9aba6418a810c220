"""paged_attention_decode_cpu: chapter 10's paged decode attention as a CPU kernel (numba @njit).

Same spec as `decode_attention.py` (the CUDA kernel), same torch reference
(`decode_attention.paged_attention_decode_reference`), plus an optional sliding window:

    query            [B, H_q, D]
    key_cache, value_cache [NB, block_size, H_kv, D]
    block_tables     [B, max_blocks] int32, -1 after a sequence's last block (never read)
    seq_lens         [B] int32: keys of sequence b are its positions 0 … seq_lens[b]-1
    scale            1 / sqrt(D)
    window           0: every key; w > 0: only the last w keys (positions ≥ seq_len - w)
    → out            [B, H_q, D]

A CPU has a few cores, not thousands of threads, so the loop nest is turned around: one pass per
sequence serves all its query heads. It walks the block table, reads each block of keys front to
back once (every KV head of a key row, 512 contiguous bytes here, rather than one head's slice at a
time: measured 1.5x faster), and the G = H_q / H_kv query heads of a KV head share each key's read
(GQA). Scores come a block at a time (H_q x block_size), then the *online softmax* update once per
block (running max m, running sum l, running weighted sum of values, rescaled by exp(m_old - m_new))
— the CUDA kernel's algorithm at block rather than key granularity — then the block's values, read
once the same way. No gather, no padded key run, no [B, H, K] score matrix.

`fastmath=True` lets LLVM reassociate the D-long dot products and value updates into SIMD lanes
(about 2× faster here); the sums come out in a different order than torch's, which is fine: the
engine's exactness test is greedy tokens equal to HF float64, not bitwise equality. `cache=True`
keeps the compiled machine code on disk (`__pycache__` beside this file, or numba's user cache when
that is read-only), so only the first process on a machine pays the compilation (about 2 s per
dtype); later ones load it in well under a second. Importing this module imports numba (the CPU
compiler only, never numba.cuda); `minillm.kernels` imports it on first use.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

# An "empty" running max: finite, because fastmath lets LLVM assume no infinities.
_NO_SCORE_YET = -1e30


@njit(cache=True, fastmath=True, nogil=True)
def paged_decode_kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out):
    num_seqs, q_heads, dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q_heads // kv_heads
    q = np.empty((q_heads, dim), query.dtype)  # this sequence's queries, pre-scaled
    acc = np.empty((q_heads, dim), query.dtype)
    scores = np.empty((q_heads, block_size), query.dtype)
    m = np.empty(q_heads, query.dtype)
    total = np.empty(q_heads, query.dtype)
    for b in range(num_seqs):
        n = seq_lens[b]
        first = max(0, n - window) if window > 0 else 0
        for h in range(q_heads):
            m[h] = _NO_SCORE_YET
            total[h] = 0.0
            qh = q[h]
            ah = acc[h]
            for d in range(dim):
                qh[d] = query[b, h, d] * scale
                ah[d] = 0.0
        for blk in range(first // block_size, (n + block_size - 1) // block_size):
            block = block_tables[b, blk]
            lo = max(first - blk * block_size, 0)
            hi = min(n - blk * block_size, block_size)
            kb = key_cache[block]  # [block_size, H_kv, D]: read front to back, once
            vb = value_cache[block]
            for j in range(lo, hi):
                for kvh in range(kv_heads):
                    krow = kb[j, kvh]
                    for g in range(group):  # the G query heads sharing this KV head share the read
                        h = kvh * group + g
                        qh = q[h]
                        s = qh[0] * krow[0]  # in the cache's dtype, not float64
                        for d in range(1, dim):
                            s += qh[d] * krow[d]
                        scores[h, j] = s
            for h in range(q_heads):  # online softmax, once per block
                m_new = m[h]
                for j in range(lo, hi):
                    m_new = max(m_new, scores[h, j])
                correction = math.exp(m[h] - m_new)
                t = total[h] * correction
                for j in range(lo, hi):
                    p = math.exp(scores[h, j] - m_new)
                    scores[h, j] = p
                    t += p
                total[h] = t
                m[h] = m_new
                ah = acc[h]
                for d in range(dim):
                    ah[d] *= correction
            for j in range(lo, hi):
                for kvh in range(kv_heads):
                    vrow = vb[j, kvh]
                    for g in range(group):
                        h = kvh * group + g
                        p = scores[h, j]
                        ah = acc[h]
                        for d in range(dim):
                            ah[d] += p * vrow[d]
        for h in range(q_heads):
            inv = 1.0 / total[h]
            for d in range(dim):
                out[b, h, d] = acc[h, d] * inv


def paged_attention_decode_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of CPU tensors (float32 or float64), zero-copy into the kernel; writes `out`
    (a fresh [B, H_q, D] tensor unless given) and returns it."""
    if query.device.type != "cpu":
        raise ValueError(f"paged_attention_decode_cpu takes CPU tensors, got query on {query.device}")
    if query.dtype not in (torch.float32, torch.float64) or key_cache.dtype != query.dtype:
        raise ValueError(f"paged_attention_decode_cpu takes float32 or float64 (query {query.dtype}, "
                         f"cache {key_cache.dtype})")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not share {key_cache.shape[2]} KV heads evenly")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    paged_decode_kernel(query.numpy(), key_cache.numpy(), value_cache.numpy(), block_tables.numpy(),
                        seq_lens.numpy(), float(scale), int(window or 0), out.numpy())
    return out
