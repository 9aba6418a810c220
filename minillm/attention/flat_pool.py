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
it groups rows of similar length (`build_row_groups`, its metadata builder, decides the groups, so
that keys read ÷ keys that exist stays near 1). Rows that bring several new tokens after a cached
context — a prefill chunk, a speculative row of 1+k, a recompute — run batched too, with an offset
causal mask.
Everything else in the layer ran on the flattened batch: Orca's "selective batching".

A quantized pool (`kv_cache_dtype="int8" | "fp8_e4m3"`, `minillm.kv.quant`, chapter 14) holds each
(token, head) row as bytes: the write quantizes, each gather dequantizes the blocks it read, and a
fresh prompt attends to its own K/V as the pool holds them (quantized and read back), so every row
sees the same keys whichever path serves it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from minillm.attention.metadata import AttentionMetadata, RowGroup, StepLayout
from minillm.kv.quant import decode, encode, kv_format

# Rows share one attention call while the keys it reads stay within this factor of the keys
# they have (in blocks); beyond it a new group starts. Grouping trades padded reads for calls.
KEY_READ_SLACK = 1.25


def group_by_length(num_blocks: list[int], slack: float = KEY_READ_SLACK) -> list[tuple[int, int]]:
    """Split rows sorted by length (longest first) into runs [start, end) whose padded reads
    (rows × longest) stay within `slack` × their real block counts."""
    groups, start, total = [], 0, 0
    for i, nb in enumerate(num_blocks):
        if i > start and (i - start + 1) * num_blocks[start] > slack * (total + nb):
            groups.append((start, i))
            start, total = i, 0
        total += nb
    if num_blocks:
        groups.append((start, len(num_blocks)))
    return groups


def build_row_groups(layout: StepLayout, decode_slack: float = KEY_READ_SLACK) -> AttentionMetadata:
    """The torch backend's metadata: the flat layout, plus the decode rows cut into length groups
    (`decode_slack`; infinite: one group) and one group per fresh prompt or per similar run of rows
    with several new tokens after a cached context (prefill chunks, speculative rows, recomputes)."""
    meta = layout.flat_metadata()
    device, bs, nd = layout.device, layout.block_size, layout.num_decode
    seq_lens, q_lens = layout.seq_lens, layout.query_lens
    num_rows = len(seq_lens)
    query_start = layout.query_start_loc.tolist() if nd < num_rows else []
    # padded reads (length groups, multi-token rows) go to the null block
    tables = np.where(layout.block_tables < 0, layout.null_block, layout.block_tables).astype(np.int64)
    blocks_of = -(-seq_lens // bs)

    def group(start: int, end: int, rows: list[int] | None = None) -> RowGroup:
        # rows start … end-1 (or `rows`) read the longest one's blocks each; one block or less (a slab)
        # only as far as the longest row goes. (A run of rows is sliced, not gathered: a decode group of
        # 64 rows costs a few µs.)
        sel = slice(start, end) if rows is None else rows
        nb = int(blocks_of[sel].max())
        key_len = int(seq_lens[sel].max()) if nb == 1 else nb * bs
        ids = torch.from_numpy(np.ascontiguousarray(tables[sel, :nb]).reshape(-1)).to(device)
        return RowGroup(first_row=start, num_rows=end - start if rows is None else len(rows), key_len=key_len,
                        block_ids=ids, seq_lens=torch.from_numpy(seq_lens[sel][:, None]).to(device))

    spans = [(0, nd)] if nd and math.isinf(decode_slack) else group_by_length(blocks_of[:nd].tolist(), decode_slack)
    for start, end in spans:
        meta.decode_groups.append(group(start, end))
    meta.keys_read = sum(g.num_rows * g.key_len for g in meta.decode_groups)
    if nd == num_rows:  # a decode-only step (most steps): nothing more to group
        return meta
    windowed = any(w is not None for w in layout.sliding_windows)
    fresh = [j for j in range(nd, num_rows) if seq_lens[j] == q_lens[j]]
    cached = [j for j in range(nd, num_rows) if seq_lens[j] != q_lens[j]]
    for j in fresh:
        g = group(j, j + 1)
        g.fresh_causal, g.token_slice = True, slice(query_start[j], query_start[j + 1])
        if windowed:  # a sliding-window layer cannot take the plain causal path: give it the general form
            g.q_max, g.query_lens = int(q_lens[j]), torch.tensor([[int(q_lens[j])]], device=device)
            g.query_index, g.valid = _query_rows([j], query_start, q_lens, device)
            g.out_index = g.query_index
        meta.prefill_groups.append(g)
    work = [int(q_lens[j] * blocks_of[j]) for j in cached]
    for a, b in group_by_length(work):
        rows = cached[a:b]
        g = group(rows[0], rows[0] + 1, rows)
        g.q_max = int(q_lens[rows].max())
        g.query_lens = torch.from_numpy(q_lens[rows][:, None]).to(device)
        g.query_index, g.valid = _query_rows(rows, query_start, q_lens, device, g.q_max)
        g.out_index = g.query_index[g.valid]
        meta.prefill_groups.append(g)
    return meta


def _query_rows(rows: list[int], query_start: list[int], q_lens: np.ndarray, device: torch.device,
                q_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    q_max = q_max or int(q_lens[rows].max())
    idx = np.zeros((len(rows), q_max), dtype=np.int64)
    valid = np.zeros((len(rows), q_max), dtype=bool)
    for k, j in enumerate(rows):
        n = int(q_lens[j])
        idx[k, :n] = np.arange(query_start[j], query_start[j] + n)
        idx[k, n:] = query_start[j]
        valid[k, :n] = True
    return torch.from_numpy(idx.reshape(-1)).to(device), torch.from_numpy(valid.reshape(-1)).to(device)


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

    @staticmethod
    def check(device: torch.device, dtype: torch.dtype) -> None:
        """Plain torch: any device, any dtype."""

    @staticmethod
    def build_metadata(layout: StepLayout) -> AttentionMetadata:
        return build_row_groups(layout)

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                 sliding_windows: tuple[int | None, ...] = (), kv_cache_dtype: str = "auto") -> None:
        self.k_pool, self.v_pool = k_pool, v_pool  # [L, num_slots, H_kv, D] (quantized: uint8 rows of W bytes)
        self.meta = meta
        self.windows = sliding_windows or (None,) * k_pool.shape[0]
        self.kv_format = kv_format(kv_cache_dtype)  # None: the pool holds the model's dtype

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, window = self.meta, self.windows[layer]
        k_blocks, v_blocks = self.write(layer, k, v)
        if meta.prefill_groups:
            k, v = self.as_stored(k), self.as_stored(v)
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
        if self.kv_format is not None:  # quantized: each (token, head) row becomes its codes (+ scale)
            k, v = encode(k, self.kv_format), encode(v, self.kv_format)
        k_pool.index_copy_(0, self.meta.slot_mapping, k)  # every new K/V is written before anyone reads
        v_pool.index_copy_(0, self.meta.slot_mapping, v)
        bs = self.meta.block_size
        return k_pool.view(-1, bs, *k_pool.shape[1:]), v_pool.view(-1, bs, *v_pool.shape[1:])

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """This step's K (or V) as the pool holds it: quantized and read back (a fresh prompt attends
        to its own keys without reading the pool, and must see the same numbers a later step will)."""
        return x if self.kv_format is None else decode(encode(x, self.kv_format), self.kv_format, x.dtype)

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
            keys, values = self._gather(g, k_blocks, v_blocks, q.dtype)
            queries = q.index_select(0, g.query_index).view(g.num_rows, g.q_max, *q.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=multi_token_mask(g, window),
                                               enable_gqa=True)
            o = o.transpose(1, 2).reshape(g.num_rows * g.q_max, *q.shape[1:])
            out.index_copy_(0, g.out_index, o[g.valid] if g.valid is not None else o)

    def _gather(self, g: RowGroup, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, H_kv, K, D] keys and values of the group's rows, read block by block (and dequantized
        to `dtype` when the pool is quantized)."""
        if g.key_len < k_blocks.shape[1]:  # one partial block (a slab): read only its start
            k_blocks, v_blocks = k_blocks[:, : g.key_len], v_blocks[:, : g.key_len]
        keys, values = k_blocks.index_select(0, g.block_ids), v_blocks.index_select(0, g.block_ids)
        if self.kv_format is not None:
            keys, values = decode(keys, self.kv_format, dtype), decode(values, self.kv_format, dtype)
        shape = (g.num_rows, g.key_len, *keys.shape[2:])
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)

    def _decode(self, g: RowGroup, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                window: int | None) -> torch.Tensor:
        keys, values = self._gather(g, k_blocks, v_blocks, q.dtype)
        # GQA folded into the query axis: the G query heads that share KV head j (heads j·G … j·G+G-1,
        # as HF's repeat_kv pairs them) become G queries of one head, so each key is read once, not G times.
        b, h_q, d = q.shape
        h_kv = keys.shape[1]
        o = F.scaled_dot_product_attention(q.view(b, h_kv, h_q // h_kv, d), keys, values,
                                           attn_mask=decode_mask(g, window, q.dtype))
        return o.reshape(b, h_q, d)
