"""The decoder's forward with its small ops fused by numba (float32 on a CPU; chapter 10).

The same computation as `LlamaModel.forward` (minillm/model/llama.py, the one to read first), with
the token-wise ops between the matmuls done by `kernels/cpu_fused_ops.py` in one pass each:
RMSNorm fused with the residual add before it, RoPE rotated in place in the q|k|v output (measured
3-15x faster than the torch ops; SiLU·mul stays torch, which measured faster). What remains per
layer is four matmuls, the attention, three numba calls and SiLU·mul. The numpy views of the
constant tensors (norm weights, the RoPE table) are made once, on the first call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    pos = positions.numpy()
    layers, last = model.layers, len(model.layers) - 1
    h = F.embedding(input_ids, model.embed)  # a fresh tensor: the residual stream, updated in place
    x = torch.empty_like(h)
    ops.rms_norm(h.numpy(), norms[0], eps, x.numpy())
    for i, lw in enumerate(layers):
        qkv = F.linear(x, lw.qkv, lw.qkv_bias).view(num_tokens, hq + 2 * hkv, d)
        ops.rotary(qkv.numpy(), hq + hkv, pos, cos, sin)  # q and k, in place
        out = attention(i, qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :])
        if i == last and output_rows is not None:  # as in LlamaModel.forward: only the rows sampled
            out, h = out.index_select(0, output_rows), h.index_select(0, output_rows)
            x = torch.empty_like(h)
        o = F.linear(out.reshape(h.shape[0], hq * d), lw.o, lw.o_bias)
        ops.add_rms_norm(h.numpy(), o.numpy(), post_norms[i], eps, x.numpy())
        gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        down = F.linear(F.silu(gate).mul_(up), lw.down, lw.down_bias)
        ops.add_rms_norm(h.numpy(), down.numpy(), norms[i + 1], eps, x.numpy())  # the next layer's norm
    return x
