"""paged_attention_decode_warp: paged decode attention with one warp per (sequence, head) (chapter 10).

Same arguments, shapes and result as `paged_attention_decode` (kernels/decode_attention.py):

    query [B, H_q, D], key_cache / value_cache [NB, block_size, H_kv, D], block_tables [B, max_blocks]
    int32 (-1 padded), seq_lens [B] int32, scale  →  out [B, H_q, D]

The simulatable kernel gives a whole sequence to one thread, so a long context is read by a single
thread, one number at a time. Here the 32 threads of a warp share one (sequence, query head): lane
j takes keys j, j + 32, j + 64, …, keeps its own online softmax over them (running max m, sum l,
weighted values acc[D]), and at the end the warp merges its 32 partial softmaxes in five butterfly
rounds of warp shuffles (`cuda.shfl_xor_sync`: each lane reads a register of the lane whose index
differs in one bit, without going through memory). Two partials merge exactly as the online
softmax merges a new key:

    m = max(m₁, m₂),  l = l₁·exp(m₁ − m) + l₂·exp(m₂ − m),  acc = acc₁·exp(m₁ − m) + acc₂·exp(m₂ − m)

after which every lane holds the whole result and the lanes write out[b, h, :] together. A lane
with no keys (a context shorter than 32) has m = −∞ and contributes nothing.

numba's CUDA simulator has no warp shuffles, so this kernel is checked by compiling it to PTX
(`python -m minillm.kernels.ptx`, tests/test_kernels.py) and against the reference on a GPU
(bench/gpu.py, which also measures its bandwidth next to the one-thread kernel's).
"""

from __future__ import annotations

import math

import torch
from minillm.kernels._launch import device_array, simulator
from numba import cuda, float32

MAX_HEAD_DIM = 256
WARP = 32
WARPS_PER_BLOCK = 4
FULL_MASK = 0xFFFFFFFF


def _kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    warp = cuda.grid(1) // WARP  # the same for all 32 lanes: a warp returns or shuffles as one
    lane = cuda.threadIdx.x % WARP
    num_seqs, q_heads, dim = query.shape
    if warp >= num_seqs * q_heads:
        return
    b = warp // q_heads
    h = warp % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    block_size = key_cache.shape[1]
    n = seq_lens[b]
    q = cuda.local.array(MAX_HEAD_DIM, float32)
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        q[d] = float32(query[b, h, d]) * float32(scale)
        acc[d] = float32(0.0)
    m = float32(-math.inf)
    total = float32(0.0)
    for p in range(lane, n, WARP):  # this lane's keys
        block = block_tables[b, p // block_size]
        off = p % block_size
        s = float32(0.0)
        for d in range(dim):
            s += q[d] * float32(key_cache[block, off, kv_head, d])
        m_new = max(m, s)
        correction = math.exp(m - m_new)
        weight = math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * float32(value_cache[block, off, kv_head, d])
        m = m_new
    offset = WARP // 2
    while offset > 0:  # butterfly: after 5 rounds every lane holds the merge of all 32
        m_other = cuda.shfl_xor_sync(FULL_MASK, m, offset)
        total_other = cuda.shfl_xor_sync(FULL_MASK, total, offset)
        m_new = max(m, m_other)
        if m_new == -math.inf:  # neither lane has a key yet
            mine = float32(0.0)
            theirs = float32(0.0)
        else:
            mine = math.exp(m - m_new)
            theirs = math.exp(m_other - m_new)
        total = total * mine + total_other * theirs
        for d in range(dim):
            acc[d] = acc[d] * mine + cuda.shfl_xor_sync(FULL_MASK, acc[d], offset) * theirs
        m = m_new
        offset //= 2
    for d in range(lane, dim, WARP):
        out[b, h, d] = acc[d] / total


kernel = None if simulator() else cuda.jit(_kernel)  # the simulator cannot run shuffles
python_function = _kernel


def paged_attention_decode_warp(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    if simulator() or not query.is_cuda:
        raise RuntimeError("paged_attention_decode_warp uses warp shuffles, which numba's simulator lacks: it runs "
                           "on a CUDA GPU only (paged_attention_decode is the simulatable version)")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {query.shape[-1]} > {MAX_HEAD_DIM}, the kernel's per-lane accumulator")
    out = torch.empty_like(query)
    num_warps = query.shape[0] * query.shape[1]
    if num_warps == 0:
        return out
    threads = WARP * WARPS_PER_BLOCK
    blocks = -(-num_warps // WARPS_PER_BLOCK)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    kernel[blocks, threads, stream](device_array(query), device_array(key_cache), device_array(value_cache),
                                    device_array(block_tables), device_array(seq_lens), float(scale),
                                    device_array(out))
    return out
