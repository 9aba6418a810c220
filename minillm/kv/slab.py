"""One contiguous max-length slab per running request (chapter 04).

The simplest KV layout: when a request starts, reserve room for `max_model_len` tokens, whether
it will use 20 or 2,000. It is what pre-vLLM servers did, and its waste — slots reserved but never
filled — is measured in chapter 04 and removed by paging in chapter 05.
"""

from __future__ import annotations

import torch

from minillm.kv.base import KVUsage
from minillm.request import Request


class SlabKVManager:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slabs: int, slab_len: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", allocate_pool: bool = True) -> None:
        """`allocate_pool=False` keeps only the accounting (the simulator's 7B pools need no memory)."""
        if num_slabs < 1:
            raise ValueError(f"the KV pool must hold at least one slab of {slab_len} tokens, got {num_slabs}")
        self.num_slabs, self.slab_len = num_slabs, slab_len
        shape = (num_layers, num_slabs * slab_len, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device) if allocate_pool else None
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device) if allocate_pool else None
        self.free_slabs = list(range(num_slabs - 1, -1, -1))  # pop() hands out slab 0 first
        self.slab_of: dict[str, int] = {}
        self._tokens_of: dict[str, int] = {}  # tokens of each request that have (or will have) K/V here

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        needed = request.num_computed_tokens + num_new_tokens
        if needed > self.slab_len:
            raise ValueError(f"request {request.request_id} needs {needed} KV slots, a slab holds {self.slab_len}")
        rid = request.request_id
        if rid not in self.slab_of:
            if not self.free_slabs:
                return False
            self.slab_of[rid] = self.free_slabs.pop()
        self._tokens_of[rid] = needed
        return True

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        return request.request_id in self.slab_of or bool(self.free_slabs)

    def get_computed_tokens(self, request: Request) -> int:
        """Slabs share nothing: no prefix is ever reused."""
        return 0

    def free(self, request: Request) -> None:
        slab = self.slab_of.pop(request.request_id, None)
        if slab is not None:
            self.free_slabs.append(slab)
            del self._tokens_of[request.request_id]

    def slot_mapping(self, requests: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        slots: list[int] = []
        for req, n in zip(requests, num_new_tokens):
            start = self.slab_of[req.request_id] * self.slab_len + req.num_computed_tokens
            slots.extend(range(start, start + n))
        return torch.tensor(slots, dtype=torch.long)

    def key_index(self, requests: list[Request], context_lens: list[int]) -> torch.Tensor:
        bases = torch.tensor([self.slab_of[r.request_id] * self.slab_len for r in requests])
        k_max = max(context_lens)
        # Slots past a row's context (still inside its own slab) hold stale data; the mask hides them.
        return bases[:, None] + torch.arange(k_max)[None, :]

    def usage(self) -> KVUsage:
        return KVUsage(used_tokens=sum(self._tokens_of.values()),
                       reserved_tokens=len(self.slab_of) * self.slab_len,
                       total_tokens=self.num_slabs * self.slab_len)

    @property
    def num_free_slabs(self) -> int:
        return len(self.free_slabs)
