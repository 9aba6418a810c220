"""The torch backend with KV eviction: decode rows attend to their kept tokens only (chapter 14).

`FlatPoolAttention` (minillm.attention.flat_pool) gathers each decode row's blocks and masks the keys
past its length; this subclass also masks the keys its `EvictionTracker` (minillm.kv.eviction) has
evicted, and computes decode attention by hand (scores, softmax, weighted sum) rather than with SDPA,
because H2O needs the probabilities: each kept token's share is added to its accumulated score. Prompt
rows (a prefill, a chunk, a recompute) attend exactly; under H2O their probabilities are summed too, so
the first eviction already knows which prompt tokens drew attention.

Only the torch path evicts: the numba kernels (chapter 10) read every key of a row, and the engine
refuses `kv_eviction` with another backend rather than silently ignoring it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from minillm.attention.flat_pool import FlatPoolAttention, decode_mask
from minillm.attention.metadata import AttentionMetadata, RowGroup
from minillm.kv.eviction import EvictionTracker
from minillm.kv.quant import decode


class EvictingAttention(FlatPoolAttention):
    """Per step: the keep masks of the decode rows, built once (evicting down to the budget first)."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                 sliding_windows: tuple[int | None, ...], tracker: EvictionTracker, row_req_ids: list[str],
                 kv_cache_dtype: str = "auto") -> None:
        super().__init__(k_pool, v_pool, meta, sliding_windows, kv_cache_dtype)
        self.tracker = tracker
        self.row_req_ids = row_req_ids  # per flattened sequence (decode rows first), its request
        self.seq_lens = meta.seq_lens.tolist()
        self.query_start = meta.query_start_loc.tolist()
        self.keep_masks: dict[int, torch.Tensor] = {}  # decode group's first row -> additive [b, 1, 1, K]
        for g in meta.decode_groups:
            allowed = np.zeros((g.num_rows, g.key_len), dtype=bool)
            for r in range(g.num_rows):
                row = g.first_row + r
                allowed[r, : self.seq_lens[row]] = tracker.keep_mask(row_req_ids[row], self.seq_lens[row])
            additive = np.where(allowed, 0.0, -math.inf)[:, None, None, :]
            self.keep_masks[g.first_row] = torch.from_numpy(additive).to(meta.slot_mapping.device)

    def _decode(self, g: RowGroup, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                window: int | None) -> torch.Tensor:
        keys, values = self._gather(g, k_blocks, v_blocks, q.dtype)  # [b, H_kv, K, D], dequantized if stored so
        b, h_q, d = q.shape
        h_kv = keys.shape[1]
        mask = self.keep_masks[g.first_row].to(q.dtype)
        if window is not None:
            mask = mask + decode_mask(g, window, q.dtype)
        # GQA folded as in the parent: the G query heads of KV head j are G queries of that head
        scores = q.view(b, h_kv, h_q // h_kv, d) @ keys.transpose(-1, -2) / math.sqrt(d)  # [b, H_kv, G, K]
        probs = torch.softmax(scores + mask, dim=-1)
        if self.tracker.needs_scores:
            mass = probs.sum(dim=(1, 2)).double().cpu().numpy()  # [b, K]: what each key received
            for r in range(g.num_rows):
                row = g.first_row + r
                self.tracker.add_scores(self.row_req_ids[row], mass[r, : self.seq_lens[row]])
        return (probs @ values).reshape(b, h_q, d)

    def multi_token(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_blocks: torch.Tensor, v_blocks: torch.Tensor, window: int | None) -> None:
        super().multi_token(out, q, k, v, k_blocks, v_blocks, window)  # exact, as without eviction
        if self.tracker.needs_scores:
            for row in range(self.meta.num_decode, len(self.seq_lens)):
                self._score_prompt_row(row, q, k_blocks)

    def _score_prompt_row(self, row: int, q: torch.Tensor, k_blocks: torch.Tensor) -> None:
        """H2O: add the attention probabilities a multi-token row's queries gave its keys (causal)."""
        seq_len, first, last = self.seq_lens[row], self.query_start[row], self.query_start[row + 1]
        n, bs = last - first, self.meta.block_size
        blocks = self.meta.block_tables[row, : -(-seq_len // bs)].long()
        keys = k_blocks.index_select(0, blocks).reshape(-1, *k_blocks.shape[2:])[:seq_len]  # [L, H_kv, D or W bytes]
        if self.kv_format is not None:
            keys = decode(keys, self.kv_format, q.dtype)
        queries = q[first:last]  # [n, H_q, D]
        h_q, h_kv, d = queries.shape[1], keys.shape[1], queries.shape[2]
        qg = queries.view(n, h_kv, h_q // h_kv, d).permute(1, 2, 0, 3)  # [H_kv, G, n, D]
        scores = qg @ keys.permute(1, 2, 0)[:, None] / math.sqrt(d)  # [H_kv, G, n, L]
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        future = torch.arange(seq_len, device=q.device)[None, :] > q_pos  # [n, L]
        probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
        self.tracker.add_scores(self.row_req_ids[row], probs.sum(dim=(0, 1, 2)).double().cpu().numpy())
