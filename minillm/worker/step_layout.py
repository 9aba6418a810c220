"""One step's flat layout, computed in one compiled pass (chapter 04).

`ModelRunner.prepare` hands this function the plan's per-row numbers (new tokens `counts`, tokens
already computed `starts`, `is_decode`, logits rows `widths`, and each row's input-batch row
`batch_rows`) and the input batch's arrays (`block_table` [rows, max_blocks], `batch_tokens`
[rows, max_len]); it returns everything the forward pass and attention need to know about where each token is:

    order[B]          the plan row of each flattened sequence: decode rows first (attention
                      batches them), then the rest, each part longest first (the torch backend
                      groups rows of similar length); among equals, plan order
    seq_lens[B]       each sequence's length once its new tokens are in (int32)
    query_start[B+1]  sequence j's new tokens are flattened rows query_start[j] … query_start[j+1]-1 (int32)
    positions[T]      each new token's position in its sequence
    token_ids[T]      the token at that position (the input batch holds every row's tokens:
                      `update_state` wrote this step's new ones, and a speculative row's guesses)
    slot_mapping[T]   where its K/V go in the pool: block_table[position // block_size] · block_size
                      + position % block_size
    tables[B, W]      each sequence's block table, W = the longest one's number of blocks, -1 padded
    logits_rows[S]    flattened rows whose logits are computed, plan order: `widths[p]` rows ending at
                      row p's last token (1 for a row that samples, 1+k for a speculative row, 0
                      for a prefill chunk short of its prompt's end)

It is plain loops, a row and a token at a time — the arithmetic as you would write it by hand —
compiled by numba (`@njit(cache=True)`, as chapter 10's CPU kernels). Timed once with a scratch
script (plans of a ladder run replayed; the numpy version is in git history): with the same work done by
~35 numpy calls over all rows, `prepare` took 83 µs per step replayed alone and 0.22 ms inside the
engine at batch 64 (the forward pass pushes their code and data out of the caches between steps);
with this one call, 54 µs and 0.17 ms (the rest is the Python around it).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def layout_step(counts, starts, is_decode, widths, batch_rows, block_table, batch_tokens, block_size):
    num_rows = counts.shape[0]
    lens = starts + counts
    # decode rows first, then the rest; a stable sort keeps plan order among equals
    key = np.empty(num_rows, np.int64)
    for p in range(num_rows):
        key[p] = (0 if is_decode[p] else 1 << 40) - lens[p]
    order = np.argsort(key, kind="mergesort")
    seq_lens = np.empty(num_rows, np.int32)
    query_start = np.zeros(num_rows + 1, np.int32)
    row_of_plan = np.empty(num_rows, np.int64)
    width = 1
    for j in range(num_rows):
        p = order[j]
        row_of_plan[p] = j
        seq_lens[j] = lens[p]
        query_start[j + 1] = query_start[j] + counts[p]
        width = max(width, (lens[p] + block_size - 1) // block_size)
    if width > block_table.shape[1] or (num_rows and lens.max() > batch_tokens.shape[1]):
        raise ValueError("a row needs more blocks or tokens than the input batch holds (a plan out of step)")
    num_tokens = query_start[num_rows]
    tables = np.empty((num_rows, width), np.int32)
    positions = np.empty(num_tokens, np.int64)
    token_ids = np.empty(num_tokens, np.int64)
    slot_mapping = np.empty(num_tokens, np.int64)
    for j in range(num_rows):
        p = order[j]
        row = batch_rows[p]
        for b in range(width):
            tables[j, b] = block_table[row, b]
        t = query_start[j]
        for i in range(counts[p]):
            pos = starts[p] + i
            positions[t + i] = pos
            token_ids[t + i] = batch_tokens[row, pos]
            slot_mapping[t + i] = tables[j, pos // block_size] * block_size + pos % block_size
    logits_rows = np.empty(widths.sum(), np.int64)
    k = 0
    for p in range(num_rows):
        end = query_start[row_of_plan[p] + 1]
        for i in range(widths[p]):
            logits_rows[k] = end - widths[p] + i
            k += 1
    return order, seq_lens, query_start, positions, token_ids, slot_mapping, tables, logits_rows
