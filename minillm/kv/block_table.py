"""The block-table buffer: one stable row per request holding KV, padded with -1 (chapter 05).

Attention kernels (FlashAttention's varlen API, vLLM's paged attention, `minillm.kernels`) read
K/V through `block_tables[B, max_blocks]` int32: row b lists sequence b's blocks in order, -1
after its last. Rebuilding that matrix from Python lists every step would cost O(all blocks);
instead the buffer lives as long as the engine, as vLLM's `BlockTable` does: a request gets a row
when it first holds a block, a new block is one write at the end of its row, and a finished or
preempted request's row is wiped and reused. Each step the runner only gathers the rows it needs.
"""

from __future__ import annotations

import numpy as np


class BlockTableBuffer:
    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 16) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = np.full((initial_rows, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)  # blocks in each row
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def row(self, request_id: str) -> int:
        """The request's row, created on first use (the buffer doubles when every row is taken)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._free_rows.pop()
            self.row_of[request_id] = row
        return row

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def append(self, request_id: str, blocks: list[int]) -> None:
        row = self.row(request_id)
        start = int(self.num_blocks[row])
        end = start + len(blocks)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"request {request_id} would hold {end} blocks; a block table row has "
                             f"{self.max_blocks_per_seq}")
        self.table[row, start:end] = blocks
        self.num_blocks[row] = end

    def truncate(self, request_id: str, num_blocks: int) -> None:
        row = self.row_of[request_id]
        self.table[row, num_blocks : self.num_blocks[row]] = -1
        self.num_blocks[row] = num_blocks

    def drop(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.table[row, : self.num_blocks[row]] = -1
            self.num_blocks[row] = 0
            self._free_rows.append(row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """block_tables[len(rows), width] for one step (a copy: the buffer keeps changing)."""
        return self.table[rows, :width]
