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
sequence serves all its query heads, in three steps:

1. scores: walk the block table and read each key row once — every KV head of it, 512 contiguous
   bytes here, rather than one head's slice at a time (the memory system streams whole rows; a
   slice per pass was measured slower once the pool is out of cache) — and dot it with the G query
   heads that share each KV head (GQA), four keys at a time (four independent sums keep the SIMD
   units busy; one key at a time waits on each sum's horizontal add);
2. softmax over each head's whole row of scores: its max, then exp(score − max) — a *two-pass*
   softmax, not the CUDA kernel's online one: a sequence's scores fit in a small buffer here, and
   each exp is computed once rather than once plus a rescale per block;
3. values: walk the block table again, each value row read once, p · v added into the heads'
   accumulators four keys at a time; divide by the sum at the end.

No gather, no padded key run, no [B, H, K] score matrix. In float32 the exp of step 2 is a
polynomial over the whole row that LLVM turns into SIMD code (exp(x) = 2^k · e^r with |r| ≤ ln2/2,
a degree-7 Taylor series for e^r: error below 1e-8 relative, under float32's own rounding; with the
arithmetic in float32, 1.1e-7 relative within 20 of the row's max, measured over 2 million points): the
library `exp` is one scalar call per score. Every step of it must stay float32: with `math.floor`,
whose result is an integer, the reduction and the series ran in float64, and the exp took 3.7× as long
(2,400 scores: 4.7 vs 1.3 µs). float64 keeps `math.exp` (the exactness tests run in
float64). Against the earlier one-pass, online-softmax kernel (this file before commit 98ed7b1),
timed side by side once on the ladder's shapes (14 sequences, ~1,700 keys, 8 query and 4 KV heads
of 32): about 1.9× faster with the keys in cache, no slower when they are not — and inside the
engine, where they mostly are not, about 5 % (docs/results.md). `python bench/attention_backends.py`
measures it against the torch backend.

`fastmath=True` lets LLVM reassociate the D-long dot products and value updates into SIMD lanes;
the sums come out in a different order than torch's, which is fine: the engine's exactness test is
greedy tokens equal to HF float64, not bitwise equality. `cache=True` keeps the compiled machine
code on disk (`__pycache__` beside this file, or numba's user cache when that is read-only), so
only the first process on a machine pays the compilation (a few seconds per dtype); later ones load
it in well under a second. Importing this module imports numba (the CPU compiler only, never
numba.cuda); `minillm.kernels` imports it on first use.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

_F32 = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F32(1.4426950408889634), _F32(0.693145751953125), _F32(1.428606820309417e-06)
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = (_F32(1.0 / math.factorial(i)) for i in range(8))  # e^r's Taylor terms
_EXP_FLOOR = _F32(-87.0)  # below it exp leaves float32's normal range; the max's own score is 1


@njit(fastmath=True, nogil=True, inline="always")
def _exp_in_place(x, bits, n, simd):
    """x[:n] = exp(x[:n]) for scores minus their max (all ≤ 0). simd (float32): exp(t) = 2^k · e^r,
    k = round(t / ln2), r = t - k·ln2 (ln2 in two parts), 2^k built from its bits in `bits`
    (int32 scratch); otherwise the library's exp, one scalar call per score."""
    if simd:
        for i in range(n):
            t = max(x[i], _EXP_FLOOR)
            k = np.floor(t * _LOG2E + _F32(0.5))  # (np.floor keeps float32; math.floor's int made the rest float64)
            r = t - k * _LN2_HI - k * _LN2_LO
            x[i] = _C0 + r * (_C1 + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * (_C6 + r * _C7))))))
            bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
        two_to_k = bits.view(np.float32)
        for i in range(n):
            x[i] *= two_to_k[i]
    else:
        for i in range(n):
            x[i] = math.exp(x[i])


@njit(fastmath=True, nogil=True, inline="always")
def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out, zero, simd_exp):
    """The kernel's body; `zero` (0 in the query's dtype) and `simd_exp` are constants of each
    compiled kernel below, so LLVM sees the sums start at a literal 0 in the right dtype."""
    num_seqs, q_heads, dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q_heads // kv_heads
    longest = 1
    for b in range(num_seqs):
        longest = max(longest, seq_lens[b])
    q = np.empty((q_heads, dim), query.dtype)  # this sequence's queries, pre-scaled
    scores = np.empty((q_heads, longest), query.dtype)  # then exp(score - max)
    bits = np.empty(longest, np.int32)
    acc = np.empty((q_heads, dim), query.dtype)
    total = np.empty(q_heads, query.dtype)
    for b in range(num_seqs):
        n = seq_lens[b]
        first = max(0, n - window) if window > 0 else 0
        count = n - first
        first_block, end_block = first // block_size, (n + block_size - 1) // block_size
        for h in range(q_heads):
            for d in range(dim):
                q[h, d] = query[b, h, d] * scale
        # 1. scores: each key row (every KV head, contiguous) read once, four keys at a time
        i = 0
        for blk in range(first_block, end_block):
            kb = key_cache[block_tables[b, blk]]  # [block_size, H_kv, D]
            j = max(first - blk * block_size, 0)
            hi = min(n - blk * block_size, block_size)
            while j + 4 <= hi:
                for kvh in range(kv_heads):
                    k0 = kb[j, kvh]
                    k1 = kb[j + 1, kvh]
                    k2 = kb[j + 2, kvh]
                    k3 = kb[j + 3, kvh]
                    for g in range(group):  # the G query heads of this KV head share the read
                        h = kvh * group + g
                        s0 = zero
                        s1 = zero
                        s2 = zero
                        s3 = zero
                        for d in range(dim):
                            qd = q[h, d]
                            s0 += qd * k0[d]
                            s1 += qd * k1[d]
                            s2 += qd * k2[d]
                            s3 += qd * k3[d]
                        scores[h, i] = s0
                        scores[h, i + 1] = s1
                        scores[h, i + 2] = s2
                        scores[h, i + 3] = s3
                j += 4
                i += 4
            while j < hi:
                for kvh in range(kv_heads):
                    k0 = kb[j, kvh]
                    for g in range(group):
                        h = kvh * group + g
                        s0 = zero
                        for d in range(dim):
                            s0 += q[h, d] * k0[d]
                        scores[h, i] = s0
                j += 1
                i += 1
        # 2. softmax over each head's row: its max, exp(score - max), their sum (divided out at the end)
        for h in range(q_heads):
            row = scores[h]
            m = row[0]
            for i in range(1, count):
                m = max(m, row[i])
            for i in range(count):
                row[i] -= m
            _exp_in_place(row, bits, count, simd_exp)
            t = zero
            for i in range(count):
                t += row[i]
            total[h] = t
            for d in range(dim):
                acc[h, d] = zero
        # 3. values, each row read once, four keys at a time
        i = 0
        for blk in range(first_block, end_block):
            vb = value_cache[block_tables[b, blk]]
            j = max(first - blk * block_size, 0)
            hi = min(n - blk * block_size, block_size)
            while j + 4 <= hi:
                for kvh in range(kv_heads):
                    v0 = vb[j, kvh]
                    v1 = vb[j + 1, kvh]
                    v2 = vb[j + 2, kvh]
                    v3 = vb[j + 3, kvh]
                    for g in range(group):
                        h = kvh * group + g
                        p0 = scores[h, i]
                        p1 = scores[h, i + 1]
                        p2 = scores[h, i + 2]
                        p3 = scores[h, i + 3]
                        for d in range(dim):
                            acc[h, d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
                j += 4
                i += 4
            while j < hi:
                for kvh in range(kv_heads):
                    v0 = vb[j, kvh]
                    for g in range(group):
                        h = kvh * group + g
                        p0 = scores[h, i]
                        for d in range(dim):
                            acc[h, d] += p0 * v0[d]
                j += 1
                i += 1
        for h in range(q_heads):
            inv = 1.0 / total[h]
            for d in range(dim):
                out[b, h, d] = acc[h, d] * inv


@njit(cache=True, fastmath=True, nogil=True)
def paged_decode_f32(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out):
    _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out, np.float32(0.0), True)


@njit(cache=True, fastmath=True, nogil=True)
def paged_decode_f64(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out):
    _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out, 0.0, False)


def kernel_for(dtype) -> object:
    """The compiled kernel for a numpy or torch float dtype (float32 or float64)."""
    return paged_decode_f32 if dtype in (np.float32, torch.float32) else paged_decode_f64


def paged_decode_kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out):
    """The kernel for the arrays' dtype (numpy arrays in, `out` written)."""
    kernel_for(query.dtype)(query, key_cache, value_cache, block_tables, seq_lens, scale, window, out)


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
