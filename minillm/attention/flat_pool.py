"""Attention over a paged KV pool, in plain torch: the CPU backend (chapters 04–05, 08–09).

Every KV layout in minillm — one max-length slab per sequence (chapter 04), fixed-size pages
(chapter 05) — stores K and V for layer l in a tensor `[num_slots, H_kv, D]`, which is also
`[num_blocks, block_size, H_kv, D]`: a slab is simply one block of `max_model_len` slots. The
step's layout comes in the form attention kernels take (FlashAttention's varlen API, vLLM's
paged attention, `minillm.kernels` in chapter 10):

- `slot_mapping[T]`: where each new token's K/V are written;
- `query_start_loc[B+1]`: sequence b's new tokens are rows `query_start_loc[b] … [b+1]-1`;
- `seq_lens[B]`: sequence b's length including its new tokens (its queries are the last ones);
- `block_tables[B, max_blocks]` int32: its blocks in order, -1 after the last.

Decode rows (one query after a cached context) come first. This torch backend reads K/V by whole
blocks through the block table and, since one SDPA call pads every row to its longest key run,
it groups rows of similar length (the runner decides the groups, so that keys read ÷ keys that
exist stays near 1). Rows that bring several new tokens after a cached context — a prefill
chunk, a speculative row of 1+k, a recompute — run batched too, with an offset causal mask.
Everything else in the layer ran on the flattened batch: Orca's "selective batching".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class RowGroup:
    """Rows that one SDPA call serves. Decode: `rows` are consecutive query rows. Multi-token:
    `query_index` [b * q_max] gathers (padded) query rows, `out_rows` / `out_index` scatter back."""

    first_row: int  # index into the step's sequences (the B dimension)
    num_rows: int
    key_len: int  # keys per row read (num_blocks * block_size, or less for one partial block)
    block_ids: torch.Tensor  # [num_rows * num_blocks] pool blocks, padding → the null block
    seq_lens: torch.Tensor  # [num_rows, 1]
    q_max: int = 1
    query_index: torch.Tensor | None = None  # multi-token groups: [num_rows * q_max] rows of q
    query_lens: torch.Tensor | None = None  # [num_rows, 1]
    out_index: torch.Tensor | None = None  # rows of the output the valid queries go to
    valid: torch.Tensor | None = None  # [num_rows * q_max] which gathered queries are real
    fresh_causal: bool = False  # one whole prompt, nothing cached: its keys are this step's own
    token_slice: slice | None = None  # its rows of the flattened batch, when fresh_causal
    _masks: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """The step's layout, in the varlen form kernels use, plus the torch backend's row groups."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    num_decode: int  # sequences 0 … num_decode-1 are decode rows (token row == sequence index)
    block_size: int
    decode_groups: list[RowGroup] = field(default_factory=list)
    prefill_groups: list[RowGroup] = field(default_factory=list)
    num_tokens: int = 0


def decode_mask(group: RowGroup, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[b, 1, 1, K] additive mask (0 or -inf): which gathered key slots each decode row may read.
    Additive rather than boolean, built once per step and shared by every layer: SDPA would
    otherwise convert a boolean mask again in each call."""
    if window not in group._masks:
        key_pos = torch.arange(group.key_len, device=group.seq_lens.device)[None, :]
        allowed = key_pos < group.seq_lens
        if window is not None:  # the query sits at position len-1; keep keys with q - k < window
            allowed &= key_pos > group.seq_lens - 1 - window
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        group._masks[window] = additive[:, None, None, :]
    return group._masks[window]


def multi_token_mask(group: RowGroup, window: int | None) -> torch.Tensor:
    """[b, 1, q_max, K]: query i of row r sits at position seq_len - q_len + i and sees keys up to it.
    A padding query (i >= q_len) sees key 0 only, so its (discarded) softmax is never all -inf."""
    if window not in group._masks:
        device = group.seq_lens.device
        q_idx = torch.arange(group.q_max, device=device)[None, :, None]  # [1, q, 1]
        k_pos = torch.arange(group.key_len, device=device)[None, None, :]  # [1, 1, K]
        lens, qlens = group.seq_lens[:, :, None], group.query_lens[:, :, None]  # [b, 1, 1]
        q_pos = lens - qlens + q_idx
        allowed = (k_pos <= q_pos) & (k_pos < lens)
        if window is not None:
            allowed &= k_pos > q_pos - window
        allowed |= (q_idx >= qlens) & (k_pos == 0)
        group._masks[window] = allowed[:, None]
    return group._masks[window]


class FlatPoolAttention:
    """Callable the model uses per layer: write this step's K/V, attend through the block tables."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                 sliding_windows: tuple[int | None, ...] = ()) -> None:
        self.k_pool, self.v_pool = k_pool, v_pool  # [L, num_slots, H_kv, D]
        self.meta = meta
        self.windows = sliding_windows or (None,) * k_pool.shape[0]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, window = self.meta, self.windows[layer]
        k_blocks, v_blocks = self.write(layer, k, v)
        if len(meta.decode_groups) == 1 and not meta.prefill_groups:  # pure decode, one group
            return self._decode(meta.decode_groups[0], q, k_blocks, v_blocks, window)
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            out[g.first_row : g.first_row + g.num_rows] = self._decode(
                g, q[g.first_row : g.first_row + g.num_rows], k_blocks, v_blocks, window)
        self.multi_token(out, q, k, v, k_blocks, v_blocks, window)
        return out

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's K/V through `slot_mapping`; the layer's pools seen as blocks
        [num_blocks, block_size, H_kv, D]."""
        k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
        k_pool.index_copy_(0, self.meta.slot_mapping, k)  # every new K/V is written before anyone reads
        v_pool.index_copy_(0, self.meta.slot_mapping, v)
        bs = self.meta.block_size
        return k_pool.view(-1, bs, *k_pool.shape[1:]), v_pool.view(-1, bs, *v_pool.shape[1:])

    def multi_token(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_blocks: torch.Tensor, v_blocks: torch.Tensor, window: int | None) -> None:
        """Attention of the rows that bring several new tokens (prefill groups), written into `out`."""
        for g in self.meta.prefill_groups:
            if g.fresh_causal and window is None:
                # A whole new prompt: its keys are exactly this step's k, v (nothing to gather). A
                # leading batch dimension of 1 lets PyTorch pick its fused CPU kernel.
                rows = g.token_slice
                o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                                                   v[rows].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                out[rows] = o[0].transpose(0, 1)
                continue
            keys, values = self._gather(g, k_blocks, v_blocks)
            queries = q.index_select(0, g.query_index).view(g.num_rows, g.q_max, *q.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=multi_token_mask(g, window),
                                               enable_gqa=True)
            o = o.transpose(1, 2).reshape(g.num_rows * g.q_max, *q.shape[1:])
            out.index_copy_(0, g.out_index, o[g.valid] if g.valid is not None else o)

    @staticmethod
    def _gather(g: RowGroup, k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, H_kv, K, D] keys and values of the group's rows, read block by block."""
        if g.key_len < k_blocks.shape[1]:  # one partial block (a slab): read only its start
            k_blocks, v_blocks = k_blocks[:, : g.key_len], v_blocks[:, : g.key_len]
        shape = (g.num_rows, g.key_len, *k_blocks.shape[2:])
        keys = k_blocks.index_select(0, g.block_ids).view(shape).transpose(1, 2)
        values = v_blocks.index_select(0, g.block_ids).view(shape).transpose(1, 2)
        return keys, values

    def _decode(self, g: RowGroup, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                window: int | None) -> torch.Tensor:
        keys, values = self._gather(g, k_blocks, v_blocks)
        # GQA folded into the query axis: the G query heads that share KV head j (heads j·G … j·G+G-1,
        # as HF's repeat_kv pairs them) become G queries of one head, so each key is read once, not G times.
        b, h_q, d = q.shape
        h_kv = keys.shape[1]
        o = F.scaled_dot_product_attention(q.view(b, h_kv, h_q // h_kv, d), keys, values,
                                           attn_mask=decode_mask(g, window, q.dtype))
        return o.reshape(b, h_q, d)
