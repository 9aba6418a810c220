"""flash_attention: tiled varlen causal attention over paged K/V, FlashAttention's way (chapter 10).

Same arguments and result as prefill_attention (kernels/varlen_attention.py):

    query            [T, H_q, D]      the step's queries, sequences laid end to end
    key_cache, value_cache [NB, block_size, H_kv, D]  (this step's K/V already written)
    block_tables     [B, max_blocks] int32, -1 padded
    query_start_loc  [B+1] int32: sequence b's queries are rows query_start_loc[b] … [b+1]-1
    seq_lens         [B] int32: its length including the new tokens
    scale
    → out            [T, H_q, D]

prefill_attention gives every (query, head) its own thread and its own pass over the keys, so a
sequence's keys are read from HBM once per query and head. Here one thread block takes a *tile*
of BLOCK_M query rows of one sequence and all the query heads that share one KV head (GQA), one
thread per (row, head). The block walks the sequence's keys BLOCK_N at a time: its threads copy a
tile of keys and values from the paged pool into shared memory together (each key read from HBM
once per query tile, not once per query and head), wait at a barrier, and then each thread scores
its query against the tile and folds it into its online softmax (one rescale per tile, as
FlashAttention-2 does). Causal: key tiles past the tile's last query position are never loaded;
inside the diagonal tile each row stops at its own position. Threads whose row lies past the
sequence's last query still help load tiles, and nothing is read past a sequence's end, so a
pool poisoned with NaN stays unread.

Grid (query tiles of the longest sequence, B, H_kv), FlashAttention-2's varlen layout: the blocks
of a shorter sequence whose tile starts past its queries return at once (the whole block, before
any barrier).

On the simulator it launches through `simulated_launch` (kernels/_launch.py: the block's threads
share one array per `cuda.shared.array` line, made under a lock; its regression note says what raced).
"""

from __future__ import annotations

import math

import torch
from minillm.kernels._launch import device_array, simulated_launch, simulator
from minillm.kernels.varlen_attention import prefill_attention_reference
from numba import cuda, float32

MAX_HEAD_DIM = 128
BLOCK_M = 16  # query rows per thread block (GPU default; the simulator tests use smaller tiles)
BLOCK_N = 16  # keys per shared-memory tile


def flash_attention_reference(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                              scale) -> torch.Tensor:
    """The same function as `prefill_attention` (the tiled kernel only reads its inputs differently),
    so its reference is that kernel's, computed in float64 to measure the error against the exact answer."""
    return prefill_attention_reference(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                       scale, compute_dtype=torch.float64)


def build(block_m: int, block_n: int):
    """The kernel's Python function for tiles of `block_m` query rows and `block_n` keys (constants
    of the compiled kernel: shared arrays need sizes known at compile time)."""

    def _kernel(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out):
        tile, b, kv_head = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        q_heads, dim = query.shape[1], query.shape[2]
        group = q_heads // key_cache.shape[2]
        block_size = key_cache.shape[1]
        q_start = query_start_loc[b]
        q_len = query_start_loc[b + 1] - q_start
        first_row = tile * block_m
        if first_row >= q_len:  # this sequence has fewer query tiles: the whole block leaves
            return
        seq_len = seq_lens[b]
        row = first_row + tid // group  # this thread's query row within its sequence ...
        head = kv_head * group + tid % group  # ... and its query head (GQA: neighbours share kv_head)
        active = row < q_len
        position = seq_len - q_len + row  # causal: this query sees keys 0 … position
        last_position = seq_len - q_len + min(first_row + block_m, q_len) - 1  # the tile's last query's

        k_tile = cuda.shared.array((block_n, MAX_HEAD_DIM), float32)
        v_tile = cuda.shared.array((block_n, MAX_HEAD_DIM), float32)
        q = cuda.local.array(MAX_HEAD_DIM, float32)
        acc = cuda.local.array(MAX_HEAD_DIM, float32)
        scores = cuda.local.array(block_n, float32)
        if active:
            for d in range(dim):
                q[d] = query[q_start + row, head, d]
                acc[d] = 0.0
        running_max = -math.inf
        denominator = 0.0
        for kv_start in range(0, last_position + 1, block_n):  # the same trip count for every thread
            for e in range(tid, block_n * dim, cuda.blockDim.x):  # the block loads the tile together
                j = e // dim
                p = kv_start + j
                if p <= last_position:  # never past the sequence's end, never a -1 table entry
                    block = block_tables[b, p // block_size]
                    k_tile[j, e % dim] = key_cache[block, p % block_size, kv_head, e % dim]
                    v_tile[j, e % dim] = value_cache[block, p % block_size, kv_head, e % dim]
            cuda.syncthreads()  # the tile is complete before anyone reads it
            num_keys = min(block_n, position + 1 - kv_start)  # this row's causal limit in the tile
            if active and num_keys > 0:
                tile_max = -math.inf
                for j in range(num_keys):
                    s = 0.0
                    for d in range(dim):
                        s += q[d] * k_tile[j, d]
                    scores[j] = s * scale
                    tile_max = max(tile_max, scores[j])
                new_max = max(running_max, tile_max)
                rescale = math.exp(running_max - new_max)  # once per tile: what was summed so far
                denominator *= rescale
                for d in range(dim):
                    acc[d] *= rescale
                for j in range(num_keys):
                    weight = math.exp(scores[j] - new_max)
                    denominator += weight
                    for d in range(dim):
                        acc[d] += weight * v_tile[j, d]
                running_max = new_max
            cuda.syncthreads()  # everyone is done with the tile before the next load overwrites it
        if active:
            for d in range(dim):
                out[q_start + row, head, d] = acc[d] / denominator

    return _kernel


python_function = build(BLOCK_M, BLOCK_N)
_compiled: dict[tuple[int, int], object] = {}


def kernel_for(block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The numba.cuda kernel for these tile sizes, compiled (or simulated) once per size."""
    if (block_m, block_n) not in _compiled:
        fn = python_function if (block_m, block_n) == (BLOCK_M, BLOCK_N) else build(block_m, block_n)
        _compiled[block_m, block_n] = cuda.jit(fn)
    return _compiled[block_m, block_n]


def launch_shape(query_start_loc: torch.Tensor, q_heads: int, kv_heads: int, block_m: int) -> tuple:
    """(grid, threads per block): (query tiles of the longest sequence, B, H_kv), BLOCK_M · group threads."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    tiles = max(-(-int(n) // block_m) for n in q_lens) if q_lens else 0
    return (tiles, len(q_lens), kv_heads), block_m * (q_heads // kv_heads)


def flash_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> torch.Tensor:
    q_heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {dim} > {MAX_HEAD_DIM}, the kernel's shared K/V tile width")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads}) for GQA")
    if block_m < 1 or block_n < 1 or block_m * (q_heads // kv_heads) > 1024:
        raise ValueError(f"block_m={block_m}, block_n={block_n}: both must be >= 1 and block_m x "
                         f"{q_heads // kv_heads} query heads per KV head <= 1024 threads per block")
    out = torch.empty_like(query)
    grid, threads = launch_shape(query_start_loc.cpu(), q_heads, kv_heads, block_m)
    if grid[0] == 0 or query.shape[0] == 0:
        return out
    args = [device_array(a) if isinstance(a, torch.Tensor) else a for a in
            (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, float(scale), out)]
    kernel = kernel_for(block_m, block_n)
    if query.is_cuda and not simulator():
        kernel[grid, threads, cuda.external_stream(torch.cuda.current_stream().cuda_stream)](*args)
    elif simulator():
        with simulated_launch():
            kernel[grid, threads](*args)
    else:
        kernel[grid, threads](*args)
    return out
