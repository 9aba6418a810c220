"""Quantized KV: K and V stored in 8 bits with their scales, read back inside attention (chapter 14).

`LLM(kv_cache_dtype=...)` (vLLM's knob; `minillm serve --kv-cache-dtype`) picks how the paged pool
stores a token's K and V:

    "auto"      the model's dtype (float32 on this CPU): exact, 4 bytes per number
    "int8"      symmetric int8 with one float32 scale per (token, KV head): x ≈ code · scale,
                scale = max|x| / 127 over the head's D numbers; error ≤ scale / 2 per number
    "fp8_e4m3"  OCP FP8 E4M3 (1 sign, 4 exponent, 3 mantissa bits; largest 448) with one static
                scale of 1 for the whole tensor, vLLM's default when a checkpoint brings no scales:
                error ≤ |x| / 16 for |x| ≥ 2⁻⁶, ≤ 2⁻¹⁰ below it; |x| > 448 saturates to ±448

Why fp8 is per tensor and int8 is not: int8 is a uniform grid, so without a scale that follows the
head's largest number it either clips or wastes its 256 steps; fp8 is itself a floating-point
format, so its relative error (3 mantissa bits) is about the same at every size, and a per-token
scale only rescues numbers below 2⁻⁶ (about 1 % of the bundled model's K/V). Measured on the
bundled model's real K/V (`python bench/kv_fp8_granularity.py`, 81 tokens, 4 layers, deterministic):
relative RMS error fp8/tensor 2.65e-2, fp8/(token, head) 2.41e-2 (1.10× less), int8/(token, head)
5.27e-3. A per-token fp8 scale costs the same 36 bytes per (token, head) as int8 (D = 32) for 4.6×
int8's error, so it is never the better choice; fp8 is worth having only at D bytes, with the static
scale. `quantize_fp8_e4m3(x, per_token_scale=True)` stays here for that measurement.

The pool layout. A quantized pool is `uint8 [L, slots, H_kv, W]`: per (token, head) the D code
bytes, then (int8 only) the float32 scale in the next 4 bytes, `W = D + 4` — the scale travels in
the same slot row as its codes (as llama.cpp's Q8_0 blocks keep theirs), so every path that moves
whole slots (swap to host memory and back, prefix-cache sharing, a PD transfer, a TP rank's share
of heads) moves the scales with the codes and needs no code of its own. fp8's rows are `W = D`.

Decoding one byte is a 256-entry table (`decode_table`): the numba kernels take it as an array, so
one kernel serves both formats (`value = table[byte] · scale`). numba has no fp8 type; the kernels
see bytes (uint8), torch sees `float8_e4m3fn` / `int8` through a view of the same bytes.

What other code calls (chapter 14's measurements, ex14's grader):

    quantize_int8(x) -> (codes int8 [..., D], scales float32 [...])     dequantize_int8(codes, scales)
    quantize_fp8_e4m3(x, per_token_scale=False) -> (codes, scales)       dequantize_fp8_e4m3(codes, scales)
    round_trip(x, kv_cache_dtype)        x as attention reads it back from the pool
    kv_row_bytes / ModelConfig.kv_bytes_per_token(dtype_bytes, kv_cache_dtype) / num_blocks_in_budget
    encode / decode / decode_table       the pool's bytes, and what the kernels decode them with
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.config import KV_CACHE_DTYPES

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BYTES = 4  # one float32 scale per (token, head)


@dataclass(frozen=True)
class KVQuantFormat:
    """How one quantized dtype stores a head's D numbers: code type and whether a scale follows them."""

    name: str
    code_dtype: torch.dtype  # what torch sees through the bytes
    per_token_scale: bool  # a float32 scale per (token, head) after the codes; else one static scale of 1

    def row_bytes(self, head_dim: int) -> int:
        """Bytes per (token, head) in the pool: the codes, then the scale if there is one."""
        return head_dim + (SCALE_BYTES if self.per_token_scale else 0)


FORMATS = {
    "int8": KVQuantFormat("int8", torch.int8, per_token_scale=True),
    "fp8_e4m3": KVQuantFormat("fp8_e4m3", torch.float8_e4m3fn, per_token_scale=False),
}


def kv_format(kv_cache_dtype: str) -> KVQuantFormat | None:
    """The format of `kv_cache_dtype` (None for "auto": the model's own dtype, unquantized)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return FORMATS.get(kv_cache_dtype)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")


def head_dim_of(row_width: int, fmt: KVQuantFormat | None) -> int:
    """D, from the last axis of a pool: D itself, or a quantized row's bytes less its scale."""
    return row_width if fmt is None else row_width - fmt.row_bytes(0)


def kv_row_bytes(kv_cache_dtype: str, head_dim: int, model_dtype_bytes: int) -> int:
    """Bytes of one (token, KV head) row of K (or of V) in the pool."""
    fmt = kv_format(kv_cache_dtype)
    return head_dim * model_dtype_bytes if fmt is None else fmt.row_bytes(head_dim)


# ---- the arithmetic, as plain functions (what chapter 14 and ex14 measure) ---------------------------
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last axis: codes int8 [..., D], scales float32 [...] with
    x ≈ codes · scales[..., None]. An all-zero row gets scale 1 (codes 0): nothing divides by zero."""
    amax = x.detach().abs().amax(-1).to(torch.float32)
    scales = amax / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero rows (and underflow) → 1
    codes = torch.round(x.to(torch.float32) / scales[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.to(torch.float32) * scales[..., None]).to(dtype)


def quantize_fp8_e4m3(x: torch.Tensor, per_token_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes [..., D] and scales: one static scale of 1 (shape [..., ] of ones, what the
    engine stores: nothing), or with `per_token_scale` max|x| / 448 per row (zero rows → 1)."""
    x32 = x.detach().to(torch.float32)
    if per_token_scale:
        scales = x32.abs().amax(-1) / FP8_E4M3_MAX
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    else:
        scales = torch.ones(x32.shape[:-1], dtype=torch.float32, device=x.device)
    codes = (x32 / scales[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def dequantize_fp8_e4m3(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.to(torch.float32) * scales[..., None]).to(dtype)


def round_trip(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x stored in `kv_cache_dtype` and read back, in x's dtype (what attention sees)."""
    fmt = kv_format(kv_cache_dtype)
    if fmt is None:
        return x
    return decode(encode(x, fmt), fmt, x.dtype)


# ---- the pool's bytes ----------------------------------------------------------------------------------
def encode(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x [..., D] → the pool's rows uint8 [..., W]: the code bytes, then the float32 scale (int8)."""
    if fmt.per_token_scale:
        codes, scales = quantize_int8(x) if fmt.code_dtype == torch.int8 else quantize_fp8_e4m3(x, True)
        scale_bytes = scales[..., None].contiguous().view(torch.uint8)  # [..., 4]
        return torch.cat([codes.view(torch.uint8), scale_bytes], -1)
    if fmt.code_dtype != torch.float8_e4m3fn:  # int8 without its scale would lose every row's range
        raise ValueError(f"{fmt.name}: only FP8 codes can go without a per-token scale (a static scale of 1)")
    return quantize_fp8_e4m3(x)[0].view(torch.uint8)


def decode(rows: torch.Tensor, fmt: KVQuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """The pool's rows uint8 [..., W] → values [..., D] in `dtype`."""
    if not fmt.per_token_scale:
        return rows.view(fmt.code_dtype).to(dtype)
    head_dim = rows.shape[-1] - SCALE_BYTES
    rows = rows.contiguous()
    values = rows[..., :head_dim].view(fmt.code_dtype).to(torch.float32)
    scales = rows.view(torch.float32)[..., head_dim // 4]
    return (values * scales[..., None]).to(dtype)


def decode_table(fmt: KVQuantFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256] the value of each byte (before its scale): what the numba kernels decode with."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.code_dtype).to(torch.float32).to(dtype)


def check_head_dim(head_dim: int, kv_cache_dtype: str) -> None:
    """The scale sits at byte D of a row and is read as float32: D must be a multiple of 4."""
    fmt = kv_format(kv_cache_dtype)
    if fmt is not None and fmt.per_token_scale and head_dim % 4:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} keeps a float32 scale after each head's {head_dim} "
                         "codes, which needs head_dim to be a multiple of 4; use kv_cache_dtype='auto' or 'fp8_e4m3'")


def num_blocks_in_budget(budget_bytes: float, model_config, block_size: int, kv_cache_dtype: str = "auto",
                         dtype_bytes: int = 4) -> int:
    """KV blocks of `block_size` tokens that fit in `budget_bytes` (K and V, every layer): the
    `num_kv_blocks` to give an engine for a fixed memory budget. `model_config`: a
    `minillm.model.config.ModelConfig`; `dtype_bytes`: the model's dtype (used when "auto")."""
    per_block = model_config.kv_bytes_per_token(dtype_bytes, kv_cache_dtype) * block_size
    return int(budget_bytes // per_block)
