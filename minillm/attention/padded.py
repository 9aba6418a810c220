"""Padded batches: the rectangle that static and dynamic batching compute (chapters 02–03).

Every row of a batch-synchronous batch is left-padded to the longest prompt, and every row takes
one decode step together, even after it finished. The model still sees a flattened `[B·S]`
batch; this backend reshapes it to `[B, S]`, keeps a per-batch cache `[L, B, S_max, H_kv, D]`
(like HF's cache), and masks the pads so real tokens never attend to them. The pads are still
computed — that is the waste these chapters measure. With a quantized `kv_cache_dtype`
(`minillm.kv.quant`, chapter 14) the rectangle holds each row's bytes and attention reads them back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.kv.quant import decode, encode, kv_format


class PaddedBatchCache:
    """K/V of one padded batch, plus which key slots hold real tokens."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto") -> None:
        self.kv_format = kv_format(kv_cache_dtype)  # None: K/V kept in the model's dtype
        width = head_dim if self.kv_format is None else self.kv_format.row_bytes(head_dim)
        shape = (num_layers, batch_size, max_len, num_kv_heads, width)
        storage = dtype if self.kv_format is None else torch.uint8
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = torch.zeros(shape, dtype=storage, device=device)
        self.is_real = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.length = 0  # slots filled in every row (pads included)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


class PaddedAttention:
    """Per layer: write this step's K/V for all rows at [length, length+S), attend with a mask."""

    def __init__(self, cache: PaddedBatchCache, num_new: int, new_is_real: torch.Tensor,
                 sliding_windows: tuple[int | None, ...] = ()) -> None:
        self.cache = cache
        self.start = cache.length
        self.num_new = num_new
        end = self.start + num_new
        cache.is_real[:, self.start:end] = new_is_real
        self.windows = sliding_windows or (None,) * cache.k.shape[0]
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, S_new, S_ctx]: causal; real queries see only real keys; pads see earlier slots."""
        if window not in self._masks:
            end = self.start + self.num_new
            device = self.cache.is_real.device
            real = self.cache.is_real[:, :end]  # [B, ctx]
            # Positions count real tokens only, as HF derives them from the attention mask.
            pos = real.long().cumsum(-1) - 1
            q_slot = torch.arange(self.start, end, device=device)[:, None]
            k_slot = torch.arange(end, device=device)[None, :]
            causal = (k_slot <= q_slot)[None]  # [1, S_new, ctx]
            q_real = real[:, self.start:end, None]  # [B, S_new, 1]
            allowed = causal & (real[:, None, :] | ~q_real)
            if window is not None:
                q_pos = pos[:, self.start:end, None]
                allowed &= pos[:, None, :] > q_pos - window
            self._masks[window] = allowed[:, None]
        return self._masks[window]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, s, end = self.cache, self.num_new, self.start + self.num_new
        batch, fmt = cache.k.shape[1], cache.kv_format
        if fmt is not None:
            k, v = encode(k, fmt), encode(v, fmt)
        cache.k[layer, :, self.start:end] = k.view(batch, s, *k.shape[1:])
        cache.v[layer, :, self.start:end] = v.view(batch, s, *v.shape[1:])
        keys, values = cache.k[layer, :, :end], cache.v[layer, :, :end]
        if fmt is not None:
            keys, values = decode(keys, fmt, q.dtype), decode(values, fmt, q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, H_kv, ctx, D]
        queries = q.view(batch, s, *q.shape[1:]).transpose(1, 2)  # [B, H_q, S_new, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask(self.windows[layer]),
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(batch * s, *q.shape[1:])

    def finish_step(self) -> None:
        self.cache.length = self.start + self.num_new
