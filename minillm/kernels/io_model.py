"""FlashAttention's I/O argument as arithmetic: HBM bytes moved by one attention layer (chapter 10).

Counts elements read from and written to GPU memory (HBM) by a prefill of N tokens, per head, then
multiplies by heads and element size. Three ways to compute softmax(QK^T / sqrt(d)) V:

- "eager":  one kernel per operation, as plain PyTorch runs it: S = QK^T is written, then read and
            written again by the scale, the causal mask and the softmax, then read by P·V.
- "standard": Algorithm 0 of Dao et al. (2022): S written once, read once by a softmax that writes
            P, P read once by the final matmul; 4·N² + 4·N·d elements.
- "tiled":  FlashAttention-2's loop order: each tile of B_r query rows stays on chip while all of K
            and V stream past it, with an online softmax; nothing of size N² ever reaches HBM.
            Q is read once, O written once, K and V read once per query tile: 2·N·d + 2·N·d·N/B_r.

B_r is bounded by on-chip memory (SRAM, M elements per streaming multiprocessor): the tile that
stays, the tiles streaming past it and the output accumulator, about 4·B·d elements, must fit, so
B_r = M / 4d. (That is the paper's B_c in its Algorithm 1, whose loop order keeps K/V tiles of that
size and streams Q and O past them; the count comes out the same with Q and O re-read instead.)
"""

from __future__ import annotations

import math


def tile_rows(head_dim: int, sram_bytes: int, bytes_per_element: int) -> int:
    """B_r = M / 4d rows, M the SRAM of one SM in elements (Dao et al. 2022, Algorithm 1's B_c)."""
    if head_dim < 1 or sram_bytes < 4 * head_dim * bytes_per_element:
        raise ValueError(f"sram_bytes={sram_bytes} cannot hold four tiles of head_dim={head_dim}")
    return sram_bytes // bytes_per_element // (4 * head_dim)


def attention_hbm_bytes(seq_len: int, head_dim: int, num_heads: int, bytes_per_element: int, variant: str,
                        block_rows: int | None = None) -> int:
    """HBM bytes read + written by one layer's attention over a prompt of `seq_len` tokens."""
    n, d = seq_len, head_dim
    if variant == "eager":  # S: write; scale, mask, softmax: read + write each; P·V: read P
        elements = 2 * n * d + 2 * n * n * 4 + n * d + n * d
    elif variant == "standard":
        elements = 4 * n * n + 4 * n * d
    elif variant == "tiled":
        if not block_rows or block_rows < 1:
            raise ValueError("variant='tiled' needs block_rows >= 1 (see tile_rows)")
        elements = 2 * n * d + 2 * n * d * math.ceil(n / block_rows)
    else:
        raise ValueError(f"variant must be 'eager', 'standard' or 'tiled', got {variant!r}")
    return elements * num_heads * bytes_per_element


def score_matrix_bytes(seq_len: int, num_heads: int, bytes_per_element: int) -> int:
    """The N×N matrix per head that eager and standard attention keep in HBM (tiled: none)."""
    return seq_len * seq_len * num_heads * bytes_per_element
