"""One contiguous max-length slab per running request (chapter 04).

The simplest KV layout: when a request starts, reserve room for `max_model_len` tokens, whether
it will use 20 or 2,000. It is what pre-vLLM servers did, and its waste — slots reserved but never
filled — is measured in chapter 04 and removed by paging in chapter 05.
"""

from __future__ import annotations

import torch

from minillm.kv.base import CachedPrefix, KVCacheSpec, KVLayoutSnapshot, KVUsage, PrefixCacheStats
from minillm.request import Request


class SlabKVManager:
    """Slabs in the block-table form kernels read: a slab is one block of `slab_len` slots, so a
    request's block table is a single entry and the attention code is the same as for pages."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slabs: int, slab_len: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", allocate_pool: bool = True,
                 kv_cache_dtype: str = "auto") -> None:
        """`allocate_pool=False` keeps only the accounting (the simulator's 7B pools need no memory);
        `kv_cache_dtype`: how the pool stores K/V (minillm.kv.quant)."""
        if num_slabs < 1:
            raise ValueError(f"the KV pool must hold at least one slab of {slab_len} tokens, got {num_slabs}")
        self.num_slabs, self.slab_len = num_slabs, slab_len
        self.block_size = slab_len
        self.null_block = 0  # never read: a slab table has no padding entries
        self.cache_spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, num_slabs * slab_len, slab_len,
                                      self.null_block, 1, dtype, device, allocate_pool, kv_cache_dtype)
        self.free_slabs = list(range(num_slabs - 1, -1, -1))  # pop() hands out slab 0 first
        self.slab_of: dict[str, int] = {}
        self._tokens_of: dict[str, int] = {}  # tokens of each request that have (or will have) K/V here
        self._used_tokens = 0
        self.fresh_blocks: list[int] = []
        self.num_query_tokens = self.num_hit_tokens = 0  # no prefix cache

    def get_computed_blocks(self, request: Request) -> CachedPrefix:
        """Slabs share nothing: no prefix is ever reused."""
        return CachedPrefix((), 0, request.num_tokens)

    def cached_prefix_tokens(self, request: Request) -> int:
        return 0

    def get_computed_tokens(self, request: Request) -> int:
        return 0

    def allocate(self, request: Request, num_new_tokens: int, cached: CachedPrefix | None = None,
                 num_lookahead_tokens: int = 0) -> bool:
        needed = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if needed > self.slab_len:
            raise ValueError(f"request {request.request_id} needs {needed} KV slots, a slab holds {self.slab_len}")
        rid = request.request_id
        if rid not in self.slab_of:
            if not self.free_slabs:
                return False
            slab = self.slab_of[rid] = self.free_slabs.pop()
            self.fresh_blocks.append(slab)
        self._used_tokens += needed - self._tokens_of.get(rid, 0)
        self._tokens_of[rid] = needed
        return True

    def can_admit(self, request: Request, num_new_tokens: int, keep_headroom: bool = True,
                  cached: CachedPrefix | None = None) -> bool:
        return request.request_id in self.slab_of or bool(self.free_slabs)

    def trim(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        if rid in self._tokens_of and num_tokens < self._tokens_of[rid]:
            self._used_tokens -= self._tokens_of[rid] - num_tokens
            self._tokens_of[rid] = num_tokens

    def free(self, request: Request) -> None:
        slab = self.slab_of.pop(request.request_id, None)
        if slab is not None:
            self.free_slabs.append(slab)
            self._used_tokens -= self._tokens_of.pop(request.request_id)

    # Slabs cannot swap (the config refuses preemption_mode="swap" with slabs) and never need to:
    # a running request's slab always has room for its next token.
    def swap_out(self, request: Request) -> list[int] | None:
        return None

    def swap_in(self, request: Request, num_new_tokens: int, keep_headroom: bool = True) -> list[int] | None:
        return None

    def is_swapped(self, request: Request) -> bool:
        return False

    def drop_swapped(self, request: Request) -> None:
        pass

    def commit_step(self) -> None:
        pass

    def rollback_step(self) -> list[str]:
        return []

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return [], []  # slabs share no prefixes, so nothing is offloaded

    def discard_offload_copies(self) -> None:
        pass

    def block_ids_of(self, request_id: str) -> list[int]:
        slab = self.slab_of.get(request_id)
        return [] if slab is None else [slab]

    def take_fresh_blocks(self) -> list[int]:
        fresh, self.fresh_blocks = self.fresh_blocks, []
        return fresh

    def usage(self) -> KVUsage:
        return KVUsage(used_tokens=self._used_tokens, reserved_tokens=len(self.slab_of) * self.slab_len,
                       total_tokens=self.num_slabs * self.slab_len)

    @property
    def num_free_slabs(self) -> int:
        return len(self.free_slabs)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()  # no prefix cache

    def layout_snapshot(self) -> KVLayoutSnapshot:
        return KVLayoutSnapshot("slabs", self.num_slabs, self.slab_len,
                                {rid: (slab,) for rid, slab in self.slab_of.items()}, dict(self._tokens_of),
                                self.usage(), bytes_per_token=self.cache_spec.bytes_per_token,
                                kv_cache_dtype=self.cache_spec.kv_cache_dtype)
