"""The decoder's small token-wise ops fused into single CPU passes (numba @njit; chapter 10).

Each op beside its torch reference (the formulas of minillm/model/llama.py and rope.py, HF's):

    add_rms_norm(h, delta, weight, eps, out)  h += delta (the residual), out = rms_norm(h) · weight
    rms_norm(h, weight, eps, out)             out = h / rms(h) · weight
    rotary(x, num_heads, positions, cos, sin) in place: x[t, :num_heads] rotated as RoPE (rotate_half)

Why: in a decode step of a small model these ops run on a few rows each, so their cost is the
per-op overhead, not arithmetic: torch's RMSNorm is 6 ops (pow, mean, add, rsqrt, mul, mul) plus
the residual add, RoPE 5 (slice, neg, cat, two muls and an add). Measured on the bundled target's
shapes (CPU µs per call, 16 / 64 / 512 rows): residual add + RMSNorm torch 23 / 27 / 116, numba
7 / 7 / 48; RoPE on q and k torch 47 / 50 / 312, numba 3 / 4 / 31. SiLU·mul was tried too and
dropped: numba's scalar exp made it slower than torch's vectorized silu at every size (33 / 171 /
1355 against 16 / 34 / 281 for `silu(gate).mul_(up)`), so the forward keeps torch for it.
Used for float32 models only (`LlamaModel(fused_ops=...)`); float64 models keep the torch ops, whose
float32 RMSNorm is HF's op for op (the float64 parity tests compare logits to 1e-6).
"""

from __future__ import annotations

import numpy as np
import torch
from minillm.kernels.cpu_decode_attention import _exp_in_place
from numba import njit


def add_rms_norm_reference(h, delta, weight, eps):
    h = h + delta
    return h, weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@njit(cache=True, fastmath=True, nogil=True)
def add_rms_norm(h, delta, weight, eps, out):
    rows, hidden = h.shape
    for t in range(rows):
        total = np.float32(0.0)
        for j in range(hidden):
            v = h[t, j] + delta[t, j]
            h[t, j] = v
            total += v * v
        inv = np.float32(1.0) / np.sqrt(total / hidden + eps)
        for j in range(hidden):
            out[t, j] = weight[j] * (h[t, j] * inv)


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm(h, weight, eps, out):
    rows, hidden = h.shape
    for t in range(rows):
        total = np.float32(0.0)
        for j in range(hidden):
            total += h[t, j] * h[t, j]
        inv = np.float32(1.0) / np.sqrt(total / hidden + eps)
        for j in range(hidden):
            out[t, j] = weight[j] * (h[t, j] * inv)


def rotary_reference(x, num_heads, positions, cos, sin):
    from minillm.model.rope import apply_rotary

    x[:, :num_heads] = apply_rotary(x[:, :num_heads], cos[positions][:, None], sin[positions][:, None])


@njit(cache=True, fastmath=True, nogil=True)
def rotary(x, num_heads, positions, cos, sin):
    rows, _, dim = x.shape
    half = dim // 2
    for t in range(rows):
        c, s = cos[positions[t]], sin[positions[t]]
        for h in range(num_heads):
            row = x[t, h]
            for i in range(half):  # (a, b) -> (a·cos - b·sin, b·cos + a·sin), HF's rotate_half layout
                a, b = row[i], row[i + half]
                row[i] = a * c[i] - b * s[i]
                row[i + half] = b * c[i + half] + a * s[i + half]


@njit(fastmath=True, nogil=True, inline="always")
def silu_mul(gate_up, out, bits, one, ceiling, simd):
    """out = SiLU(gate) · up for one row, gate_up = [gate | up]: exp(−gate) by the attention kernel's
    exp (its SIMD polynomial when `simd`, float32), clamped at `ceiling` (88 in float32: exp(88) is still
    finite, and past it SiLU(gate) is 0 either way); `one` (1 in out's dtype) keeps the arithmetic in it;
    `bits` is the exp's int32 scratch. The compiled decode step and the draft loop both call it."""
    n = out.shape[0]
    for j in range(n):
        out[j] = min(-gate_up[j], ceiling)
    _exp_in_place(out, bits, n, simd)
    for j in range(n):
        out[j] = gate_up[j] / (one + out[j]) * gate_up[n + j]
