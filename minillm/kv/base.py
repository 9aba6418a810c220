"""What the scheduler and the runner need from a KV cache manager (chapters 04–07).

The manager *accounts*: it decides which slots of the pool a request may use and says no when
the pool is full. It never decides who runs — that is the scheduler's job — and it never
computes attention — that is the backend's. Slabs (chapter 04) and pages (chapter 05)
implement this same protocol, so the engine can swap one for the other; a layout without a
power (slabs share no prefixes and cannot swap) implements it as "never".

Static and dynamic batching (chapters 02–03) compute one padded rectangle per batch: their
`PaddedKVManager` is a different kind of object with its own small protocol (`PaddedKV`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minillm.request import Request


@dataclass(frozen=True)
class KVUsage:
    used_tokens: int  # slots holding a real token's K/V
    reserved_tokens: int  # slots set aside for running requests (used + not yet used)
    total_tokens: int  # capacity of the pool
    swapped_tokens: int = 0  # tokens of preempted requests held in host memory

    @property
    def occupancy(self) -> float:
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


@dataclass(frozen=True)
class KVLayoutSnapshot:
    """Who holds which blocks (or slabs), as plain values: what the KV heatmap draws (`minillm.viz`)."""

    kind: str  # "blocks" (paged) or "slabs"
    num_blocks: int  # blocks (or slabs) in the pool
    block_size: int  # token slots per block (a slab's length)
    tables: dict[str, tuple[int, ...]]  # request id -> its blocks in order, in admission order
    tokens: dict[str, int]  # request id -> tokens whose K/V it holds (or this step adds)
    usage: KVUsage
    ref_counts: tuple[int, ...] = ()  # per block: readers (paged)
    cached_unused: tuple[int, ...] = ()  # blocks kept for the prefix cache that nobody reads (paged)
    bytes_per_token: int = 0  # K and V of one token in the pool's storage (follows kv_cache_dtype; 0: unknown)
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last `make_prefix_cache_stats()` (vLLM's name): tokens of
    admitted requests looked up, and of those, found cached."""

    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV pool a worker allocates for a manager's layout: `[num_layers, num_slots, H_kv, D]` for
    K and for V. Slot `b * block_size + i` is position i of block b; `null_block` is never handed
    out and stays zero (padding entries of a block table read it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    block_size: int
    null_block: int
    max_blocks_per_seq: int  # width of a block-table row
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    allocate: bool = True  # False: accounting only (the simulator's 7B pools need no memory)
    # "auto" (the model's dtype) or a quantized one: then the pool holds bytes, each (token, head) row
    # its codes and (int8) its scale (minillm.kv.quant, chapter 14)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from minillm.kv.quant import check_head_dim

        check_head_dim(self.head_dim, self.kv_cache_dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the pool tensors hold: the model's dtype, or bytes (uint8) when quantized."""
        return torch.uint8 if self.quantized else self.dtype

    @property
    def row_width(self) -> int:
        """Elements of `storage_dtype` per (token, KV head) row: D, or the quantized row's bytes."""
        from minillm.kv.quant import kv_row_bytes

        return kv_row_bytes(self.kv_cache_dtype, self.head_dim, 1) if self.quantized else self.head_dim

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Of the K pool and of the V pool: `[num_layers, num_slots, H_kv, row_width]`."""
        return (self.num_layers, self.num_slots, self.num_kv_heads, self.row_width)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer (and KV head) of this pool, scales included."""
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * element

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True)
class CachedPrefix:
    """A prefix-cache lookup's result: blocks holding a request's first `num_tokens` tokens.

    Looking up takes nothing; `allocate(request, n, cached=...)` attaches the blocks, so a request
    that is turned away leaves the cache (reference counts, LRU order) exactly as it was."""

    blocks: tuple[int, ...]
    num_tokens: int  # device blocks and host blocks together
    num_query_tokens: int  # the tokens looked up (vLLM's hit rate: hits ÷ queried)
    # the offload tier (minillm.kv.offload): keys of host blocks that follow `blocks`, copied back in on attach
    host_keys: tuple[bytes, ...] = ()


class KVManager(Protocol):
    cache_spec: KVCacheSpec  # the pool the worker allocates (the manager holds no tensors)
    block_size: int  # tokens per block (a slab is one block of max_model_len)
    null_block: int  # a block that is never handed out and stays zero: where -1 entries read
    fresh_blocks: list[int]  # blocks handed out since the last plan (the worker zeroes them)
    num_query_tokens: int  # prefix cache: tokens looked up by admissions so far (0 without a cache)
    num_hit_tokens: int  # ... and found cached

    # -- the scheduler's side
    def get_computed_blocks(self, request: Request) -> CachedPrefix:
        """Look up a new request's cached prefix (changes nothing)."""
        ...

    def cached_prefix_tokens(self, request: Request) -> int:
        """How many tokens `get_computed_blocks` would find (for LPM ranking; changes nothing)."""
        ...

    def can_admit(self, request: Request, num_new_tokens: int, keep_headroom: bool = True,
                  cached: CachedPrefix | None = None) -> bool:
        """Room to start a new request after its cached prefix (keeping the layout's safety margin
        if `keep_headroom`)?"""
        ...

    def allocate(self, request: Request, num_new_tokens: int, cached: CachedPrefix | None = None,
                 num_lookahead_tokens: int = 0) -> bool:
        """Room for `num_new_tokens` more K/V of `request`; False (and no change) if full."""
        ...

    def trim(self, request: Request, num_tokens: int) -> None:
        """Roll the request's KV back to its first `num_tokens` tokens."""
        ...

    def free(self, request: Request) -> None:
        """Give back every slot the request holds on the device."""
        ...

    def swap_out(self, request: Request) -> list[int] | None:
        """Plan a swap to host memory and free the device blocks; None if it cannot."""
        ...

    def swap_in(self, request: Request, num_new_tokens: int, keep_headroom: bool = True) -> list[int] | None:
        """Plan bringing a swapped request back; None (no change) if there is no room."""
        ...

    def is_swapped(self, request: Request) -> bool: ...

    def drop_swapped(self, request: Request) -> None: ...

    def commit_step(self) -> None:
        """The step completed."""
        ...

    def rollback_step(self) -> list[str]:
        """The step failed: undo its prefix-cache entries; returns requests whose swap-out was lost."""
        ...

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offload tier's copies planned since the last call: (device block, host block) out,
        (host block, device block) in (minillm.kv.offload); ([], []) for a layout without one."""
        ...

    def discard_offload_copies(self) -> None:
        """The plan that would carry the pending copies is dropped: forget what they would have stored."""
        ...

    def usage(self) -> KVUsage: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups since the last call (then counting starts again)."""
        ...

    def layout_snapshot(self) -> KVLayoutSnapshot:
        """Who holds which blocks now (for pictures; a copy)."""
        ...

    # -- what the plan reads (minillm.scheduler.output)
    def block_ids_of(self, request_id: str) -> list[int]: ...

    def take_fresh_blocks(self) -> list[int]: ...


class PaddedKV(Protocol):
    """What static and dynamic batching need: one rectangle per batch, held until the batch ends
    (the rectangle's tensors are the worker's)."""

    max_len: int  # slots per row of the running batch
    num_query_tokens: int
    num_hit_tokens: int

    def start_batch(self, rows: list[Request], max_len: int) -> None: ...

    def end_batch(self) -> None: ...

    def free(self, request: Request) -> None: ...

    def commit_step(self) -> None: ...

    def rollback_step(self) -> list[str]: ...

    def usage(self) -> KVUsage: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats: ...
