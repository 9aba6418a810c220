"""Attention over a flat KV pool, in plain torch: the CPU backend (chapters 04–05).

Every KV layout in minillm — one max-length slab per sequence (chapter 04), fixed-size pages
(chapter 05) — stores K and V for layer l in a tensor `[num_slots, H_kv, D]`. A layout is then
nothing but two index maps, built once per step by the KV manager:

- `slot_mapping[T]`: where each new token's K/V are written;
- per sequence, the slots of all its keys in order (`key_index`), for reading.

Decode rows (one query each) are batched into a single SDPA call over keys padded to the longest
context; prefill rows (many queries) run one SDPA call each with a causal mask. This is the
"selective batching" of Orca: everything else in the layer ran on the flattened batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A sequence that brings several new tokens this step (a prompt, or a chunk of one)."""

    token_start: int  # first of its tokens in the flattened batch
    num_new_tokens: int
    key_index: torch.Tensor  # [context_len] slots of all its keys, cached ones first


@dataclass
class AttentionMetadata:
    """The step's layout: decode rows first (tokens [0, num_decode)), then prefill spans."""

    slot_mapping: torch.Tensor  # [T]
    num_decode: int
    decode_key_index: torch.Tensor | None  # [B_decode, K_max]
    decode_context_lens: torch.Tensor | None  # [B_decode]
    prefills: list[PrefillSpan]
    _mask_cache: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B_decode, 1, 1, K_max]: which padded key slots each decode row may read."""
        if window not in self._mask_cache:
            k_max = self.decode_key_index.shape[1]
            lens = self.decode_context_lens[:, None]
            key_pos = torch.arange(k_max, device=lens.device)[None, :]
            allowed = key_pos < lens
            if window is not None:  # the query sits at position len-1; keep keys with q - k < window
                allowed &= key_pos > lens - 1 - window
            self._mask_cache[window] = allowed[:, None, None, :]
        return self._mask_cache[window]


def prefill_mask(num_new: int, context_len: int, window: int | None,
                 device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Causal mask [n, ctx] for queries at positions ctx-n … ctx-1; None means plain causal."""
    if window is None and num_new == context_len:
        return None
    q_pos = torch.arange(context_len - num_new, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class FlatPoolAttention:
    """Callable the model uses per layer: write this step's K/V, attend over each sequence's keys."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                 sliding_windows: tuple[int | None, ...] = ()) -> None:
        self.k_pool, self.v_pool = k_pool, v_pool  # [L, num_slots, H_kv, D]
        self.meta = meta
        self.windows = sliding_windows or (None,) * k_pool.shape[0]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, window = self.meta, self.windows[layer]
        k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
        k_pool.index_copy_(0, meta.slot_mapping, k)
        v_pool.index_copy_(0, meta.slot_mapping, v)
        if not meta.prefills:  # pure decode step: one call, no output assembly
            return self._decode(q, k_pool, v_pool, window)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], k_pool, v_pool, window)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_new_tokens)
            keys, values = k_pool.index_select(0, span.key_index), v_pool.index_select(0, span.key_index)
            mask = prefill_mask(span.num_new_tokens, span.key_index.shape[0], window, q.device)
            # A leading batch dimension of 1 lets PyTorch pick its fused CPU kernel (~6x faster at
            # 1k tokens than the generic path 3-D inputs take).
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                window: int | None) -> torch.Tensor:
        index = self.meta.decode_key_index
        flat = index.reshape(-1)  # index_select is several times faster than fancy indexing on CPU
        keys = k_pool.index_select(0, flat).view(*index.shape, *k_pool.shape[1:]).transpose(1, 2)  # [B,H,K,D]
        values = v_pool.index_select(0, flat).view(*index.shape, *v_pool.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values,
                                           attn_mask=self.meta.decode_mask(window), enable_gqa=True)
        return o[:, :, 0, :]
