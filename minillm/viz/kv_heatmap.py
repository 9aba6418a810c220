"""A picture of the KV pool: which physical block holds whose tokens (chapter 05).

Paging scatters a request's K/V over blocks anywhere in the pool; its block table lists them in
order. `block_states` reads a `BlockManager` and classifies every physical block:

- **free**: on the free list;
- **cached**: nobody uses it, but it holds a full block of some earlier prompt and is kept for a
  later request with the same prefix (the allocator's evictable LRU queue, chapter 07);
- **in use** by exactly one request (reference count 1), tinted per owning request;
- **shared**: read by more than one request (reference count > 1: a prefix-cache hit).

`plot_kv_blocks` draws the pool as a grid of cells in block-id order, row by row. The empty tail
of each request's last block is shaded: it is the only waste paging leaves (*internal*
fragmentation, less than one block per request), and the title counts it, with the bytes the
tokens take in the pool's storage (they follow `kv_cache_dtype`, chapter 14). Given a
`SlabKVManager` (chapter 04) it draws one row per slab instead: the filled prefix in the owner's
tint, the reserved-but-empty rest in the reservation color — the waste paging removes.

    from minillm.viz import plot_kv_blocks
    plot_kv_blocks(llm.engine.kv)

`LiveView(llm.engine, kind="kv")` redraws the same picture beside KV occupancy over time while the
engine runs (`draw_kv_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch, Rectangle

from minillm.kv.base import KVLayoutSnapshot
from minillm.kv.block_manager import BlockManager
from minillm.kv.slab import SlabKVManager
from minillm.viz.plots import _axes, plot_batch_occupancy, plot_kv_occupancy
from minillm.viz.style import COLORS

KVSource = BlockManager | SlabKVManager | KVLayoutSnapshot  # what the pictures read: a manager, or its snapshot

# Codes in the grid `block_states` returns: a request's index (0, 1, …) where one request owns the
# cell, else one of these. Negative so that owner indices can start at 0.
FREE, CACHED, SHARED, RESERVED = -1, -2, -3, -4
STATE_NAMES = {FREE: "free", CACHED: "cached", SHARED: "shared", RESERVED: "reserved, empty"}
STATE_COLORS = {
    FREE: "#EDEDED",  # light gray: nothing here
    CACHED: "#CFC8E6",  # pale prefix-purple: kept for reuse, nobody reads it now
    SHARED: "#8172B3",  # the prefix-caching purple (SYSTEM_COLORS["prefix"])
    RESERVED: COLORS["kv_reserved"],  # reserved but empty: the slab's waste, a last block's tail
}
# Per-request tints: calm, mutually distinct, none of them gray, purple or warning red.
OWNER_COLORS = ("#4C72B0", "#55A868", "#DD8452", "#64B5CD", "#DA8BC3", "#937860", "#8DA0CB", "#A6D854",
                "#E5C494", "#66C2A5", "#FC8D62", "#1F78B4", "#B2DF8A", "#FB9A99")
_LOWEST = RESERVED  # the smallest code: the colormap starts here


def owner_color(index: int) -> str:
    return OWNER_COLORS[index % len(OWNER_COLORS)]


def layout_of(kv: Any) -> KVLayoutSnapshot:
    """The snapshot a picture draws: `kv.layout_snapshot()` of a paged or slab manager, or a snapshot."""
    if isinstance(kv, KVLayoutSnapshot):
        return kv
    if isinstance(kv, (BlockManager, SlabKVManager)):
        return kv.layout_snapshot()
    raise TypeError(f"KV pictures need a BlockManager, a SlabKVManager or a KVLayoutSnapshot, got {type(kv).__name__}")


def can_draw(kv: Any) -> bool:
    """Does `plot_kv_blocks` know this KV manager's layout (paged blocks or slabs)?"""
    return isinstance(kv, (BlockManager, SlabKVManager, KVLayoutSnapshot))


# ---- states -----------------------------------------------------------------------------------
def block_states(kv: KVSource) -> tuple[np.ndarray, dict[int, str]]:
    """Classify the pool: `(owner_grid, legend)`.

    For a `BlockManager`, `owner_grid[b]` describes physical block b (shape `[num_blocks]`):
    FREE, CACHED, SHARED, or the index of the one request using it. For a `SlabKVManager` the
    grid is `[num_slabs, slab_len]`, one cell per token slot: the owner's index where a token's
    K/V are, RESERVED for the rest of an occupied slab, FREE for an unused slab.
    `legend` maps every state code, and every owner index present, to a name (owners: request ids,
    numbered in block-table order, which is admission order).
    """
    layout = layout_of(kv)
    if layout.kind == "slabs":
        return slab_states(layout)
    grid = np.full(layout.num_blocks, FREE, dtype=np.int64)
    grid[list(layout.cached_unused)] = CACHED
    legend: dict[int, str] = {code: STATE_NAMES[code] for code in (FREE, CACHED, SHARED)}
    for index, (request_id, table) in enumerate(layout.tables.items()):
        legend[index] = request_id
        for block in table:
            grid[block] = SHARED if layout.ref_counts[block] > 1 else index
    return grid, legend


def slab_states(kv: SlabKVManager | KVLayoutSnapshot) -> tuple[np.ndarray, dict[int, str]]:
    """`[num_slabs, slab_len]` token slots: owner index where filled, RESERVED after, FREE slabs."""
    layout = layout_of(kv)
    grid = np.full((layout.num_blocks, layout.block_size), FREE, dtype=np.int64)
    legend: dict[int, str] = {FREE: STATE_NAMES[FREE], RESERVED: STATE_NAMES[RESERVED]}
    for index, (request_id, (slab,)) in enumerate(layout.tables.items()):
        legend[index] = request_id
        filled = min(layout.tokens.get(request_id, 0), layout.block_size)
        grid[slab, :filled] = index
        grid[slab, filled:] = RESERVED
    return grid, legend


def block_fill(kv: BlockManager | KVLayoutSnapshot) -> np.ndarray:
    """Tokens in each physical block, `[num_blocks]`: block_size for full blocks, less in a request's
    last block, 0 where free or cached-and-unused. A shared block counts its fullest reader."""
    layout = layout_of(kv)
    bs = layout.block_size
    fill = np.zeros(layout.num_blocks, dtype=np.int64)
    # The manager's own count of each request's tokens (those computed plus those this step adds),
    # as its `usage()` reads it.
    for request_id, table in layout.tables.items():
        tokens = layout.tokens.get(request_id, len(table) * bs)
        for i, block in enumerate(table):
            fill[block] = max(fill[block], min(bs, max(tokens - i * bs, 0)))
    return fill


# ---- drawing ----------------------------------------------------------------------------------
def _state_colormap(num_owners: int) -> tuple[ListedColormap, BoundaryNorm]:
    """One color per code from RESERVED (-4) up to the last owner index: codes map to themselves."""
    colors = [STATE_COLORS[code] for code in range(_LOWEST, 0)] + [owner_color(i) for i in range(num_owners)]
    cmap = ListedColormap(colors).with_extremes(bad=(1, 1, 1, 0))  # cells past the last block: transparent
    return cmap, BoundaryNorm(np.arange(_LOWEST - 0.5, num_owners), len(colors))


def _num_owners(legend: dict[int, str]) -> int:
    return sum(1 for code in legend if code >= 0)


def _legend_handles(legend: dict[int, str], states: Sequence[int], max_owners: int = 6) -> list[Patch]:
    handles = [Patch(facecolor=STATE_COLORS[code], edgecolor="#999999", label=STATE_NAMES[code]) for code in states]
    owners = [(code, name) for code, name in legend.items() if code >= 0]
    if len(owners) <= max_owners:
        handles += [Patch(facecolor=owner_color(code), label=f"req {name}") for code, name in owners]
    else:
        handles.append(Patch(facecolor=owner_color(0), label=f"in use: {len(owners)} requests, a tint each"))
    return handles


def default_ncols(num_blocks: int) -> int:
    """About twice as many columns as rows: a wide grid fits a notebook cell."""
    return max(1, min(num_blocks, math.ceil(math.sqrt(2 * num_blocks))))


def plot_kv_blocks(kv: KVSource, ax: Axes | None = None, ncols: int | None = None) -> Axes:
    """The KV pool as a grid of cells colored by state; block b sits at row b // ncols, column b % ncols.

    The image (`ax.images[0]`) holds the codes of `block_states` (masked past the last block), so
    `ax.images[0].get_array()` reads back what was drawn. Shared blocks carry a white ×; the empty
    tail of a partly filled block is shaded in the reservation color. A `SlabKVManager` is drawn as
    one row per slab (`ncols` ignored).
    """
    layout = layout_of(kv)
    if layout.kind == "slabs":
        return plot_kv_slabs(layout, ax)
    ax = _axes(ax)
    grid, legend = block_states(layout)
    num_blocks = len(grid)
    ncols = ncols or default_ncols(num_blocks)
    nrows = -(-num_blocks // ncols)
    cells = np.ma.masked_all(nrows * ncols, dtype=np.int64)
    cells[:num_blocks] = grid
    cmap, norm = _state_colormap(_num_owners(legend))
    ax.imshow(cells.reshape(nrows, ncols), cmap=cmap, norm=norm, interpolation="nearest",
              aspect="equal", extent=(0, ncols, nrows, 0))

    bs = layout.block_size
    fill = block_fill(layout)
    # The empty right part of each partly filled block in use: internal fragmentation.
    partial = np.flatnonzero((grid >= 0) | (grid == SHARED))
    partial = partial[fill[partial] < bs]
    tails = [Rectangle((b % ncols + fill[b] / bs, b // ncols), 1 - fill[b] / bs, 1) for b in partial]
    if tails:
        ax.add_collection(PatchCollection(tails, facecolor=STATE_COLORS[RESERVED], edgecolor="none"))
    shared = np.flatnonzero(grid == SHARED)
    if len(shared):
        size = max(8.0, min(60.0, 2000.0 / max(ncols, nrows) ** 1.3))
        ax.scatter(shared % ncols + 0.5, shared // ncols + 0.5, marker="x", c="white", s=size, linewidths=1)
    if ncols * nrows <= 2048:  # cell borders while cells are big enough to show them
        ax.set_xticks(np.arange(ncols + 1), minor=True)
        ax.set_yticks(np.arange(nrows + 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ax.set_xlabel(f"physical block id = row × {ncols} + column", fontsize="small")

    usage = layout.usage
    counts = {code: int(np.sum(grid == code)) for code in (FREE, CACHED, SHARED)}
    in_use = num_blocks - counts[FREE] - counts[CACHED]
    empty = usage.reserved_tokens - usage.used_tokens
    frag = empty / usage.reserved_tokens if usage.reserved_tokens else 0.0
    ax.set_title(f"KV blocks: {in_use}/{num_blocks} in use ({counts[SHARED]} shared), {counts[CACHED]} cached, "
                 f"{counts[FREE]} free\n{usage.used_tokens} tokens / {usage.reserved_tokens} reserved slots: "
                 f"{frag:.1%} internal fragmentation ({empty} empty){kv_bytes_line(layout)}", fontsize="medium")
    ax.legend(handles=_legend_handles(legend, (FREE, CACHED, SHARED, RESERVED)), loc="upper center",
              bbox_to_anchor=(0.5, -0.06), ncols=4, fontsize="small", frameon=False)
    return ax


def kv_bytes_line(layout: KVLayoutSnapshot) -> str:
    """A title's last line: the tokens' K/V bytes in the pool's storage (empty if the snapshot has no bytes)."""
    if not layout.bytes_per_token:
        return ""
    used = layout.usage.used_tokens * layout.bytes_per_token
    return (f"\n{used / 2**10:,.1f} KiB of K/V at {layout.bytes_per_token:,} B per token "
            f"(kv_cache_dtype={layout.kv_cache_dtype!r})")


def plot_kv_slabs(kv: SlabKVManager | KVLayoutSnapshot, ax: Axes | None = None) -> Axes:
    """One row per slab: the owner's tint over the slots that hold tokens, the reservation color
    over the slots reserved for tokens that may never come, gray for unused slabs."""
    ax = _axes(ax)
    layout = layout_of(kv)
    num_slabs, slab_len = layout.num_blocks, layout.block_size
    grid, legend = slab_states(layout)
    cmap, norm = _state_colormap(_num_owners(legend))
    ax.imshow(grid, cmap=cmap, norm=norm, interpolation="nearest", aspect="auto",
              extent=(0, slab_len, num_slabs, 0))
    if num_slabs <= 64:
        ax.set_yticks(np.arange(num_slabs) + 0.5, [str(s) for s in range(num_slabs)], fontsize="small")
        ax.hlines(np.arange(1, num_slabs), 0, slab_len, color="white", linewidth=1)
    ax.set_ylabel("slab")
    ax.set_xlabel("token slot within the slab")
    usage = layout.usage
    empty = usage.reserved_tokens - usage.used_tokens
    waste = empty / usage.reserved_tokens if usage.reserved_tokens else 0.0
    ax.set_title(f"KV slabs: {len(layout.tables)}/{num_slabs} in use\n{usage.used_tokens} tokens / "
                 f"{usage.reserved_tokens} reserved slots: {waste:.1%} reserved but empty ({empty})"
                 f"{kv_bytes_line(layout)}", fontsize="medium")
    ax.legend(handles=_legend_handles(legend, (FREE, RESERVED)), loc="upper center", bbox_to_anchor=(0.5, -0.12),
              ncols=4, fontsize="small", frameon=False)
    return ax


class KVView(Protocol):
    """What `draw_kv_layout` reads of a live view (`minillm.viz.live.LiveView`)."""

    kv: Any  # the engine's KV manager, or None
    steps: list
    max_num_seqs: int | None


def draw_kv_layout(axes: Sequence[Axes], view: KVView) -> None:
    """LiveView kind="kv": the pool's blocks (or slabs) now, beside KV occupancy over the steps.

    Without a KV manager to read (a bare MetricsCollector, or static/dynamic batching's padded
    rectangles) it shows occupancy and batch occupancy instead.
    """
    if can_draw(view.kv):
        plot_kv_blocks(view.kv, ax=axes[0])
        plot_kv_occupancy(view.steps, ax=axes[1])
    else:
        plot_kv_occupancy(view.steps, ax=axes[0])
        plot_batch_occupancy(view.steps, view.max_num_seqs, ax=axes[1])
