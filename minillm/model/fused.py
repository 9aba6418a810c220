"""The decoder's forward with its small ops fused by numba (float32 on a CPU; chapter 10).

The same computation as `LlamaModel.forward` (minillm/model/llama.py, the one to read first), with
the token-wise ops between the matmuls done by `kernels/cpu_fused_ops.py` in one pass each:
RMSNorm fused with the residual add before it, RoPE rotated in place in the q|k|v output (measured
3-15x faster than the torch ops; SiLU·mul stays torch, which measured faster). What remains per
layer is four matmuls, the attention, three numba calls and SiLU·mul. The numpy views of the
constant tensors (norm weights, the RoPE table) are made once, on the first call.

The matmuls go to oneDNN with each weight packed into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`, the ops torch's compiler
uses for oneDNN linears; vLLM's CPU backend runs its linears on oneDNN too) instead of `F.linear`'s
MKL sgemm. On this AMD CPU oneDNN runs AVX-512 kernels (ONEDNN_VERBOSE=1 says so; MKL does not say
which it picks) and measured faster (one-off timings, scratch script). One thread, best of 5, µs per
call (F.linear → oneDNN), rows
1 / 2 / 16 / 200: q|k|v 11 → 22 / 20 → 22 / 61 → 54 / 547 → 476, gate|up 27 → 37 / 51 → 39 /
147 → 120 / 1404 → 1259, lm_head 72 → 78 / 140 → 86 / 536 → 324 / 4576 → 3882 (o and down within
±20 % either way). One row is MKL's matrix-vector path, faster; so oneDNN takes the calls of
`ONEDNN_MIN_ROWS` rows or more. On the ladder's trace (bench/ladder.py, batch 16), three runs of each
interleaved in one process: 6.54 → 5.05 ms CPU per step at best, 6.68 → 5.57 on average (the VM's
speed drifts; the ladder's own step time, an hour apart: 5.32 → 4.94 ms). The first call at a new
row count builds a oneDNN primitive (~0.5-1 ms, kept for the process). A weight is packed on first
use and again if it is changed in place or replaced (`linear` checks its version). The sums are
the same products in another order: float32 results differ in the last bits (tests compare the
greedy tokens with the torch ops: tests/test_cpu_fused_ops.py). The packed copies are kept beside
the plain weights (one-row matmuls and the float64 path use those), so a float32 CPU model holds its
matmul weights twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN_MIN_ROWS = 2  # matmuls of this many rows or more go to oneDNN (see above)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [out, in] in oneDNN's blocked layout, or None where this torch has no oneDNN linear."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)  # laid out for ~16 rows: measured best
    except (AttributeError, RuntimeError):
        return None


def _version(w: torch.Tensor) -> int:
    try:
        return w._version  # bumped by every in-place change of w
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return -1


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, packed: dict) -> torch.Tensor:
    """F.linear(x, w, bias), by oneDNN on w's packed copy from ONEDNN_MIN_ROWS rows. `packed` is the
    model's cache, id(w) -> (w, w's version, packed w); the copy is made
    on first use and again whenever w was changed in place (its version) or replaced (the cache
    holds w itself, so its id cannot be reused by another tensor)."""
    entry = packed.get(id(w))
    if entry is None or entry[0] is not w or entry[1] != _version(w):
        entry = packed[id(w)] = (w, _version(w), _onednn_pack(w))
    if entry[2] is not None and x.shape[0] >= ONEDNN_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")
    return F.linear(x, w, bias)


def fused_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                  output_rows: torch.Tensor | None = None) -> torch.Tensor:
    from minillm.kernels import cpu_fused_ops as ops

    num_tokens = input_ids.shape[0]
    hq, hkv, d, eps = model._q_heads, model._kv_heads, model._head_dim, model._eps
    views = model._fused_views
    if views is None:  # [input norm of each layer..., final norm], post-attention norms, cos, sin
        views = model._fused_views = ([lw.input_norm.numpy() for lw in model.layers] + [model.final_norm.numpy()],
                                      [lw.post_attention_norm.numpy() for lw in model.layers],
                                      model.rope.cos.numpy(), model.rope.sin.numpy())
    norms, post_norms, cos, sin = views
    packed = model._packed_weights
    pos = positions.numpy()
    layers, last = model.layers, len(model.layers) - 1
    h = F.embedding(input_ids, model.embed)  # a fresh tensor: the residual stream, updated in place
    x = torch.empty_like(h)
    ops.rms_norm(h.numpy(), norms[0], eps, x.numpy())
    for i, lw in enumerate(layers):
        qkv = linear(x, lw.qkv, lw.qkv_bias, packed).view(num_tokens, hq + 2 * hkv, d)
        ops.rotary(qkv.numpy(), hq + hkv, pos, cos, sin)  # q and k, in place
        out = attention(i, qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :])
        if i == last and output_rows is not None:  # as in LlamaModel.forward: only the rows sampled
            out, h = out.index_select(0, output_rows), h.index_select(0, output_rows)
            x = torch.empty_like(h)
        o = linear(out.reshape(h.shape[0], hq * d), lw.o, lw.o_bias, packed)
        ops.add_rms_norm(h.numpy(), o.numpy(), post_norms[i], eps, x.numpy())
        gate, up = linear(x, lw.gate_up, lw.gate_up_bias, packed).chunk(2, dim=-1)
        down = linear(F.silu(gate).mul_(up), lw.down, lw.down_bias, packed)
        ops.add_rms_norm(h.numpy(), down.numpy(), norms[i + 1], eps, x.numpy())  # the next layer's norm
    return x
