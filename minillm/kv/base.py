"""What the scheduler and the runner need from a KV cache manager (chapters 04–05).

The manager *accounts*: it decides which slots of the pool a request may use and says no when
the pool is full. It never decides who runs — that is the scheduler's job — and it never
computes attention — that is the backend's. Slabs (chapter 04) and pages (chapter 05)
implement this same protocol, so the engine can swap one for the other.
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

    @property
    def occupancy(self) -> float:
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


class KVManager(Protocol):
    k_pool: torch.Tensor  # [num_layers, num_slots, H_kv, D]
    v_pool: torch.Tensor

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more K/V of `request`; False (and no change) if full."""
        ...

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Is there room to start a new request (keeping any safety margin the layout wants)?"""
        ...

    def get_computed_tokens(self, request: Request) -> int:
        """Attach any cached prefix of a new request's tokens; return how many tokens it covers."""
        ...

    def free(self, request: Request) -> None:
        """Give back every slot the request holds."""
        ...

    def slot_mapping(self, requests: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        """[T] pool slots for the new tokens of each request (positions num_computed … + n - 1)."""
        ...

    def key_index(self, requests: list[Request], context_lens: list[int]) -> torch.Tensor:
        """[B, max(context_lens)] slots of each request's keys in order, padded with slot 0."""
        ...

    def usage(self) -> KVUsage:
        ...
