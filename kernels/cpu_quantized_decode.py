"""paged_attention_decode_cpu_quantized: chapter 10's CPU decode kernel over a quantized pool (chapter 14).

The pool holds bytes (`minillm.kv.quant`): per (token, KV head) a row of W bytes, the D codes and,
when the format has one (int8), the float32 scale in bytes D … D+3.

    query            [B, H_q, D] float32 or float64
    k_codes, v_codes [NB, block_size, H_kv, W] uint8
    k_scales, v_scales [NB, block_size, H_kv, W // 4] float32: the same bytes seen as float32
                     (the scale of a row is element D // 4); ignored without per-token scales
    table            [256] in the query's dtype: the value of each code byte (int8 or FP8 E4M3)
    has_scale        whether rows carry a scale (else the scale is 1: fp8's static scale)
    block_tables, seq_lens, scale, window, out: as in `cpu_decode_attention`

Per sequence, the kernel first reads its blocks' bytes once and decodes them — value =
table[byte] · scale, the only place a quantized number becomes a float — into a small scratch of
its own (a sequence's K/V in the compute dtype: a few KiB to a few hundred KiB, which stays in the
CPU's cache), then runs the float kernel `cpu_decode_attention._decode` on that scratch with a
block table 0, 1, 2, …. What crosses from memory is the bytes (1 per number plus the scales), not
4 per number; the float kernel's loops stay one piece of code for both.

numba has no FP8 type, hence the table: 256 floats, computed by torch (`minillm.kv.quant.decode_table`),
so the kernel and the torch reference decode every byte to the same value.
"""

from __future__ import annotations

import numpy as np
import torch
from minillm.kernels.cpu_decode_attention import _decode
from numba import njit


@njit(fastmath=True, nogil=True, inline="always")
def _decode_quantized(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, seq_lens,
                      scale, window, out, zero, simd_exp):
    num_seqs, _, dim = query.shape
    block_size, kv_heads = k_codes.shape[1], k_codes.shape[2]
    scale_at = dim // 4  # the float32 element holding a row's scale
    most_blocks = 1
    for b in range(num_seqs):
        most_blocks = max(most_blocks, (seq_lens[b] + block_size - 1) // block_size)
    # (uninitialised: the float kernel reads only the rows decoded here, a sequence's first n)
    keys = np.empty((most_blocks, block_size, kv_heads, dim), query.dtype)
    values = np.empty((most_blocks, block_size, kv_heads, dim), query.dtype)
    table_row = np.arange(most_blocks).astype(np.int32).reshape(1, most_blocks)
    length = np.empty(1, np.int32)
    for b in range(num_seqs):
        n = seq_lens[b]
        first = max(0, n - window) if window > 0 else 0
        for blk in range(first // block_size, (n + block_size - 1) // block_size):
            src = block_tables[b, blk]
            for j in range(min(n - blk * block_size, block_size)):
                for h in range(kv_heads):
                    ks = k_scales[src, j, h, scale_at] if has_scale else 1.0
                    vs = v_scales[src, j, h, scale_at] if has_scale else 1.0
                    for d in range(dim):
                        keys[blk, j, h, d] = table[k_codes[src, j, h, d]] * ks
                        values[blk, j, h, d] = table[v_codes[src, j, h, d]] * vs
        length[0] = n
        _decode(query[b:b + 1], keys, values, table_row, length, scale, window, out[b:b + 1], zero, simd_exp)


@njit(cache=True, fastmath=True, nogil=True)
def quantized_decode_f32(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, seq_lens,
                         scale, window, out):
    _decode_quantized(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, seq_lens,
                      scale, window, out, np.float32(0.0), True)


@njit(cache=True, fastmath=True, nogil=True)
def quantized_decode_f64(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, seq_lens,
                         scale, window, out):
    _decode_quantized(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, seq_lens,
                      scale, window, out, 0.0, False)


def quantized_kernel_for(dtype) -> object:
    """The compiled kernel for a query in float32 or float64 (numpy or torch dtype)."""
    return quantized_decode_f32 if dtype in (np.float32, torch.float32) else quantized_decode_f64


def scale_view(codes: np.ndarray, has_scale: bool) -> np.ndarray:
    """The float32 view of a pool's bytes where the scales sit (a 1-element stand-in without scales)."""
    if not has_scale:
        return np.ones((1, 1, 1, 1), np.float32)
    return codes.view(np.float32)


def paged_attention_decode_cpu_quantized(query: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                         kv_cache_dtype: str, window: int | None = None,
                                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of CPU tensors over a quantized pool (`minillm.kv.quant` rows), zero-copy into
    the kernel; writes `out` (a fresh [B, H_q, D] tensor unless given) and returns it."""
    from minillm.kv.quant import decode_table, kv_format

    fmt = kv_format(kv_cache_dtype)
    if fmt is None or k_codes.dtype != torch.uint8:
        raise ValueError(f"paged_attention_decode_cpu_quantized reads a quantized pool (uint8 rows, "
                         f"kv_cache_dtype 'int8' or 'fp8_e4m3'), got {k_codes.dtype} and {kv_cache_dtype!r}")
    if query.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"paged_attention_decode_cpu_quantized computes in float32 or float64, not {query.dtype}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    has_scale = fmt.per_token_scale
    k_np, v_np = k_codes.numpy(), v_codes.numpy()
    quantized_kernel_for(query.dtype)(
        query.numpy(), k_np, v_np, scale_view(k_np, has_scale), scale_view(v_np, has_scale),
        decode_table(fmt, query.dtype).numpy(), has_scale, block_tables.numpy(), seq_lens.numpy(), float(scale),
        int(window or 0), out.numpy())
    return out
