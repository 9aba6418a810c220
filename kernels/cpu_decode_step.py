"""A whole decode step of a dense Llama-family model in one compiled CPU call (numba @njit; chapter 10).

`decode_forward(...)` computes what `LlamaModel.forward` + `compute_logits` compute with
`FusedOps` (minillm/model/fused.py, the reference) for B rows that each bring one new token after a
cached context — the embedding row, per layer RMSNorm, q|k|v, RoPE, the K/V write into the paged
pool, paged decode attention, o, residual + RMSNorm, gate|up, SiLU·mul, down, residual + RMSNorm,
then the lm_head — and writes the logits [B, vocab] into a buffer the caller keeps. The step's
layout is computed inside too, from the input batch's own arrays (each row's position, token, K/V
slot and block-table row), so nothing is built in Python for it.

Rows may share a sequence: a speculative verify step passes one request's pending token and its
guesses as consecutive rows of the same input-batch row at positions L, L+1, …. Each layer writes
every row's K/V into the pool first, then runs one attention call over all rows, in which a row
reads keys 0 … its own position only: row L+j sees the K/V of rows L … L+j−1, and the later rows'
K/V, already in the pool, lie past its length: causal, with no mask. (One call rather than one per
row: at 32 rows the per-call work — the kernel's scratch arrays, its setup — was ~4 % of the step.)

Why one call: at batch 1 the bundled model's step reads ~16 MB of weights, about a millisecond of
memory traffic, while the op-by-op forward dispatches ~480 torch ops and 17 numba calls a step
(counted: `python bench/step_profile.py --batch-sizes 1`), each a few µs of framework work. The norms,
RoPE and attention are the same compiled functions the op-by-op path calls (`cpu_fused_ops`,
`cpu_decode_attention`).

The matmuls (`dot_rows`): every output is a dot product over one weight row (weights stored [out, in],
HF's layout, a copy made once by minillm/model/decode_step.py), which LLVM vectorizes along `in` in
8-wide lanes and ends with one horizontal sum. A step of R rows runs a register tile made for R: R rows
× W outputs side by side (1 × 8, 2 × 4, 3 × 3, 5 × 2; `matmul_rows`' 4 × 3, in blocks, for four rows and past five),
so that each weight element loaded feeds all R rows and the R·W sums plus the W weight vectors fit in
AVX2's sixteen registers. Every tile sums an output in the same order, so a row's logits have the same
bits whether it runs alone or among other rows (tests/test_decode_step.py): a speculative verify row's
logits are exactly what plain decoding computes at that position, which is what makes greedy
speculation emit plain decoding's tokens.

That is what a verify step needs on a machine whose last-level cache holds the weights (the course's
EPYC VM: 32 MiB of L3, 15.8 MB of fp32 weights). There a lone row waits on L3 (~35-45 GB/s for one
core) and its arithmetic is nearly free, but five rows (a k = 4 verify) bring five times the
multiply-adds, and the step turns compute-bound unless each weight load feeds every row. The earlier
loop (`matvec_rows`, this file before 2026-12-03: `out[b] += x[b, i] · W[i]` over [in, out] rows,
eight weight rows per pass) streamed each weight in long runs but redid every row's loads and stores
of `out`; the tiles read three to eight 1 KB rows at a time, so each tile asks for the next tile's rows
ahead (`prefetch_row`): without it, five rows out of L3 ran ~2.7× slower (10-11 against 29-31 GFMA/s,
one 16 MB weight, three runs). The bundled target's 17 products per step, on its shapes, 5 interleaved
rounds (scratch timing, 2026-12-03, quiet VM; µs): 1 row 419 with `matvec_rows` / 389 with the tiles,
2 rows 576 / 461, 3 rows 771 / 469, 4 rows 1,008 / 538, 5 rows 1,156 / 632, each row's outputs bit for
bit the same in every shape. Inside the engine (a captured n-gram verify step, re-run in place, 5
rounds), the whole step of 1 … 5 rows took 503, 602, 678, 771 and 926 µs, the matmuls 449 … 713 of it:
a k = 4 verify costs 1.8 plain steps (with `matvec_rows`, 3.0-3.6).

float32 only: the sums run in another order than MKL's or oneDNN's, so the logits differ from the
op-by-op forward in the last bits, as `FusedOps`' already do; the engine's test is greedy tokens
equal (tests/test_decode_step.py). float64 models keep HF's ops, op for op.
"""

from __future__ import annotations

import math

import llvmlite
import numpy as np
from llvmlite import binding, ir
from minillm.kernels.cpu_decode_attention import paged_decode_f32
from minillm.kernels.cpu_fused_ops import add_rms_norm, rms_norm, rotary, silu_mul
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# llvm.prefetch's name carries its pointer type: `p0` where pointers are opaque (llvmlite on LLVM 16+, or 0.44
# with them switched on), `p0i8` where they are typed
_OPAQUE = getattr(llvmlite, "opaque_pointers_enabled", binding.llvm_version_info[0] >= 16)
_PREFETCH = "llvm.prefetch.p0" if _OPAQUE else "llvm.prefetch.p0i8"


@intrinsic
def prefetch_row(typingctx, array, row):
    """Ask the CPU to start loading array[row] (a C-contiguous 2-D float32 array's row) into its caches: one
    `llvm.prefetch` (read, keep in all levels) per 64-byte line. numba has no prefetch of its own; LLVM lowers
    this to `prefetcht0` on x86 (and to the matching hint elsewhere, or to nothing). Returns nothing."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        first = cgutils.get_item_pointer(context, builder, array_type, ary, [args[1], zero])
        byte_ptr = ir.IntType(8).as_pointer()
        base = builder.bitcast(first, byte_ptr)
        i32 = ir.IntType(32)
        signature_ir = ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
        prefetch = cgutils.get_or_insert_function(builder.module, signature_ir, _PREFETCH)
        row_bytes = builder.mul(builder.extract_value(ary.shape, 1), context.get_constant(types.intp, 4))
        line = context.get_constant(types.intp, 64)
        with cgutils.for_range_slice(builder, zero, row_bytes, line) as (offset, _):
            # (address, 0: a read, 3: keep in every cache level, 1: data, not instructions)
            builder.call(prefetch, [builder.gep(base, [offset]), ir.Constant(i32, 0), ir.Constant(i32, 3),
                                    ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(array, row), codegen


# exp(88) = 1.7e38 is still a float32 (its max is 3.4e38); SiLU(g) for g below -88 is 0 to float32 anyway
_EXP_CEILING = np.float32(88.0)
_TILE_BLOCK_BYTES = 1 << 17  # weights per output block of `matmul_rows`: stays in L2 while every row tile reads it


@njit(fastmath=True, nogil=True, inline="always")
def _prefetch_tile(w_t, o, width):
    """Prefetch the weight rows of the tile after the one at output `o` (`width` outputs), if there is one."""
    if o + 2 * width <= w_t.shape[0]:
        for j in range(width):
            prefetch_row(w_t, o + width + j)


@njit(cache=True, fastmath=True, nogil=True)
def matmul_rows(x, w_t, out):
    """out = x @ w_t.T for w_t [out, in] C-contiguous (HF's own layout): for many rows.

    A register tile of 4 rows × 3 outputs: twelve dot products over `in` run side by side, so each
    weight element loaded feeds 4 rows and each x element 3 outputs (7 loads per 12 multiply-adds,
    against 10 per 8 in the matrix-vector loop this file had before, whose every pass also stored `out`). LLVM vectorizes the `i`
    loop into twelve 8-wide accumulators: with the three weight vectors and one x vector, all sixteen
    AVX2 registers, and twelve independent chains of fused multiply-adds, more than the eight that
    keep both FMA units busy (4 × 2, the old tile, was exactly eight). The outputs go in blocks of
    ~128 KB of weights, which all row tiles read while the block is in L2, so each weight is fetched
    from memory once per call; while the second row tile reads a block, it prefetches the next one
    (`prefetch_row`), so that the first tile of the next block finds it in cache rather than waiting
    on L3 or memory (the weights do not stay in cache between steps: 16 MB of them, with the KV pool).
    Where the rows or outputs do not divide into tiles, the last tile is moved back to end at the last
    row (output): it recomputes a few sums already written, with the same code, rather than running a
    second loop."""
    rows, n_in = x.shape
    n_out = w_t.shape[0]
    if rows < 4 or n_out < 3:  # too small to tile: one dot product per output
        for b in range(rows):
            for o in range(n_out):
                s = np.float32(0.0)
                for i in range(n_in):
                    s += x[b, i] * w_t[o, i]
                out[b, o] = s
        return
    block = max(3, _TILE_BLOCK_BYTES // (4 * n_in) // 3 * 3)  # (whole tiles: only the last block ends short)
    for o_start in range(0, n_out, block):
        o_end = min(o_start + block, n_out)
        for b_tile in range(0, rows, 4):
            b = min(b_tile, rows - 4)
            x0, x1, x2, x3 = x[b], x[b + 1], x[b + 2], x[b + 3]
            for o_tile in range(o_start, o_end, 3):
                o = min(o_tile, n_out - 3)
                if b_tile == 4 and o_tile + block + 2 < n_out:  # the next block's rows, 3 KB per tile
                    prefetch_row(w_t, o_tile + block)
                    prefetch_row(w_t, o_tile + block + 1)
                    prefetch_row(w_t, o_tile + block + 2)
                elif rows == 4:  # one row tile (a k = 3 verify): the next tile's rows, as the small tiles do
                    _prefetch_tile(w_t, o, 3)
                w0, w1, w2 = w_t[o], w_t[o + 1], w_t[o + 2]
                s00 = s01 = s02 = s10 = s11 = s12 = s20 = s21 = s22 = s30 = s31 = s32 = np.float32(0.0)
                for i in range(n_in):
                    a, c, d = w0[i], w1[i], w2[i]
                    u0, u1, u2, u3 = x0[i], x1[i], x2[i], x3[i]
                    s00 += u0 * a
                    s01 += u0 * c
                    s02 += u0 * d
                    s10 += u1 * a
                    s11 += u1 * c
                    s12 += u1 * d
                    s20 += u2 * a
                    s21 += u2 * c
                    s22 += u2 * d
                    s30 += u3 * a
                    s31 += u3 * c
                    s32 += u3 * d
                out[b, o], out[b, o + 1], out[b, o + 2] = s00, s01, s02
                out[b + 1, o], out[b + 1, o + 1], out[b + 1, o + 2] = s10, s11, s12
                out[b + 2, o], out[b + 2, o + 1], out[b + 2, o + 2] = s20, s21, s22
                out[b + 3, o], out[b + 3, o + 1], out[b + 3, o + 2] = s30, s31, s32


@njit(cache=True, fastmath=True, nogil=True)
def dot_1x8(x, w_t, out):
    """One row, eight outputs at a time: eight dot products over `in` side by side (LLVM vectorizes each
    along `in`, 8 lanes, as in every tile here), the next eight weight rows prefetched."""
    n_in = x.shape[1]
    n_out = w_t.shape[0]
    xb = x[0]
    for o_tile in range(0, n_out, 8):
        o = min(o_tile, n_out - 8)
        _prefetch_tile(w_t, o, 8)
        w0, w1, w2, w3 = w_t[o], w_t[o + 1], w_t[o + 2], w_t[o + 3]
        w4, w5, w6, w7 = w_t[o + 4], w_t[o + 5], w_t[o + 6], w_t[o + 7]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        for i in range(n_in):
            u = xb[i]
            s0 += u * w0[i]
            s1 += u * w1[i]
            s2 += u * w2[i]
            s3 += u * w3[i]
            s4 += u * w4[i]
            s5 += u * w5[i]
            s6 += u * w6[i]
            s7 += u * w7[i]
        out[0, o], out[0, o + 1], out[0, o + 2], out[0, o + 3] = s0, s1, s2, s3
        out[0, o + 4], out[0, o + 5], out[0, o + 6], out[0, o + 7] = s4, s5, s6, s7


@njit(cache=True, fastmath=True, nogil=True)
def dot_2x4(x, w_t, out):
    """Exactly two rows (a k = 1 verify), four outputs: each weight element loaded once for both rows."""
    n_in = x.shape[1]
    n_out = w_t.shape[0]
    x0, x1 = x[0], x[1]
    for o_tile in range(0, n_out, 4):
        o = min(o_tile, n_out - 4)
        _prefetch_tile(w_t, o, 4)
        w0, w1, w2, w3 = w_t[o], w_t[o + 1], w_t[o + 2], w_t[o + 3]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for i in range(n_in):
            p0, p1, p2, p3 = w0[i], w1[i], w2[i], w3[i]
            u0, u1 = x0[i], x1[i]
            a0 += u0 * p0
            a1 += u0 * p1
            a2 += u0 * p2
            a3 += u0 * p3
            b0 += u1 * p0
            b1 += u1 * p1
            b2 += u1 * p2
            b3 += u1 * p3
        out[0, o], out[0, o + 1], out[0, o + 2], out[0, o + 3] = a0, a1, a2, a3
        out[1, o], out[1, o + 1], out[1, o + 2], out[1, o + 3] = b0, b1, b2, b3


@njit(cache=True, fastmath=True, nogil=True)
def dot_3x3(x, w_t, out):
    """Exactly three rows (a k = 2 verify), three outputs."""
    n_in = x.shape[1]
    n_out = w_t.shape[0]
    x0, x1, x2 = x[0], x[1], x[2]
    for o_tile in range(0, n_out, 3):
        o = min(o_tile, n_out - 3)
        _prefetch_tile(w_t, o, 3)
        w0, w1, w2 = w_t[o], w_t[o + 1], w_t[o + 2]
        a0 = a1 = a2 = b0 = b1 = b2 = c0 = c1 = c2 = np.float32(0.0)
        for i in range(n_in):
            p0, p1, p2 = w0[i], w1[i], w2[i]
            u0, u1, u2 = x0[i], x1[i], x2[i]
            a0 += u0 * p0
            a1 += u0 * p1
            a2 += u0 * p2
            b0 += u1 * p0
            b1 += u1 * p1
            b2 += u1 * p2
            c0 += u2 * p0
            c1 += u2 * p1
            c2 += u2 * p2
        out[0, o], out[0, o + 1], out[0, o + 2] = a0, a1, a2
        out[1, o], out[1, o + 1], out[1, o + 2] = b0, b1, b2
        out[2, o], out[2, o + 1], out[2, o + 2] = c0, c1, c2


@njit(cache=True, fastmath=True, nogil=True)
def dot_5x2(x, w_t, out):
    """Exactly five rows (a k = 4 verify), two outputs."""
    n_in = x.shape[1]
    n_out = w_t.shape[0]
    x0, x1, x2, x3, x4 = x[0], x[1], x[2], x[3], x[4]
    for o_tile in range(0, n_out, 2):
        o = min(o_tile, n_out - 2)
        _prefetch_tile(w_t, o, 2)
        w0, w1 = w_t[o], w_t[o + 1]
        a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = e0 = e1 = np.float32(0.0)
        for i in range(n_in):
            p, q = w0[i], w1[i]
            u0, u1, u2, u3, u4 = x0[i], x1[i], x2[i], x3[i], x4[i]
            a0 += u0 * p
            a1 += u0 * q
            b0 += u1 * p
            b1 += u1 * q
            c0 += u2 * p
            c1 += u2 * q
            d0 += u3 * p
            d1 += u3 * q
            e0 += u4 * p
            e1 += u4 * q
        out[0, o], out[0, o + 1] = a0, a1
        out[1, o], out[1, o + 1] = b0, b1
        out[2, o], out[2, o + 1] = c0, c1
        out[3, o], out[3, o + 1] = d0, d1
        out[4, o], out[4, o + 1] = e0, e1


@njit(cache=True, fastmath=True, nogil=True)
def dot_rows(x, w_t, out):
    """out = x @ w_t.T for any number of rows, every output summed in the same order whatever the rows:
    a tile made for 1, 2, 3 or 5 rows, `matmul_rows` (4 x 3, in blocks) for 4 and more."""
    rows = x.shape[0]
    if w_t.shape[0] < 8:  # too few outputs for the tiles (no model layer has so few)
        matmul_rows(x, w_t, out)
    elif rows == 1:
        dot_1x8(x, w_t, out)
    elif rows == 2:
        dot_2x4(x, w_t, out)
    elif rows == 3:
        dot_3x3(x, w_t, out)
    elif rows == 5:
        dot_5x2(x, w_t, out)
    else:
        matmul_rows(x, w_t, out)


@njit(cache=True, fastmath=True, nogil=True)
def decode_forward(batch_rows, starts, batch_tokens, batch_tables, block_size,
                   embed, input_norms, post_norms, final_norm, qkv_t, o_t, gate_up_t, down_t, lm_head_t,
                   cos, sin, k_blocks, v_blocks, num_heads, num_kv_heads, eps,
                   positions, seq_lens, h, x, qkv, attn, delta, gate_up, act, logits):
    """One decode step for rows b = 0 … B-1 (input-batch row `batch_rows[b]`, its new token at
    position `starts[b]`). Weights: the matmuls' per layer stacked [L, out, in] (lm_head [vocab, hidden]),
    all run by `dot_rows`; norms [L, hidden]; the pools [L, num_blocks, block_size, H_kv, D]. The last ten arguments
    are the caller's buffers (`positions` int64 [B], `seq_lens` int32 [B], then float32 [B, ·]);
    `logits` [B, vocab] is the output."""
    num_rows = batch_rows.shape[0]
    num_layers = qkv_t.shape[0]
    dim = cos.shape[1]
    intermediate = act.shape[1]
    scale = np.float32(1.0 / math.sqrt(dim))
    for b in range(num_rows):
        pos = starts[b]
        positions[b] = pos
        seq_lens[b] = pos + 1
        token = batch_tokens[batch_rows[b], pos]
        for j in range(h.shape[1]):
            h[b, j] = embed[token, j]
    rms_norm(h, input_norms[0], eps, x)
    heads = qkv.reshape(num_rows, num_heads + 2 * num_kv_heads, dim)
    queries = attn.reshape(num_rows, num_heads, dim)
    tables = batch_tables[batch_rows]  # each row's block-table row, in row order (a small copy, once a step)
    bits = np.empty(intermediate, np.int32)  # the SIMD exp's scratch
    for layer in range(num_layers):
        dot_rows(x, qkv_t[layer], qkv)
        rotary(heads, num_heads + num_kv_heads, positions, cos, sin)  # q and k, in place
        kb, vb = k_blocks[layer], v_blocks[layer]
        for b in range(num_rows):  # this step's K/V into the pool ...
            pos = positions[b]
            block, offset = tables[b, pos // block_size], pos % block_size
            for kvh in range(num_kv_heads):
                for d in range(dim):
                    kb[block, offset, kvh, d] = heads[b, num_heads + kvh, d]
                    vb[block, offset, kvh, d] = heads[b, num_heads + num_kv_heads + kvh, d]
        # ... then every row's attention in one call (row b reads keys 0 … positions[b] only)
        paged_decode_f32(heads[:, :num_heads], kb, vb, tables, seq_lens, scale, 0, queries)
        dot_rows(attn, o_t[layer], delta)
        add_rms_norm(h, delta, post_norms[layer], eps, x)
        dot_rows(x, gate_up_t[layer], gate_up)
        for b in range(num_rows):  # SiLU(gate) · up, exp(-gate) by the attention's SIMD polynomial
            silu_mul(gate_up[b], act[b], bits, np.float32(1.0), _EXP_CEILING, True)
        dot_rows(act, down_t[layer], delta)
        add_rms_norm(h, delta, input_norms[layer + 1] if layer + 1 < num_layers else final_norm, eps, x)
    dot_rows(x, lm_head_t, logits)
