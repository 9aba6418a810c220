"""Pictures of what a kernel reads and writes, GPU-Puzzles style (chapter 10).

Each function draws the KV pool as a grid, one row per physical block and one column per slot in
the block, and colors every slot by who touches it: the sequence (and so the threads) that reads
it, or the token whose thread writes it. A slot that a block table points at but that lies past
its sequence's end (the partial last block) is hatched: a correct kernel never reads it.
Imports neither numba nor CUDA; only matplotlib.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch, Rectangle

PALETTE = ("#4C72B0", "#55A868", "#DD8452", "#8172B3", "#C44E52", "#937860", "#DA8BC3", "#64B5CD")
FREE = "#F2F2F2"


def _pool_axes(ax, num_blocks: int, block_size: int, title: str):
    ax.set_xlim(-0.5, block_size - 0.5)
    ax.set_ylim(num_blocks - 0.5, -0.5)
    ax.set_xticks(range(block_size))
    ax.set_yticks(range(num_blocks))
    ax.set_xticks(np.arange(-0.5, block_size), minor=True)
    ax.set_yticks(np.arange(-0.5, num_blocks), minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("slot in block")
    ax.set_ylabel("physical block")
    ax.set_title(title, fontsize="medium")
    ax.tick_params(labelsize="small")


def slot_owners(block_tables, seq_lens, block_size: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(owner, unread): owner[block, slot] = the sequence reading it or -1; unread marks the slots of
    a sequence's last block that lie past its end (in its table, never read)."""
    owner = np.full((num_blocks, block_size), -1)
    unread = np.zeros((num_blocks, block_size), dtype=bool)
    for b, n in enumerate(int(x) for x in seq_lens):
        for i in range(-(-n // block_size)):
            block = int(block_tables[b][i])
            for off in range(block_size):
                if i * block_size + off < n:
                    owner[block, off] = b
                else:
                    unread[block, off] = True
    return owner, unread


def plot_decode_reads(block_tables, seq_lens, block_size: int, num_blocks: int, q_heads: int, kv_heads: int,
                      ax=None, title: str | None = None):
    """Which pool slots the threads of each sequence read in paged_attention_decode.

    One thread per (sequence, query head): the H_q threads of sequence b all read the slots colored
    b (each its own KV head's numbers within them), block by block through b's block table.
    """
    ax = ax or plt.subplots(figsize=(1.0 + 0.45 * block_size, 0.8 + 0.32 * num_blocks))[1]
    owner, unread = slot_owners(block_tables, seq_lens, block_size, num_blocks)
    colors = ListedColormap([FREE, *PALETTE[: max(1, len(seq_lens))]])
    ax.imshow(owner + 1, cmap=colors, vmin=0, vmax=len(seq_lens), aspect="auto")
    for block, off in zip(*np.nonzero(unread)):
        ax.add_patch(Rectangle((off - 0.5, block - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#888888", lw=0))
    group = q_heads // kv_heads
    handles = [Patch(color=PALETTE[b % len(PALETTE)],
                     label=f"seq {b}: {int(n)} keys, threads {b * q_heads}-{(b + 1) * q_heads - 1}")
               for b, n in enumerate(seq_lens)]
    handles.append(Patch(facecolor="white", hatch="///", edgecolor="#888888", label="in a table, past the end"))
    handles.append(Patch(color=FREE, label="free (NaN here)"))
    ax.legend(handles=handles, fontsize="x-small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    _pool_axes(ax, num_blocks, block_size, title or f"decode: reads (GQA: {group} query heads per KV head)")
    return ax


def plot_cache_writes(slot_mapping, block_size: int, num_blocks: int, ax=None, title: str | None = None):
    """Which pool slot each new token's threads write in reshape_and_cache (slot < 0: nothing)."""
    ax = ax or plt.subplots(figsize=(2.5 + 0.6 * block_size, 0.8 + 0.32 * num_blocks))[1]
    grid = np.full((num_blocks, block_size), np.nan)
    for t, slot in enumerate(int(s) for s in slot_mapping):
        if slot >= 0:
            grid[slot // block_size, slot % block_size] = t
    ax.imshow(np.zeros_like(grid), cmap=ListedColormap([FREE]), aspect="auto")
    for block, off in zip(*np.nonzero(~np.isnan(grid))):
        ax.add_patch(Rectangle((off - 0.5, block - 0.5), 1, 1, color=PALETTE[0]))
        ax.text(off, block, f"t{int(grid[block, off])}", ha="center", va="center", color="white", fontsize="x-small")
    skipped = [t for t, s in enumerate(int(s) for s in slot_mapping) if s < 0]
    _pool_axes(ax, num_blocks, block_size, title or "reshape_and_cache: token t writes one slot"
               + (f" (skipped: {', '.join(f't{t}' for t in skipped)})" if skipped else ""))
    return ax


def plot_prefill_reads(q_len: int, seq_len: int, block_size: int, ax=None, title: str | None = None):
    """One sequence in prefill_attention: which key positions each of its query rows reads (causal),
    split into the cached prefix and this step's new keys, with block boundaries."""
    ax = ax or plt.subplots(figsize=(1.5 + 0.45 * seq_len, 1.2 + 0.45 * q_len))[1]
    first = seq_len - q_len
    grid = np.zeros((q_len, seq_len))
    for i in range(q_len):
        grid[i, : first + i + 1] = 1
        grid[i, first: first + i + 1] = 2
    ax.imshow(grid, cmap=ListedColormap([FREE, PALETTE[1], PALETTE[0]]), vmin=0, vmax=2, aspect="auto")
    for edge in range(block_size, seq_len, block_size):
        ax.axvline(edge - 0.5, color="#333333", lw=1)
    ax.set_xticks(range(seq_len))
    ax.set_yticks(range(q_len), [f"pos {first + i}" for i in range(q_len)])
    ax.set_xlabel(f"key position (vertical lines: block boundaries, block_size={block_size})")
    ax.set_title(title or "prefill: query rows (one thread each per head) × keys read", fontsize="medium")
    ax.legend(handles=[Patch(color=PALETTE[1], label="cached prefix"), Patch(color=PALETTE[0], label="new this step"),
                       Patch(color=FREE, label="future: masked")], fontsize="x-small",
              loc="center left", bbox_to_anchor=(1.02, 0.5))
    ax.tick_params(labelsize="small")
    return ax


def plot_thread_map(num_items: int, threads_per_block: int, shape: tuple[int, int], ax=None,
                    title: str = "one thread per item, colored by thread block"):
    """A [rows, cols] array whose items are handed out one per thread, in row-major order."""
    ax = ax or plt.subplots(figsize=(1.0 + 0.3 * shape[1], 0.8 + 0.3 * shape[0]))[1]
    blocks = (np.arange(num_items) // threads_per_block).reshape(shape)
    ax.imshow(blocks, cmap=ListedColormap(PALETTE[: int(blocks.max()) + 1]), aspect="auto")
    for r, c in np.ndindex(*shape):
        ax.text(c, r, str(r * shape[1] + c), ha="center", va="center", color="white", fontsize="xx-small")
    ax.set_title(title, fontsize="medium")
    ax.tick_params(labelsize="small")
    return ax


def plot_touches(trace, names: list[str], title: str = "", fig=None):
    """One panel per array of a traced launch (minillm.kernels.trace): each element colored by the
    thread block that read it (inputs) or wrote it (the last name, the output); hatched where more
    than one block read it (a halo, or a number re-read); blank where no thread touched it."""
    fig = fig or plt.figure(figsize=(7.5, 0.9 + 1.0 * len(names)))
    axes = fig.subplots(len(names), 1, squeeze=False)[:, 0]
    blocks = sorted({block for per_array in trace.accesses.values() for block, _ in per_array})
    index = {block: i for i, block in enumerate(blocks)}
    for ax, name in zip(axes, names):
        how = "w" if name == names[-1] else "r"
        shape = trace.arrays[name].shape
        grid = np.full(shape, -1)
        readers: dict = {}
        for (block, _), elements in trace.accesses[name, how].items():
            for element in elements:
                grid[element] = index[block]
                readers.setdefault(element, set()).add(block)
        grid2 = grid.reshape(1, -1) if grid.ndim == 1 else grid.reshape(shape[0], -1)
        colors = ListedColormap([FREE, *(PALETTE[i % len(PALETTE)] for i in range(max(1, len(blocks))))])
        ax.imshow(grid2 + 1, cmap=colors, vmin=0, vmax=max(1, len(blocks)), aspect="auto")
        for element, who in readers.items():
            if len(who) > 1:
                r, c = (0, element[0]) if grid.ndim == 1 else element[:2]
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="///", edgecolor="white", lw=0))
        ax.set_xticks(np.arange(-0.5, grid2.shape[1]), minor=True)
        ax.set_yticks(np.arange(-0.5, grid2.shape[0]), minor=True)
        ax.grid(which="minor", color="white", lw=1)
        ax.tick_params(which="both", length=0, labelsize="x-small")
        ax.set_yticks([] if grid.ndim == 1 else range(grid2.shape[0]))
        ax.set_ylabel(f"{name}\n({'written' if how == 'w' else 'read'})", fontsize="small", rotation=0, ha="right",
                      va="center")
    handles = [Patch(color=PALETTE[i % len(PALETTE)], label=f"block {list(b)}") for i, b in enumerate(blocks)]
    handles.append(Patch(facecolor=PALETTE[0], hatch="///", edgecolor="white", label="read by 2+ blocks"))
    axes[0].legend(handles=handles, fontsize="x-small", loc="lower left", bbox_to_anchor=(1.01, -0.2 * len(names)))
    axes[0].set_title(title, fontsize="medium")
    return fig


def plot_tile_loads(q_len: int, seq_len: int, block_m: int, block_n: int, ax=None, title: str | None = None):
    """One sequence in flash_attention (kernels/tiled_attention.py): query rows × key positions.

    Each band of `block_m` query rows is one thread block; it loads key tiles of `block_n` positions
    into shared memory up to its last row's position (causal) and never the tiles beyond. Colored:
    the scores a row uses; hatched: keys its block loaded that this row masks (the diagonal tile);
    blank: tiles the block never loads. Drawn from the kernel's loop bounds."""
    ax = ax or plt.subplots(figsize=(1.5 + 0.32 * seq_len, 1.0 + 0.32 * q_len))[1]
    first = seq_len - q_len
    grid = np.zeros((q_len, seq_len))
    hatched = []
    for start in range(0, q_len, block_m):
        tile = start // block_m
        last = first + min(start + block_m, q_len) - 1  # the block's last query position
        loaded = -(-(last + 1) // block_n) * block_n  # whole key tiles up to it
        for row in range(start, min(start + block_m, q_len)):
            grid[row, : first + row + 1] = 1 + tile % len(PALETTE)
            hatched += [(row, k) for k in range(first + row + 1, min(loaded, last + 1))]
    ax.imshow(grid, cmap=ListedColormap([FREE, *PALETTE]), vmin=0, vmax=len(PALETTE), aspect="auto",
              interpolation="nearest")
    for row, k in hatched:
        ax.add_patch(Rectangle((k - 0.5, row - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#888888", lw=0))
    for edge in range(block_n, seq_len, block_n):
        ax.axvline(edge - 0.5, color="#333333", lw=1)
    for edge in range(block_m, q_len, block_m):
        ax.axhline(edge - 0.5, color="#333333", lw=1)
    ax.set_xlabel(f"key position (vertical lines: key tiles of {block_n}, loaded into shared memory together)")
    ax.set_ylabel(f"query row (bands: thread blocks of {block_m} rows)")
    ax.set_title(title or f"flash_attention: {q_len} queries after {first} cached keys; each band loads each "
                 "key tile once", fontsize="medium")
    ax.tick_params(labelsize="small")
    return ax
