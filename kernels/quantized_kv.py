"""Chapter 10's numba.cuda kernels over a quantized KV pool: the write quantizes, attention decodes (chapter 14).

The pool's rows are bytes (`minillm.kv.quant`): per (token, KV head) W bytes — the D codes, then
for int8 the float32 scale in bytes D … D+3 (W = D + 4); fp8's static scale is 1 (W = D).

    reshape_and_cache_quantized(key, value, k_codes, v_codes, slot_mapping, kv_cache_dtype)      # in place
        key, value [T, H_kv, D]; k_codes, v_codes [NB, block_size, H_kv, W] uint8
    paged_attention_decode_quantized(query, k_codes, v_codes, block_tables, seq_lens, scale, kv_cache_dtype)
    prefill_attention_quantized(query, k_codes, v_codes, block_tables, query_start_loc, seq_lens, scale,
                                kv_cache_dtype)
        the same arguments and results as `paged_attention_decode` / `prefill_attention`

The write gives one thread a whole (token, head) row, because the int8 scale is the row's largest
|x| / 127: the thread finds it, then writes each code round(x / scale) (half to even, as torch
rounds) and the scale into a [T, H_kv] float32 array, which one torch scatter then puts into the
rows' scale bytes. (Not the kernel itself through a float32 view of the pool: numba's simulator
copies each array argument in and back out, so two views of one pool written by one launch would
overwrite each other there; on a GPU they would not, and the scatter costs one small op.) FP8 E4M3 has no type in numba, so the thread builds the byte itself: the sign,
the exponent e with 2^e ≤ |x| < 2^(e+1) (biased by 7), and the 3 mantissa bits rounded half to
even; below 2^-6 the subnormal steps of 2^-9. The bytes equal torch's `.to(torch.float8_e4m3fn)`.

The attention kernels are `decode_attention.py` and `varlen_attention.py` with one change: where
they read `key_cache[block, off, head, d]` they read `table[codes[block, off, head, d]] * s`, s the
row's scale (1 without one) and `table` the 256 values a byte stands for
(`minillm.kv.quant.decode_table`). Each key row is read as D bytes and a scale instead of 4·D bytes.
The float32 view of the pool's bytes (`scales`) is how the kernels reach the scale; no copy.
The references dequantize the pool with torch and call the float references.
"""

from __future__ import annotations

import math

import torch
from minillm.kernels._launch import device_array, launch
from minillm.kernels.decode_attention import paged_attention_decode_reference
from minillm.kernels.varlen_attention import prefill_attention_reference
from numba import cuda, float32

from minillm.kv.quant import FP8_E4M3_MAX, INT8_MAX, decode, decode_table, encode, kv_format

MAX_HEAD_DIM = 256
SUBNORMAL_STEP = 2.0**-9  # FP8 E4M3's smallest step; its smallest normal is 2^-6


# ---- references ---------------------------------------------------------------------------------------
def dequantize_cache(codes: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[NB, block_size, H_kv, W] bytes → [NB, block_size, H_kv, D] values, with torch."""
    return decode(codes, kv_format(kv_cache_dtype), dtype)


def reshape_and_cache_quantized_reference(key, value, k_codes, v_codes, slot_mapping, kv_cache_dtype) -> None:
    fmt, bs = kv_format(kv_cache_dtype), k_codes.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_codes[slots // bs, slots % bs] = encode(key[keep], fmt)
    v_codes[slots // bs, slots % bs] = encode(value[keep], fmt)


def paged_attention_decode_quantized_reference(query, k_codes, v_codes, block_tables, seq_lens, scale,
                                               kv_cache_dtype) -> torch.Tensor:
    return paged_attention_decode_reference(query, dequantize_cache(k_codes, kv_cache_dtype, query.dtype),
                                            dequantize_cache(v_codes, kv_cache_dtype, query.dtype), block_tables,
                                            seq_lens, scale)


def prefill_attention_quantized_reference(query, k_codes, v_codes, block_tables, query_start_loc, seq_lens, scale,
                                          kv_cache_dtype) -> torch.Tensor:
    return prefill_attention_reference(query, dequantize_cache(k_codes, kv_cache_dtype, query.dtype),
                                       dequantize_cache(v_codes, kv_cache_dtype, query.dtype), block_tables,
                                       query_start_loc, seq_lens, scale)


# ---- device functions -----------------------------------------------------------------------------------
@cuda.jit(device=True, inline="always")
def _round_half_even(y):
    f = math.floor(y)
    r = y - f
    if r > 0.5 or (r == 0.5 and f % 2 == 1):
        f += 1
    return f


@cuda.jit(device=True, inline="always")
def _fp8_e4m3_byte(x):
    """The E4M3 byte nearest to x (|x| > 448 saturates to ±448)."""
    sign = 128 if math.copysign(1.0, x) < 0 else 0  # (-0 too, as torch encodes it)
    a = min(abs(x), FP8_E4M3_MAX)
    if a < 8 * SUBNORMAL_STEP:  # below 2^-6: subnormal, steps of 2^-9 (8 steps reach the smallest normal)
        return sign + int(_round_half_even(a / SUBNORMAL_STEP))
    e = -6
    p = 8 * SUBNORMAL_STEP
    while p * 2 <= a:
        p *= 2
        e += 1
    m = int(_round_half_even((a / p - 1) * 8))
    if m == 8:
        m = 0
        e += 1
    return sign + (e + 7) * 8 + m


@cuda.jit(device=True, inline="always")
def _write_row(src, t, h, codes, scales, blk, off, dim, is_fp8, has_scale):
    s = float32(1.0)
    if has_scale:
        amax = float32(0.0)
        for d in range(dim):
            amax = max(amax, abs(float32(src[t, h, d])))
        s = amax / float32(FP8_E4M3_MAX if is_fp8 else INT8_MAX)
        if not s > 0:  # an all-zero row (or an underflow): scale 1, codes 0
            s = float32(1.0)
        scales[t, h] = s
    for d in range(dim):
        y = float32(src[t, h, d]) / s
        if is_fp8:
            codes[blk, off, h, d] = _fp8_e4m3_byte(y)
        else:
            c = int(min(max(_round_half_even(y), -INT8_MAX), INT8_MAX))
            codes[blk, off, h, d] = c + 256 if c < 0 else c


@cuda.jit(device=True, inline="always")
def _value(codes, scales, table, has_scale, block, off, head, d, dim):
    s = scales[block, off, head, dim // 4] if has_scale else float32(1.0)
    return table[codes[block, off, head, d]] * s


# ---- kernels --------------------------------------------------------------------------------------------
def _write_kernel(key, value, k_codes, v_codes, k_scales, v_scales, slot_mapping, is_fp8, has_scale):
    """k_scales, v_scales: [T, H_kv] float32, each row's scale (the launcher scatters them into the pool)."""
    i = cuda.grid(1)  # one thread per (token, head): the row's scale needs all its D numbers
    num_tokens, heads, dim = key.shape
    if i >= num_tokens * heads:
        return
    t = i // heads
    h = i % heads
    slot = slot_mapping[t]
    if slot < 0:
        return
    block_size = k_codes.shape[1]
    blk = slot // block_size
    off = slot % block_size
    _write_row(key, t, h, k_codes, k_scales, blk, off, dim, is_fp8, has_scale)
    _write_row(value, t, h, v_codes, v_scales, blk, off, dim, is_fp8, has_scale)


@cuda.jit(device=True, inline="always")
def _attend(query, row, h, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, b, num_keys, scale,
            out):
    """out[row, h] = softmax(q·K / √D)·V over sequence b's first `num_keys` positions, one pass with an
    online softmax (as decode_attention.py), each K/V number decoded from its byte as it is read."""
    dim = query.shape[2]
    kv_head = h // (query.shape[1] // k_codes.shape[2])
    block_size = k_codes.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m = -math.inf
    total = 0.0
    for p in range(num_keys):
        block = block_tables[b, p // block_size]
        off = p % block_size
        s = 0.0
        for d in range(dim):
            s += query[row, h, d] * _value(k_codes, k_scales, table, has_scale, block, off, kv_head, d, dim)
        s *= scale
        m_new = max(m, s)
        correction = math.exp(m - m_new)
        weight = math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * _value(v_codes, v_scales, table, has_scale, block, off, kv_head,
                                                           d, dim)
        m = m_new
    for d in range(dim):
        out[row, h, d] = acc[d] / total


def _decode_kernel(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, seq_lens, scale,
                   out):
    i = cuda.grid(1)  # one thread per (sequence, query head), as decode_attention.py
    num_seqs, q_heads, _ = query.shape
    if i >= num_seqs * q_heads:
        return
    b = i // q_heads
    _attend(query, b, i % q_heads, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, b,
            seq_lens[b], scale, out)


def _prefill_kernel(query, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, query_start_loc,
                    seq_lens, scale, out):
    i = cuda.grid(1)  # one thread per (query, head), as varlen_attention.py
    num_tokens, q_heads, _ = query.shape
    if i >= num_tokens * q_heads:
        return
    t = i // q_heads
    b = 0
    while query_start_loc[b + 1] <= t:  # which sequence this query belongs to
        b += 1
    position = seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b]) + (t - query_start_loc[b])
    _attend(query, t, i % q_heads, k_codes, v_codes, k_scales, v_scales, table, has_scale, block_tables, b,
            position + 1, scale, out)


write_kernel = cuda.jit(_write_kernel)
decode_kernel = cuda.jit(_decode_kernel)
prefill_kernel = cuda.jit(_prefill_kernel)
python_functions = {"reshape_and_cache_quantized": _write_kernel, "paged_attention_decode_quantized": _decode_kernel,
                    "prefill_attention_quantized": _prefill_kernel}  # (for minillm.kernels.ptx)


# ---- launchers ------------------------------------------------------------------------------------------
def _scales(codes: torch.Tensor, has_scale: bool) -> torch.Tensor:
    """The float32 view of the pool's bytes where the scales sit (a 1-element stand-in without scales)."""
    return codes.view(torch.float32) if has_scale else torch.ones((1, 1, 1, 1), device=codes.device)


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def _table(kv_cache_dtype: str, device: torch.device) -> torch.Tensor:
    key = (kv_cache_dtype, str(device))
    if key not in _TABLES:  # the kernels compute in float32 whatever the query's dtype
        _TABLES[key] = decode_table(kv_format(kv_cache_dtype), torch.float32).to(device)
    return _TABLES[key]


def _check(query: torch.Tensor, k_codes: torch.Tensor, kv_cache_dtype: str) -> None:
    fmt = kv_format(kv_cache_dtype)
    if fmt is None or k_codes.dtype != torch.uint8:
        raise ValueError(f"the quantized kernels read a uint8 pool with kv_cache_dtype 'int8' or 'fp8_e4m3', got "
                         f"{k_codes.dtype} and {kv_cache_dtype!r}")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {query.shape[-1]} > {MAX_HEAD_DIM}, the kernel's per-thread accumulator")


def reshape_and_cache_quantized(key: torch.Tensor, value: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                slot_mapping: torch.Tensor, kv_cache_dtype: str) -> None:
    _check(key, k_codes, kv_cache_dtype)
    fmt = kv_format(kv_cache_dtype)
    k_scales = torch.empty(key.shape[:2], dtype=torch.float32, device=key.device)
    v_scales = torch.empty_like(k_scales)
    launch(write_kernel, key.shape[0] * key.shape[1], device_array(key), device_array(value),
           device_array(k_codes), device_array(v_codes), device_array(k_scales), device_array(v_scales),
           device_array(slot_mapping), fmt.code_dtype == torch.float8_e4m3fn, fmt.per_token_scale)
    if fmt.per_token_scale:  # each row's scale into its 4 bytes after the codes
        keep = slot_mapping >= 0
        slots, bs, at = slot_mapping[keep].long(), k_codes.shape[1], key.shape[-1] // 4
        k_codes.view(torch.float32)[slots // bs, slots % bs, :, at] = k_scales[keep]
        v_codes.view(torch.float32)[slots // bs, slots % bs, :, at] = v_scales[keep]


def _attention(kernel, query: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, kv_cache_dtype: str,
               *layout) -> torch.Tensor:
    """Launch `kernel` with one thread per (query row, head): the pool's bytes, their scales and the byte
    table, then the step's layout (`layout`: tensors, then the softmax scale) and the output."""
    _check(query, k_codes, kv_cache_dtype)
    has_scale = kv_format(kv_cache_dtype).per_token_scale
    out = torch.empty_like(query)
    launch(kernel, query.shape[0] * query.shape[1], device_array(query), device_array(k_codes),
           device_array(v_codes), device_array(_scales(k_codes, has_scale)), device_array(_scales(v_codes, has_scale)),
           device_array(_table(kv_cache_dtype, query.device)), has_scale,
           *(device_array(a) if isinstance(a, torch.Tensor) else float(a) for a in layout), device_array(out))
    return out


def paged_attention_decode_quantized(query: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                     kv_cache_dtype: str) -> torch.Tensor:
    return _attention(decode_kernel, query, k_codes, v_codes, kv_cache_dtype, block_tables, seq_lens, scale)


def prefill_attention_quantized(query: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float, kv_cache_dtype: str) -> torch.Tensor:
    return _attention(prefill_kernel, query, k_codes, v_codes, kv_cache_dtype, block_tables, query_start_loc,
                      seq_lens, scale)
