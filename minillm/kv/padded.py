"""KV for batch-synchronous batching: one rectangle per batch (chapters 02–03).

Static and dynamic batching reserve `rows × (longest prompt + longest output)` slots when a batch
starts and hold them until its last row finishes, as HF `generate` does. `usage()` reports how
few of those slots ever hold a real token. The rectangle's tensors are the worker's
(`minillm.worker.model_runner`): the plan tells it when a batch starts and how long its rows are.
"""

from __future__ import annotations

import torch

from minillm.kv.base import KVCacheSpec, KVUsage, PrefixCacheStats
from minillm.request import Request


class PaddedKVManager:
    """The `PaddedKV` protocol: start_batch / end_batch / free / commit_step / rollback_step / usage."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, max_model_len: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", allocate_pool: bool = True,
                 kv_cache_dtype: str = "auto") -> None:
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device, self.allocate_pool = dtype, device, allocate_pool
        self.capacity_tokens = max_num_seqs * max_model_len
        # No shared pool (num_slots=0): the worker makes one rectangle per batch, of these dimensions.
        self.cache_spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, 0, 1, 0, 1, dtype, device, allocate_pool,
                                      kv_cache_dtype)
        self.rows: list[Request] = []
        self.max_len = 0
        self.num_query_tokens = self.num_hit_tokens = 0  # no prefix cache

    def start_batch(self, rows: list[Request], max_len: int) -> None:
        self.rows, self.max_len = rows, max_len

    def end_batch(self) -> None:
        self.rows, self.max_len = [], 0

    def free(self, request: Request) -> None:
        """A finished row keeps its slots until the whole batch ends."""

    def commit_step(self) -> None:
        """A padded step keeps nothing to undo: its cache length advances only once the forward ends."""

    def rollback_step(self) -> list[str]:
        return []

    def usage(self) -> KVUsage:
        used = sum(r.num_computed_tokens for r in self.rows if not r.status.finished)
        return KVUsage(used_tokens=used, reserved_tokens=len(self.rows) * self.max_len,
                       total_tokens=self.capacity_tokens)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()  # no prefix cache
